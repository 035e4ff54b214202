"""Chat widgets without a model: Markdown split into prose and code, code copy,
folding long messages, figures text; the controller on a fake engine: every error
(a refused request, a failed job, a store that refuses a write) ends on screen with
what to do, and no reply stays marked as generating."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QGuiApplication

from engine.generator.job import EventKind, JobEvent, JobResult
from gui.chat.bubble import FOLD_CHARS, CodeBlock, MessageBubble, format_figures
from gui.chat.controller import ChatController
from gui.chat.markdown import Segment, split_segments
from gui.store import Store


def test_split_segments_closed_and_streaming_fences():
    text = "Here:\n```python\nprint(1)\n```\nDone."
    assert split_segments(text) == [
        Segment("text", "Here:"),
        Segment("code", "print(1)", "python"),
        Segment("text", "Done."),
    ]
    # half-streamed: the open block runs to the end
    assert split_segments("Try\n```sh\nls -") == [
        Segment("text", "Try"),
        Segment("code", "ls -", "sh", closed=False),
    ]
    assert split_segments("") == [Segment("text", "")]


def test_bubble_renders_code_with_copy_and_updates_in_place(qtbot):
    bubble = MessageBubble(1, "assistant", [1])
    qtbot.addWidget(bubble)
    bubble.set_text("A\n```py\nx = 1")
    first_widgets = list(bubble._segment_widgets)
    bubble.set_text("A\n```py\nx = 1\ny = 2")  # same shape: no widget rebuilt
    assert bubble._segment_widgets == first_widgets
    code = [w for w in bubble._segment_widgets if isinstance(w, CodeBlock)][0]
    code.copy()
    assert QGuiApplication.clipboard().text() == "x = 1\ny = 2"


def test_long_user_message_is_folded(qtbot):
    bubble = MessageBubble(2, "user", [2, 5])
    qtbot.addWidget(bubble)
    bubble.set_text("word " * 1000)
    label = bubble._segment_widgets[0]
    assert len(label.text()) < FOLD_CHARS + 60 and not bubble.expand_button.isHidden()
    bubble.expand_button.click()
    assert len(bubble._segment_widgets[0].text()) == len("word " * 1000)
    assert bubble.version_label.text() == "1/2" and not bubble.prev_button.isEnabled()


def test_figures_text():
    stats = {
        "prompt_tokens": 412,
        "cached_tokens": 384,
        "new_tokens": 57,
        "time_prefill": 0.1,
        "prefill_tps": 280.0,
        "decode_tps": 61.5,
        "eos_reason": "cancelled",
    }
    text = format_figures(stats)
    assert text.startswith("412 prompt · 384 cached · 57 new · prefill 0.10 s")
    assert "decode 61.5 tok/s" in text and text.endswith("stopped")
    assert format_figures({}) == ""


def test_bubbles_follow_the_theme(qtbot):
    """The chat's colours come from the same light/dark palettes as the memory views:
    dark bubbles with light text in the dark theme, and back."""
    from PySide6.QtWidgets import QVBoxLayout, QWidget

    from gui.chat.bubble import DARK_BUBBLES, LIGHT_BUBBLES, bubble_style
    from gui.palette import DARK, LIGHT

    host = QWidget()
    qtbot.addWidget(host)
    bubble = MessageBubble(3, "assistant", [3])
    QVBoxLayout(host).addWidget(bubble)
    bubble.set_text("Hello")
    for pal, colors in ((DARK, DARK_BUBBLES), (LIGHT, LIGHT_BUBBLES)):
        host.setStyleSheet(bubble_style(pal))
        host.resize(300, 120)
        host.show()
        image = bubble.grab().toImage()
        background = image.pixelColor(image.width() // 2, image.height() - 4).name()
        assert background == colors.assistant.lower()
        text = bubble._segment_widgets[0].palette().color(bubble.foregroundRole()).name()
        assert text == pal.foreground.lower()


# -- every failure ends on screen, with what to do ------------------------------------


class FakeBridge(QObject):
    """The controller's side of `EngineBridge`: submit, cancel and the job events."""

    job_events = Signal(list)

    def __init__(self):
        super().__init__()
        self.submitted: list = []
        self.refusal: Exception | None = None

    def submit(self, request):
        if self.refusal is not None:
            raise self.refusal
        self.submitted.append(request)
        return SimpleNamespace(job_id=len(self.submitted))

    def cancel(self, job_id: int) -> None:
        pass


@pytest.fixture
def chat(qtbot, tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    bridge = FakeBridge()
    controller = ChatController(store, bridge)
    controller._save_timer.stop()  # the tests call save_partials themselves
    yield SimpleNamespace(store=store, bridge=bridge, controller=controller)
    store.close()


def done(job_id: int, text: str = "", **result) -> list[JobEvent]:
    streamed = [JobEvent(job_id, EventKind.STREAMING, text=text)] if text else []
    final = JobResult(texts=[text], eos_reason=result.pop("eos_reason", "stop"), **result)
    return [*streamed, JobEvent(job_id, EventKind.DONE, eos=True, result=final)]


def test_an_engine_error_ends_the_reply_with_what_to_do(chat):
    conv = chat.store.create_conversation()
    job = chat.controller.send(conv.id, "Hi")
    chat.controller.on_job_events(
        done(job, "Hel", eos_reason="error", error="the engine failed: out of memory")
    )
    reply = chat.store.transcript(conv.id)[-1]
    assert reply.complete and reply.error.startswith("the engine failed: out of memory.")
    assert "Regenerate" in reply.error
    assert not chat.controller.is_generating(conv.id) and chat.controller.status(reply.id) == ""


@pytest.mark.parametrize(
    ("refusal", "advice"),
    [
        (RuntimeError("no model is loaded yet"), "File > Models"),
        (ValueError("message 1 has no text"), "Edit the message"),
        (TypeError("an engine bug"), "Edit the message"),  # not a documented refusal
    ],
)
def test_a_refused_request_is_an_error_bubble_with_what_to_do(chat, refusal, advice):
    conv = chat.store.create_conversation()
    chat.bridge.refusal = refusal
    assert chat.controller.send(conv.id, "Hi", n=2) is None
    replies = [m for m in chat.store.messages(conv.id) if m.role == "assistant"]
    assert len(replies) == 2
    for reply in replies:
        assert reply.complete and str(refusal) in reply.error and advice in reply.error
    assert not chat.controller.generations


def fill_the_disk(store: Store) -> None:
    store._db.execute("PRAGMA max_page_count = 1")  # SQLITE_FULL once a page is needed


def free_the_disk(store: Store) -> None:
    store._db.execute("PRAGMA max_page_count = 1000000")


def test_a_full_disk_at_the_end_of_a_reply_keeps_it_shown_and_saves_it_later(chat):
    """The final write fails: the reply stays on screen as finished ("not saved"), the
    chat says why, the other reply of the same burst still finishes, and the text is
    written once there is room."""
    first, second = chat.store.create_conversation(), chat.store.create_conversation()
    job1 = chat.controller.send(first.id, "Write a lot")
    job2 = chat.controller.send(second.id, "Say hi")
    changes: list[str] = []
    chat.controller.saving_changed.connect(changes.append)
    fill_the_disk(chat.store)
    long_reply = "word " * 40_000
    chat.controller.on_job_events(done(job1, long_reply) + done(job2, "Hi!"))
    assert not chat.controller.generations  # neither is left generating
    stored = chat.store.transcript(first.id)[-1]
    assert not stored.complete and stored.content == ""  # the store kept what it had
    shown = chat.controller.shown(stored)
    assert shown.complete and shown.content == long_reply
    assert chat.controller.status(stored.id) == "not saved"
    notice = chat.controller.failures[first.id].message
    assert str(chat.store.path) in notice and "disk is full" in notice
    assert chat.store.transcript(second.id)[-1].content == "Hi!"  # that one fitted
    # still full: the save tick retries quietly
    chat.controller.save_partials()
    chat.controller.save_partials()
    assert changes == [notice] and chat.controller.unsaved
    free_the_disk(chat.store)
    chat.controller.save_partials()
    saved = chat.store.message(stored.id)
    assert saved.complete and saved.content == long_reply
    assert not chat.controller.unsaved and not chat.controller.failures
    assert changes == [notice, ""]


def test_a_full_disk_while_streaming_keeps_the_text_in_memory(chat):
    conv = chat.store.create_conversation()
    job = chat.controller.send(conv.id, "Write a lot")
    fill_the_disk(chat.store)
    text = "word " * 40_000
    chat.controller.on_job_events([JobEvent(job, EventKind.STREAMING, text=text)])
    chat.controller.save_partials()  # refused: no exception, nothing lost
    reply = chat.store.transcript(conv.id)[-1]
    assert chat.controller.live_text(reply.id) == text
    assert "disk is full" in chat.controller.failures[conv.id].message
    free_the_disk(chat.store)
    chat.controller.save_partials()
    assert chat.store.message(reply.id).content == text
    assert conv.id not in chat.controller.failures


def test_a_message_the_store_refuses_goes_back_to_the_user(chat):
    conv = chat.store.create_conversation()
    chat.controller.send(conv.id, "short")
    fill_the_disk(chat.store)
    text = "a long question " * 20_000
    assert chat.controller.send(conv.id, text) is None
    assert not chat.bridge.submitted[1:]  # nothing was asked of the engine
    assert "disk is full" in chat.controller.failures[conv.id].message
    assert chat.controller.take_unsent(conv.id) == text.strip()
    assert chat.controller.take_unsent(conv.id) == ""  # handed back once
