"""`folio` (no arguments) and `folio app`: the desktop application.

main([])                 start the app
main(["--smoke-test"])   build the window, load the engine, run a few seconds, exit 0
main(["path/to.gguf"])   start on that model
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
SMOKE_SECONDS = 3.0
SMOKE_LOAD_TIMEOUT_S = 120.0


def display_available() -> bool:
    """False on Linux without an X11/Wayland display, unless Qt is told to draw
    offscreen (tests, screenshots)."""
    if not sys.platform.startswith("linux"):
        return True
    if os.environ.get("QT_QPA_PLATFORM", "") in ("offscreen", "minimal", "vnc", "eglfs"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="folio app", description="The Folio desktop app.")
    parser.add_argument("model", nargs="?", type=Path, help="a .gguf file or model folder")
    parser.add_argument(
        "--smoke-test",
        action="store_true",
        help="open the window, load the engine, run a few seconds and exit (0 = fine)",
    )
    return parser.parse_args(argv)


def app_icon(resources: Path = RESOURCES):
    """Folio's icon from `resources/`: every PNG size in `icons/` (crisp in task bars
    and title bars alike) plus the SVG; None when there are no icon files, so a
    checkout without resources still starts."""
    from PySide6.QtGui import QIcon

    files = sorted((resources / "icons").glob("folio-*.png")) if resources.is_dir() else []
    svg = resources / "folio.svg"
    if svg.is_file():
        files.append(svg)
    icon = QIcon()
    for path in files:
        icon.addFile(str(path))
    return None if icon.isNull() else icon


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if not display_available():
        print(
            "folio: no display found (DISPLAY and WAYLAND_DISPLAY are unset), so the "
            "window cannot open.\nUse `folio chat` to chat in the terminal, or run the "
            "app where a display is available.",
            file=sys.stderr,
        )
        return 1

    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtGui import QGuiApplication
    from PySide6.QtWidgets import QApplication

    from engine.paths import data_dir
    from gui.data_folder import open_store
    from gui.main_window import MainWindow

    app = QApplication.instance() or QApplication(["folio"])
    QGuiApplication.setApplicationName("Folio")
    QGuiApplication.setOrganizationName("folio")
    QGuiApplication.setDesktopFileName("folio")
    icon = app_icon()
    if icon is not None:
        app.setWindowIcon(icon)  # every window, dialogs included, takes the app's icon

    folder = data_dir()
    # A data folder that cannot be used does not stop the app: it starts on a fallback
    # store, and the dialog names the path, the reason and what to do.
    opening = open_store(folder)
    store = opening.store
    settings = QSettings(str(folder / "folio.ini"), QSettings.Format.IniFormat)
    window = MainWindow(store, settings)
    window.show()
    if opening.problem is not None:
        window.show_data_folder_problem(opening.problem)
    window.start_engine(args.model)

    if not args.smoke_test:
        code = app.exec()
        store.close()
        return code

    # Smoke test: wait for the engine (or its failure), let the loop run, then close.
    outcome: dict[str, str] = {}
    window.bridge.engine_ready.connect(lambda info: outcome.setdefault("ready", info.name))
    window.bridge.engine_failed.connect(lambda msg: outcome.setdefault("failed", msg))
    deadline = time.monotonic() + SMOKE_LOAD_TIMEOUT_S
    while not outcome and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.01)
    end = time.monotonic() + SMOKE_SECONDS
    while time.monotonic() < end and "ready" in outcome:
        app.processEvents()
        time.sleep(0.01)
    QTimer.singleShot(0, window.close)
    app.processEvents()
    window.close()
    store.close()
    if "ready" in outcome:
        print(f"folio: smoke test passed ({outcome['ready']})")
        return 0
    print(
        f"folio: smoke test failed: {outcome.get('failed', 'the engine did not load')}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
