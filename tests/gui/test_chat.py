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
    # A reply still streaming has only its context plan: no figures rather than zeros.
    assert format_figures({"context": {"policy": "truncate", "dropped": []}}) == ""


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
    """The chat's side of `EngineBridge`: submit, cancel, the job events, and no model
    (the engine judges the whole chat), or a word tokenizer on a cache of
    `cache_tokens` (`with_model`)."""

    job_events = Signal(list)
    engine_ready = Signal(object)
    snapshot_ready = Signal(object)
    remote = False  # this computer's engine, not a server's

    def __init__(self):
        super().__init__()
        self.submitted: list = []
        self.refusal: Exception | None = None
        self.engine = self.loaded = self.tokenizer = None

    def with_model(self, cache_tokens: int, page_size: int = 32) -> None:
        from tests.gui.test_context import word_template

        self.engine = SimpleNamespace(
            cache=SimpleNamespace(page_size=page_size, num_pages=cache_tokens // page_size)
        )
        self.loaded = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
        self.tokenizer = SimpleNamespace(
            has_chat_template=True,
            encode_chat=word_template,
            encode=lambda text, add_special_tokens=False: text.split(),
        )

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


# -- a chat that outgrows the cache: its context policy -------------------------------


def long_chat(store: Store, turns: int, words: int, policy: str = "truncate_middle") -> int:
    """A stored chat of `turns` exchanges of `words` words each way."""
    conv = store.create_conversation("Long", system_prompt="Be brief.")
    store.update_conversation(conv.id, context_policy=policy)
    parent = None
    for t in range(turns):
        q = store.add_message(conv.id, parent, "user", " ".join([f"q{t}"] * words))
        parent = store.add_message(conv.id, q.id, "assistant", " ".join([f"a{t}"] * words)).id
    return conv.id


@pytest.mark.parametrize("policy", ["truncate_middle", "rolling_window"])
def test_a_chat_past_the_cache_is_sent_with_earlier_turns_left_out(chat, policy):
    chat.bridge.with_model(cache_tokens=1024)
    cid = long_chat(chat.store, turns=8, words=100, policy=policy)
    preview = chat.controller.preview(cid, "And then?")
    job = chat.controller.send(cid, "And then?")
    assert job is not None
    request = chat.bridge.submitted[-1]
    from tests.gui.test_context import word_template

    assert len(word_template(request.messages)) == preview.prompt_tokens  # the gauge's count
    assert request.max_new_tokens == preview.reply_tokens >= 256
    assert preview.prompt_tokens + request.max_new_tokens <= 1024
    path = chat.store.transcript(cid)
    reply = path[-1]
    dropped = reply.stats["context"]["dropped"]  # marked while it streams
    assert dropped == list(preview.dropped_ids) and dropped
    first_question = path[0].id
    assert (first_question in dropped) is (policy == "rolling_window")
    chat.controller.on_job_events(done(job, "Fine.", prompt_tokens=preview.prompt_tokens))
    stats = chat.store.message(reply.id).stats
    assert stats["context"]["dropped"] == dropped and stats["prompt_tokens"] > 0
    assert len(chat.store.messages(cid)) == 2 * 8 + 2  # left out, not deleted


def test_under_stop_a_chat_past_the_cache_says_what_to_do_and_sends_nothing(chat):
    chat.bridge.with_model(cache_tokens=1024)
    cid = long_chat(chat.store, turns=8, words=100, policy="stop")
    assert chat.controller.send(cid, "And then?") is None
    assert chat.bridge.submitted == []
    reply = chat.store.transcript(cid)[-1]
    assert reply.complete and "no longer fits" in reply.error
    assert "Truncate the middle" in reply.error and "new chat" in reply.error


def test_the_reply_budget_shrinks_before_any_turn_is_dropped(chat):
    chat.bridge.with_model(cache_tokens=1024)
    cid = long_chat(chat.store, turns=3, words=100)  # ~640 tokens: 512 more do not fit
    chat.controller.send(cid, "And then?")
    request = chat.bridge.submitted[-1]
    assert 256 <= request.max_new_tokens < 512
    assert len(request.messages) == 1 + 6 + 1  # system prompt, every turn, the question
    assert chat.store.transcript(cid)[-1].stats["context"]["dropped"] == []


@pytest.fixture
def view(qtbot, chat):
    from gui.chat.view import ChatView

    widget = ChatView(chat.store, chat.controller)
    qtbot.addWidget(widget)
    widget.resize(700, 500)
    widget.show()
    return widget


def test_dropped_messages_are_marked_in_the_chat(qtbot, chat, view):
    chat.bridge.with_model(cache_tokens=1024)
    cid = long_chat(chat.store, turns=8, words=100)
    view.show_conversation(cid)
    view.input.setPlainText("And then?")
    view.refresh_gauge()
    plan = chat.controller.preview(cid, "And then?")
    n = len(plan.dropped_ids)
    assert n and n % 2 == 0  # whole turns
    assert f"Sending leaves {n} earlier messages out" in view.gauge.label.text()
    assert view.gauge.count == plan.prompt_tokens and view.gauge.level.value == "warn"
    view.send()
    dropped = chat.store.transcript(cid)[-1].stats["context"]["dropped"]
    assert dropped == list(plan.dropped_ids)
    (marker,) = view.outside_markers
    assert marker.text() == f"↑ {n} earlier messages are outside the model's context"
    assert all(view.bubbles[mid].property("outside") for mid in dropped)
    kept = [mid for mid in view.bubbles if mid not in dropped]
    assert not any(view.bubbles[mid].property("outside") for mid in kept)
    # the marker sits right below the last left-out message
    layout = view.messages_layout
    assert layout.indexOf(marker) == layout.indexOf(view.bubbles[dropped[-1]]) + 1


def test_the_gauge_waits_for_typing_to_stop(qtbot, chat, view, monkeypatch):
    """Tokenizing runs once after the keys, not once per key."""
    chat.bridge.with_model(cache_tokens=1024)
    cid = long_chat(chat.store, turns=2, words=20)
    view.show_conversation(cid)
    view.refresh_gauge()
    calls = []
    real = chat.controller.preview
    monkeypatch.setattr(chat.controller, "preview", lambda *a: calls.append(a) or real(*a))
    qtbot.keyClicks(view.input, "twenty characters!!!")
    assert calls == []
    qtbot.waitUntil(lambda: len(calls) == 1)
    assert view.gauge.count == real(cid, "twenty characters!!!").prompt_tokens
    assert view.gauge.label.text().startswith(f"{view.gauge.count:,} tokens + up to 512")


# -- scrolling --------------------------------------------------------------------------


def scroll_bar(view):
    return view.scroll.verticalScrollBar()


def at_end(view) -> bool:
    bar = scroll_bar(view)
    return bar.maximum() > 0 and bar.value() == bar.maximum()


def test_a_chat_opens_on_its_newest_message(qtbot, chat, view):
    cid = long_chat(chat.store, turns=15, words=60)
    other = long_chat(chat.store, turns=15, words=60)
    view.show_conversation(cid)
    qtbot.waitUntil(lambda: at_end(view))
    scroll_bar(view).triggerAction(scroll_bar(view).SliderAction.SliderToMinimum)
    view.show_conversation(other)  # read from the top before: still opens at the end
    qtbot.waitUntil(lambda: at_end(view))


def test_sending_follows_the_reply_unless_the_user_scrolled_up(qtbot, chat, view):
    cid = long_chat(chat.store, turns=15, words=60)
    view.show_conversation(cid)
    qtbot.waitUntil(lambda: at_end(view))
    bar = scroll_bar(view)
    bar.triggerAction(bar.SliderAction.SliderToMinimum)  # the user reads the start
    view.input.setPlainText("Tell me more.")
    job = view.send()
    qtbot.waitUntil(lambda: at_end(view))  # the new message and reply come into view
    stream = "A line of the reply.\n\n"
    for _ in range(3):
        chat.controller.on_job_events([JobEvent(job, EventKind.STREAMING, text=stream * 5)])
        end = bar.maximum()
        view.render_streaming()
        qtbot.waitUntil(lambda end=end: bar.maximum() > end and at_end(view))
    bar.triggerAction(bar.SliderAction.SliderPageStepSub)  # up a page: stays put
    held = bar.value()
    assert held < bar.maximum() and not view.follow
    for _ in range(2):
        end = bar.maximum()
        chat.controller.on_job_events([JobEvent(job, EventKind.STREAMING, text=stream * 5)])
        view.render_streaming()
        qtbot.waitUntil(lambda end=end: bar.maximum() > end)
        assert bar.value() == held
    chat.controller.on_job_events(done(job, ""))  # the reply finishes: the view rebuilds
    qtbot.waitUntil(lambda: bar.maximum() > 0 and not view.controller.generations)
    assert bar.value() == held
    bar.triggerAction(bar.SliderAction.SliderToMaximum)  # back at the end: follows again
    assert view.follow
