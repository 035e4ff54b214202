"""Models in the main window: the picker (local models, fit labels, loading one), the
load progress line, "last used", the process memory tooltip, the first-run dialog's
words, the prompt-length record and the one confirmation of a settings change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import QMessageBox

from engine.cache.page import PageState
from engine.hub.fit import (
    RUNTIME_OVERHEAD_BYTES,
    Fit,
    kv_bytes_per_token,
    runtime_overhead_bytes,
)
from engine.hub.gguf_info import summary_from_file
from engine.hub.library import list_local_models
from engine.model.fetch import DEFAULT_MODEL
from engine.units import format_bytes
from gui.first_run_dialog import FetchDialog
from gui.main_window import MainWindow
from gui.models.loading import LoadProgress, process_memory_tip
from gui.models.model_bar import ModelPicker
from gui.settings_dialog import EngineSettings, SettingsDialog
from gui.settings_hints import page_size_hint, shared_prefix_tokens
from gui.store import Store

SMALL = EngineSettings(page_size=16, budget=1024, max_chunk_size=64, max_batch_size=8)


def test_load_progress_says_the_step_and_the_seconds_left():
    now = [100.0]
    progress = LoadProgress("SmolLM2", clock=lambda: now[0])
    assert progress.update(0.0, "layer 0/30").startswith("Loading SmolLM2: layer 0 of 30 · 0%")
    assert "left" not in progress.text  # no pace yet
    now[0] += 4.0
    text = progress.update(0.4, "layer 12/30")
    # 4 s for 40%: the other 60% at the same pace take 6 s
    assert text == "Loading SmolLM2: layer 12 of 30 · 40% · about 6 s left"
    now[0] += 5.0
    assert progress.update(0.95, "tokenizer").startswith("Loading SmolLM2: reading the tokenizer")
    # the engine's start (its warm-up compiles the kernels on a first start after an
    # install or update): no pace to go by, so no seconds left, and it says why it may last
    text = progress.update(0.97, "allocating the KV cache")
    assert "loading the kernels" in text and "up to a minute" in text and "left" not in text
    assert progress.update(1.0, "ready").endswith("· 100%")


def test_load_progress_says_when_the_layers_are_repacked():
    progress = LoadProgress("Qwen2-7B", clock=lambda: 0.0)
    text = progress.update(0.3, "layer 9/28, repacking weights for this CPU (once: kept on disk)")
    assert text == (
        "Loading Qwen2-7B: layer 9 of 28, repacking weights for this CPU (once: kept on disk) · 30%"
    )


def test_first_run_dialog_names_the_model_and_its_size(qtbot):
    dialog = FetchDialog(lambda **_: Path("/nowhere"))
    qtbot.addWidget(dialog)
    name = Path(DEFAULT_MODEL.filename).stem
    size = f"{DEFAULT_MODEL.size / 1e6:.0f} MB"
    assert name in dialog.labelText() and size in dialog.labelText()
    dialog._on_progress("download", 0, 1)
    text = dialog.labelText()
    assert f"Downloading {name} ({size})" in text and "part" not in text
    dialog._on_progress("download", 1, 3)
    assert name in dialog.labelText() and "part 2 of 3" in dialog.labelText()
    dialog._on_progress("extract", 50_000_000, 98_000_000)
    assert f"Unpacking {name}… 50 of 98 MB" == dialog.labelText()


# -- with the real model -------------------------------------------------------------------


@pytest.fixture
def models_dir(tmp_path, monkeypatch, smollm2_path):
    """A models folder holding SmolLM2 under two names, and no Hugging Face cache."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / smollm2_path.name).symlink_to(smollm2_path)
    (folder / "SmolLM2-copy.Q4_1.gguf").symlink_to(smollm2_path)
    monkeypatch.setenv("FOLIO_MODELS_DIR", str(folder))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    return folder


def make_window(qtbot, tmp_path: Path, settings: EngineSettings = SMALL) -> MainWindow:
    qsettings = QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)
    qsettings.setValue("engine/settings", json.dumps(settings.as_dict()))
    window = MainWindow(Store(tmp_path / "chats.sqlite3"), qsettings)
    window.model_picker.free_memory = lambda: 10**12
    qtbot.addWidget(window)
    window.show()
    return window


def load(qtbot, window: MainWindow, path: Path) -> None:
    window.load_model(path)
    assert window.load_status.shown
    assert window.load_status.label.text().startswith(f"Loading {path.stem}")
    qtbot.waitUntil(lambda: window.bridge.ready and window.model_info.path == path, timeout=120_000)
    assert not window.load_status.shown, window.load_status.label.text()


def picker_ready(qtbot, window: MainWindow) -> None:
    qtbot.waitUntil(lambda: not window.model_picker.runner.busy, timeout=30_000)


@pytest.mark.slow
def test_picker_lists_local_models_with_fit_and_switches(qtbot, tmp_path, models_dir):
    first, second = (
        models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf",
        models_dir / "SmolLM2-copy.Q4_1.gguf",
    )
    window = make_window(qtbot, tmp_path)
    progress: list[str] = []
    window.bridge.load_progress.connect(lambda *_: progress.append(window.load_status.label.text()))
    load(qtbot, window, first)
    assert any("layer" in line and " of " in line for line in progress), progress
    # the engine's start (its warm-up: a minute when the kernels compile) comes after the
    # file's 95%, and says so; the bar is full only when the engine is up
    assert any("loading the kernels" in line and "97%" in line for line in progress), progress
    assert not any(line.endswith("100%") for line in progress), progress
    picker = window.model_picker
    picker_ready(qtbot, window)
    listed = {str(m.path) for m in list_local_models()}
    shown = {picker.itemData(i) for i in range(picker.count())} - {None, "manage"}
    assert shown == listed == {str(first), str(second)}
    assert picker.currentData() == str(first)

    # The loaded model's figure is what it holds: weights as the settings keep them, its
    # KV cache as the engine allocated it, and the runtime's overhead.
    info = window.model_info
    snapshot = window.bridge.poll_snapshot(force=True)
    entry = next(e for e in picker.entries if e.model.path == first)
    assert entry.fit.label is Fit.FITS
    assert entry.fit.kv_bytes == snapshot.cache_bytes
    assert entry.fit.weight_bytes == info.weight_costs[window.engine_settings.weights]
    assert abs(entry.fit.weight_bytes - info.weight_bytes) <= 0.05 * info.weight_bytes
    # the runtime's part priced for this model's vocabulary (engine/hub/fit.py)
    runtime = runtime_overhead_bytes(summary_from_file(first).vocab_size)
    assert runtime != RUNTIME_OVERHEAD_BYTES  # SmolLM2's 49k tokens, not Llama 3's 128k
    need = entry.fit.weight_bytes + snapshot.cache_bytes + runtime
    assert entry.fit.need_bytes == need
    assert picker.currentText() == f"{first.stem} — Fits · {format_bytes(need)}"
    per_token = kv_bytes_per_token(*info.kv_shape)
    assert f"× {per_token:,} B" in picker.itemData(
        picker.currentIndex(), Qt.ItemDataRole.ToolTipRole
    )

    # "Last used" is set for the model loaded at start-up, not only from the Models window.
    used = {str(m.path): m.last_used for m in list_local_models()}
    assert used[str(first)] is not None and used[str(second)] is None

    # The memory figure explains itself.
    window.update_status(snapshot)
    tip = window.memory_label.toolTip()
    assert "model weights" in tip and "KV cache up to" in tip and "runtime" in tip

    # Choosing the other model loads it.
    picker.activated.emit(picker.findData(str(second)))
    qtbot.waitUntil(
        lambda: window.bridge.ready and window.model_info.path == second, timeout=120_000
    )
    picker_ready(qtbot, window)
    assert picker.currentData() == str(second)

    # Too little memory: the label says so.
    picker.free_memory = lambda: 1
    picker.released_bytes = lambda: 0
    picker.refresh()
    picker_ready(qtbot, window)
    assert all(e.fit.label is Fit.WONT_FIT for e in picker.entries)
    assert "Won't fit" in picker.currentText()
    window.close()


@pytest.mark.slow
def test_settings_ask_once_and_only_when_work_would_be_lost(
    qtbot, tmp_path, monkeypatch, smollm2_int4
):
    window = make_window(qtbot, tmp_path, dataclasses.replace(SMALL, disk_cache=False))
    window.use_loaded(smollm2_int4)
    qtbot.waitUntil(lambda: window.bridge.ready, timeout=60_000)
    asked: list[str] = []
    answer = [QMessageBox.StandardButton.Yes]

    def question(parent, title, text, *args, **kwargs):
        asked.append(text)
        return answer[0]

    monkeypatch.setattr(QMessageBox, "question", question)
    chosen: list[EngineSettings] = []

    def exec_(dialog: SettingsDialog) -> int:
        dialog.page_size.setCurrentIndex(dialog.page_size.findData(chosen[-1].page_size))
        return 1

    monkeypatch.setattr(SettingsDialog, "exec", exec_)

    # An empty cache: nothing is lost, nothing is asked.
    chosen.append(dataclasses.replace(window.engine_settings, page_size=32))
    window.open_settings()
    assert asked == []
    qtbot.waitUntil(
        lambda: window.bridge.ready and window.bridge.cache_settings.page_size == 32, timeout=60_000
    )

    # A chat leaves cached pages: one question, naming them.
    view = window.chat_view
    view.settings.load("Answer briefly.", {"temperature": 0.0, "max_new_tokens": 6})
    view.save_settings()
    qtbot.keyClicks(view.input, "Name a colour.")
    qtbot.keyClick(view.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not window.controller.generations, timeout=60_000)
    recorded = window.prompt_lengths.lengths
    assert len(recorded) == 1 and recorded[0] > 0
    assert json.loads(window.settings.value("engine/prompt_lengths")) == list(recorded)
    snap = window.bridge.poll_snapshot(force=True)
    assert snap.stats.pages_cached > 0

    answer[0] = QMessageBox.StandardButton.No
    chosen.append(dataclasses.replace(window.engine_settings, page_size=64))
    window.open_settings()
    assert len(asked) == 1 and "cached page" in asked[0]
    assert window.engine_settings.page_size == 32  # declined: nothing changed
    answer[0] = QMessageBox.StandardButton.Yes
    window.open_settings()
    assert len(asked) == 2
    qtbot.waitUntil(
        lambda: window.bridge.ready and window.bridge.cache_settings.page_size == 64, timeout=60_000
    )
    window.close()


def test_picker_lists_a_broken_model_as_unloadable(qtbot, tmp_path, monkeypatch, smollm2_path):
    """A damaged file in the models folder is listed, greyed out, with the reason; it
    never stops the listing."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / smollm2_path.name).symlink_to(smollm2_path)
    (folder / "broken.Q8_0.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    monkeypatch.setenv("FOLIO_MODELS_DIR", str(folder))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    picker = ModelPicker(lambda: SMALL.cache_settings(), lambda: "native", lambda: None)
    picker.free_memory = lambda: 10**12
    qtbot.addWidget(picker)
    picker.refresh()
    qtbot.waitUntil(lambda: not picker.runner.busy, timeout=30_000)
    by_name = {e.model.name: e for e in picker.entries}
    assert by_name[smollm2_path.stem].fit.label is Fit.FITS
    broken = by_name["broken.Q8_0"]
    assert broken.fit is None and broken.note.startswith("cannot load")
    row = picker.findData(str(broken.model.path))
    assert not picker.model().item(row).isEnabled()
    assert broken.note in picker.itemData(row, Qt.ItemDataRole.ToolTipRole)
    assert picker.currentIndex() == -1  # nothing loaded: nothing chosen
    with qtbot.waitSignal(picker.load_requested) as chosen:
        picker.activated.emit(picker.findData(str(by_name[smollm2_path.stem].model.path)))
    assert chosen.args == [by_name[smollm2_path.stem].model.path]
    with qtbot.waitSignal(picker.manage_requested):
        picker.activated.emit(picker.findData("manage"))


def test_process_memory_tip_adds_up():
    mib = 1 << 20
    tip = process_memory_tip(2000 * mib, 800 * mib, "native", 300 * mib, 180 * mib, 0)
    accounted = (800 + 300 + 180) * mib + RUNTIME_OVERHEAD_BYTES
    assert f"= {format_bytes(accounted, binary=True)}" in tip
    assert f"the other {format_bytes(2000 * mib - accounted, binary=True)}" in tip
    assert "bf16 copies for batched replies" in tip and "host tier" not in tip
    small = process_memory_tip(500 * mib, 800 * mib, "native", 0, 180 * mib, 0)
    assert "not in RAM (yet)" in small and "bf16 copies" not in small


@pytest.mark.slow
@pytest.mark.parametrize("page", [16, 32])
def test_shared_prefix_in_the_page_hint_is_what_the_engine_shares(smollm2_int4, page):
    """The page-size hint's "N pages shared" for a system prompt is what the engine's
    prefix cache reuses when a second chat with that system prompt starts."""
    from engine.cache.kv_cache import CacheSettings
    from engine.engine import Engine
    from engine.generator.job import JobRequest

    system = {"role": "system", "content": "You are Folio's test assistant. Answer briefly."}
    shared = shared_prefix_tokens(smollm2_int4.tokenizer.encode_chat, system["content"])
    with Engine(smollm2_int4, CacheSettings(page_size=page, token_budget=1024)) as engine:
        for text in ("What is two plus two?", "Name a colour."):
            request = JobRequest(
                messages=[system, {"role": "user", "content": text}], max_new_tokens=1
            )
            result = engine.submit(request).wait(60)
        snapshot = engine.snapshot()
    # The whole common start is reused (full pages shared, the rest copied) ...
    assert result.cached_tokens == shared
    # ... and the chats' chains meet in a shared page only when it is a whole page long.
    cache = snapshot.cache
    held = set(np.flatnonzero(cache.state != PageState.FREE).tolist())
    roots = held - set(cache.edges[:, 0].tolist())
    assert len(roots) == (1 if shared >= page else 2)
    line = page_size_hint(page, [], shared).line
    if shared >= page:
        assert f"same {shared} tokens: {shared // page} page" in line
    else:
        assert f"same {shared} tokens, less than one {page}-token page: no page shared" in line
