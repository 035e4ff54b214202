"""Host tier (docs/ENGINE.md §5): push on eviction, restore by copy, its own eviction."""

from __future__ import annotations

import signal

import pytest
import torch

from engine.cache import HostTier
from tests.engine.cache import assert_prefix_content, fill, make_storage, make_table

PS = 16


def _random_storage(num_pages: int):
    storage = make_storage(num_pages, PS)
    gen = torch.Generator().manual_seed(0)
    for layer in storage.k + storage.v:
        layer["data"].copy_(torch.randn(layer["data"].shape, generator=gen))
    return storage


def test_push_restore_round_trip_is_bytes_equal():
    storage = _random_storage(4)
    tier = HostTier(3 * storage.bytes_per_page, storage)
    assert tier.num_slots == 3
    page = storage.read_page(1)
    assert tier.push(b"h" * 16, None, list(range(PS)), storage, 1)
    assert tier.read_slot(b"h" * 16) == page
    tier.restore(b"h" * 16, storage, 3)
    assert storage.read_page(3) == page
    assert b"h" * 16 in tier, "the tier is inclusive: a restored entry stays"
    tier.validate()


def test_pushing_a_present_hash_only_refreshes_it():
    storage = _random_storage(4)
    tier = HostTier(2 * storage.bytes_per_page, storage)
    tier.push(b"a" * 16, None, [0] * PS, storage, 0)
    serial = tier.entries[b"a" * 16].access_serial
    copies = storage.page_copies + tier.storage.page_copies
    assert not tier.push(b"a" * 16, None, [0] * PS, storage, 2)
    assert storage.page_copies + tier.storage.page_copies == copies
    assert tier.entries[b"a" * 16].access_serial > serial
    assert tier.pushes == 1


def test_full_tier_evicts_leaf_first():
    storage = _random_storage(4)
    tier = HostTier(2 * storage.bytes_per_page, storage)
    root, child, other = b"r" * 16, b"c" * 16, b"o" * 16
    tier.push(root, None, [1] * PS, storage, 0)
    tier.push(child, root, [2] * PS, storage, 1)
    tier.push(other, None, [3] * PS, storage, 2)
    assert root in tier and other in tier and child not in tier
    tier.validate()


def test_budget_smaller_than_a_page_is_refused():
    storage = make_storage(2, PS)
    with pytest.raises(ValueError, match="holds no page"):
        HostTier(storage.bytes_per_page - 1, storage)


def test_evicted_pages_come_back_from_the_tier():
    table = make_table(6, PS, tier_slots=8)
    seq = list(range(4 * PS + 1))
    job = table.allocate(1, seq, 0)
    fill(table, job, seq, len(seq) - 1)
    table.release(job)
    other = list(range(500, 500 + 6 * PS))  # every page: the whole conversation is evicted
    job = table.allocate(2, other, 0)
    fill(table, job, other, len(other) - 1)
    table.release(job)
    assert table.counters.tier_pushes == 4
    job = table.allocate(3, seq, 0)
    assert job.restored_pages == 4 and job.cached_tokens == 4 * PS
    assert_prefix_content(table, job, seq)
    assert table.counters.tier_restores == 4
    table.validate()


def test_a_prompt_ending_on_a_page_boundary_takes_its_whole_last_page_from_the_tier():
    table = make_table(6, PS, tier_slots=8)
    seq = list(range(4 * PS))  # four whole pages: the last one holds the last token
    job = table.allocate(1, seq, 1)
    fill(table, job, seq, len(seq))
    table.release(job)
    other = list(range(500, 500 + 6 * PS))
    job = table.allocate(2, other, 0)
    fill(table, job, other, len(other) - 1)
    table.release(job)
    job = table.allocate(3, seq, 0)
    # Three context pages, and all but the last token's row of the fourth.
    assert job.restored_pages == 3 and job.partial_rows == PS - 1
    assert job.cached_tokens == len(seq) - 1
    assert_prefix_content(table, job, seq)
    assert table.counters.tier_restores == 4
    table.validate()


def _alarm(_signum, _frame):
    raise TimeoutError("host tier livelock")


def test_prompt_longer_than_a_full_tier_terminates():
    # ExLlamaV3 could loop forever here; our victim queue is consumed, never reset.
    table = make_table(12, PS, tier_slots=3)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        seqs = [[k * 1000 + t for t in range(10 * PS + 1)] for k in range(2)]
        for round_ in range(2):
            for k, seq in enumerate(seqs):
                job = table.allocate(round_ * 10 + k, seq, PS)
                assert_prefix_content(table, job, seq)
                fill(table, job, seq, len(seq) - 1)
                table.validate()
                table.release(job)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    tier = table.host_tier
    assert len(tier) == tier.num_slots == 3
    assert tier.evictions > 0 and table.counters.tier_restores > 0
    tier.validate()
    table.validate()


def test_a_tier_full_of_the_jobs_own_chain_keeps_it():
    storage = _random_storage(4)
    tier = HostTier(2 * storage.bytes_per_page, storage)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    tier.push(a, None, [1] * PS, storage, 0)
    tier.push(b, a, [2] * PS, storage, 1)
    assert not tier.push(c, None, [3] * PS, storage, 2, protected={a, b})
    assert a in tier and b in tier and c not in tier
    # a protected page may still displace another protected one: never a deadlock
    assert tier.push(c, None, [3] * PS, storage, 2, protected={a, b, c})
    assert len(tier) == 2
    tier.validate()
