"""Snapshot, events and counters: what the UI's page map draws from."""

from __future__ import annotations

import numpy as np

from engine.cache import EventKind, PageState, Tier
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
    stored = [e for e in table.events if e.kind is EventKind.STORED]
    assert len(stored) == 4 and stored[1].parent_hash == stored[0].hash
    other = list(range(800, 800 + 6 * PS))
    job = table.allocate(2, other, 0)
    fill(table, job, other, len(other) - 1)
    table.release(job)
    job = table.allocate(3, seq, 0)
    kinds = {e.kind for e in table.events}
    assert {EventKind.EVICTED, EventKind.TIER_PUSH, EventKind.RESTORED} <= kinds
    table.release(job)
    table.clear()
    assert table.events[-1].kind is EventKind.CLEARED
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
