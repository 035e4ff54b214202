"""The prompt cache on disk in the app (docs/ENGINE.md §10): its settings and settings
files from before it, Clear disk cache, an engine without it, and pages that come back
after a cache rebuild and after a restart, as the page map, legend, queue panel, status
bar and the reply's figures show them. (Deleting a model with its store:
test_model_manager.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import Qt

from engine import paths
from engine.cache.disk_tier import (
    DiskTier,
    DiskTierSnapshot,
    DiskTierStats,
    list_stores,
    store_dir,
)
from engine.cache.page import CacheFingerprint, PageState
from engine.cache.storage import PagedKVStorage, dense_allocator
from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from engine.units import format_bytes
from gui.bridge import EngineBridge
from gui.palette import ChatColors
from gui.settings_dialog import EngineSettings, SettingsDialog, cleared_text
from gui.views.memory_panel import MemoryPanel
from gui.views.page_map_model import PageMapModel, disk_cell_cap, disk_pages
from gui.views.prefix_tree_model import TREE_DISK_CAP
from gui.views.queue_panel import QueuePanel
from tests.gui.conftest import synthetic_snapshot

PS = 16
SETTINGS = EngineSettings(page_size=PS, budget=1024, max_chunk_size=64, max_batch_size=8)
SYSTEM = (
    "You are Folio's test assistant. You answer in one short sentence, plainly and "
    "politely, and you never make up facts you do not know. " * 4
)


def disk_store(location: Path, model_path: Path, pages: int, page_size: int = PS) -> DiskTier:
    """A store at ``location`` for ``model_path`` (one per page size) holding ``pages``
    written pages of 16 KiB a token; still open, so it counts as in use until the
    caller closes it."""
    storage = PagedKVStorage(4, 4, page_size, dense_allocator(8, 64))
    fp = CacheFingerprint(model_path.name, page_size)
    label = {"model": model_path.stem, "path": str(model_path.resolve())}
    tier = DiskTier(store_dir(location, fp), fp, storage, label=label)
    for i in range(pages):
        tier.put(bytes([i + 1]) * 16, None, bytes(storage.bytes_per_page), wait=True)
    tier.flush()
    return tier


def start_bridge(qtbot, loaded, settings: EngineSettings = SETTINGS) -> EngineBridge:
    bridge = EngineBridge()
    with qtbot.waitSignal(bridge.engine_ready, timeout=60_000):
        bridge.use_loaded(loaded, settings.cache_settings(), settings.generator_settings())
    return bridge


def ask(bridge: EngineBridge, question: str = "Name a colour."):
    request = JobRequest(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_new_tokens=4,
        sampling=SamplingSettings(temperature=0),
        tag="chat",
    )
    return bridge.submit(request).wait(120)


def test_disk_settings_round_trip_and_older_settings_files(qtbot):
    s = EngineSettings(disk_cache=False, disk_gb=2.5, disk_dir="/somewhere/kv")
    assert EngineSettings.from_dict(json.loads(json.dumps(s.as_dict()))) == s
    assert s.cache_settings().disk_dir is None and s.cache_settings().disk_bytes == 2_500_000_000
    on = EngineSettings().cache_settings()
    assert on.disk_dir == str(paths.kv_cache_dir()) and on.disk_bytes is None
    # A settings file from before the disk cache: kept, with the disk cache on by default.
    old = {k: v for k, v in EngineSettings(page_size=64).as_dict().items() if "disk" not in k}
    loaded = EngineSettings.from_dict(old)
    assert loaded == EngineSettings(page_size=64) and loaded.disk_cache
    for bad in ({"disk_gb": -1}, {"disk_gb": "4"}, {"disk_gb": float("nan")},
                {"disk_cache": "yes"}, {"disk_dir": 3}):  # fmt: skip
        assert EngineSettings.from_dict({**old, **bad}) == EngineSettings()
    for field in ({"disk_cache": False}, {"disk_gb": 1.0}, {"disk_dir": "/x"}):
        assert EngineSettings(**field).needs_rebuild(EngineSettings())

    dialog = SettingsDialog(s)
    qtbot.addWidget(dialog)
    assert dialog.values() == s and not dialog.disk_gb.isEnabled()
    assert dialog.rebuild_note.isHidden()
    dialog.disk_on.setChecked(True)
    assert dialog.disk_gb.isEnabled() and dialog.needs_rebuild()
    assert not dialog.rebuild_note.isHidden()
    dialog.disk_gb.setValue(0)
    assert dialog.disk_gb.specialValueText().startswith("automatic: ")
    assert dialog.disk_gb.specialValueText().endswith(" GB here")
    dialog.disk_dir.setText(str(paths.kv_cache_dir()))
    assert dialog.values().disk_dir == ""  # the default, so FOLIO_KV_CACHE_DIR still moves it
    tip = dialog.disk_on.toolTip()
    assert "restart" in tip and "no prefill" in tip and "disk space" in tip


def test_clear_disk_cache_frees_the_space_and_says_how_much(qtbot, tmp_path):
    location = paths.kv_cache_dir()
    disk_store(location, tmp_path / "a.gguf", 12).close()
    busy = disk_store(location, tmp_path / "b.gguf", 3)  # as another process would hold it
    sizes = {st.model: st.bytes for st in list_stores(location)}
    assert sizes["a"] > 3_000_000
    dialog = SettingsDialog(EngineSettings())
    qtbot.addWidget(dialog)
    qtbot.waitUntil(lambda: "cached in" in dialog.disk_note.text(), timeout=10_000)
    assert format_bytes(sizes["a"] + sizes["b"], "MB") in dialog.disk_note.text()
    qtbot.mouseClick(dialog.disk_clear, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.disk_note.text().startswith("Freed"), timeout=10_000)
    assert dialog.disk_note.text() == cleared_text(sizes["a"], 1)
    assert "1 store is in use by another Folio process" in dialog.disk_note.text()
    assert [st.model for st in list_stores(location)] == ["b"]
    busy.close()
    qtbot.mouseClick(dialog.disk_clear, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.disk_note.text() == cleared_text(sizes["b"], 0), timeout=10_000)
    assert list_stores(location) == []


@pytest.mark.slow
def test_disk_cache_off_gives_an_engine_without_a_disk_tier(qtbot, smollm2_int4):
    bridge = start_bridge(qtbot, smollm2_int4, dataclasses.replace(SETTINGS, disk_cache=False))
    assert bridge.cache_settings.disk_dir is None and bridge.engine.cache.disk is None
    ask(bridge)
    snap = bridge.poll_snapshot(force=True)
    assert snap.cache.disk is None and snap.cache.disk_records is None
    assert PageMapModel.from_snapshot(snap, ChatColors()).disk_cells == 0
    bridge.shutdown()
    assert list_stores(paths.kv_cache_dir()) == []


@pytest.mark.slow
def test_pages_come_back_after_a_rebuild_and_a_restart(qtbot, smollm2_int4):
    location = paths.kv_cache_dir()
    bridge = start_bridge(qtbot, smollm2_int4)
    assert bridge.cache_settings.disk_dir == str(location)
    first = ask(bridge)
    assert first.disk_pages == 0 and first.prompt_tokens > 8 * PS

    # A batching change rebuilds the cache in the same format, so on the same store: the
    # old cache writes its pages and lets go of the store, the new one takes it over.
    changed = dataclasses.replace(SETTINGS, max_batch_size=4)
    with qtbot.waitSignal(bridge.engine_ready, timeout=60_000):
        bridge.rebuild(changed.cache_settings(), changed.generator_settings())
    disk = bridge.engine.cache.disk
    assert disk.writable and disk.status == ""
    second = ask(bridge)
    full = (first.prompt_tokens - 1) // PS  # every full page before the last prompt token
    assert second.disk_pages >= full and second.cached_tokens >= second.disk_pages * PS
    assert second.text == first.text and second.disk_bytes > 0 and second.disk_seconds > 0

    qtbot.waitUntil(lambda: not bridge.engine.cache.disk.writing, timeout=10_000)
    snap = bridge.poll_snapshot(force=True)
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.refresh(snap, bridge.telemetry, bridge.tokenizer)
    model = panel.page_map.model
    assert model.disk_pages == disk_pages(snap) == len(snap.cache.disk_records.hash_prefix)
    assert model.disk_pages >= full and model.disk_cells == model.disk_pages  # under the cap
    assert (model.state[-model.disk_cells :] == PageState.DISK).all()
    assert int(model.restored.sum()) == second.disk_pages  # the corner mark
    assert f"disk tier {model.disk_pages:,}" in panel.legend.entries()
    assert f"disk tier {model.disk_pages:,} (bottom)" in panel.page_map.caption.text()
    summary = panel.queue.summary_text()
    assert f"restored {second.disk_pages} pages from disk" in summary
    assert f"instead of prefilling {second.disk_pages * PS:,} tokens" in summary
    on_disk = [n for n in panel.tree.model.nodes().values() if n.state == PageState.DISK]
    assert panel.tree.model.disk_records == model.disk_pages and on_disk == []  # all on device

    # A restart: shutting down writes the pages through; the next process reads them back.
    bridge.shutdown()
    assert not any(st.in_use for st in list_stores(location))
    again = start_bridge(qtbot, smollm2_int4)
    third = ask(again)
    assert third.disk_pages >= full and third.text == first.text

    # Clear disk cache with this engine running: its own store is emptied in place.
    freed, in_use = again.clear_disk_cache(location)
    assert freed > second.disk_bytes and in_use == 0
    assert again.engine.cache.disk.stats().pages == 0
    assert sum(st.bytes for st in list_stores(location)) < 100_000  # index, lock, label
    assert ask(again, "Name a fruit.").new_tokens > 0  # and it runs on
    again.shutdown()


@pytest.mark.slow
def test_a_chat_reopened_after_a_restart_comes_back_from_disk(qtbot, tmp_path, smollm2_int4):
    from tests.gui.test_app import SMALL, bubbles, configure, make_window, wait_idle

    win = make_window(qtbot, tmp_path, smollm2_int4)
    configure(win, max_new_tokens=6)
    win.chat_view.input.setPlainText("Tell me about lighthouses. " * 12)
    win.chat_view.send()
    wait_idle(qtbot, win)
    cid = win.chat_view.conversation_id
    first = win.store.message(bubbles(win)[-1].message_id).stats

    def status_agrees(window) -> bool:
        snap = window.bridge.engine.snapshot()
        window.update_status(snap)
        want = f"disk cache {disk_pages(snap):,} pages · {format_bytes(snap.cache.disk.bytes)}"
        return disk_pages(snap) > 0 and window.disk_label.text() == want

    qtbot.waitUntil(lambda: status_agrees(win), timeout=10_000)
    assert win.disk_label.isVisibleTo(win)
    win.close()

    again = make_window(qtbot, tmp_path, smollm2_int4)
    assert again.chat_view.conversation_id == cid
    configure(again, max_new_tokens=6)
    again.chat_view.input.setPlainText("And one more thing?")
    again.chat_view.send()
    wait_idle(qtbot, again)
    reply = bubbles(again)[-1]
    stats = again.store.message(reply.message_id).stats
    # every full page of the earlier conversation's prompt came back from disk
    assert stats["disk_pages"] >= first["prompt_tokens"] // SMALL.page_size >= 6
    assert stats["cached_tokens"] >= stats["disk_pages"] * SMALL.page_size
    assert f"({stats['disk_pages']} pages from disk: " in reply.figures.text()
    qtbot.waitUntil(lambda: status_agrees(again), timeout=10_000)
    again.close()


def with_disk(snapshot, records: int, seed: int = 0):
    """``snapshot`` with a disk tier of ``records`` records, chains of 8 pages."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(1, 2**63, records, dtype=np.int64).astype(np.uint64)
    parents = np.where(np.arange(records) % 8 == 0, 0, np.roll(hashes, 1)).astype(np.uint64)
    disk = DiskTierSnapshot(hashes, parents, np.arange(1, records + 1, dtype=np.int64), 1)
    stats = DiskTierStats(pages=records, bytes=records * 300_000, budget=4 << 30, writable=True)
    cache = dataclasses.replace(snapshot.cache, disk=stats, disk_records=disk)
    return dataclasses.replace(snapshot, cache=cache, version=snapshot.version + 1)


def test_views_cap_the_disk_cells_and_say_so(qtbot):
    snap = with_disk(synthetic_snapshot(256, chats=2), 5000)
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.resize(700, 900)
    panel.refresh(snap, None, None)
    view = panel.page_map
    m = view.model
    shown = disk_cell_cap(256)
    assert m.disk_pages == 5000 and m.disk_cells == shown == 256
    # the newest records, oldest of them first, as the tier lists them
    assert m.hash_prefix[-shown:].tolist() == snap.cache.disk_records.hash_prefix[-shown:].tolist()
    assert "disk tier 5,000 (newest 256 shown)" in view.caption.text()
    assert "disk tier 5,000" in panel.legend.entries() and "5,000 on disk" in panel.header.toolTip()
    last = m.cells - 1
    assert view.page_at(view.scene_pos_of(last)) == last
    assert view.page_at(view.scene_pos_of(m.num_pages - 1)) == m.num_pages - 1
    tip = view.tooltip_text(last)
    assert tip.startswith(f"Disk record {shown - 1} · disk tier") and "parent " in tip
    assert view.cell_color(last) == panel.palette_.disk
    assert len({panel.palette_.disk, panel.palette_.host, panel.palette_.cached}) == 3
    tree = panel.tree.model
    disk_nodes = [n for n in tree.nodes().values() if n.state == PageState.DISK]
    assert len(disk_nodes) == TREE_DISK_CAP and tree.disk_records == 5000
    # chains of 8 records: every disk node but a chain's first has its parent in the tree
    assert sum(1 for n in disk_nodes if tree.is_root(n)) == -(-TREE_DISK_CAP // 8)
    assert f"of the newest {TREE_DISK_CAP} of 5,000 records" in panel.tree.caption.text()


def test_queue_panel_row_of_a_job_reading_from_disk(qtbot):
    snap = synthetic_snapshot(64, chats=1)
    job = dataclasses.replace(
        snap.jobs[0], cached_tokens=320, disk_pages=20, disk_bytes=29_360_128, disk_seconds=0.04
    )
    queue = QueuePanel(ChatColors())
    qtbot.addWidget(queue)
    queue.set_snapshot(dataclasses.replace(snap, jobs=[job]))
    why = queue.rows()[0]["why / saved"]
    assert why.endswith(
        "restored 20 pages from disk (29.4 MB in 0.04 s) instead of prefilling 320 tokens"
    )
