<#
.SYNOPSIS
    Install Folio for the current user from this folder (a checkout or an unpacked
    release) and add a Start-menu shortcut with Folio's icon.
.DESCRIPTION
    Runs installer\bootstrap.py, which creates Folio's virtual environment in
    %LOCALAPPDATA%\Folio\venv (never under Program Files), installs PyTorch (CUDA
    build when nvidia-smi reports a recent enough driver, else CPU) and Folio, and
    fetches the default model. Then creates "Folio" in the Start menu, pointing at
    installer\windows\Folio.cmd. Run through install.cmd (-ExecutionPolicy Bypass).
.PARAMETER Torch
    cpu, cuda or auto (default): which PyTorch build to install.
.PARAMETER NoFetch
    Do not download the default model now (the first start does it).
.PARAMETER DesktopShortcut
    Also put a shortcut on the desktop.
#>
[CmdletBinding()]
param(
    [ValidateSet('auto', 'cpu', 'cuda')][string]$Torch = 'auto',
    [switch]$NoFetch,
    [switch]$DesktopShortcut
)
$ErrorActionPreference = 'Stop'
[Console]::OutputEncoding = [System.Text.Encoding]::UTF8
$env:PYTHONUTF8 = '1'

$App = (Resolve-Path -LiteralPath (Join-Path $PSScriptRoot '..\..')).Path
$Bootstrap = Join-Path $App 'installer\bootstrap.py'
$Launcher = Join-Path $App 'installer\windows\Folio.cmd'
$Icon = Join-Path $App 'resources\folio.ico'
$Data = if ($env:FOLIO_HOME) { $env:FOLIO_HOME } else { Join-Path $env:LOCALAPPDATA 'Folio' }

function Find-Python {
    # A bundled Python first, then the py launcher (3.11 exactly, then any 3.x >= 3.11).
    $bundled = Join-Path $App 'python\python.exe'
    if (Test-Path -LiteralPath $bundled) { return @($bundled) }
    foreach ($candidate in @(@('py', '-3.11'), @('py', '-3'), @('python'))) {
        $exe = Get-Command $candidate[0] -ErrorAction SilentlyContinue
        if (-not $exe) { continue }
        $rest = @($candidate | Select-Object -Skip 1)
        & $exe.Source @rest -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>$null
        if ($LASTEXITCODE -eq 0) { return @($exe.Source) + $rest }
    }
    return $null
}

$python = Find-Python
if (-not $python) {
    Write-Host 'Folio needs Python 3.11 or newer: https://www.python.org/downloads/' -ForegroundColor Red
    exit 1
}
$pyExe = $python[0]
$pyArgs = @($python | Select-Object -Skip 1)

$bootArgs = @('--user', '--torch', $Torch)
if ($NoFetch) { $bootArgs += '--no-fetch' }
Write-Host "Installing Folio into $Data (this takes a few minutes the first time) ..."
& $pyExe @pyArgs $Bootstrap @bootArgs
if ($LASTEXITCODE -ne 0) {
    Write-Host "Folio could not be installed; see $(Join-Path $Data 'logs\install.log')" -ForegroundColor Red
    exit 1
}

function New-FolioShortcut([string]$Path) {
    $shell = New-Object -ComObject WScript.Shell
    $link = $shell.CreateShortcut($Path)
    $link.TargetPath = $Launcher
    $link.WorkingDirectory = $App
    $link.IconLocation = "$Icon,0"
    $link.Description = 'Run quantized language models locally'
    $link.WindowStyle = 7  # minimized: the .cmd's console does not flash up
    $link.Save()
}

$programs = [Environment]::GetFolderPath('Programs')
New-FolioShortcut (Join-Path $programs 'Folio.lnk')
if ($DesktopShortcut) {
    New-FolioShortcut (Join-Path ([Environment]::GetFolderPath('Desktop')) 'Folio.lnk')
}
Write-Host 'Folio is installed: start it from the Start menu.' -ForegroundColor Green
exit 0
