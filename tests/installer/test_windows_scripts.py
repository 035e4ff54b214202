"""Checks of the Windows scripts that run on Linux CI.

No PowerShell, cmd.exe or Inno Setup compiler is available here (PowerShell as a
dotnet tool needs the .NET SDK, which is not installable from PyPI/npm/Debian's main
archive reliably offline), so these are structural checks: CRLF line ends, balanced
blocks, the paths and options the issue requires, and every file the scripts point at.
When `pwsh` is on PATH the .ps1 files are also parsed by PowerShell's own parser.
The install logic itself lives in installer/bootstrap.py, which the Linux tests run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIN = ROOT / "installer" / "windows"
CRLF_FILES = ["Folio.cmd", "install.cmd", "uninstall.cmd", "install.ps1", "uninstall.ps1",
              "folio.iss"]


@pytest.mark.parametrize("name", CRLF_FILES)
def test_crlf_line_ends_and_ascii(name):
    data = (WIN / name).read_bytes()
    assert data.endswith(b"\r\n")
    assert b"\n" not in data.replace(b"\r\n", b""), f"{name}: a bare LF"
    assert b"\r" not in data.replace(b"\r\n", b""), f"{name}: a bare CR"
    data.decode("ascii")  # cmd.exe reads batch files in the OEM code page: keep them ASCII


def test_gitattributes_keeps_crlf_for_windows_scripts():
    text = (ROOT / ".gitattributes").read_text()
    for pattern in ("*.cmd", "*.bat", "*.ps1", "*.iss"):
        assert re.search(rf"^{re.escape(pattern)}\s+text eol=crlf$", text, re.MULTILINE), pattern
    assert re.search(r"^\*\.sh\s+text eol=lf$", text, re.MULTILINE)
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(["git", "check-attr", "eol", "--", "installer/windows/Folio.cmd"],
                             cwd=ROOT, capture_output=True, text=True).stdout
        assert out.strip().endswith("eol: crlf")


def _batch(name: str) -> str:
    return (WIN / name).read_text().replace("\r\n", "\n")


def test_batch_files_are_balanced_and_quote_paths():
    for name in ("Folio.cmd", "install.cmd", "uninstall.cmd"):
        text = _batch(name)
        assert text.startswith("@echo off\n"), name
        code = "\n".join(ln for ln in text.splitlines() if not ln.lower().startswith("rem "))
        assert code.count("(") == code.count(")"), f"{name}: unbalanced parentheses"
        assert code.count('"') % 2 == 0, f"{name}: unbalanced quotes"
        # %~dp0 (the script's folder, may hold spaces or non-ASCII) is always quoted
        for m in re.finditer(r"%~dp0", code):
            line = code[:m.start()].rsplit("\n", 1)[-1]
            assert line.count('"') % 2 == 1, f"{name}: unquoted %~dp0 in {line!r}"
        for label in re.findall(r"goto\s+:?(\w+)", code):
            assert re.search(rf"^:{label}\b", code, re.MULTILINE), f"{name}: no label :{label}"


def test_folio_cmd_uses_py_311_pythonw_and_the_bootstrap():
    text = _batch("Folio.cmd")
    assert "py -3.11" in text and "pyw -3.11" in text and r"python\pythonw.exe" in text
    assert re.search(r'start "" %PYW% "%FOLIO_BOOT%" --user --windowed --launch %\*', text)
    assert r'set "FOLIO_BOOT=%~dp0..\bootstrap.py"' in text
    assert (WIN / ".." / "bootstrap.py").resolve() == ROOT / "installer" / "bootstrap.py"
    assert "chcp 65001" in text and "PYTHONUTF8=1" in text
    assert r"%LOCALAPPDATA%\Folio" in text


def test_cmd_wrappers_bypass_execution_policy():
    for name, script in (("install.cmd", "install.ps1"), ("uninstall.cmd", "uninstall.ps1")):
        text = _batch(name)
        assert f'-ExecutionPolicy Bypass -File "%~dp0{script}"' in text
        assert (WIN / script).is_file()


def _ps(name: str) -> str:
    return (WIN / name).read_text().replace("\r\n", "\n")


def _strip_ps_strings(text: str) -> str:
    """The code without comments and string contents, scanned left to right so that a
    quote inside the other kind of string does not confuse it."""
    text = re.sub(r"<#.*?#>", "", text, flags=re.DOTALL)
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "#":
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
        elif c in "'\"":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if (c == '"' and text[j] == "`") else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


@pytest.mark.parametrize("name", ["install.ps1", "uninstall.ps1"])
def test_powershell_structure(name):
    code = _strip_ps_strings(_ps(name))
    for open_, close in ("{}", "()", "[]"):
        assert code.count(open_) == code.count(close), f"{name}: unbalanced {open_}{close}"
    assert "$ErrorActionPreference = 'Stop'" in _ps(name)
    assert "-LiteralPath" in _ps(name)  # paths with [ ] or non-ASCII are taken literally


def test_install_ps1_shortcut_and_bootstrap():
    text = _ps("install.ps1")
    assert "installer\\bootstrap.py" in text and "'--user'" in text
    assert "GetFolderPath('Programs')" in text and "Folio.lnk" in text
    assert "resources\\folio.ico" in text and "IconLocation" in text
    assert "installer\\windows\\Folio.cmd" in text


@pytest.mark.skipif(shutil.which("pwsh") is None, reason="PowerShell (pwsh) is not installed")
@pytest.mark.parametrize("name", ["install.ps1", "uninstall.ps1"])
def test_powershell_parser_accepts(name):
    cmd = ("$e = $null; [System.Management.Automation.Language.Parser]::ParseFile("
           f"'{WIN / name}', [ref]$null, [ref]$e) | Out-Null; if ($e) {{ $e; exit 1 }}")
    proc = subprocess.run(["pwsh", "-NoProfile", "-Command", cmd], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _iss() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in (WIN / "folio.iss").read_text().replace("\r\n", "\n").splitlines():
        m = re.match(r"^\[(\w+)\]\s*$", line)
        if m:
            current = m.group(1)
            sections[current] = []
        elif current and line.strip() and not line.lstrip().startswith(";"):
            sections[current].append(line)
    return sections


def test_inno_setup_script():
    s = _iss()
    for name in ("Setup", "Files", "Icons", "Run", "UninstallDelete", "Code"):
        assert name in s, f"[{name}] missing"
    setup = dict(ln.split("=", 1) for ln in s["Setup"] if "=" in ln)
    assert setup["PrivilegesRequired"] == "lowest"  # per user, no elevation
    assert setup["DefaultDirName"] == r"{localappdata}\Programs\Folio"
    assert "program" not in setup["DefaultDirName"].lower().replace(r"\programs", "")
    icon = (WIN / setup["SetupIconFile"].replace("\\", "/")).resolve()
    assert icon == ROOT / "resources" / "folio.ico"
    icons = " ".join(s["Icons"])
    assert r"{userprograms}\{#AppName}" in icons and r"{app}\resources\folio.ico" in icons
    assert 'AppUserModelID: "{#AppUserModelID}"' in icons
    assert '#define AppUserModelID "Folio.Folio"' in (WIN / "folio.iss").read_text()
    deletes = " ".join(s["UninstallDelete"])
    assert r"{localappdata}\Folio\venv" in deletes
    code = "\n".join(s["Code"])
    assert code.count("begin") == code.count("end;") and "usPostUninstall" in code


def test_inno_setup_sources_exist():
    for line in _iss()["Files"]:
        src = re.search(r'Source:\s*"([^"]+)"', line).group(1)
        path = (WIN / src.replace("\\", "/")).resolve()
        if path.name == "*":
            assert path.parent.is_dir(), src
        else:
            assert path.exists(), src


def test_app_user_model_id_is_the_same_everywhere():
    from folio import platform_setup
    from tests.installer.test_bootstrap import B

    assert platform_setup.APP_USER_MODEL_ID == B.APP_ID == "Folio.Folio"
