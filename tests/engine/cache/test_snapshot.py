"""Snapshot, events and counters: what the UI's page map draws from; the pool's figures
(waste, sharing, hit rate) counted by hand."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cache import CacheEventKind, CacheStats, PageState, PageTable, Tier, cache_stats
from tests.engine.cache import fill, make_table

PS = 16


def _busy_table():
    table = make_table(16, PS, tier_slots=4)
    a_seq = list(range(3 * PS + 2))
    a = table.allocate(1, a_seq, 8)
    fill(table, a, a_seq, len(a_seq) - 1)
    table.release(a)
    b_seq = a_seq[: 2 * PS] + [500] * 20
    b = table.allocate(2, b_seq, 4)
    fill(table, b, b_seq, len(b_seq) - 1)
    c = table.fork(b, 3)
    return table, b, c


def test_snapshot_matches_the_records():
    table, b, c = _busy_table()
    snap = table.snapshot()
    n = table.num_pages
    for arr in (snap.state, snap.ref_count, snap.fill, snap.tier, snap.access_serial):
        assert arr.shape == (n,)
    for rec in table.pages:
        i = rec.index
        assert snap.state[i] == rec.state
        assert snap.ref_count[i] == rec.ref_count
        assert snap.fill[i] == rec.fill
        assert snap.tier[i] == Tier.DEVICE
        assert snap.access_serial[i] == rec.access_serial
        assert snap.owners[i] == tuple(sorted(rec.owners))
        if rec.has_content_hash:
            assert int(snap.hash_prefix[i]) == int.from_bytes(rec.hash[:8], "little")
        else:
            assert snap.hash_prefix[i] == 0
    for page in b.block_table:
        assert snap.state[page] == PageState.REFERENCED and snap.owners[page] == (2, 3)
    assert (snap.state == PageState.CACHED).any() and (snap.state == PageState.FREE).any()
    edges = {tuple(e) for e in snap.edges.tolist()}
    expect = set()
    for rec in table.pages:
        parent = table.page_for_hash(rec.parent_hash) if rec.parent_hash else None
        if parent is not None:
            expect.add((rec.index, parent.index))
    assert edges == expect and (b.block_table[1], b.block_table[0]) in edges
    assert snap.host is not None and snap.host.state.shape == (4,)
    assert snap.counters["prefix_hit_tokens"] == table.counters.prefix_hit_tokens > 0


def test_snapshot_is_a_copy():
    table, b, _ = _busy_table()
    snap = table.snapshot()
    ref = snap.ref_count.copy()
    table.release(b)
    assert np.array_equal(snap.ref_count, ref)


def test_events_record_stores_evictions_restores_and_clear():
    table = make_table(6, PS, tier_slots=6)
    seq = list(range(4 * PS + 1))
    job = table.allocate(1, seq, 0)
    fill(table, job, seq, len(seq) - 1)
    table.release(job)
    stored = [e for e in table.events if e.kind is CacheEventKind.STORED]
    assert len(stored) == 4 and stored[1].parent_hash == stored[0].hash
    other = list(range(800, 800 + 6 * PS))
    job = table.allocate(2, other, 0)
    fill(table, job, other, len(other) - 1)
    table.release(job)
    job = table.allocate(3, seq, 0)
    kinds = {e.kind for e in table.events}
    assert {CacheEventKind.EVICTED, CacheEventKind.TIER_PUSH, CacheEventKind.RESTORED} <= kinds
    table.release(job)
    table.clear()
    assert table.events[-1].kind is CacheEventKind.CLEARED
    assert all(p.state is PageState.FREE for p in table.pages) and len(table.host_tier) == 0
    c = table.counters
    assert c.evictions >= 4 and c.tier_restores == 4 and c.tier_pushes >= 4
    table.validate()


def test_events_are_bounded():
    table = make_table(4, PS, with_storage=False)
    table.events = type(table.events)(maxlen=5)
    for i in range(20):
        seq = [i * 100 + t for t in range(PS + 1)]
        job = table.allocate(i, seq, 0)
        table.release(job)
    assert len(table.events) == 5


def _fill_pages(table: PageTable, alloc, seq: list[int]) -> None:
    """Write every token of ``seq`` into the job's pages (no K/V storage here)."""
    for logical in range(-(-len(seq) // PS)):
        rows = seq[logical * PS : (logical + 1) * PS]
        table.mark_filled(alloc, logical, rows, len(rows))


def _stats(table: PageTable) -> CacheStats:
    """The figures from a snapshot, checked equal to the page table's in-place reading
    (what the generator records every step)."""
    from_snapshot = cache_stats(table.snapshot(), PS)
    assert table.stats() == from_snapshot
    return from_snapshot


def test_cache_stats_empty_table():
    table = PageTable(8, PS, "test-model")
    assert _stats(table) == CacheStats(pages_free=8)


def test_cache_stats_counted_by_hand_through_fork_copy_on_write_and_release():
    table = PageTable(8, PS, "test-model")
    seq = list(range(2 * PS + 8))  # 40 tokens: pages of 16, 16 and 8
    a = table.allocate(1, seq, 8)  # ceil(48 / 16) = 3 pages
    _fill_pages(table, a, seq)
    s = _stats(table)
    assert (s.pages_free, s.pages_referenced, s.pages_cached, s.pages_host) == (5, 3, 0, 0)
    assert s.tokens_stored == 40
    assert s.waste == pytest.approx(1 - 40 / 48)  # the half-filled last page
    assert s.sharing == 0.0
    assert s.prefix_hit_rate == 0.0  # 39 tokens queried, none found

    b = table.fork(a, 2)  # parallel sampling: the same 3 pages, ref 2 each
    s = _stats(table)
    assert (s.pages_free, s.pages_referenced, s.tokens_stored) == (5, 3, 40)
    assert s.sharing == 1.0

    # Job 2 writes its 41st token: copy-on-write gives it a private last page.
    assert table.ensure_writable(b, 2) not in a.block_table
    table.mark_filled(b, 2, seq[32:40] + [777], 9)
    s = _stats(table)
    # pages 16 (ref 2) + 16 (ref 2) + 8 (job 1) + 9 (job 2)
    assert (s.pages_free, s.pages_referenced, s.pages_cached) == (4, 4, 0)
    assert s.tokens_stored == 16 + 16 + 8 + 9
    assert s.waste == pytest.approx(1 - 49 / 64)
    assert s.sharing == 2 / 4

    table.release(a)  # its partial page keeps 8 rows: cached, not free
    s = _stats(table)
    assert (s.pages_free, s.pages_referenced, s.pages_cached) == (4, 3, 1)
    assert s.tokens_stored == 16 + 16 + 9
    assert s.waste == pytest.approx(1 - 41 / 48)
    assert s.sharing == 0.0

    c = table.allocate(3, seq[:32] + [900] * 5, 0)  # hits both full prompt pages
    assert c.cached_tokens == 32
    s = _stats(table)
    assert (s.pages_free, s.pages_referenced, s.pages_cached) == (3, 4, 1)
    assert s.tokens_stored == 41  # the new page is still empty
    assert s.waste == pytest.approx(1 - 41 / 64)
    assert s.sharing == 2 / 4
    assert s.prefix_hit_rate == pytest.approx(32 / (39 + 36))

    table.release(b)
    table.release(c)
    s = _stats(table)
    # two full prompt pages and the two partial pages stay; job 3's empty page is free
    assert (s.pages_free, s.pages_referenced, s.pages_cached) == (4, 0, 4)
    assert (s.tokens_stored, s.waste, s.sharing) == (0, 0.0, 0.0)
    assert s.prefix_hit_rate == pytest.approx(32 / 75)
    table.validate()


def test_cache_stats_counts_host_tier_entries():
    table = make_table(6, PS, tier_slots=6)
    seq = list(range(4 * PS + 1))
    job = table.allocate(1, seq, 0)
    fill(table, job, seq, len(seq) - 1)
    table.release(job)  # four full pages cached
    assert _stats(table).pages_host == 0
    other = list(range(800, 800 + 6 * PS))
    job = table.allocate(2, other, 0)  # takes all six pages: the four go to the tier
    s = _stats(table)
    assert s.pages_host == 4 == len(table.host_tier)
    assert (s.pages_free, s.pages_referenced, s.pages_cached) == (0, 6, 0)
