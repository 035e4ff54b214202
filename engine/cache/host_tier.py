"""Host tier (§5): a second, slower pool of slots that keeps evicted full pages.

One slot holds one page of every layer's K and V (the tier is itself a
``PagedKVStorage`` with the device pool's format). It is inclusive: a restore copies
the slot back and the entry stays. Its own eviction follows §4's order; the order is
built once and consumed front to back, rebuilt only when it runs out or recency
changed, so a prompt longer than the tier always terminates (ExLlamaV3 reset its
deferred counter on every rebuild and could loop forever).
On a CPU-only machine the device pool and the tier are both RAM: it still works. With
the pool on a CUDA GPU the slots are pinned RAM and the copies run on a side stream,
waited for only by what touches their pages or slots (engine/cache/tier_copies.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from engine.cache.eviction import EvictionPolicy, eviction_order
from engine.cache.page import PageState, Tier
from engine.cache.storage import PagedKVStorage, host_mirror
from engine.cache.tier_copies import TierCopies


@dataclass(eq=False)
class TierEntry:
    index: int  # slot
    hash: bytes
    parent_hash: bytes | None
    tokens: list[int]
    access_serial: int
    fill: int
    ref_count: int = 0  # tier entries are never referenced; present for the eviction order
    tier: Tier = Tier.HOST


@dataclass
class HostTierSnapshot:
    state: np.ndarray  # PageState.HOST or FREE per slot
    access_serial: np.ndarray
    hash_prefix: np.ndarray


@dataclass
class _VictimQueue:
    order: list[int] = field(default_factory=list)
    position: int = 0
    protected: frozenset[bytes] = frozenset()
    stale: bool = True


class HostTier:
    def __init__(
        self,
        byte_budget: int,
        layout: PagedKVStorage,
        pin_memory: bool | None = None,
        policy: EvictionPolicy = EvictionPolicy.TAIL_FIRST,
        copies: TierCopies | None = None,
    ):
        """``layout`` is the device pool whose format (K and V) the slots copy, and the
        pool the tier copies to and from. Slots are CPU tensors, pinned when the pool is
        on a CUDA device (``pin_memory`` overrides). ``copies``: how the tier's copies run
        and are waited for (default: on a side stream for a CUDA pool; a test passes fake
        streams)."""
        self.page_size = layout.page_size
        per_page = layout.bytes_per_page
        num_slots = byte_budget // per_page
        if num_slots < 1:
            raise ValueError(f"host tier budget {byte_budget} B holds no page of {per_page} B")
        pin = layout.device.type == "cuda" if pin_memory is None else pin_memory
        self.storage = PagedKVStorage(
            layout.num_layers,
            num_slots,
            layout.page_size,
            host_mirror(layout.allocator, pin),
            host_mirror(layout.v_allocator, pin),
        )
        self.num_slots = num_slots
        # the pool's own copies (copy-on-write, defragmentation, disk reads) wait for these
        self.copies = copies or TierCopies.for_pool(layout.page_tensors())
        layout.copies = self.copies
        self.policy = policy
        self.slots: list[TierEntry | None] = [None] * num_slots
        self.entries: dict[bytes, TierEntry] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._clock = 0
        self._victims = _VictimQueue()
        self.pushes = 0
        self.restores = 0
        self.evictions = 0
        # Called with (hash, parent hash, page bytes) of each evicted entry before its slot
        # is reused: the page table hands it to the disk tier.
        self.on_evict: Callable[[bytes, bytes | None, bytes], None] | None = None

    def __contains__(self, h: bytes) -> bool:
        return h in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def nbytes(self) -> int:
        return self.storage.nbytes()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def push(
        self,
        h: bytes,
        parent_hash: bytes | None,
        tokens: list[int],
        source: PagedKVStorage,
        page: int,
        protected: Collection[bytes] = (),
    ) -> bool:
        """Copy a full, content-hashed device page into the tier. A hash already
        present only refreshes its recency. Returns True when a copy was made. When
        every slot holds a protected hash (the allocating job's own chain), a page
        outside that chain is not pushed."""
        entry = self.entries.get(h)
        if entry is not None:
            entry.access_serial = self._tick()
            self._victims.stale = True
            return False
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._evict_one(frozenset(protected), allow_protected=h in protected)
            if slot is None:
                return False
        self.copies.copy(lambda: self.storage.copy_page_between(source, page, slot), page, slot)
        entry = TierEntry(slot, h, parent_hash, list(tokens), self._tick(), self.page_size)
        self.slots[slot] = entry
        self.entries[h] = entry
        self.pushes += 1
        return True

    def restore(self, h: bytes, target: PagedKVStorage, page: int) -> TierEntry:
        """Copy the entry for ``h`` into device page ``page``; the entry stays."""
        entry = self.entries[h]
        self.copies.copy(
            lambda: target.copy_page_between(self.storage, entry.index, page), page, entry.index
        )
        entry.access_serial = self._tick()
        self._victims.stale = True
        self.restores += 1
        return entry

    def _evict_one(self, protected: frozenset[bytes], allow_protected: bool) -> int | None:
        """Free the slot first in eviction order; None (nothing freed) when that slot
        is protected and ``allow_protected`` is False."""
        q = self._victims
        if q.protected != protected:
            q.protected, q.stale = protected, True
        while True:
            if q.stale or q.position >= len(q.order):
                live = [e for e in self.slots if e is not None]
                assert live, "evicting from an empty tier"
                q.order = eviction_order(live, protected, self.policy)
                q.position, q.stale = 0, False
            slot = q.order[q.position]
            entry = self.slots[slot]
            if entry is None:
                q.position += 1
                continue
            if entry.hash in protected and not allow_protected:
                return None  # protected entries come last: every slot is protected
            q.position += 1
            break
        if self.on_evict is not None:
            self.copies.await_slot(slot)
            self.on_evict(entry.hash, entry.parent_hash, self.storage.read_page(slot))
        del self.entries[entry.hash]
        self.slots[slot] = None
        self.evictions += 1
        return slot

    def clear(self) -> None:
        self.slots = [None] * self.num_slots
        self.entries.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._victims = _VictimQueue()

    def validate(self) -> None:
        assert len(self.entries) + len(self._free) == self.num_slots, "tier slot count mismatch"
        assert len(set(self._free)) == len(self._free), "tier free list has duplicates"
        for slot in self._free:
            assert self.slots[slot] is None, f"tier slot {slot} free but occupied"
        for h, entry in self.entries.items():
            assert entry.hash == h, f"tier entry keyed {h.hex()} holds {entry.hash.hex()}"
            assert self.slots[entry.index] is entry, f"tier slot {entry.index} mismatch"
            assert len(entry.tokens) == self.page_size, "tier entry not a full page"

    def snapshot(self) -> HostTierSnapshot:
        state = np.full(self.num_slots, PageState.FREE, dtype=np.uint8)
        serial = np.zeros(self.num_slots, dtype=np.int64)
        prefix = np.zeros(self.num_slots, dtype=np.uint64)
        for e in self.entries.values():
            state[e.index] = PageState.HOST
            serial[e.index] = e.access_serial
            prefix[e.index] = int.from_bytes(e.hash[:8], "little")
        return HostTierSnapshot(state, serial, prefix)

    def read_slot(self, h: bytes) -> bytes:
        slot = self.entries[h].index
        self.copies.await_slot(slot)
        return self.storage.read_page(slot)
