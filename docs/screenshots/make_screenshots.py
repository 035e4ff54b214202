"""Re-take the README's screenshots with the real SmolLM2 model (offscreen, ~30 s on CPU).

    python docs/screenshots/make_screenshots.py [output folder]

main_window.png: two chats sharing a system prompt, the second one mid-reply, the
memory views in their dock. memory_panel.png / memory_panel_dark.png: the memory
panel alone, light and dark, fed the same moment's snapshot. main_window_1024.png /
main_window_1024_dark.png: the same window at 1024x700 (the smallest size the layout is
made for), light and dark; main_window_1024_settings.png: there with the chat's
"System prompt and sampling" open.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from PySide6.QtCore import QSettings  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

# Long enough to fill a few whole pages, so the two chats visibly share a chain.
SYSTEM = (
    "You are Folio, a friendly assistant running locally on this computer. Keep answers "
    "short and practical, use plain words, give one small example when it helps, and say "
    "so when you are unsure instead of guessing. Never invent sources or figures."
)
WINDOW_SIZE = (1500, 900)
SMALL_SIZE = (1024, 700)
PANEL_SIZE = (640, 1000)
SHOTS = (
    "main_window.png",
    "memory_panel.png",
    "memory_panel_dark.png",
    "main_window_1024.png",
    "main_window_1024_settings.png",
    "main_window_1024_dark.png",
)


def wait(app: QApplication, condition, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError("the screenshot scene did not come about in time")
        app.processEvents()
        time.sleep(0.005)


def pause(app: QApplication, seconds: float) -> None:
    end = time.monotonic() + seconds
    wait(app, lambda: time.monotonic() >= end)


def dark_qt_palette():
    """A dark palette for the Qt widgets around the views (the offscreen platform has no
    OS colour scheme to follow); the chat and the memory views pin their own."""
    from PySide6.QtGui import QColor, QPalette

    pal = QPalette()
    roles = QPalette.ColorRole
    for role, color in (
        (roles.Window, "#202226"), (roles.WindowText, "#E6E6E6"), (roles.Base, "#17181B"),
        (roles.AlternateBase, "#26282C"), (roles.Text, "#E6E6E6"), (roles.Button, "#2B2D31"),
        (roles.ButtonText, "#E6E6E6"), (roles.Highlight, "#3B6EA8"),
        (roles.HighlightedText, "#FFFFFF"), (roles.PlaceholderText, "#8A8F98"),
        (roles.ToolTipBase, "#2B2D31"), (roles.ToolTipText, "#E6E6E6"), (roles.Link, "#7FB2FF"),
    ):  # fmt: skip
        pal.setColor(role, QColor(color))
    return pal


def small_window_shots(app: QApplication, window, out: Path) -> None:
    """The window at 1024x700 while the reply still streams: as it is, with the chat's
    settings open, and dark. The panel and the status bar show one snapshot each time."""
    window.resize(*SMALL_SIZE)
    panel = window.memory_panel

    def take(name: str) -> None:
        pause(app, 0.3)  # the layout settles over a few passes
        snapshot = window.bridge.engine.snapshot()
        panel.refresh(snapshot, window.bridge.telemetry, window.bridge.tokenizer)
        window.update_status(snapshot)
        app.processEvents()
        window.grab().save(str(out / name), "PNG", 0)

    take("main_window_1024.png")
    window.chat_view.settings.toggle.setChecked(True)
    take("main_window_1024_settings.png")
    window.chat_view.settings.toggle.setChecked(False)
    light = app.palette()
    app.setPalette(dark_qt_palette())
    window.chat_view.set_dark(True)
    panel.set_dark(True)
    take("main_window_1024_dark.png")
    app.setPalette(light)  # the panel's own shots next, light first


def send(window, text: str, max_new_tokens: int) -> None:
    view = window.chat_view
    view.settings.load(SYSTEM, {"temperature": 0.3, "max_new_tokens": max_new_tokens, "seed": 7})
    view.save_settings()
    view.input.setPlainText(text)
    view.send()


def main(out: Path) -> None:
    app = QApplication.instance() or QApplication(["folio"])
    from engine.model.fetch import ensure_default_model
    from engine.model.loader import load_model
    from gui.app import app_icon
    from gui.main_window import MainWindow
    from gui.settings_dialog import EngineSettings
    from gui.store import Store
    from gui.views.memory_panel import MemoryPanel

    icon = app_icon()
    if icon is not None:
        app.setWindowIcon(icon)
    folder = Path(tempfile.mkdtemp(prefix="folio_shots_"))
    # A prompt cache on disk of its own: the user's (or an earlier run's) would show up
    # in the page map and the tree, and every run would differ.
    os.environ["FOLIO_KV_CACHE_DIR"] = str(folder / "kv")
    settings = QSettings(str(folder / "folio.ini"), QSettings.Format.IniFormat)
    engine = EngineSettings(page_size=16, budget=2048, max_chunk_size=64, max_batch_size=8)
    settings.setValue("engine/settings", json.dumps(engine.as_dict()))
    window = MainWindow(Store(folder / "chats.sqlite3"), settings)
    window.resize(*WINDOW_SIZE)
    window.show()
    window.use_loaded(load_model(ensure_default_model()))  # the default weight mode
    wait(app, lambda: window.bridge.ready)

    # Chat 1 answers in full; chat 2 (same system prompt, so its first pages are hits)
    # is caught mid-reply.
    window.rename_conversation(window.chat_view.conversation_id, "Trip plan")
    send(window, "Plan a relaxed two-day visit to Lisbon.", 160)
    wait(app, lambda: not window.controller.generations)
    second = window.new_conversation()
    window.rename_conversation(second, "Python help")
    send(window, "How do I read a CSV file in Python? Show a short example.", 400)

    def mid_reply() -> bool:
        bubbles = list(window.chat_view.bubbles.values())
        return len(bubbles) == 2 and len(bubbles[1].text) > 350

    wait(app, mid_reply)
    snapshot = window.bridge.engine.snapshot()
    panel = window.memory_panel
    panel.refresh(snapshot, window.bridge.telemetry, window.bridge.tokenizer)
    pause(app, 0.3)  # let the last paint land
    out.mkdir(parents=True, exist_ok=True)
    window.grab().save(str(out / "main_window.png"), "PNG", 0)
    small_window_shots(app, window, out)

    # The panel alone, light and dark, from the same moment.
    for dark, name in ((False, "memory_panel.png"), (True, "memory_panel_dark.png")):
        alone = MemoryPanel()
        alone.set_dark(dark)
        alone.resize(*PANEL_SIZE)
        for conv in sorted(window.store.conversations(), key=lambda c: c.id):
            alone.chats.index_of(conv.id)  # colours in the window's order: they match
            alone.set_chat_name(conv.id, conv.title)
        alone.show()
        alone.refresh(snapshot, window.bridge.telemetry, window.bridge.tokenizer)
        pause(app, 0.2)
        alone.grab().save(str(out / name), "PNG", 0)
        alone.close()
    window.close()
    for name in SHOTS:
        print(f"{out / name}: {(out / name).stat().st_size // 1024} KB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
