"""Allocating pages for a job (docs/ENGINE.md §2) and sharing them (§7, §8)."""

from __future__ import annotations

import pytest
import torch

from engine.cache import CacheFullError, EvictionPolicy, PagesUnavailableError
from tests.engine.cache import (
    assert_prefix_content,
    expected_rows,
    fill,
    make_table,
    read_rows,
)

PS = 16


def test_context_pages_exclude_the_last_prompt_token():
    table = make_table(16, PS)
    assert table.allocate(1, list(range(2 * PS)), 0).num_context_pages == 1
    assert table.allocate(2, list(range(2 * PS + 1)), 0).num_context_pages == 2
    assert table.allocate(3, [5], 0).num_context_pages == 0
    table.validate()


def test_reserves_every_page_of_the_round():
    table = make_table(16, PS)
    alloc = table.allocate(1, list(range(20)), 30)
    assert len(alloc.block_table) == -(-(20 + 30) // PS) == 4
    assert alloc.prefill_pages == [0, 1]
    assert all(table.pages[p].ref_count == 1 for p in alloc.block_table)
    table.validate()


def test_concurrent_jobs_with_a_shared_prefix_share_live_pages():
    table = make_table(16, PS)
    seq = list(range(3 * PS + 4))
    a = table.allocate(1, seq, 8)
    # B arrives before A has prefilled: the keyed pages are shared, but hold no data.
    b = table.allocate(2, seq[: 2 * PS] + [999] * 10, 8)
    assert b.block_table[:2] == a.block_table[:2]
    assert [table.pages[p].ref_count for p in b.block_table[:2]] == [2, 2]
    assert b.cached_tokens == 0 and b.prefill_pages[:2] == [0, 1]
    fill(table, a, seq, len(seq) - 1)
    table.validate()
    # After A's prefill a third job finds the data present.
    c = table.allocate(3, seq[: 2 * PS + 1], 0)
    assert c.cached_tokens == 2 * PS
    assert_prefix_content(table, c, seq[: 2 * PS + 1])
    table.validate()


def test_identical_generations_dedup_to_one_page():
    table = make_table(16, PS)
    seq = list(range(PS + 3))
    a = table.allocate(1, seq, 2 * PS)
    b = table.allocate(2, seq, 2 * PS)
    assert a.block_table[1] != b.block_table[1]  # new pages are never shared
    full = seq + [42] * (2 * PS - len(seq))
    fill(table, a, full, 2 * PS)
    fill(table, b, full, 2 * PS)
    assert a.block_table[1] == b.block_table[1], "second page should dedup"
    assert table.pages[a.block_table[1]].ref_count == 2
    assert table.counters.dedup_switches == 1
    table.validate()


def test_prompt_cache_hit_after_release_returns_written_content():
    table = make_table(16, PS)
    seq = list(range(100, 100 + 3 * PS + 5))
    a = table.allocate(1, seq, 4)
    fill(table, a, seq, len(seq) - 1)
    table.release(a)
    table.validate()
    b = table.allocate(2, seq, 4)
    assert b.hit_pages == 3
    assert b.cached_tokens == len(seq) - 1  # 3 full pages + 4 rows copied from the partial page
    assert b.partial_rows == 4
    assert_prefix_content(table, b, seq)
    assert table.counters.prefix_hit_tokens == len(seq) - 1
    table.validate()


def test_job_larger_than_the_cache_is_refused_with_numbers():
    table = make_table(4, PS)
    with pytest.raises(CacheFullError) as err:
        table.allocate(1, list(range(100)), 12)
    assert isinstance(err.value, ValueError)
    msg = str(err.value)
    assert "needs 7 pages" in msg and "only 4 pages" in msg
    assert not table.allocations
    table.validate()


def test_admission_counts_only_unreferenced_context_pages():
    table = make_table(6, PS)
    seq = list(range(3 * PS + 1))
    a = table.allocate(1, seq, 0)  # 3 context pages + 1 new page: 4 of 6
    assert table.pages_needed(seq, 0) == 1  # its context pages are live: shared, not taken
    assert table.can_allocate(seq, 0)
    assert not table.can_allocate(list(range(500, 500 + 3 * PS)), 0)
    with pytest.raises(PagesUnavailableError):
        table.allocate(2, list(range(500, 500 + 3 * PS)), 0)
    table.validate()  # a refused allocation leaves nothing behind
    table.release(a)
    assert table.can_allocate(list(range(500, 500 + 3 * PS)), 0)


def test_partial_last_page_copies_only_matching_rows():
    table = make_table(16, PS)
    seq = list(range(2 * PS + 10))
    a = table.allocate(1, seq, 0)
    fill(table, a, seq, len(seq) - 1)
    table.release(a)
    src = a.block_table[1]
    source_before = table.storage.read_page(src)
    other = seq[: PS + 5] + [777] * 20  # shares page 0 and 5 tokens of page 1
    b = table.allocate(2, other, 0)
    dst = b.block_table[1]
    assert dst != src
    assert b.partial_rows == 5 and b.cached_tokens == PS + 5
    assert table.storage.read_page(src) == source_before, "source page modified"
    assert torch.equal(read_rows(table.storage, dst, 5), expected_rows(seq, 1, 5, PS))
    assert torch.count_nonzero(read_rows(table.storage, dst, PS)[:, :, 5:]) == 0
    table.validate()


def test_own_chain_is_protected_while_allocating():
    # LRU evicts a conversation's root first, leaving its later pages as orphans.
    table = make_table(6, PS, eviction="lru")
    seq = list(range(4 * PS + 1))
    a = table.allocate(1, seq, 0)
    fill(table, a, seq, len(seq) - 1)
    table.release(a)
    other = list(range(900, 900 + 2 * PS + 1))
    filler = table.allocate(2, other, 0)  # 2 empty pages + the root
    fill(table, filler, other, len(other))
    table.release(filler)  # now every unreferenced page holds content
    assert table.page_for_hash(table.context_hashes(seq)[0]) is None
    b = table.allocate(3, seq, 0)
    # The root miss takes a page, but never one of the chain's later hits.
    assert b.hit_pages == 3
    assert_prefix_content(table, b, seq)
    table.validate()


def test_fork_shares_pages_and_copies_on_write():
    table = make_table(16, PS)
    seq = list(range(PS + 6))
    a = table.allocate(1, seq, PS)
    fill(table, a, seq, len(seq) - 1)
    b = table.fork(a, 2)
    assert b.block_table == a.block_table
    assert all(table.pages[p].ref_count == 2 for p in a.block_table)
    shared = a.block_table[1]
    before = table.storage.read_page(shared)
    page = table.ensure_writable(b, 1)
    assert page != shared and b.block_table[1] == page
    assert table.storage.read_page(shared) == before
    assert torch.equal(read_rows(table.storage, page, 5), read_rows(table.storage, shared, 5))
    assert table.pages[shared].ref_count == 1 and table.ensure_writable(a, 1) == shared
    assert table.ensure_writable(b, 0) == a.block_table[0]  # full content page: shared as is
    table.validate()
    table.release(a)
    table.release(b)
    table.validate()
    assert not table.referenced


def test_eviction_policy_option_accepts_strings():
    assert make_table(4, PS, eviction="lru").policy is EvictionPolicy.LRU
    assert make_table(4, PS).policy is EvictionPolicy.TAIL_FIRST
