"""Windowed start (pythonw on Windows, a menu entry on Linux): no console, so
sys.stdout and sys.stderr are None.  The entry points must start anyway and log to a
file.  Here the streams are really missing: the child starts with file descriptors 1
and 2 closed, which is how CPython ends up with None streams, as under pythonw."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
posix_only = pytest.mark.skipif(os.name != "posix", reason="closes fds with the shell")


def _run_without_streams(code: str, env: dict[str, str], timeout: int = 120):
    # `exec 1>&- 2>&-` closes stdout and stderr before Python starts.
    return subprocess.run(["sh", "-c", 'exec "$0" -c "$1" 1>&- 2>&-', sys.executable, code],
                          env=env, cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


@posix_only
def test_entry_point_with_no_streams_logs_to_file(tmp_path):
    env = dict(os.environ, FOLIO_LOG_DIR=str(tmp_path / "logs"), PYTHONPATH=str(ROOT))
    code = (
        "import sys\n"
        "assert sys.stdout is None and sys.stderr is None, 'streams exist'\n"
        "from folio.platform_setup import main\n"
        "rc = main(['generate', '--help'])\n"
        "import tqdm\n"  # after the redirect, tqdm and print have somewhere to write
        "for _ in tqdm.tqdm(range(3), desc='tqdm-works'): pass\n"
        "print('print-works')\n"
        "sys.exit(rc)\n"
    )
    proc = _run_without_streams(code, env)
    log = (tmp_path / "logs" / "folio.log").read_text(encoding="utf-8")
    assert proc.returncode == 0, log
    assert "usage: folio generate" in log and "tqdm-works" in log and "print-works" in log
    assert "--- " in log  # the start header with time and arguments


@posix_only
def test_entry_point_logs_a_crash_instead_of_vanishing(tmp_path):
    env = dict(os.environ, FOLIO_LOG_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    code = (
        "import sys, folio.main\n"
        "def boom(argv): raise RuntimeError('kaboom in the app')\n"
        "folio.main.main = boom\n"
        "from folio.platform_setup import main\n"
        "sys.exit(main([]))\n"
    )
    proc = _run_without_streams(code, env)
    assert proc.returncode == 1
    log = (tmp_path / "folio.log").read_text(encoding="utf-8")
    assert "RuntimeError: kaboom in the app" in log and "Traceback" in log


def test_streams_that_exist_are_left_alone(tmp_path, monkeypatch):
    from folio import platform_setup

    monkeypatch.setenv("FOLIO_LOG_DIR", str(tmp_path))
    assert platform_setup.redirect_missing_streams() is None
    assert not (tmp_path / "folio.log").exists()
    assert platform_setup.set_app_user_model_id() is (sys.platform == "win32")


def test_log_dir_matches_the_bootstrap_user_layout():
    from folio import platform_setup

    sys.path.insert(0, str(ROOT / "installer"))
    try:
        import bootstrap
    finally:
        sys.path.remove(str(ROOT / "installer"))
    for env, plat in (({"HOME": "/h"}, "linux"), ({"HOME": "/h", "XDG_DATA_HOME": "/x"}, "linux"),
                      ({"LOCALAPPDATA": "C:/L", "USERPROFILE": "C:/U"}, "win32"),
                      ({"HOME": "/h", "FOLIO_HOME": "/f"}, "linux")):
        assert platform_setup.log_dir(env, plat) == bootstrap.choose_layout("user", ROOT, env, plat).logs


@posix_only
def test_bootstrap_with_no_streams_logs_its_errors(tmp_path):
    """The bootstrap under pythonw: its messages go to <root>/logs/launcher.log."""
    env = dict(os.environ, FOLIO_HOME=str(tmp_path / "Folio data"), FOLIO_TORCH="rocm")
    code = (f"import runpy, sys; sys.argv = ['bootstrap.py', '--user', '--launch']\n"
            f"runpy.run_path({str(ROOT / 'installer' / 'bootstrap.py')!r}, run_name='__main__')\n")
    proc = _run_without_streams(code, env)
    assert proc.returncode == 2  # a usage error, reported in the log, not a crash
    log = (tmp_path / "Folio data" / "logs" / "launcher.log").read_text(encoding="utf-8")
    assert "FOLIO_TORCH must be cpu, cuda or auto" in log
