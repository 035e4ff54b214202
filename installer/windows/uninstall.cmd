@echo off
rem Double-click: runs uninstall.ps1 (removes the shortcut; asks about the venv and models).
setlocal
chcp 65001 >nul 2>nul
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0uninstall.ps1" %*
if errorlevel 1 pause
exit /b %errorlevel%
