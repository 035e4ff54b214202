"""The main window with the real SmolLM2 engine: chat round trip, edits that reuse the
prefix, stop, close while generating, bad input, event-loop latency, crash safety,
the smoke test and the `folio` entry point."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings, Qt, QTimer

from gui.main_window import MainWindow
from gui.settings_dialog import EngineSettings
from gui.store import Store

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Small pages so a short system prompt already fills whole (shareable) pages; a small
# budget so the cache allocates in milliseconds.
SMALL = EngineSettings(page_size=16, budget=1024, max_chunk_size=64, max_batch_size=8)
SYSTEM = "You are Folio's test assistant. Answer in one short sentence, plainly and politely."


def make_window(qtbot, tmp_path: Path, loaded, settings: EngineSettings = SMALL) -> MainWindow:
    qsettings = QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)
    qsettings.setValue("engine/settings", json.dumps(settings.as_dict()))
    store = Store(tmp_path / "chats.sqlite3")
    window = MainWindow(store, qsettings)
    qtbot.addWidget(window)
    window.show()
    window.use_loaded(loaded)
    qtbot.waitUntil(lambda: window.bridge.ready, timeout=30_000)
    configure(window, max_new_tokens=12)
    return window


def configure(window: MainWindow, max_new_tokens: int, temperature: float = 0.0) -> None:
    view = window.chat_view
    view.settings.load(SYSTEM, {"temperature": temperature, "max_new_tokens": max_new_tokens})
    view.save_settings()


def wait_idle(qtbot, window: MainWindow, timeout: int = 60_000) -> None:
    qtbot.waitUntil(lambda: not window.controller.generations, timeout=timeout)


def bubbles(window: MainWindow):
    return list(window.chat_view.bubbles.values())


@pytest.fixture
def window(qtbot, tmp_path, smollm2_int4):
    win = make_window(qtbot, tmp_path, smollm2_int4)
    yield win
    win.close()


def test_chat_round_trip(qtbot, window):
    view = window.chat_view
    qtbot.keyClicks(view.input, "Name a colour.")
    qtbot.keyClick(view.input, Qt.Key.Key_Return)
    assert view.input.toPlainText() == ""
    # the reply streams into its bubble before the job ends
    qtbot.waitUntil(
        lambda: len(bubbles(window)) == 2 and bool(bubbles(window)[1].text), timeout=30_000
    )
    wait_idle(qtbot, window)
    user, reply = bubbles(window)
    assert user.text == "Name a colour." and reply.text.strip()
    figures = reply.figures.text()
    assert "prompt" in figures and "cached" in figures and "tok/s" in figures
    saved = window.store.transcript(view.conversation_id)
    assert [m.role for m in saved] == ["user", "assistant"]
    assert saved[1].complete and saved[1].content == reply.text
    assert saved[1].stats["new_tokens"] > 0 and saved[1].stats["prompt_tokens"] > 0
    # the first message names the chat
    assert window.store.conversation(view.conversation_id).title == "Name a colour."
    # Shift+Enter is a new line, not a send
    qtbot.keyClicks(view.input, "a")
    qtbot.keyClick(view.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    assert view.input.toPlainText() == "a\n" and not window.controller.generations


def test_edit_makes_a_branch_that_reuses_the_prefix(qtbot, window):
    view = window.chat_view
    view.input.setPlainText("Name a fruit.")
    view.send()
    wait_idle(qtbot, window)
    first_user = bubbles(window)[0]
    first_user.start_edit()
    first_user.editor.setPlainText("Name a vegetable.")
    qtbot.mouseClick(first_user.save_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, window)
    user, reply = bubbles(window)
    assert user.text == "Name a vegetable."
    assert user.version_label.text() == "2/2" and user.prev_button.isEnabled()
    stats = window.store.message(reply.message_id).stats
    # system prompt and template head are whole pages already in the cache
    assert stats["cached_tokens"] >= SMALL.page_size, stats
    # the switcher goes back to the old branch, which is still there
    qtbot.mouseClick(user.prev_button, Qt.MouseButton.LeftButton)
    assert bubbles(window)[0].text == "Name a fruit." and len(bubbles(window)) == 2


def test_regenerate_and_sample_n(qtbot, window):
    view = window.chat_view
    configure(window, max_new_tokens=8, temperature=0.9)
    view.input.setPlainText("Say hello.")
    view.send(n=3)
    qtbot.waitUntil(
        lambda: (
            any(j.pages for j in window.bridge.engine.snapshot().jobs)
            or not window.controller.generations
        ),
        timeout=30_000,
    )
    wait_idle(qtbot, window)
    reply = bubbles(window)[1]
    assert reply.version_label.text() == "1/3"
    replies = window.store.siblings(window.store.message(reply.message_id))
    assert len(replies) == 3 and all(m.complete and m.content for m in replies)
    assert all(m.stats["samples"] == 3 for m in replies)
    reply.regenerate_requested.emit(reply.message_id)
    wait_idle(qtbot, window)
    assert bubbles(window)[1].version_label.text() == "4/4"


def test_stop_frees_the_jobs_pages(qtbot, window):
    view = window.chat_view
    configure(window, max_new_tokens=400)
    view.input.setPlainText("Tell me a long story about a lighthouse.")
    view.send()
    qtbot.waitUntil(
        lambda: len(bubbles(window)) == 2 and len(bubbles(window)[1].text) > 10, timeout=30_000
    )
    assert view.stop_button.isEnabled()
    qtbot.keyClick(view.input, Qt.Key.Key_Escape)  # Esc stops, from the input box too
    wait_idle(qtbot, window, timeout=10_000)

    def freed() -> bool:
        snap = window.bridge.engine.snapshot()
        return not snap.jobs and snap.stats.pages_referenced == 0

    qtbot.waitUntil(freed, timeout=5_000)
    reply = window.store.transcript(view.conversation_id)[-1]
    assert reply.complete and reply.content and reply.stats["eos_reason"] == "cancelled"
    assert "stopped" in bubbles(window)[1].figures.text()


def test_close_while_generating_shuts_down(qtbot, tmp_path, smollm2_int4):
    win = make_window(qtbot, tmp_path, smollm2_int4)
    configure(win, max_new_tokens=400)
    win.chat_view.input.setPlainText("Count from one to one hundred.")
    cid = win.chat_view.conversation_id
    win.chat_view.send()
    qtbot.waitUntil(lambda: len(bubbles(win)) == 2 and bool(bubbles(win)[1].text), timeout=30_000)
    engine = win.bridge.engine
    start = time.monotonic()
    win.close()
    assert time.monotonic() - start < 10
    assert not engine.running and win.bridge.engine is None
    reply = win.store.transcript(cid)[-1]
    assert reply.complete and reply.content  # the partial reply is kept, marked stopped


def test_bad_input_never_crashes(qtbot, window, tmp_path):
    view = window.chat_view
    assert view.send() is None  # empty
    view.input.setPlainText("   \n ")
    assert view.send() is None and not window.store.transcript(view.conversation_id)
    # a prompt longer than the whole cache: an error bubble, nothing queued
    view.input.setPlainText("lighthouse " * 1500)
    assert view.send() is None
    msgs = window.store.transcript(view.conversation_id)
    assert "too long" in msgs[-1].error and "Shorten it" in msgs[-1].error  # context policy
    assert bubbles(window)[-1].objectName() == "bubble_error"
    assert not window.controller.generations
    # a corrupt model file: a dialog with the loader's message; the engine keeps running
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    window.load_model(bad)
    qtbot.waitUntil(lambda: window.error_dialog is not None, timeout=30_000)
    assert "broken.gguf" in window.error_dialog.text()
    window.error_dialog.close()
    assert window.bridge.ready
    # and the chat still works after both
    configure(window, max_new_tokens=4)
    view.input.setPlainText("Hi")
    assert view.send() is not None
    wait_idle(qtbot, window)


def test_conversations_new_rename_delete_search(qtbot, window):
    first = window.chat_view.conversation_id
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    second = window.chat_view.conversation_id
    assert second != first and window.chats.list.count() == 2
    # a new chat inherits the system prompt (so the chats share cached pages)
    assert window.store.conversation(second).system_prompt == SYSTEM
    window.rename_conversation(second, "Lighthouse notes")
    window.chats.search.setText("lighthouse")
    assert window.chats.list.count() == 1
    window.chats.search.clear()
    window.delete_conversation(second, confirm=False)
    assert [c.id for c in window.store.conversations()] == [first]
    assert window.chat_view.conversation_id == first


def test_event_loop_latency_with_four_chats(qtbot, window, capsys, record_property):
    """The issue's budget: the UI thread never waits on the engine, measured as the
    lateness of a 10 ms QTimer probe while four chats generate at once (continuous
    batching) with the memory views visible and updating.

    The first second is warm-up and left out of the max: the four new chats' first
    bubbles, legend entries and tree nodes are created then, once per chat, not per
    token. Every later tick counts, including the last ones, when the jobs finish."""
    # Seeded long replies, so the chats generate for seconds however fast the engine is
    # (80-token poems at a free temperature ended within two seconds at times).
    view = window.chat_view
    view.settings.load(SYSTEM, {"temperature": 0.7, "max_new_tokens": 240, "seed": 7})
    view.save_settings()
    chats = [window.chat_view.conversation_id] + [window.new_conversation() for _ in range(3)]
    ticks: list[tuple[float, float]] = []  # (seconds since start, lateness in ms)
    start = [0.0]
    last = [0.0]

    def probe() -> None:
        now = time.perf_counter()
        ticks.append((now - start[0], max(0.0, (now - last[0]) * 1000 - 10)))
        last[0] = now

    own: list[float] = []

    def timed(obj, name: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args):
            t0 = time.perf_counter()
            inner(*args)
            own.append((time.perf_counter() - t0) * 1000)

        setattr(obj, name, wrapper)

    timed(window.chat_view, "render_streaming")  # the 100 ms re-render tick
    timed(window.controller, "save_partials")  # the 500 ms partial save
    panel = window.memory_panel
    parts_run: list[str] = []
    inner_part = panel._run_part
    panel._run_part = lambda part, force=False: (parts_run.append(part), inner_part(part, force))
    timer = QTimer()
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.setInterval(10)
    timer.timeout.connect(probe)
    for i, cid in enumerate(chats):
        window.select_conversation(cid)
        window.chat_view.input.setPlainText(f"Tell a long story about the number {i + 1}.")
        window.chat_view.send()
    batch_sizes: list[int] = []
    window.bridge.snapshot_ready.connect(
        lambda s: batch_sizes.append(sum(1 for j in s.jobs if j.state == "decode"))
    )
    start[0] = last[0] = time.perf_counter()
    timer.start()
    wait_idle(qtbot, window, timeout=120_000)
    qtbot.wait(300)  # the jobs' last events and the views' last updates count too
    timer.stop()
    assert max(batch_sizes) >= 2  # the chats really ran together
    assert window.memory_dock.isVisible() and {"page_map", "tree", "graphs"} <= set(parts_run)
    late = sorted(ms for _, ms in ticks)
    steady = sorted(ms for t, ms in ticks if t >= 1.0)
    assert len(steady) >= 200  # a few seconds of generation, not a blink
    median, p95 = statistics.median(late), late[int(0.95 * (len(late) - 1))]
    worst = steady[-1]
    with capsys.disabled():
        print(
            f"\nevent-loop latency, 4 chats generating: median {median:.1f} ms, "
            f"p95 {p95:.1f} ms, max {worst:.1f} ms after the first second "
            f"(max {late[-1]:.1f} ms with it) over {len(late)} ticks; "
            f"chat-side handlers max {max(own):.1f} ms"
        )
    record_property("event_loop_latency_max_ms", round(worst, 1))
    assert median < 5
    assert max(own) < 50
    assert worst < 50


CRASH_SCRIPT = r"""
import os, sys, time
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication
app = QApplication([])
from gui.main_window import MainWindow
from gui.settings_dialog import EngineSettings
from engine.paths import data_dir
from gui.store import Store
folder = data_dir()
settings = QSettings(str(folder / "folio.ini"), QSettings.Format.IniFormat)
store = Store(folder / "chats.sqlite3")
w = MainWindow(store, settings)
w.show()
w.start_engine(sys.argv[1])
while not w.bridge.ready:
    app.processEvents(); time.sleep(0.01)
w.chat_view.settings.load("Be helpful.", {"temperature": 0.0, "max_new_tokens": 500})
w.chat_view.save_settings()
w.chat_view.input.setPlainText("First question")
w.chat_view.send()
while w.controller.generations:
    app.processEvents(); time.sleep(0.01)
w.chat_view.input.setPlainText("Tell me a very long story about a lighthouse keeper.")
w.chat_view.send()
print("SENT", flush=True)
while True:
    app.processEvents(); time.sleep(0.01)
"""


def test_crash_mid_reply_keeps_the_partial_reply(qtbot, tmp_path, smollm2_path, smollm2_int4):
    data = tmp_path / "data"
    data.mkdir()
    settings = QSettings(str(data / "folio.ini"), QSettings.Format.IniFormat)
    settings.setValue("engine/settings", json.dumps(SMALL.as_dict()))
    settings.sync()
    env = dict(os.environ, FOLIO_DATA_DIR=str(data), QT_QPA_PLATFORM="offscreen")
    log = open(tmp_path / "crash.log", "w")  # a file: a full pipe would stall the child
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, str(smollm2_path)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        db = Store(data / "chats.sqlite3")
        deadline = time.monotonic() + 60
        partial = ""
        while time.monotonic() < deadline:
            msgs = db.messages(1) if db.conversations() else []
            if len(msgs) == 4 and len(msgs[3].content) > 20:
                partial = msgs[3].content
                break
            time.sleep(0.1)
        assert partial, (tmp_path / "crash.log").read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        log.close()
    # restart: the earlier messages and the partial reply are there, marked interrupted
    win = make_window(qtbot, data, smollm2_int4)
    texts = [b.text for b in bubbles(win)]
    assert texts[0] == "First question" and texts[1]
    assert texts[2].startswith("Tell me a very long story")
    assert texts[3].startswith(partial)
    assert bubbles(win)[3].status.text() == "interrupted"
    win.close()


def test_weights_setting_loads_the_model_again(qtbot, tmp_path, smollm2_int4):
    """ "Weights in memory" reloads the same file in the chosen mode: the resident bytes
    the dialog showed beforehand are what the engine then holds, and chats go on."""
    from engine.model.weight_modes import USER_WEIGHT_MODES

    win = make_window(qtbot, tmp_path, smollm2_int4)
    costs = win.model_info.weight_costs
    assert set(costs) == set(USER_WEIGHT_MODES) and costs["native"] < costs["bf16"]
    changed = EngineSettings(**{**SMALL.as_dict(), "weights": "bf16"})
    assert changed.needs_reload(SMALL) and not changed.needs_rebuild(SMALL)
    assert win.apply_settings(changed, confirm=False)
    qtbot.waitUntil(
        lambda: win.bridge.ready and win.model_info.weight_mode == "bf16", timeout=60_000
    )
    assert abs(win.model_info.weight_bytes - costs["bf16"]) <= 0.05 * costs["bf16"]
    assert "bf16 weights" in win.model_label.text()
    assert win.bridge.cache_settings.page_size == SMALL.page_size  # the cache as it was
    view = win.chat_view
    qtbot.keyClicks(view.input, "Name a colour.")
    qtbot.keyClick(view.input, Qt.Key.Key_Return)
    wait_idle(qtbot, win)
    assert bubbles(win)[1].text.strip()
    win.close()


def test_layout_and_settings_persist(qtbot, tmp_path, smollm2_int4):
    win = make_window(qtbot, tmp_path, smollm2_int4)
    win.memory_dock.hide()
    cid = win.new_conversation()
    changed = EngineSettings(**{**SMALL.as_dict(), "page_size": 32, "max_chunk_size": 64})
    assert changed.needs_rebuild(SMALL)
    assert win.apply_settings(changed, confirm=False)
    qtbot.waitUntil(
        lambda: win.bridge.ready and win.bridge.cache_settings.page_size == 32, timeout=30_000
    )
    win.close()
    again = make_window(qtbot, tmp_path, smollm2_int4, settings=changed)
    assert again.chat_view.conversation_id == cid
    assert not again.memory_dock.isVisible()
    assert again.engine_settings == changed
    assert again.settings.value("model/last_path")
    again.close()


def test_smoke_test_entry_point(qtbot, monkeypatch, tmp_path, smollm2_path):
    import gui.app

    monkeypatch.setenv("FOLIO_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(gui.app, "SMOKE_SECONDS", 0.5)
    assert gui.app.main(["--smoke-test", str(smollm2_path)]) == 0


def test_no_display_says_so(monkeypatch, capsys):
    import gui.app

    monkeypatch.setattr(sys, "platform", "linux")
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    assert gui.app.main([]) == 1
    assert "folio chat" in capsys.readouterr().err


def test_folio_without_a_command_starts_the_app(monkeypatch):
    import folio.main
    import gui.app

    calls: list[list[str]] = []
    monkeypatch.setattr(gui.app, "main", lambda argv=None: calls.append(argv) or 0)
    assert folio.main.main([]) == 0
    assert folio.main.main(["app", "--smoke-test"]) == 0
    assert calls == [[], ["--smoke-test"]]


def test_first_run_fetches_the_default_model(qtbot, monkeypatch, tmp_path, smollm2_path):
    """No model on disk: a progress dialog runs the fetch off the UI thread, then the
    engine loads what it fetched."""
    import engine.model.fetch as fetch

    ui_thread = threading.get_ident()
    fetch_threads: list[int] = []

    def fake_fetch(progress=None, **_):
        fetch_threads.append(threading.get_ident())
        progress("download", 0, 1)
        for done in range(0, 101, 25):
            progress("extract", done, 100)
            time.sleep(0.02)
        return smollm2_path

    monkeypatch.setattr(fetch, "is_fetched", lambda *a, **k: False)
    monkeypatch.setattr(fetch, "ensure_default_model", fake_fetch)
    store = Store(tmp_path / "chats.sqlite3")
    win = MainWindow(store, QSettings(str(tmp_path / "f.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(win)
    win.start_engine()
    assert win.fetch_dialog.isVisible()
    qtbot.waitUntil(lambda: win.bridge.ready, timeout=60_000)
    assert fetch_threads and fetch_threads[0] != ui_thread
    assert not win.fetch_dialog.isVisible()
    assert win.settings.value("model/last_path") == str(smollm2_path)
    win.close()


def test_app_icon_from_resources(qtbot, tmp_path):
    import gui.app

    icon = gui.app.app_icon()
    if not (gui.app.RESOURCES / "folio.svg").is_file():
        pytest.skip("no icon in resources/ in this checkout")
    assert icon is not None and not icon.isNull()
    assert not icon.pixmap(32, 32).isNull()
    assert gui.app.app_icon(tmp_path) is None  # no icon files: no icon, no error
