"""Engine settings in plain words: the MB a budget takes (against the cache the engine
builds), the measured quality of each K/V format, the page-size suggestion from the
prompts seen, and what applying would lose (offscreen Qt, no model)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QLineEdit,
    QSpinBox,
    QWidget,
)

from engine.bench.kv_quant_measured import measured_formats
from engine.cache import formats
from engine.cache.kv_cache import KVCache
from engine.cache.page import PageState
from engine.units import format_bytes
from gui.bridge import ModelInfo
from gui.settings_dialog import EngineSettings, SettingsDialog
from gui.settings_hints import (
    PROMPT_RECORD_SIZE,
    PromptLengths,
    budget_figures,
    kv_quality_hint,
    suggest_page_size,
    work_lost,
)
from tests.gui.conftest import synthetic_snapshot

SHAPE = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head size
MODEL = ModelInfo(
    "SmolLM2-135M-Instruct.Q4_1",
    Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "GGUF Q4_1",
    "CPU",
    "llama",
    90_000_000,
    1.0,
    kv_shape=SHAPE,
    context_length=8192,
)


@pytest.fixture
def dialog(qtbot):
    def make(settings: EngineSettings, **kwargs) -> SettingsDialog:
        d = SettingsDialog(settings, model=MODEL, **kwargs)
        qtbot.addWidget(d)
        return d

    return make


@pytest.mark.parametrize(
    "settings",
    [
        EngineSettings(page_size=32, budget=4096),
        EngineSettings(page_size=64, budget=1000, k_bits=4, v_bits=4),
        EngineSettings(page_size=16, budget=50, budget_unit="MB", k_bits=8, v_bits=8),
        EngineSettings(page_size=128, budget=3000, k_bits=8, v_bits=4),
    ],
)
def test_budget_hint_shows_the_memory_the_engine_allocates(dialog, settings):
    """The hint's MB and tokens are the cache the engine builds for these settings,
    and its bytes per token the cache formats' price."""
    d = dialog(settings)
    cache = KVCache(*SHAPE, "test", settings.cache_settings())
    kv = formats.kv_formats(settings.k_bits, settings.v_bits)
    per_token = formats.kv_bytes_per_token(*SHAPE, kv)
    figures = budget_figures(settings, SHAPE)
    assert figures.pages == cache.num_pages
    assert figures.bytes == cache.nbytes() == cache.num_pages * settings.page_size * per_token
    line = d.budget_hint.text()
    assert f"{cache.num_pages * settings.page_size:,} tokens" in line
    assert format_bytes(cache.nbytes(), "MB", binary=True) in line
    assert "one pool shared by all chats" in line
    assert f"{per_token:,} bytes a token" in d.budget_hint.toolTip()


def test_budget_hint_follows_the_fields_live(dialog):
    d = dialog(EngineSettings(page_size=32, budget=4096))
    before = d.budget_hint.text()
    d.budget.setValue(8192)
    after = d.budget_hint.text()
    assert before != after and "8,192 tokens" in after
    d.k_bits.setCurrentIndex(d.k_bits.findData(4))
    d.v_bits.setCurrentIndex(d.v_bits.findData(4))
    per_token = formats.kv_bytes_per_token(*SHAPE, formats.kv_formats(4, 4))
    assert format_bytes(8192 * per_token, "MB", binary=True) in d.budget_hint.text()


def test_budget_hint_names_the_models_context_limit(dialog):
    d = dialog(EngineSettings(page_size=32, budget=16384))
    assert "up to 8,192 tokens (the model reads at most 8,192)" in d.budget_hint.text()


def test_budget_hint_without_a_model_says_so(qtbot):
    d = SettingsDialog(EngineSettings())
    qtbot.addWidget(d)
    assert "load one to see it" in d.budget_hint.text()
    assert "not a context per chat" in d.budget_hint.text()


def test_kv_hint_quotes_the_recorded_bench(dialog):
    records = measured_formats()
    d = dialog(EngineSettings())
    assert d.kv_hint.text().startswith(f"{formats.width_name(None)}: ")  # the default's own line
    for (k, v), record in records.items():
        if k == 32:
            continue
        # the combos offer fp16 as their default (None), not as 16
        d.k_bits.setCurrentIndex(d.k_bits.findData(None if k == 16 else k))
        d.v_bits.setCurrentIndex(d.v_bits.findData(None if v == 16 else v))
        line = d.kv_hint.text()
        percent = record.vs_fp32 * 100
        shown = f"{percent:+.2f}%" if abs(percent) < 10 else f"{percent:+.0f}%"
        name = "fp16" if k == v == 16 else f"K{k}/V{v}"
        assert line.startswith(f"{name}: perplexity {shown} against fp32"), line
        assert "folio bench kv-quant" in d.kv_hint.toolTip()
    d.k_bits.setCurrentIndex(d.k_bits.findData(32))
    d.v_bits.setCurrentIndex(d.v_bits.findData(32))
    assert d.kv_hint.text().startswith("fp32: the model's own arithmetic")
    assert d.k_bits.currentText() == "32-bit float (exact)"


def test_kv_hint_for_an_unmeasured_format_lists_the_measured_ones():
    hint = kv_quality_hint(5, 8)
    assert hint.line.startswith("K5/V8 was not measured")
    for k, v in measured_formats():
        if k != 32:
            assert ("fp16" if k == 16 else f"K{k}/V{v}") in hint.line


def test_every_field_explains_itself(dialog):
    d = dialog(EngineSettings())
    kinds = (QSpinBox, QComboBox, QDoubleSpinBox, QLineEdit, QCheckBox)
    fields = [
        w
        for w in d.findChildren(QWidget)
        if isinstance(w, kinds) and not isinstance(w.parent(), (QAbstractSpinBox, QComboBox))
    ]
    assert len(fields) >= 13
    for w in fields:
        assert w.toolTip().strip(), f"{type(w).__name__} without an explanation"


def test_the_dialog_shows_only_the_chosen_engines_fields_and_fits_700_pixels(dialog, qtbot):
    d = dialog(EngineSettings())
    d.show()
    qtbot.waitExposed(d)
    assert d.local_part.isVisible() and not d.remote_key.isVisible()
    assert d.height() <= 700
    d.use_remote.setChecked(True)
    assert d.remote_key.isVisible() and d.remote_events.isVisible()
    assert not d.local_part.isVisible()
    qtbot.waitUntil(lambda: d.height() < 400)  # the height of what it shows
    d.use_local.setChecked(True)
    assert d.local_part.isVisible() and not d.remote_replay.isVisible()
    qtbot.waitUntil(lambda: d.height() <= 700)
    assert d.height() > 400


# -- page size ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("average", "size"),
    [
        (4000, 512),  # a quarter: 1000 -> 512
        (1000, 128),  # 250 -> 128
        (256, 64),  # the first long prompt: 64
        (255, 32),  # short: 63.75 -> 32
        (100, 16),  # 25 -> 16
        (20, 16),  # never under the smallest page
        (10**7, 1024),  # never over the largest
    ],
)
def test_page_size_suggestion_rule(average, size):
    expect = min(max(2 ** math.floor(math.log2(average / 4)), 16), 1024)
    if average >= 256:
        expect = max(64, expect)
    assert suggest_page_size([average]) == expect == size


def test_page_size_suggestion_averages_and_holds_its_bounds():
    assert suggest_page_size([]) is None
    assert suggest_page_size([100, 300, 500]) == 64  # average 300 -> 75 -> 64
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 20_000, int(rng.integers(1, 30))).tolist()
        size = suggest_page_size(lengths)
        assert size & (size - 1) == 0 and 16 <= size <= 1024
        assert size <= max(16, np.mean(lengths) / 4)  # a prompt spans about four pages
        if np.mean(lengths) >= 256:
            assert size >= 64


def test_prompt_length_record_keeps_the_latest():
    record = PromptLengths()
    for n in range(1, PROMPT_RECORD_SIZE + 51):
        record = record.add(n)
    assert len(record.lengths) == PROMPT_RECORD_SIZE
    assert record.lengths[-1] == PROMPT_RECORD_SIZE + 50 and record.lengths[0] == 51
    assert record.add(0) == record
    assert PromptLengths.parse("not a list") == PromptLengths()
    assert PromptLengths.parse([5, "x", -1, True, 7]).lengths == (5, 7)


def test_page_size_hint_suggests_from_the_prompts_seen(dialog):
    d = dialog(EngineSettings(page_size=32), prompt_lengths=[900, 1100])
    assert "averaged 1,000 tokens: suggested 128 tokens" in d.page_hint.text()
    assert "shorter than a page" in d.page_hint.toolTip()
    assert d.use_suggested.isEnabled()
    d.use_suggested.click()
    assert d.values().page_size == 128
    assert not d.use_suggested.isEnabled()
    assert "suggested the size chosen" in d.page_hint.text()
    empty = dialog(EngineSettings(page_size=32))
    assert not empty.use_suggested.isEnabled()
    assert "only in whole pages" in empty.page_hint.text()


# -- what applying loses -----------------------------------------------------------------


def empty_snapshot():
    snap = synthetic_snapshot(64, chats=0)
    cache = snap.cache
    cache.state[:] = PageState.FREE
    cache.fill[:] = 0
    return dataclasses.replace(snap, jobs=[])


def test_work_lost_counts_jobs_and_cached_pages():
    old = EngineSettings(page_size=16, disk_cache=False)
    new = dataclasses.replace(old, page_size=32)
    snap = synthetic_snapshot(256, chats=4)
    held = snap.cache.state != PageState.FREE
    lost = work_lost(snap, old, new)
    assert lost.jobs == len(snap.jobs) == 4
    assert lost.pages == int(held.sum()) > 0
    assert lost.tokens == int(snap.cache.fill[held].sum())
    assert lost.any and "4 replies in progress stop" in lost.text()
    assert not work_lost(snap, old, old).any  # nothing to rebuild
    assert not work_lost(empty_snapshot(), old, new).any
    assert not work_lost(None, old, new).any


def test_pages_kept_on_disk_are_not_lost():
    """Same format at the same place: the old cache writes its pages to the disk tier
    and the new one reads them back; only the running replies stop."""
    old = EngineSettings(page_size=16, disk_cache=True)
    snap = synthetic_snapshot(256, chats=2)
    bigger = work_lost(snap, old, dataclasses.replace(old, budget=8192))
    assert bigger.pages == 0 and bigger.jobs == 2
    other_format = work_lost(snap, old, dataclasses.replace(old, page_size=32))
    assert other_format.pages > 0


def test_dialog_note_says_what_applying_loses(dialog):
    busy = dialog(EngineSettings(page_size=16, disk_cache=False), snapshot=synthetic_snapshot(128))
    busy.page_size.setCurrentIndex(busy.page_size.findData(32))
    assert busy.rebuild_note.isVisibleTo(busy)
    assert "replies in progress stop" in busy.rebuild_note.text()
    idle = dialog(EngineSettings(page_size=16, disk_cache=False), snapshot=empty_snapshot())
    idle.page_size.setCurrentIndex(idle.page_size.findData(32))
    assert "Nothing is lost" in idle.rebuild_note.text()


def test_hints_never_overlap_the_fields(dialog, qtbot):
    """A hint that wraps to more lines as a value changes makes room for itself."""
    d = dialog(EngineSettings(page_size=32), prompt_lengths=[900, 1100], shared_prefix=21)
    d.show()
    qtbot.waitExposed(d)
    d.k_bits.setCurrentIndex(d.k_bits.findData(5))  # "not measured" lists every format
    d.page_size.setCurrentIndex(d.page_size.findData(64))
    qtbot.wait(50)
    fields = [d.budget, d.page_size, d.k_bits, d.v_bits, d.host_mb, d.max_batch, d.weights]
    for hint in (d.budget_hint, d.page_hint, d.kv_hint, d.weights_note):
        assert hint.height() >= hint.heightForWidth(hint.width()), hint.text()
        for field in fields:
            assert not hint.geometry().intersects(field.geometry()), hint.text()
