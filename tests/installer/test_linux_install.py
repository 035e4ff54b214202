"""The real Linux installer, end to end: install.sh into a throw-away HOME (with a space
and non-ASCII letters in its path) from local wheels only, the launcher's smoke test,
an idempotent second run, and uninstall.sh.

This is the one test that installs torch for real (a few minutes on 2 cores), so it runs
once per CI run.  The checkout layout's real install is what CI's own first command
(`python3 installer/bootstrap.py --extras test -- python -m pytest`) does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "installer" / "linux"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.installer,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux installer"),
]


def _env(home: Path, wheelhouse: Path, models: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "FOLIO_", "XDG_", "VIRTUAL_ENV", "PYTHON"))}
    venv_bin = str(Path(sys.prefix) / "bin")  # this test's venv must not be the Python found
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env.update(
        HOME=str(home),
        # Local wheels only: no config file (so no index, find-links or constraints from
        # /etc), no index, and the session's wheelhouse as the only source.
        PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse),
        PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
        FOLIO_TORCH="cpu",  # the CPU path, even where a GPU answers
        FOLIO_PYTHON=getattr(sys, "_base_executable", sys.executable),
        FOLIO_MODELS_DIR=str(models),  # the already fetched default model: no 93 MB copy
        QT_QPA_PLATFORM="offscreen",
    )
    return env


def _run(cmd, env, timeout):
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def _all_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def test_install_launch_reinstall_uninstall(tmp_path, wheelhouse, smollm2_path):
    home = tmp_path / "home of Zoë Ångström"
    home.mkdir()
    env = _env(home, wheelhouse, smollm2_path.parent)
    data = home / ".local" / "share"
    root = data / "folio"

    # 1. install
    first, first_s = _run(["sh", str(LINUX / "install.sh")], env, timeout=1500)
    log = (root / "logs" / "install.log")
    assert first.returncode == 0, first.stderr + (log.read_text() if log.exists() else "")
    assert "hash-checked" in first.stderr  # the pinned lock was used
    stamp_path = root / "venv" / "folio-install.json"
    stamp = json.loads(stamp_path.read_text())
    assert stamp["torch"] == "cpu" and stamp["lock_sha256"] and stamp["checkout"] == str(root / "app")
    assert "--require-hashes" in log.read_text()
    torch_version = subprocess.run(
        [str(root / "venv" / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, env=env, timeout=120,
    ).stdout.strip()
    assert torch_version == "2.13.0+cpu"

    launcher = root / "bin" / "folio"
    desktop = data / "applications" / "folio.desktop"
    assert os.access(launcher, os.X_OK)
    text = desktop.read_text()
    assert "Terminal=false" in text and "StartupWMClass=Folio" in text and "Icon=folio" in text
    assert "Categories=" in text
    assert f'Exec="{launcher}"' in text  # quoted: the path has a space
    for size in (16, 24, 32, 48, 64, 128, 256, 512):
        assert (data / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "folio.png").is_file()
    assert (data / "icons" / "hicolor" / "scalable" / "apps" / "folio.svg").is_file()
    validator = shutil.which("desktop-file-validate")
    if validator:
        check = subprocess.run([validator, str(desktop)], capture_output=True, text=True)
        assert check.returncode == 0 and "error" not in check.stdout.lower(), check.stdout

    # 2. the launcher's smoke test (offscreen): window, engine, a few seconds, exit 0
    smoke, smoke_s = _run([str(launcher), "--smoke-test"], env, timeout=600)
    launcher_log = (root / "logs" / "launcher.log").read_text(errors="replace")
    assert smoke.returncode == 0, smoke.stderr + launcher_log[-4000:]
    assert "smoke test passed" in launcher_log

    # 3. a second run reinstalls nothing: no pip step, same stamp
    stamped = stamp_path.stat().st_mtime_ns
    second, second_s = _run(["sh", str(LINUX / "install.sh")], env, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "Installing" not in second.stderr and "Creating" not in second.stderr
    assert stamp_path.stat().st_mtime_ns == stamped
    print(f"\ninstall {first_s:.0f} s, smoke test {smoke_s:.0f} s, second run {second_s:.1f} s")

    # 4. uninstall --purge removes everything it created
    gone, _ = _run(["sh", str(LINUX / "uninstall.sh"), "--purge"], env, timeout=300)
    assert gone.returncode == 0, gone.stderr
    assert not root.exists() and not desktop.exists()
    assert _all_files(data) == []
    assert smollm2_path.is_file()  # models elsewhere ($FOLIO_MODELS_DIR) are never touched
