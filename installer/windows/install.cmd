@echo off
rem Double-click: runs install.ps1 (venv, packages, default model, Start-menu shortcut)
rem without changing the machine's PowerShell execution policy.
setlocal
chcp 65001 >nul 2>nul
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0install.ps1" %*
if errorlevel 1 pause
exit /b %errorlevel%
