"""The host tier's copies and who waits for them (engine/cache/tier_copies.py).

On a CUDA pool the copies run on a side stream; here fake streams run each copy at once
(the bytes are real) but keep its event in flight until something waits for it, and
record who waited: the compute stream (a forward, the pool's own copies) or the host
(reading a tier slot). The real streams: tests/engine/test_cuda.py."""

from __future__ import annotations

import torch

from engine.cache import HostTier
from engine.cache.kv_cache import CacheSettings, KVCache, StepBatch
from engine.cache.tier_copies import TierCopies
from tests.engine.cache import make_storage

PS = 16


class FakeStreams:
    """Events are numbers; one is finished once the host waited for it or `finish` says so."""

    def __init__(self):
        self.issued = 0
        self.compute_waited: list[int] = []
        self.host_waited: list[int] = []
        self.done: set[int] = set()

    def run_on_side(self, copy):
        copy()
        self.issued += 1
        return self.issued - 1

    def compute_waits(self, event):
        self.compute_waited.append(event)

    def host_waits(self, event):
        self.host_waited.append(event)
        self.done.add(event)

    def finished(self, event):
        return event in self.done

    def keep_alive(self, tensors):
        pass


def _tier_on_fake_streams(num_pages: int = 6, slots: int = 3):
    storage = make_storage(num_pages, PS)
    gen = torch.Generator().manual_seed(0)
    for layer in storage.k + storage.v:
        layer["data"].copy_(torch.randn(layer["data"].shape, generator=gen))
    streams = FakeStreams()
    tier = HostTier(slots * storage.bytes_per_page, storage, copies=TierCopies(streams))
    return storage, tier, streams


def test_copies_are_waited_for_only_where_their_pages_are_touched():
    storage, tier, streams = _tier_on_fake_streams()
    assert storage.copies is tier.copies  # the pool's own copies consult the tier's
    pushed = storage.read_page(1)
    assert tier.push(b"a" * 16, None, list(range(PS)), storage, 1)  # event 0: page 1
    tier.restore(b"a" * 16, storage, 4)  # event 1: page 4, from the same slot
    assert tier.copies.pending_pages() == {1, 4}
    assert storage.read_page(4, rows=0) == b""  # page 4 read by the host: it waited
    assert streams.compute_waited == [1] and tier.copies.pending_pages() == {1}
    storage.copy_page(0, 2)  # pages no copy touches: nothing waits
    storage.copy_rows(3, 5, 4)
    assert streams.compute_waited == [1]
    storage.copy_rows(1, 2, 4)  # page 1's push: the compute stream waits, the host does not
    assert streams.compute_waited == [1, 0] and streams.host_waited == []
    assert not tier.copies.pending
    # the host reads a slot's bytes only after the copy into it (a disk spill)
    assert tier.read_slot(b"a" * 16) == pushed
    assert streams.host_waited == [1]  # the slot's latest copy: the restore out of it
    assert storage.read_page(4) == pushed


def test_the_pools_cycle_and_disk_writes_wait_for_their_pages():
    storage, tier, streams = _tier_on_fake_streams()
    tier.push(b"a" * 16, None, [0] * PS, storage, 2)
    tier.push(b"b" * 16, None, [1] * PS, storage, 3)
    storage.move_cycle([0, 1])
    assert streams.compute_waited == []
    storage.move_cycle([5, 3, 0])
    assert streams.compute_waited == [1]
    storage.write_page(2, storage.read_page(0))
    assert streams.compute_waited == [1, 0]


def test_finished_copies_leave_nothing_to_wait_for():
    storage, tier, streams = _tier_on_fake_streams()
    tier.push(b"a" * 16, None, [0] * PS, storage, 2)
    streams.done.add(0)
    assert tier.copies.pending_pages() == set()
    storage.copy_page(2, 0)
    assert streams.compute_waited == []
    tier.push(b"b" * 16, None, [0] * PS, storage, 3)
    tier.copies.drain()  # what must happen before the tensors may go
    assert streams.host_waited == [1] and not tier.copies.pending


def test_a_forward_waits_for_the_copies_of_its_own_pages():
    cache = KVCache(1, 1, 32, "m", CacheSettings(page_size=PS, token_budget=8 * PS))
    streams = FakeStreams()
    copies = cache.storage.copies = TierCopies(streams)
    copies.copy(lambda: None, page=5, slot=0)
    copies.copy(lambda: None, page=6, slot=1)
    decode = StepBatch.build([([0, 1], 20, 1), ([2], 3, 1)], PS)
    cache._layer_kv(0, decode)  # what write and attend call first, every layer
    assert streams.compute_waited == []
    decode = StepBatch.build([([0, 5], 20, 1), ([2], 3, 1)], PS)
    cache._layer_kv(0, decode)
    assert streams.compute_waited == [0] and copies.pending_pages() == {6}
    prefill = StepBatch.build([([3], 0, 10)], PS)  # no host block tables: every copy
    cache.await_copies(prefill)
    assert streams.compute_waited == [0, 1] and not copies.pending


def test_on_the_cpu_copies_are_plain():
    storage = make_storage(4, PS)
    tier = HostTier(2 * storage.bytes_per_page, storage)
    assert tier.copies.streams is None
    assert not any(t.is_pinned() for t in tier.storage.page_tensors())
    tier.push(b"a" * 16, None, [0] * PS, storage, 1)
    assert not tier.copies.pending and tier.read_slot(b"a" * 16) == storage.read_page(1)
