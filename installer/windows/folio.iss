; Inno Setup script for Folio (compile on Windows: iscc installer\windows\folio.iss).
; A per-user install without administrator rights: the program files go to
; %LOCALAPPDATA%\Programs\Folio, the virtual environment that installer\bootstrap.py
; makes on first start to %LOCALAPPDATA%\Folio\venv (never under Program Files, and a
; short root, so the venv's deep site-packages paths stay under MAX_PATH).
; The uninstaller removes both, and asks before deleting models and chats.

#define AppName "Folio"
#define AppVersion "0.1.0"
#define AppUserModelID "Folio.Folio"

[Setup]
AppId={{6E0C8B5A-3F1D-4B7E-9A42-5D0F1C2B7E31}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=Folio
DefaultDirName={localappdata}\Programs\Folio
DisableDirPage=yes
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
UsedUserAreasWarning=no
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir=..\..\dist
OutputBaseFilename=FolioSetup-{#AppVersion}
SetupIconFile=..\..\resources\folio.ico
UninstallDisplayIcon={app}\resources\folio.ico
UninstallDisplayName={#AppName}
Compression=lzma2
SolidCompression=yes
WizardStyle=modern

[Tasks]
Name: "desktopicon"; Description: "Create a desktop shortcut"; Flags: unchecked

[Files]
Source: "..\..\pyproject.toml"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\README.md"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\engine\*"; DestDir: "{app}\engine"; Excludes: "__pycache__,*.pyc"; Flags: ignoreversion recursesubdirs
Source: "..\..\kernels\*"; DestDir: "{app}\kernels"; Excludes: "__pycache__,*.pyc"; Flags: ignoreversion recursesubdirs
Source: "..\..\gui\*"; DestDir: "{app}\gui"; Excludes: "__pycache__,*.pyc"; Flags: ignoreversion recursesubdirs
Source: "..\..\resources\*"; DestDir: "{app}\resources"; Flags: ignoreversion recursesubdirs
Source: "..\..\installer\*"; DestDir: "{app}\installer"; Excludes: "__pycache__,*.pyc,linux\*"; Flags: ignoreversion recursesubdirs
; Optional: a full CPython 3.11 (with venv and ensurepip, e.g. the "tools" folder of
; the python NuGet package; the embeddable zip has no venv) in installer\windows\python
; makes Folio.cmd independent of an installed Python:
; Source: "python\*"; DestDir: "{app}\python"; Flags: ignoreversion recursesubdirs

[Icons]
Name: "{userprograms}\{#AppName}"; Filename: "{app}\installer\windows\Folio.cmd"; WorkingDir: "{app}"; IconFilename: "{app}\resources\folio.ico"; Comment: "Run quantized language models locally"; AppUserModelID: "{#AppUserModelID}"; Flags: runminimized
Name: "{userdesktop}\{#AppName}"; Filename: "{app}\installer\windows\Folio.cmd"; WorkingDir: "{app}"; IconFilename: "{app}\resources\folio.ico"; AppUserModelID: "{#AppUserModelID}"; Flags: runminimized; Tasks: desktopicon

[Run]
; First start: Folio.cmd installs PyTorch and Folio's packages in a console window
; (a few minutes), then starts the app.
Filename: "{app}\installer\windows\Folio.cmd"; Description: "Set up and start {#AppName}"; Flags: postinstall shellexec skipifsilent

[UninstallDelete]
; Made at run time, so Inno does not know them: the venv, logs, caches, build files.
Type: filesandordirs; Name: "{localappdata}\Folio\venv"
Type: filesandordirs; Name: "{localappdata}\Folio\logs"
Type: filesandordirs; Name: "{app}"
Type: dirifempty; Name: "{localappdata}\Folio"

[Code]
procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  DataDir: String;
begin
  { The app keeps models, chats and settings in platformdirs' folder, which on
    Windows is %LOCALAPPDATA%\folio\folio (the same top folder as the venv). }
  if CurUninstallStep = usPostUninstall then
  begin
    DataDir := ExpandConstant('{localappdata}\Folio\folio');
    if DirExists(DataDir) and not UninstallSilent() then
      if MsgBox('Also delete the downloaded models, chats and settings in ' + DataDir + '?',
                mbConfirmation, MB_YESNO or MB_DEFBUTTON2) = IDYES then
        DelTree(DataDir, True, True, True);
    RemoveDir(ExpandConstant('{localappdata}\Folio'));
  end;
end;
