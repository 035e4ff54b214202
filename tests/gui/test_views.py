"""The memory views against real engine snapshots and at scale (offscreen, pytest-qt).

Assertions read the widgets' model data (cell states, tree nodes, table rows), never
pixels."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import Qt

from engine.cache.kv_cache import CacheSettings
from engine.cache.page import PageState
from engine.engine import Engine, JobInfo
from engine.generator.generator import GeneratorSettings
from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from gui.views.graphs import ThroughputGraphs
from gui.views.memory_panel import MemoryPanel
from gui.views.page_map import PageMapView
from gui.views.prefix_tree import PrefixTreeView
from gui.views.prefix_tree_model import PrefixTreeModel, hash_key
from gui.views.queue_panel import QueuePanel
from tests.gui.conftest import synthetic_snapshot

SYSTEM = (
    "You are Folio, a careful assistant running on this computer. Answer briefly, say "
    "when you are unsure, and never invent sources. " * 3
)


def _chat(tag: str, user: str, max_new_tokens: int = 6) -> JobRequest:
    return JobRequest(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_new_tokens=max_new_tokens,
        sampling=SamplingSettings(temperature=0),
        tag=tag,
    )


def _publish(engine: Engine, panel: MemoryPanel):
    """The engine loop's own publish step, run here so the test decides when."""
    engine._publish_snapshot()
    snap = engine.snapshot()
    panel.refresh(snap, engine.telemetry, engine.loaded.tokenizer)
    return snap


def _assert_map_matches(view: PageMapView, snap) -> None:
    cache = snap.cache
    assert view.page_count == snap.num_pages
    for page in range(snap.num_pages):
        assert view.cell_state(page) == cache.state[page], page
        assert view.cell_ref(page) == cache.ref_count[page], page
        assert view.cell_fill(page) == cache.fill[page], page
        assert view.cell_hash(page) == cache.hash_prefix[page], page


def _assert_tree_matches(tree: PrefixTreeModel, snap) -> None:
    """One node per page with content, keyed and parented as the snapshot says."""
    cache = snap.cache
    parent = np.full(snap.num_pages, -1)
    parent[cache.edges[:, 0]] = cache.edges[:, 1]
    content = [p for p in range(snap.num_pages) if cache.hash_prefix[p] or cache.fill[p]]
    nodes = tree.nodes()
    assert len(nodes) == len(content)
    for page in content:
        node = tree.node_for_page(page)
        assert node is not None, page
        assert node.ref_count == cache.ref_count[page]
        assert node.state == cache.state[page]
        p = parent[page]
        want_parent = tree.node_for_page(p).key if p >= 0 else None
        assert node.parent == want_parent, page


def test_tree_model_reconciles_snapshots_without_a_widget(fake_tokenizer):
    """The tree's model is plain Python: built from a snapshot, then updated by diffs."""
    snap = synthetic_snapshot(64, chats=2)
    tree = PrefixTreeModel()
    assert tree.set_snapshot(snap, fake_tokenizer)
    _assert_tree_matches(tree, snap)
    assert not tree.set_snapshot(snap)  # the same version: nothing to redo
    shared = [p for p in range(64) if snap.cache.ref_count[p] == 2]
    fork = tree.node_for_page(shared[-1])
    assert tree.branch_points() == [fork.key]
    assert fork.owners == ("chat 1", "chat 2") and fork.shared
    assert tree.text(fork) == fake_tokenizer.decode(snap.page_tokens[shared[-1]])
    first, second = (tree.nodes()[k] for k in tree.children_of(fork.key))
    # Layout: a chain stays on its row, a fork steps down.
    at = {k: tree.run_of(k).pos for k in (fork.key, first.key, second.key)}
    assert at[first.key][1] == at[fork.key][1] < at[second.key][1]
    assert at[first.key][0] == at[second.key][0] > at[fork.key][0]
    assert set(shared) <= set(tree.chain_pages(fork.key))

    # One page's job ends: only that page is redone; it is cached now, so it no longer
    # folds with the chat's pages before it (a new layout).
    page = tree.node_for_page(max(tree.chain_pages(second.key))).page
    state, ref = snap.cache.state.copy(), snap.cache.ref_count.copy()
    state[page], ref[page] = PageState.CACHED, 0
    cache = dataclasses.replace(snap.cache, state=state, ref_count=ref)
    assert tree.set_snapshot(dataclasses.replace(snap, version=2, cache=cache))
    assert tree.last_update == {"changed_pages": 1, "added": 0, "removed": 0, "touched": 1,
                                "relayout": 1}  # fmt: skip
    assert tree.node_for_page(page).state == PageState.CACHED

    tree.select_chat("chat 2")
    assert tree.selected() == {k for k, n in tree.nodes().items() if "chat 2" in n.owners}
    assert tree.select_chain(fork.key) == tree.chain_pages(fork.key)


def test_tree_model_follows_page_events():
    """Stored pages, a defrag cycle applied as one batch, eviction, the host tier."""
    digests = [f"{i:02x}" * 32 for i in (1, 2, 3)]
    keys = [hash_key(d) for d in digests]
    parents = ["", *digests[:2]]
    stored = [
        {"kind": "page_stored", "page": p, "hash": d, "parent": parents[p]}
        for p, d in enumerate(digests)
    ]
    tree = PrefixTreeModel()
    assert tree.apply_events(stored)
    assert tree.roots() == [keys[0]] and tree.children_of(keys[0]) == [keys[1]]
    assert [tree.node_for_page(p).key for p in range(3)] == keys
    # 0 -> 1, 1 -> 2, 2 -> 0 at once: no mapping is overwritten before it is read.
    cycle = ((0, 1), (1, 2), (2, 0))
    moves = [{"kind": "page_defrag_move", "page": a, "detail": b} for a, b in cycle]
    assert not tree.apply_events(moves)  # pages moved, no node came or went
    assert [tree.node_for_page(p).key for p in (1, 2, 0)] == keys
    assert tree.apply_events([{"kind": "page_evicted", "page": 0}])
    assert keys[2] not in tree.nodes() and tree.node_for_page(0) is None
    tree.apply_events([{"kind": "page_tier_push", "hash": digests[2], "parent": digests[1]}])
    pushed = tree.nodes()[keys[2]]
    assert pushed.page == -1 and pushed.state == PageState.HOST
    assert tree.chain_pages(keys[2]) == [1, 2]  # host-tier nodes have no device page
    assert tree.apply_events([{"kind": "page_cleared"}]) and not tree.nodes()


def test_the_view_models_import_no_qt():
    """The page map's and the prefix tree's models load without Qt or pyqtgraph."""
    code = (
        "import sys, gui.views.page_map_model, gui.views.prefix_tree_model; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'PySide6', 'pyqtgraph'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_views_follow_two_chats_sharing_a_system_prompt(qtbot, smollm2_int4):
    engine = Engine(
        smollm2_int4,
        CacheSettings(page_size=16, token_budget=1024),
        GeneratorSettings(max_batch_size=4),
    )
    gen = engine.generator  # driven step by step: no thread, so every snapshot is exact
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.resize(600, 900)
    a = gen.submit(_chat("chat-a", "Name three rivers in Europe."))
    b = gen.submit(_chat("chat-b", "What is a paged KV cache, and why is it useful?"))
    gen.iterate()  # both admitted in one step: b shares a's system-prompt pages
    gen.iterate()
    snap = _publish(engine, panel)
    pm, tree = panel.page_map, panel.tree.model

    _assert_map_matches(pm, snap)
    _assert_tree_matches(tree, snap)
    shared = [p for p in range(pm.page_count) if pm.cell_ref(p) > 1]
    assert shared, "the system prompt's pages should be shared"
    for page in shared:
        assert pm.cell_ref(page) == 2
        assert pm.cell_state(page) == PageState.REFERENCED
        assert pm.cell_owners(page) == ["chat-a", "chat-b"]
        # Once: no other page holds the same content.
        assert sum(pm.cell_hash(p) == pm.cell_hash(page) for p in range(pm.page_count)) == 1
        assert tree.node_for_page(page).shared
    forks = tree.branch_points()
    assert len(forks) == 1
    fork = tree.nodes()[forks[0]]
    assert fork.page == max(shared, key=lambda p: len(pm.model.chain(p)) and p)
    assert len(tree.children_of(forks[0])) == 2
    shared_hashes = {pm.cell_hash(p) for p in shared}

    # The event path alone builds the same hashed tree as the snapshot reconcile.
    from_events = PrefixTreeModel()
    from_events.apply_events(engine.telemetry.events(0))
    hashed = {k: n.parent for k, n in tree.nodes().items() if k[0] == "h"}
    assert {k: n.parent for k, n in from_events.nodes().items()} == hashed

    # A queue row per job, coloured and explained.
    rows = panel.queue.rows()
    assert [r["chat"] for r in rows] == ["chat-a", "chat-b"]
    assert int(rows[1]["cached"]) > 0 and "hit" in rows[1]["why / saved"]

    # Release: both jobs finish, their pages stay as cache.
    while not gen.idle:
        gen.iterate()
    assert a.state == b.state == "done"
    snap = _publish(engine, panel)
    _assert_map_matches(pm, snap)
    _assert_tree_matches(tree, snap)
    assert not pm.pages_in_state(PageState.REFERENCED)
    for h in shared_hashes:
        pages = [p for p in range(pm.page_count) if pm.cell_hash(p) == h]
        assert len(pages) == 1  # still once (defrag may have moved it)
        assert pm.cell_state(pages[0]) == PageState.CACHED
        assert pm.cell_ref(pages[0]) == 0
        assert tree.nodes()[("h", h)].state == PageState.CACHED
    assert len(tree.branch_points()) == 1

    # Eviction: one prompt that needs every page pushes the old chains out.
    rng = np.random.default_rng(0)
    prompt = rng.integers(1000, 40000, 1010).tolist()
    gen.submit(JobRequest(prompt=prompt, max_new_tokens=14, sampling=SamplingSettings(0)))
    while not gen.idle:
        gen.iterate()
    snap = _publish(engine, panel)
    _assert_map_matches(pm, snap)
    _assert_tree_matches(tree, snap)
    hashes = {pm.cell_hash(p) for p in range(pm.page_count)}
    assert not shared_hashes & hashes
    assert not {("h", h) for h in shared_hashes} & tree.nodes().keys()
    assert tree.branch_points() == []
    assert engine.telemetry.events(0)  # the log the tree followed

    # The graphs read the same telemetry.
    graphs = panel.graphs
    assert len(graphs.curves["decode"].getData()[0]) == len(engine.telemetry)
    assert graphs.latest["batch_size"] >= 0


def test_page_map_update_cost_at_16384_pages(qtbot, record_property):
    """Scale: 16,384 pages, every update a new snapshot (recorded, not asserted)."""
    view = PageMapView()
    tree = PrefixTreeView()
    for w in (view, tree):
        qtbot.addWidget(w)
        w.resize(600, 600)
        w.show()
    snaps = [synthetic_snapshot(16384, version=k + 1, seed=k) for k in range(8)]
    view.set_snapshot(snaps[0])  # warm-up: first layout and pattern caches
    costs, renders = [], []
    for snap in snaps[1:]:
        t0 = time.perf_counter()
        view.set_snapshot(snap)
        view.plot.viewport().repaint()
        costs.append(time.perf_counter() - t0)
        renders.append(view.last_render_s)
    t0 = time.perf_counter()
    tree.set_snapshot(snaps[0])
    tree_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    tree.set_snapshot(snaps[1])
    tree_next = time.perf_counter() - t0
    mean_ms, max_ms = 1e3 * np.mean(costs), 1e3 * np.max(costs)
    print(
        f"\npage map, 16384 pages: update+paint mean {mean_ms:.1f} ms, max {max_ms:.1f} ms "
        f"(image build mean {1e3 * np.mean(renders):.1f} ms); prefix tree of "
        f"{len(tree.model.nodes())} nodes: first {1e3 * tree_first:.0f} ms, "
        f"next snapshot {1e3 * tree_next:.0f} ms"
    )
    record_property("page_map_16384_update_ms_mean", round(mean_ms, 2))
    record_property("page_map_16384_update_ms_max", round(max_ms, 2))
    assert view.page_count == 16384
    assert view.cell_ref(0) == 2  # the first pair's shared prefix


def test_hover_and_click_on_a_page(qtbot, fake_tokenizer):
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.resize(600, 900)
    panel.show()
    snap = synthetic_snapshot(64, chats=2)
    panel.refresh(snap, None, fake_tokenizer)
    pm, tree = panel.page_map, panel.tree
    shared = [p for p in range(64) if pm.cell_ref(p) == 2]
    page = shared[-1]

    # Hover through the same handler the scene's mouse-move signal calls.
    pm._on_mouse_moved(pm.scene_pos_of(page))
    tip = pm.last_tooltip
    assert tip.startswith(f"Page {page} · in use")
    assert "ref count 2" in tip
    assert f"fill 16/{snap.page_size}" in tip
    assert "chats: chat 1, chat 2" in tip
    assert "hash " in tip and "last access" in tip and "parent" in tip
    assert "text: " + fake_tokenizer.decode(snap.page_tokens[page])[:40] in tip

    # Click: the chain lights up, the map says which page and which chat.
    clicked, selected = [], []
    pm.page_clicked.connect(clicked.append)
    panel.chat_selected.connect(selected.append)
    pm.click_page(page)
    assert clicked == [page]
    assert selected == ["chat 1"]  # the first chat holding it
    chain = pm.highlighted_pages()
    assert chain == pm.model.chain(page)
    assert set(shared) <= set(chain)
    both_tails = {p for p in range(64) if pm.cell_owners(p) in (["chat 1"], ["chat 2"])}
    assert both_tails <= set(chain)  # the page's continuations in both chats
    assert {tree.model.node_for_page(p).key for p in chain} == tree.model.selected()

    # A tree node click highlights its pages in the map.
    leaf = next(k for k, n in tree.model.nodes().items() if not tree.model.children_of(k))
    with qtbot.waitSignal(tree.node_clicked) as blocker:
        tree.click_node(leaf)
    assert pm.highlighted_pages() == blocker.args[0] == tree.model.chain_pages(leaf)

    # Selecting a chat from outside highlights exactly its pages.
    panel.select_chat("chat 2")
    assert pm.highlighted_pages() == [p for p in range(64) if "chat 2" in pm.cell_owners(p)]

    # Off the cells, nothing is shown.
    pm.hover_page(None)
    assert pm.last_tooltip == ""


def test_queue_panel_says_why_jobs_wait_and_what_hits_saved(qtbot):
    queue = QueuePanel()
    qtbot.addWidget(queue)
    snap = synthetic_snapshot(64, chats=2)
    waiting = JobInfo(9, "chat 9", "pending", 300, 0, 0, 2,
                      "not enough free pages: needs 20, 3 free", (), 0,
                      wait_kind="memory")  # fmt: skip
    snap.jobs.append(waiting)
    # The finished job computed 480 of its 576 prompt tokens in 1 s: hits are priced at
    # that rate, the jobs' own, not at an engine-wide average that includes idle time.
    queue.apply_events(
        [{"kind": "job_done", "prompt_tokens": 576, "cached_tokens": 96, "time_prefill": 1.0}]
    )
    queue.set_snapshot(snap)
    rows = queue.rows()
    assert rows[-1]["state"] == "pending"
    why = rows[-1]["why / saved"]
    assert why.startswith(
        "waiting for memory: the KV cache has too few free pages (needs 20, 3 free)"
    )
    assert why.endswith("(skipped 2×)")
    assert rows[1]["why / saved"] == "hit: 48 tok ≈ 0.10 s saved"
    assert "2 running · 1 waiting" in queue.summary_text()
    summary = queue.summary_text()
    assert "saved 144 prompt tokens ≈ 0.30 s of prefill" in summary
    assert "recent jobs prefilled at 480 tok/s" in summary
    # Narrow, the shown summary keeps to its three lines; the tooltip has all of it.
    queue.resize(200, 300)
    queue.show()
    shown = queue.summary.text()
    assert shown != summary and summary.startswith(shown) and queue.summary.toolTip() == summary
    metrics = queue.summary.fontMetrics()
    rect = metrics.boundingRect(
        0, 0, queue.summary.width(), 10_000, int(Qt.TextFlag.TextWordWrap), shown
    )
    assert rect.height() <= 3 * metrics.lineSpacing()


def test_dark_and_light_share_one_language(qtbot):
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    snap = synthetic_snapshot(64, chats=2)
    panel.refresh(snap, None, None)
    light = panel.page_map.cell_color(0)
    panel.set_dark(True)
    assert panel.dark and panel.page_map.palette_.dark
    assert panel.page_map.cell_color(0) == light  # chats keep their colour across themes
    words = panel.legend.entries()
    # counted where the engine has the tier (this one has no host or disk tier)
    s = snap.stats
    assert words[:4] == [
        f"free {s.pages_free}",
        f"cached {s.pages_cached}",
        "host tier",
        "disk tier",
    ]
    assert "chat 1" in words and "shared" in words and "evicted next" in words
    panel.set_dark(False)
    assert not panel.dark


def test_graphs_follow_a_rolling_window(qtbot):
    from engine.cache.snapshot import CacheStats
    from engine.telemetry import StepRecord, Telemetry

    telemetry = Telemetry(history=50)
    for i in range(80):
        telemetry.record(StepRecord.of(float(i) * 0.1, CacheStats(pages_free=10, pages_cached=i),
                                       prefill_tokens=16, decode_tokens=4, batch_size=2))  # fmt: skip
    graphs = ThroughputGraphs()
    qtbot.addWidget(graphs)
    assert graphs.update_from(telemetry)
    x, y = graphs.curves["decode"].getData()
    assert len(x) == 50 and x[-1] == 0.0
    assert y[-1] == pytest.approx(40.0)  # 4 tokens per 0.1 s step
    assert graphs.latest["prefill_tok_s"] == pytest.approx(160.0)
    assert not graphs.update_from(telemetry)  # nothing new, nothing redrawn


def test_feed_brings_one_view_up_to_date_per_tick(qtbot):
    """What the main window calls while chats stream: `feed` only stores the snapshot;
    the panel's timer then updates one view per tick, and only views whose input moved."""
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.show()
    ran: list[str] = []
    inner = panel._run_part
    panel._run_part = lambda part, force=False: (ran.append(part), inner(part, force))
    snap = synthetic_snapshot(64, chats=2)
    panel.feed(snap)
    assert panel.page_map.page_count == 0  # nothing drawn inside `feed` itself
    assert set(panel.pending_parts()) == {"queue", "page_map", "tree"}  # no telemetry
    panel._run_next_part()
    assert len(ran) == 1
    qtbot.waitUntil(lambda: not panel.pending_parts(), timeout=2000)
    assert sorted(ran) == ["page_map", "queue", "tree"]
    assert panel.page_map.page_count == 64 and panel.tree.model.nodes()
    panel.feed(snap)  # the same version again: nothing to redo
    assert panel.pending_parts() == []
