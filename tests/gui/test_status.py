"""A status that tells the truth: the words for each job state (`gui.status`), the status
bar and the memory panel reading the same figures, and with SmolLM2: "prefilling" (with
progress) during a long prompt's prefill, a waiting reply that says why in its bubble,
and the panel and status bar agreeing at once after an Engine-settings change."""

from __future__ import annotations

import dataclasses
import re

import pytest

from engine.engine import JobInfo
from engine.generator.job import WaitKind
from gui.settings_dialog import EngineSettings
from gui.status import engine_words, job_words, memory_figures, wait_words
from tests.gui.conftest import synthetic_snapshot

LINE = "The keeper of the lighthouse wrote down the wind, the waves and every ship he saw. "


def job(state: str, **kw) -> JobInfo:
    base = dict(job_id=1, tag=1, state=state, prompt_tokens=3000, new_tokens=0,
                cached_tokens=0, skips=0, wait_reason="", sequences=(1,), pages=10)  # fmt: skip
    return JobInfo(**{**base, **kw})


def test_wait_words_say_why_and_what_ends_the_wait():
    memory = wait_words(WaitKind.MEMORY, "not enough free pages: needs 20, 3 free")
    assert memory.startswith("waiting for memory") and "(needs 20, 3 free)" in memory
    assert "another reply ends" in memory
    batch = wait_words(WaitKind.BATCH, "batch full: needs 1 slot(s), 0 free")
    assert batch.startswith("waiting for a batch slot") and "(needs 1 slot(s), 0 free)" in batch
    assert "disk" in wait_words(WaitKind.DISK, "reading its cached pages from disk")
    assert wait_words("", "").startswith("queued")
    assert wait_words("something new", "a new reason") == "waiting: a new reason"


def test_job_words_prefill_progress_and_time_left():
    prefilling = job("prefill", prefill_done=1200, prefill_total=3000, prefill_from=200,
                     prefill_since=10.0)  # fmt: skip
    # 1,000 tokens in 5 s: 200 tok/s, 1,800 left: 9 s.
    assert job_words(prefilling, 15.0) == "prefilling 1,200 / 3,000 tokens · about 9 s left"
    first = dataclasses.replace(prefilling, prefill_done=200)  # no chunk done: no rate yet
    assert job_words(first, 15.0) == "prefilling 200 / 3,000 tokens"
    waiting = job(
        "pending", wait_kind="memory", wait_reason="not enough free pages: needs 9, 2 free"
    )
    assert job_words(waiting, 0.0).startswith("waiting for memory")


def test_engine_words_count_every_state():
    snap = synthetic_snapshot(64, chats=2)
    assert engine_words(dataclasses.replace(snap, jobs=[])) == "idle"
    jobs = [
        job("prefill", job_id=1, prefill_done=64, prefill_total=640),
        job("decode", job_id=2),
        job("decode", job_id=3),
        job("pending", job_id=4, wait_kind="memory"),
        job("pending", job_id=5, wait_kind="memory"),
    ]
    text = engine_words(dataclasses.replace(snap, jobs=jobs))
    assert text == "prefilling 64 / 640 tokens · 2 decoding · 2 waiting for memory"


def test_in_use_is_referenced_and_cached_is_reclaimable():
    snap = dataclasses.replace(synthetic_snapshot(200, page_size=16), cache_bytes=200 * 2**16)
    s, figures = snap.stats, memory_figures(snap)
    assert (figures.in_use, figures.reclaimable, figures.free) == (
        s.pages_referenced, s.pages_cached, s.pages_free)  # fmt: skip
    assert s.pages_cached > 0
    # 64 KiB a page: in use and reclaimable are priced apart, never added up.
    kib = 64 * s.pages_referenced
    assert figures.use_text().startswith(f"KV {kib / 1024:.1f} MB in use · ")
    assert f"{64 * s.pages_cached / 1024:.1f} MB reclaimable" in figures.use_text()
    assert f"{s.pages_referenced} in use · {s.pages_cached} reclaimable" in figures.pages_text()


def test_the_status_bar_and_the_panel_read_the_same_snapshot(qtbot, tmp_path):
    from tests.gui.test_window_layout import make_window

    window = make_window(qtbot, tmp_path)
    window.show()
    for pages in (128, 32):
        snap = dataclasses.replace(
            synthetic_snapshot(pages, page_size=16, version=1000 + pages),
            cache_bytes=pages * 1440 * 1024,
        )
        window.on_snapshot(snap)
        figures = memory_figures(snap)
        assert window.cache_label.text() == figures.cache_text()
        assert window.memory_label.text().startswith(figures.use_text())
        qtbot.waitUntil(lambda f=figures: window.memory_panel.header.toolTip() == f.pages_text())
    window.close()


# -- with SmolLM2 -------------------------------------------------------------------

LONG = EngineSettings(page_size=16, budget=4096, max_chunk_size=16, max_batch_size=8)


@pytest.mark.slow
def test_the_status_reads_prefilling_during_a_long_prefill(qtbot, tmp_path, smollm2_int4):
    from tests.gui.test_app import bubbles, configure, make_window, wait_idle

    window = make_window(qtbot, tmp_path, smollm2_int4, LONG)
    configure(window, max_new_tokens=4)
    view = window.chat_view
    view.input.setPlainText("Summarise this log. " + LINE * 100)  # about 1,900 tokens
    view.send()
    reply = lambda: bubbles(window)[-1]  # noqa: E731
    # One chunk of 16 tokens per step: the status shows the prefill's progress, and the
    # reply's bubble says the same rather than "queued".
    qtbot.waitUntil(lambda: "left" in window.jobs_label.text(), timeout=60_000)
    text = window.jobs_label.text()
    assert text.startswith("prefilling ") and " tokens · about " in text
    qtbot.waitUntil(lambda: reply().status.text().startswith("prefilling "), timeout=10_000)
    done, total = (
        int(n.replace(",", "")) for n in re.findall(r"[\d,]+", reply().status.text())[:2]
    )
    assert 0 < done < total and total > 1500
    wait_idle(qtbot, window)
    qtbot.waitUntil(lambda: window.jobs_label.text() == "idle", timeout=5_000)
    window.close()


@pytest.mark.slow
def test_a_waiting_reply_says_why_in_its_bubble(qtbot, tmp_path, smollm2_int4):
    from tests.gui.test_app import bubbles, configure, make_window

    one_at_a_time = EngineSettings(page_size=16, budget=2048, max_chunk_size=64, max_batch_size=1)
    window = make_window(qtbot, tmp_path, smollm2_int4, one_at_a_time)
    configure(window, max_new_tokens=400)
    view = window.chat_view
    first = view.conversation_id
    view.input.setPlainText("Tell me a long story about a lighthouse keeper.")
    view.send()
    qtbot.waitUntil(lambda: window.controller.status(bubbles(window)[-1].message_id)
                    == "generating…", timeout=30_000)  # fmt: skip
    window.new_conversation()
    configure(window, max_new_tokens=8)
    view.input.setPlainText("And one about a baker.")
    view.send()
    waiting = lambda: bubbles(window)[-1].status.text()  # noqa: E731
    qtbot.waitUntil(lambda: waiting().startswith("waiting for a batch slot"), timeout=10_000)
    assert "it starts when one of them ends" in waiting()
    # The status bar follows within its half-second refresh.
    qtbot.waitUntil(lambda: "1 waiting for a batch slot" in window.jobs_label.text(), timeout=5_000)
    window.controller.stop(first)
    qtbot.waitUntil(lambda: not window.controller.generations, timeout=60_000)
    window.close()


@pytest.mark.slow
def test_panel_and_status_bar_agree_after_a_settings_change(qtbot, tmp_path, smollm2_int4):
    from tests.gui.test_app import SMALL, make_window

    window = make_window(qtbot, tmp_path, smollm2_int4)  # 64 pages of 16
    panel = window.memory_panel
    qtbot.waitUntil(lambda: "64 × 16 tok" in panel.header.toolTip(), timeout=10_000)
    smaller = EngineSettings(**{**SMALL.as_dict(), "budget": 512})  # 32 pages
    assert window.apply_settings(smaller, confirm=False)
    qtbot.waitUntil(lambda: window.bridge.ready and window.bridge.engine.cache.num_pages == 32,
                    timeout=30_000)  # fmt: skip
    snapshot = window.bridge.engine.snapshot()
    figures = memory_figures(snapshot)
    qtbot.waitUntil(lambda: window.cache_label.text() == figures.cache_text(), timeout=10_000)
    # The panel catches up without a message being sent.
    qtbot.waitUntil(lambda: panel.header.toolTip().startswith(figures.pages_text()), timeout=10_000)
    assert "32 pages × 16" in window.cache_label.text()
    assert "32 × 16 tok" in panel.header.toolTip()
    window.close()
