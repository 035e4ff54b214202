@echo off
rem Folio for Windows: double-click to start (the Start-menu shortcut runs this too).
rem Finds Python (a bundled one in <app>\python, else the py launcher's 3.11, else any
rem Python 3 the bootstrap can use), runs installer\bootstrap.py, and starts the app
rem with pythonw so that no console window stays open.  All logic is in bootstrap.py;
rem the venv lives in %LOCALAPPDATA%\Folio\venv, the logs in %LOCALAPPDATA%\Folio\logs.
rem Paths are always quoted (spaces, non-ASCII user names); UTF-8 for Python's I/O.
setlocal EnableExtensions
chcp 65001 >nul 2>nul
set "PYTHONUTF8=1"
set "FOLIO_APP=%~dp0..\.."
set "FOLIO_BOOT=%~dp0..\bootstrap.py"
if defined FOLIO_HOME (set "FOLIO_DATA=%FOLIO_HOME%") else (set "FOLIO_DATA=%LOCALAPPDATA%\Folio")

set "PY="
set "PYW="
if exist "%FOLIO_APP%\python\python.exe" (
    set "PY="%FOLIO_APP%\python\python.exe""
    set "PYW="%FOLIO_APP%\python\pythonw.exe""
    goto :found
)
py -3.11 -c "import sys" >nul 2>nul && (
    set "PY=py -3.11"
    set "PYW=pyw -3.11"
    goto :found
)
py -3 -c "import sys; sys.exit(sys.version_info < (3, 11))" >nul 2>nul && (
    set "PY=py -3"
    set "PYW=pyw -3"
    goto :found
)
python -c "import sys; sys.exit(sys.version_info < (3, 11))" >nul 2>nul && (
    set "PY=python"
    set "PYW=pythonw"
    goto :found
)
echo Folio needs Python 3.11 or newer. Install it from https://www.python.org/downloads/
echo (tick "Add python.exe to PATH" or keep the "py launcher" option), then start Folio again.
pause
exit /b 1

:found
rem First run (no install stamp yet): install in this console so that progress shows.
if not exist "%FOLIO_DATA%\venv\folio-install.json" (
    echo Setting up Folio for the first time; this takes a few minutes ...
    %PY% "%FOLIO_BOOT%" --user %FOLIO_BOOTSTRAP_ARGS%
    if errorlevel 1 (
        echo.
        echo Folio could not be installed. The log is in "%FOLIO_DATA%\logs\install.log".
        pause
        exit /b 1
    )
)
rem Later runs: the bootstrap only checks its stamp, then replaces itself by the app.
start "" %PYW% "%FOLIO_BOOT%" --user --windowed --launch %*
exit /b 0
