"""Process set-up for the desktop launchers, run before anything heavy is imported.

The installer starts the app as ``python -m folio [ARGS]`` (``pythonw``
on Windows), which

- sends ``sys.stdout`` / ``sys.stderr`` to ``<logs>/folio.log`` when they are None,
  as under ``pythonw`` or a desktop launcher without a terminal: transformers,
  tqdm and plain ``print`` write to them and would raise ``AttributeError`` on
  None.  This must happen before those modules are imported, hence this module
  is tiny and imports nothing of Folio's until it is done;
- on Windows sets the process's AppUserModelID, so the taskbar groups Folio's
  windows under Folio's own icon (matching the Start-menu shortcut) instead of
  under Python's;
- then runs ``folio`` (``folio.main.main``) with ARGS; no ARGS starts the app.

gui/app.py may call ``prepare_process()`` itself as its first step; calling it twice
is harmless.  The Linux counterpart of the AppUserModelID is
``QGuiApplication.setDesktopFileName("folio")`` (matches ``folio.desktop``), which
gui/app.py sets.

Qt-free and standard library only until ``main`` hands over to ``folio.main``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

APP_USER_MODEL_ID = "Folio.Folio"  # the Windows shortcut carries the same ID (folio.iss)
LOG_NAME = "folio.log"
_MAX_LOG_BYTES = 2_000_000


def log_dir(env: dict[str, str] | None = None, platform_name: str = sys.platform) -> Path:
    """``$FOLIO_LOG_DIR`` (set by the bootstrap), else ``logs`` in Folio's per-user
    data folder, the same place installer/bootstrap.py uses."""
    env = os.environ if env is None else env
    if env.get("FOLIO_LOG_DIR"):
        return Path(env["FOLIO_LOG_DIR"]).expanduser()
    if env.get("FOLIO_HOME"):
        return Path(env["FOLIO_HOME"]).expanduser() / "logs"
    home = Path(env.get("HOME") or env.get("USERPROFILE") or Path.home())
    if platform_name == "win32":
        return Path(env.get("LOCALAPPDATA") or home / "AppData" / "Local") / "Folio" / "logs"
    if platform_name == "darwin":
        return home / "Library" / "Application Support" / "Folio" / "logs"
    xdg = env.get("XDG_DATA_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".local" / "share"
    return base / "folio" / "logs"


def redirect_missing_streams(path: Path | None = None) -> Path | None:
    """Point a None ``sys.stdout`` / ``sys.stderr`` at a log file; the file's path, or
    None when both streams exist (then nothing changes)."""
    if sys.stdout is not None and sys.stderr is not None:
        return None
    path = path or log_dir() / LOG_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > _MAX_LOG_BYTES:
            os.replace(path, path.with_suffix(".old.log"))
        stream = open(path, "a", encoding="utf-8", errors="backslashreplace", buffering=1)  # noqa: SIM115
    except OSError:
        # Nowhere to write: swallow output rather than crash on the first print.
        path, stream = None, open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    stream.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} folio {sys.argv[1:]!r} "
                 f"(python {sys.version.split()[0]}, {sys.executable})\n")
    if sys.stdout is None:
        sys.stdout = stream
    if sys.stderr is None:
        sys.stderr = stream
    # Some libraries fall back to the original streams; give them the file too.
    if sys.__stdout__ is None:
        sys.__stdout__ = stream
    if sys.__stderr__ is None:
        sys.__stderr__ = stream
    try:
        import faulthandler

        faulthandler.enable(stream)  # a hard crash (segfault) still leaves a trace
    except (OSError, ValueError):
        pass
    return path


def set_app_user_model_id(app_id: str = APP_USER_MODEL_ID) -> bool:
    """Windows: group this process's windows under Folio's taskbar entry."""
    if sys.platform != "win32":
        return False
    try:
        import ctypes

        return ctypes.windll.shell32.SetCurrentProcessExplicitAppUserModelID(app_id) == 0
    except (ImportError, AttributeError, OSError):
        return False


def prepare_process() -> Path | None:
    """Everything above; the log file's path when output was redirected."""
    path = redirect_missing_streams()
    set_app_user_model_id()
    return path


def main(argv: list[str] | None = None) -> int:
    prepare_process()
    argv = sys.argv[1:] if argv is None else argv
    from folio.main import main as cli_main  # only now: it may import transformers/tqdm

    try:
        return cli_main(argv)
    except SystemExit as exc:  # argparse errors and --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()  # into the log when there is no console
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass


if __name__ == "__main__":
    sys.exit(main())
