<#
.SYNOPSIS
    Remove the Start-menu (and desktop) shortcut that install.ps1 made, and, when
    asked, Folio's virtual environment and its data (models, chats, settings).
.PARAMETER RemoveVenv
    Delete %LOCALAPPDATA%\Folio\venv and the logs without asking.
.PARAMETER Purge
    Also delete the models, chats and settings without asking.
#>
[CmdletBinding()]
param([switch]$RemoveVenv, [switch]$Purge)
$ErrorActionPreference = 'Stop'

$Data = if ($env:FOLIO_HOME) { $env:FOLIO_HOME } else { Join-Path $env:LOCALAPPDATA 'Folio' }
foreach ($dir in @([Environment]::GetFolderPath('Programs'), [Environment]::GetFolderPath('Desktop'))) {
    $link = Join-Path $dir 'Folio.lnk'
    if (Test-Path -LiteralPath $link) { Remove-Item -LiteralPath $link -Force }
}
if (-not $RemoveVenv -and -not $Purge) {
    $RemoveVenv = (Read-Host "Also delete Folio's Python environment in $Data\venv? [y/N]") -match '^[yY]'
}
if ($RemoveVenv -or $Purge) {
    foreach ($name in @('venv', 'logs')) {
        $path = Join-Path $Data $name
        if (Test-Path -LiteralPath $path) { Remove-Item -LiteralPath $path -Recurse -Force }
    }
}
if (-not $Purge) {
    $Purge = (Read-Host 'Also delete downloaded models, chats and settings? [y/N]') -match '^[yY]'
}
if ($Purge -and (Test-Path -LiteralPath $Data)) {
    Remove-Item -LiteralPath $Data -Recurse -Force
}
Write-Host 'Folio was removed.'
exit 0
