"""A long chat on SmolLM2 with the issue's 1,024-token cache (32 pages of 32): under each
context policy the next message is answered (or, under "stop", refused with what to do),
the reply budget shrinks before turns drop, and the gauge under the composer counts
exactly the prompt the engine's job holds."""

from __future__ import annotations

import pytest

from gui.chat.context import Outcome
from gui.settings_dialog import EngineSettings
from tests.gui.test_app import bubbles, configure, make_window, wait_idle

pytestmark = pytest.mark.slow

ISSUE_CACHE = EngineSettings(page_size=32, budget=1024, max_chunk_size=128, max_batch_size=8)
LINE = "The keeper of the lighthouse wrote down the wind, the waves and every ship he saw. "


@pytest.fixture
def window(qtbot, tmp_path, smollm2_int4):
    win = make_window(qtbot, tmp_path, smollm2_int4, ISSUE_CACHE)
    configure(win, max_new_tokens=512)  # the default reply budget
    win.resize(1400, 860)
    yield win
    win.close()


def grow(window, turns: int, lines: int) -> None:
    """Stored exchanges of about 20 tokens per line each way, as if the chat had them."""
    store, cid = window.store, window.chat_view.conversation_id
    parent = store.conversation(cid).current_leaf
    for t in range(turns):
        q = store.add_message(cid, parent, "user", f"Question {t}: " + LINE * lines)
        parent = store.add_message(cid, q.id, "assistant", f"Answer {t}: " + LINE * lines).id
    window.chat_view.show_conversation(cid)


def use_policy(window, policy: str) -> None:
    combo = window.chat_view.settings.policy
    combo.setCurrentIndex(combo.findData(policy))
    window.chat_view.save_settings()


def spy_requests(window) -> list:
    requests, submit = [], window.bridge.submit
    window.bridge.submit = lambda request: requests.append(request) or submit(request)
    return requests


def type_and_count(qtbot, window, text: str):
    view = window.chat_view
    view.input.setPlainText(text)
    qtbot.waitUntil(lambda: not view._gauge_timer.isActive() and view.gauge.plan is not None)
    return view.gauge.plan


def shot(qtbot, widget, path: str) -> None:
    """A screenshot to look at, once the layout has settled."""
    qtbot.wait(300)
    widget.grab().save(path)


def send_and_stop(qtbot, window) -> None:
    """Send, let the reply start streaming, stop it: enough to show the job ran."""
    view = window.chat_view
    view.send()
    qtbot.waitUntil(lambda: bool(bubbles(window)[-1].text), timeout=60_000)
    view.stop()
    wait_idle(qtbot, window)


@pytest.mark.parametrize("policy", ["truncate_middle", "rolling_window"])
def test_a_chat_past_the_cache_goes_on_answering_with_the_dropped_turns_marked(
    qtbot, window, policy
):
    view = window.chat_view
    use_policy(window, policy)
    grow(window, turns=6, lines=5)  # ~1,300 tokens of chat: past 1,024 by itself
    requests = spy_requests(window)
    plan = type_and_count(qtbot, window, "Which ship came last?")
    assert plan.outcome is Outcome.DROPPED and plan.dropped_ids
    assert "earlier messages out" in view.gauge.label.text()
    if policy == "truncate_middle":
        shot(qtbot, view, "/tmp/folio_17a_gauge_dropping.png")
    send_and_stop(qtbot, window)
    path = window.store.transcript(view.conversation_id)
    reply = path[-1]
    assert reply.role == "assistant" and not reply.error and reply.content
    # the gauge counted what the engine's job held
    assert reply.stats["prompt_tokens"] == plan.prompt_tokens
    assert requests[-1].max_new_tokens == plan.reply_tokens
    assert plan.prompt_tokens + plan.reply_tokens <= 1024
    dropped = reply.stats["context"]["dropped"]
    assert dropped == list(plan.dropped_ids)
    assert (path[0].id in dropped) is (policy == "rolling_window")
    (marker,) = view.outside_markers
    assert f"{len(dropped)} earlier messages are outside the model's context" in marker.text()
    assert len(window.store.messages(view.conversation_id)) == len(path)  # none deleted
    if policy == "truncate_middle":
        qtbot.waitUntil(lambda: view.scroll.verticalScrollBar().maximum() > 0)
        view.follow = False  # looking at the marker, as a reader who scrolled up
        view.scroll.ensureWidgetVisible(marker, 50, 250)
        shot(qtbot, view, "/tmp/folio_17a_dropped_marker.png")


def test_under_stop_the_chat_says_what_to_do(qtbot, window):
    view = window.chat_view
    use_policy(window, "stop")
    grow(window, turns=6, lines=5)
    requests = spy_requests(window)
    plan = type_and_count(qtbot, window, "Which ship came last?")
    assert plan.outcome is Outcome.STOPPED and view.gauge.level.value == "blocked"
    shot(qtbot, view.gauge, "/tmp/folio_17a_gauge_stop.png")
    view.send()
    assert requests == [] and not window.controller.generations
    reply = window.store.transcript(view.conversation_id)[-1]
    assert "no longer fits" in reply.error and "Truncate the middle" in reply.error
    assert f"{plan.prompt_tokens:,} tokens" in reply.error
    shot(qtbot, view, "/tmp/folio_17a_stop.png")
    view.settings.toggle.setChecked(True)  # where the policy is picked
    shot(qtbot, view, "/tmp/folio_17a_policy.png")


def test_the_reply_budget_shrinks_before_turns_drop_and_the_gauge_counts_the_job(qtbot, window):
    """~650 tokens of chat and a 512-token reply budget: the issue's "job needs 38
    pages" failure. The reply gets what is left instead, every turn is kept."""
    view = window.chat_view
    grow(window, turns=3, lines=5)
    requests = spy_requests(window)
    plan = type_and_count(qtbot, window, "Which ship came last?")
    assert plan.outcome is Outcome.SHORTENED and not plan.dropped_ids
    assert 256 <= plan.reply_tokens < 512
    assert "(512 asked for: the chat fills the rest)" in view.gauge.label.text()
    shot(qtbot, view.gauge, "/tmp/folio_17a_gauge_shortened.png")
    send_and_stop(qtbot, window)
    reply = window.store.transcript(view.conversation_id)[-1]
    assert not reply.error and reply.stats["prompt_tokens"] == plan.prompt_tokens
    assert requests[-1].max_new_tokens == plan.reply_tokens
    assert len(requests[-1].messages) == 1 + 6 + 1  # system prompt, every turn, the question
    assert reply.stats["context"]["dropped"] == [] and not view.outside_markers
