"""Defragmentation (docs/ENGINE.md §5): contents kept, chains contiguous, few moves."""

from __future__ import annotations

import pytest
import torch

from engine.cache import CacheEventKind
from engine.cache.defrag import plan_defrag
from tests.engine.cache import fill, make_table, read_rows

PS = 16


def _run(table, job_id, seq, max_rq=0, release=True):
    job = table.allocate(job_id, seq, max_rq)
    fill(table, job, seq, len(seq) - 1)
    if release:
        table.release(job)
    return job


def _fragmented_table():
    """One tree whose longest chain is split by an unrelated job's pages."""
    table = make_table(12, PS)
    prefix = list(range(2 * PS))
    a = prefix + list(range(100, 100 + 2 * PS)) + [1]
    b = prefix + list(range(200, 200 + 2 * PS)) + [1]
    c = list(range(300, 300 + 3 * PS)) + [1]
    _run(table, 1, a)  # pages 0-3 (+ empty 4)
    _run(table, 2, b)  # shares 0-1
    _run(table, 3, c)
    _run(table, 4, a + list(range(400, 400 + 2 * PS)))  # extends a's chain elsewhere
    table.validate()
    return table


def _contents(table):
    return {
        h: read_rows(table.storage, p.index, PS)
        for h, p in table.unreferenced.items()
        if p.has_content_hash
    }


def _longest_chain(table, root):
    chain = [root]
    while True:
        kids = [p for p in table.pages if p.fill > 0 and p.parent_hash == chain[-1].hash]
        if not kids:
            return chain
        chain.append(max(kids, key=lambda k: len(_longest_chain(table, k))))


def test_defrag_keeps_contents_and_lays_chains_out_contiguously():
    table = _fragmented_table()
    before = _contents(table)
    copies_before = table.storage.page_copies
    result = table.defrag()
    assert result is not None and result.moved_pages > 0.1 * table.num_pages
    table.validate()
    after = _contents(table)
    assert before.keys() == after.keys()
    for h in before:
        assert torch.equal(before[h], after[h]), "defrag changed a page's K/V"
    n = table.num_pages
    roots = [p for p in table.pages if p.fill > 0 and p.parent_hash is None]
    assert len(roots) == 2
    for root in roots:
        chain = _longest_chain(table, root)
        steps = [(b.index - a.index) % n for a, b in zip(chain, chain[1:])]
        assert steps == [1] * (len(chain) - 1), f"chain not contiguous: {[p.index for p in chain]}"
    assert table.storage.page_copies - copies_before == result.copies
    assert table.counters.defrags == 1
    assert any(e.kind is CacheEventKind.DEFRAG_MOVE for e in table.events)
    # A second pass has nothing left to do.
    assert table.defrag() is None


def test_moves_are_cycles_of_length_plus_one_copies():
    table = _fragmented_table()
    plan = plan_defrag(table.pages)
    assert plan is not None
    copied = [c for c in plan.cycles if any(table.pages[i].fill > 0 for i in c)]
    result = table.defrag()
    assert result.copies == sum(len(c) + 1 for c in copied)
    # a cycle permutation: every page goes somewhere distinct
    assert sorted(plan.target) == list(range(table.num_pages))


def test_ten_percent_or_fewer_moves_is_a_no_op():
    table = make_table(20, PS)
    seq = list(range(3 * PS + 1))
    _run(table, 1, seq)  # pages 0..2 already in order
    copies = table.storage.page_copies
    assert table.defrag() is None
    assert table.storage.page_copies == copies


def test_defrag_needs_drained_queues():
    table = make_table(8, PS)
    _run(table, 1, list(range(2 * PS + 1)), release=False)
    with pytest.raises(RuntimeError, match="drained"):
        table.defrag()


def test_hits_after_defrag_find_moved_pages():
    table = _fragmented_table()
    table.defrag()
    seq = list(range(2 * PS)) + list(range(100, 100 + 2 * PS)) + [1]
    seq += list(range(400, 400 + 2 * PS))
    job = table.allocate(9, seq, 0)
    assert job.cached_tokens == len(seq) - 1
    pages = job.block_table[:5]
    assert [(y - x) % table.num_pages for x, y in zip(pages, pages[1:])] == [1] * 4
    table.validate()
