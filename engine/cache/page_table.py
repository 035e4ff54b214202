"""The page table: the one owner of every page's state (§1, §2, §4, §5).

Every page is in exactly one of two maps keyed by hash: ``referenced`` (ref > 0) or
``unreferenced`` (ref == 0). Full pages carry a chained content hash; pages being
filled carry a unique placeholder. Jobs get an ``Allocation`` (their block table)
from ``allocate`` and give it back with ``release``; everything else that changes a
page (fills, completion, copy-on-write, eviction, tier restore, defrag) goes through
a method here, and ``validate()`` checks every invariant.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import numpy as np

from engine.cache.defrag import plan_defrag
from engine.cache.disk_tier import DiskTier
from engine.cache.eviction import EvictionPolicy, eviction_order
from engine.cache.host_tier import HostTier
from engine.cache.page import (
    CacheFingerprint,
    CacheFullError,
    PageRecord,
    PageState,
    PagesUnavailableError,
    Tier,
    chain_hash,
    is_content_hash,
    new_placeholder_hash,
)
from engine.cache.snapshot import CacheSnapshot, CacheStats, page_stats
from engine.cache.storage import PagedKVStorage


@dataclass
class Allocation:
    """A job's pages. Only the page table changes it (block table included)."""

    job_id: int
    block_table: list[int]  # physical page per logical page
    prompt_len: int
    num_context_pages: int
    cached_tokens: int  # leading prompt tokens whose K/V are already present
    prefill_pages: list[int]  # logical pages covering the prompt that are not full yet
    hit_pages: int = 0  # context pages found in the device pool
    restored_pages: int = 0  # context pages copied back from the host tier
    disk_pages: int = 0  # context pages read back from the disk tier
    disk_bytes: int = 0  # what they held
    disk_seconds: float = 0.0  # reading and checking them, copying them into the pool
    partial_rows: int = 0  # rows copied from a sibling page (partial last page)


class CacheEventKind(StrEnum):
    STORED = "stored"  # a page got its content hash (full, data present or coming)
    REMOVED = "removed"  # a page lost its content (reset to empty)
    EVICTED = "evicted"  # a page with content was taken for reuse
    RESTORED = "restored"  # a page was copied back from the host tier
    DISK_RESTORED = "disk_restored"  # a page was read back from the disk tier
    TIER_PUSH = "tier_push"  # an evicted page was copied to the host tier
    DEFRAG_MOVE = "defrag_move"
    CLEARED = "cleared"


@dataclass(frozen=True)
class CacheEvent:
    kind: CacheEventKind
    page: int = -1
    hash: bytes | None = None
    parent_hash: bytes | None = None
    detail: int = 0  # target page for DEFRAG_MOVE
    tokens: tuple[int, ...] = ()  # STORED: the page's tokens (KV events, §11)


@dataclass
class CacheCounters:
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    tier_pushes: int = 0
    tier_restores: int = 0
    disk_restores: int = 0
    disk_restored_bytes: int = 0
    disk_spills: int = 0  # full pages queued for the disk tier
    defrags: int = 0
    defrag_moved_pages: int = 0
    defrag_copies: int = 0
    dedup_switches: int = 0


@dataclass
class DefragResult:
    moved_pages: int
    cycles: int
    copies: int


@dataclass
class _Victims:
    """The eviction order, consumed front to back and rebuilt only when stale: when
    a page became unreferenced, the policy changed, or it ran out. Pages that became
    referenced since are skipped; a page taken is past the cursor."""

    order: list[int] = field(default_factory=list)
    position: int = 0
    stale: bool = True
    skipped_protected: bool = False


class PageTable:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        fingerprint: CacheFingerprint | str,
        storage: PagedKVStorage | None = None,
        host_tier: HostTier | None = None,
        eviction: EvictionPolicy | str = EvictionPolicy.TAIL_FIRST,
        max_events: int = 4096,
        disk_tier: DiskTier | None = None,
    ):
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 16, got {page_size}")
        if num_pages < 1:
            raise ValueError("num_pages must be positive")
        if isinstance(fingerprint, str):
            fingerprint = CacheFingerprint(fingerprint, page_size)
        if fingerprint.page_size != page_size:
            raise ValueError("fingerprint page size differs from the table's")
        if storage is not None and (storage.num_pages, storage.page_size) != (
            num_pages,
            page_size,
        ):
            raise ValueError("storage shape differs from the page table's")
        if (host_tier is not None or disk_tier is not None) and storage is None:
            raise ValueError("a host or disk tier needs a device storage to copy from")
        self.num_pages = num_pages
        self.page_size = page_size
        self.fingerprint = fingerprint
        self.root_digest = fingerprint.root_digest()
        self.storage = storage
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        if host_tier is not None and disk_tier is not None:
            host_tier.on_evict = self._spill_host_entry
        self._victims = _Victims()
        self._policy = EvictionPolicy(eviction)
        self.pages = [PageRecord(i, new_placeholder_hash()) for i in range(num_pages)]
        self.referenced: dict[bytes, PageRecord] = {}
        self.unreferenced: dict[bytes, PageRecord] = {p.hash: p for p in self.pages}
        self.allocations: dict[int, Allocation] = {}
        # parent hash -> pages naming it as parent (None: roots and empty pages)
        self._children: dict[bytes | None, set[int]] = {None: set(range(num_pages))}
        self._clock = itertools.count(1)
        self._serial = 0
        self.events: deque[CacheEvent] = deque(maxlen=max_events)
        self.counters = CacheCounters()
        # Mirrors of the records for cheap snapshots; _sync keeps them current.
        self._m_state = np.full(num_pages, PageState.FREE, dtype=np.uint8)
        self._m_ref = np.zeros(num_pages, dtype=np.int32)
        self._m_fill = np.zeros(num_pages, dtype=np.int32)
        self._m_serial = np.zeros(num_pages, dtype=np.int64)
        self._m_prefix = np.zeros(num_pages, dtype=np.uint64)
        self._m_owners: list[tuple[int, ...]] = [()] * num_pages
        self._m_parent = np.full(num_pages, -1, dtype=np.int32)  # parent page or -1

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @policy.setter
    def policy(self, value: EvictionPolicy | str) -> None:
        self._policy = EvictionPolicy(value)
        self._victims.stale = True

    # -- hashing -------------------------------------------------------------------

    def context_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Content hashes of the full pages before the prompt's last token."""
        ps = self.page_size
        n_ctx = (len(token_ids) - 1) // ps if len(token_ids) else 0
        arr = np.asarray(token_ids[: n_ctx * ps], dtype=np.int64)
        hashes, parent = [], self.root_digest
        for i in range(n_ctx):
            parent = chain_hash(parent, arr[i * ps : (i + 1) * ps])
            hashes.append(parent)
        return hashes

    def _parent_digest(self, parent_hash: bytes | None) -> bytes:
        return self.root_digest if parent_hash is None else parent_hash

    # -- admission -----------------------------------------------------------------

    def pages_total(self, num_tokens: int, max_rq_tokens: int) -> int:
        return -(-(num_tokens + max_rq_tokens) // self.page_size)

    def pages_needed(self, token_ids: Sequence[int], max_rq_tokens: int, reuse: bool = True) -> int:
        """Unreferenced pages an allocation would consume now: its context pages not
        currently referenced plus its new pages."""
        total = self.pages_total(len(token_ids), max_rq_tokens)
        if not reuse:
            return total
        ctx = self.context_hashes(token_ids)
        return sum(1 for h in ctx if h not in self.referenced) + total - len(ctx)

    def can_allocate(self, token_ids: Sequence[int], max_rq_tokens: int) -> bool:
        return self.pages_needed(token_ids, max_rq_tokens) <= len(self.unreferenced)

    def check_fits(self, num_tokens: int, max_rq_tokens: int) -> None:
        """Raise CacheFullError when a job could never fit in the whole cache."""
        total = self.pages_total(num_tokens, max_rq_tokens)
        if total > self.num_pages:
            raise CacheFullError(total, self.num_pages, num_tokens + max_rq_tokens, self.page_size)

    # -- allocation ----------------------------------------------------------------

    def allocate(
        self, job_id: int, token_ids: Sequence[int], max_rq_tokens: int, reuse: bool = True
    ) -> Allocation:
        """Reserve every page the job can need this round (§2). With ``reuse`` off
        (prefix caching disabled) no context page is looked up: every page is fresh."""
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("a job needs at least one prompt token")
        if job_id in self.allocations:
            raise ValueError(f"job {job_id} already holds an allocation")
        self.check_fits(len(tokens), max_rq_tokens)
        ps = self.page_size
        ctx = self.context_hashes(tokens) if reuse else []
        total = self.pages_total(len(tokens), max_rq_tokens)
        needed = sum(1 for h in ctx if h not in self.referenced) + total - len(ctx)
        if needed > len(self.unreferenced):
            raise PagesUnavailableError(
                f"job {job_id} needs {needed} unreferenced pages, {len(self.unreferenced)} free"
            )
        protected = frozenset(ctx)
        alloc = Allocation(job_id, [], len(tokens), len(ctx), 0, [])
        parent: bytes | None = None
        disk = self.disk_tier
        if disk is not None and ctx:
            disk.refresh()  # a reader sees what another process wrote since
        disk_chain = disk is not None  # off after the first page the disk cannot give
        from_disk: Callable[[PageRecord, bytes], bool] | None = None  # set at its first page
        for i, h in enumerate(ctx):
            rec = self.referenced.get(h) or self.unreferenced.get(h)
            if rec is not None:
                alloc.hit_pages += 1
            else:
                rec = self._take_page(protected)
                self._assign(rec, h, parent, tokens[i * ps : (i + 1) * ps], fill=0)
                if self.host_tier is not None and h in self.host_tier:
                    assert self.storage is not None
                    self.host_tier.restore(h, self.storage, rec.index)
                    rec.fill = ps
                    self._sync(rec)
                    alloc.restored_pages += 1
                    self.counters.tier_restores += 1
                    self.events.append(CacheEvent(CacheEventKind.RESTORED, rec.index, h, parent))
                elif disk_chain:
                    if from_disk is None:
                        from_disk = self._disk_reader(ctx[i:], alloc)
                    disk_chain = from_disk(rec, h)
            self._add_ref(rec, job_id)
            alloc.block_table.append(rec.index)
            parent = h
        for _ in range(total - len(ctx)):
            rec = self._take_page(protected)
            self._set_parent(rec, parent)
            self._add_ref(rec, job_id)
            alloc.block_table.append(rec.index)
            parent = rec.hash
        if self._victims.skipped_protected:
            self._victims.stale, self._victims.skipped_protected = True, False
        if reuse:
            self._copy_partial_page(alloc, tokens)
        alloc.cached_tokens = self._cached_prefix(alloc)
        n_prompt_pages = -(-len(tokens) // ps)
        alloc.prefill_pages = [
            i for i in range(n_prompt_pages) if self.pages[alloc.block_table[i]].fill < ps
        ]
        self.counters.prefix_query_tokens += len(tokens) - 1
        self.counters.prefix_hit_tokens += alloc.cached_tokens
        self.allocations[job_id] = alloc
        return alloc

    def count_prefix_hit(self, tokens: int) -> None:
        """Prompt tokens a job did not compute because another job filled their pages
        after its allocation (a live share): hits like those found at allocation."""
        self.counters.prefix_hit_tokens += tokens

    def _cached_prefix(self, alloc: Allocation) -> int:
        cached = 0
        for logical in range(alloc.num_context_pages + 1):
            if logical >= len(alloc.block_table):
                break
            fill = self.pages[alloc.block_table[logical]].fill
            cached += min(fill, alloc.prompt_len - 1 - cached)
            if fill < self.page_size:
                break
        return cached

    def _copy_partial_page(self, alloc: Allocation, tokens: list[int]) -> None:
        """§2 last bullet: seed the first uncached page with matching rows of a cached
        sibling (same parent), copying, never touching the source."""
        ps = self.page_size
        first = next(
            (
                i
                for i in range(alloc.num_context_pages)
                if self.pages[alloc.block_table[i]].fill < ps
            ),
            alloc.num_context_pages,
        )
        if first >= len(alloc.block_table):
            return
        rec = self.pages[alloc.block_table[first]]
        if rec.fill > 0 or rec.ref_count > 1:
            return  # another job is already filling it
        want = tokens[first * ps : min((first + 1) * ps, len(tokens) - 1)]
        if not want:
            return
        best, best_rows = None, 0
        if rec.parent_hash is None:
            # Roots share the None bucket with every empty page: filter in numpy.
            candidates = np.flatnonzero((self._m_fill > 0) & (self._m_parent < 0)).tolist()
        else:
            candidates = self._children.get(rec.parent_hash, ())
        for idx in candidates:
            cand = self.pages[idx]
            if cand.parent_hash != rec.parent_hash:
                continue
            if idx == rec.index or cand.fill == 0:
                continue
            rows = 0
            limit = min(cand.fill, len(want))
            while rows < limit and cand.tokens[rows] == want[rows]:
                rows += 1
            if rows > best_rows:
                best, best_rows = cand, rows
        if best_rows < len(want) and self._seed_from_tiers(rec, tokens, first, alloc):
            best_rows = len(want)
        elif best is None:
            return
        elif self.storage is not None:
            self.storage.copy_rows(best.index, rec.index, best_rows)
        rec.fill = best_rows
        if not rec.has_content_hash:
            rec.tokens = want[:best_rows]
        alloc.partial_rows = best_rows
        self._sync(rec)

    def _take_page(self, protected: frozenset[bytes]) -> PageRecord:
        """Next unreferenced page in eviction order, emptied (pushed to the tier first
        when it holds a complete hashed page). Protected pages are passed over until
        nothing else is left; then a fresh order (protected last) is used."""
        v = self._victims
        rec = None
        for attempt in range(2):
            if v.stale:
                v.order, v.position, v.stale = self.eviction_order(protected), 0, False
            while v.position < len(v.order):
                cand = self.pages[v.order[v.position]]
                v.position += 1
                if cand.ref_count != 0:
                    continue
                if attempt == 0 and cand.hash in protected:
                    v.skipped_protected = True
                    continue
                rec = cand
                break
            if rec is not None:
                break
            v.stale = True
        if rec is None:
            raise PagesUnavailableError("no unreferenced page left")
        if rec.fill > 0:
            self.counters.evictions += 1
            self.events.append(
                CacheEvent(CacheEventKind.EVICTED, rec.index, rec.hash, rec.parent_hash)
            )
            if self.host_tier is not None and rec.has_content_hash and rec.fill == self.page_size:
                assert self.storage is not None
                if self.host_tier.push(
                    rec.hash, rec.parent_hash, rec.tokens, self.storage, rec.index, protected
                ):
                    self.counters.tier_pushes += 1
                    self.events.append(
                        CacheEvent(CacheEventKind.TIER_PUSH, rec.index, rec.hash, rec.parent_hash)
                    )
            if self.host_tier is None or rec.hash not in self.host_tier:
                self._spill(rec)  # leaving every faster tier: keep it on disk
        self._reset_empty(rec)
        return rec

    # -- the disk tier ---------------------------------------------------------------

    def read_ahead(self, token_ids: Sequence[int]) -> bool:
        """§10: True while the disk tier reads, on its reader thread, the pages of this
        prompt's chain that neither the pool nor the host tier holds; the scheduler
        lets the job wait and steps the others meanwhile. False when there is nothing
        to read, or it has been read (the allocation then takes those pages at once)."""
        disk = self.disk_tier
        if disk is None or not disk.enabled:
            return False
        ctx = self.context_hashes(token_ids)
        first = next((i for i, h in enumerate(ctx) if not self._in_faster_tier(h)), None)
        if first is None:
            return False
        disk.refresh()
        return disk.read_ahead(self._disk_wanted(ctx[first:]))

    def _in_faster_tier(self, h: bytes) -> bool:
        return (
            h in self.referenced
            or h in self.unreferenced
            or (self.host_tier is not None and h in self.host_tier)
        )

    def _disk_wanted(self, hashes: list[bytes]) -> list[bytes]:
        """The rest of a chain from its first page no faster tier holds: that page, and
        those after it that no faster tier holds."""
        return hashes[:1] + [h for h in hashes[1:] if not self._in_faster_tier(h)]

    def _disk_reader(
        self, hashes: list[bytes], alloc: Allocation
    ) -> Callable[[PageRecord, bytes], bool]:
        """How the rest of a chain, from ``hashes[0]`` (its first page no faster tier
        holds), comes back from disk: ``restore(rec, h)`` fills the freshly keyed ``rec``
        with page ``h`` and says whether the disk gave it. A chain read ahead is taken from
        the reader thread's buffers; otherwise each record is read straight into its pool
        page (no buffer to allocate and fault in, no second copy), the kernel reading the
        rest of the chain ahead meanwhile."""
        assert self.disk_tier is not None and self.storage is not None
        storage, disk = self.storage, self.disk_tier
        if disk.has_read_ahead(hashes[0]) or not storage.addressable:
            payloads = self._read_from_disk(hashes, alloc)
            return lambda rec, h: self._restore_from_disk(rec, payloads.pop(h, None), alloc)
        disk.prefetch(self._disk_wanted(hashes))
        page_bytes = storage.bytes_per_page

        def restore(rec: PageRecord, h: bytes) -> bool:
            start = time.perf_counter()
            ok = disk.read_into(h, storage.page_buffers(rec.index))
            alloc.disk_seconds += time.perf_counter() - start
            if ok:
                rec.fill = self.page_size
                self._count_disk_restore(alloc, rec, page_bytes)
                self._sync(rec)
            return ok

        return restore

    def _read_from_disk(self, hashes: list[bytes], alloc: Allocation) -> dict[bytes, memoryview]:
        """The disk tier's pages for the rest of a chain, ``hashes[0]`` (just keyed, empty)
        and those after it no faster tier holds, in one batched read up to the first page
        the disk cannot give."""
        assert self.disk_tier is not None
        start = time.perf_counter()
        wanted = self._disk_wanted(hashes)
        found = dict(zip(wanted, self.disk_tier.read_chain(wanted)))
        alloc.disk_seconds += time.perf_counter() - start
        return found

    def _restore_from_disk(
        self, rec: PageRecord, payload: memoryview | None, alloc: Allocation
    ) -> bool:
        """Fill the freshly keyed ``rec`` with its page read from disk; False when the
        disk had no good copy (the page, and the rest of the chain, are recomputed)."""
        if payload is None:
            return False
        rec.fill = self.page_size
        self._fill_from_disk(alloc, rec, payload)
        self._sync(rec)
        return True

    def _seed_from_tiers(
        self, rec: PageRecord, tokens: list[int], first: int, alloc: Allocation
    ) -> bool:
        """A prompt that ends on a page boundary (a chat sent again, a reply regenerated
        after a restart): its last page is whole, so a slower tier may hold it under its
        content hash. Copied into ``rec`` whole, it gives every row but the last token's,
        which the prefill writes again; True when a tier had it."""
        ps = self.page_size
        if (
            self.storage is None
            or first != alloc.num_context_pages
            or len(tokens) != (first + 1) * ps
            or (self.host_tier is None and self.disk_tier is None)
        ):
            return False
        page_tokens = np.asarray(tokens[first * ps :], dtype=np.int64)
        h = chain_hash(self._parent_digest(rec.parent_hash), page_tokens)
        if h in self.referenced or h in self.unreferenced:
            return False  # a device sibling; the scan above found what it could give
        if self.host_tier is not None and h in self.host_tier:
            self.host_tier.restore(h, self.storage, rec.index)
            self.counters.tier_restores += 1
            return True
        if self.disk_tier is None:
            return False
        payload = self._read_from_disk([h], alloc).get(h)
        if payload is None:
            return False
        self._fill_from_disk(alloc, rec, payload)
        return True

    def _fill_from_disk(self, alloc: Allocation, rec: PageRecord, payload: memoryview) -> None:
        """Copy a page read from disk into ``rec`` and count it for the job."""
        assert self.storage is not None
        start = time.perf_counter()
        self.storage.write_page(rec.index, payload)
        alloc.disk_seconds += time.perf_counter() - start
        self._count_disk_restore(alloc, rec, len(payload))

    def _count_disk_restore(self, alloc: Allocation, rec: PageRecord, nbytes: int) -> None:
        alloc.disk_pages += 1
        alloc.disk_bytes += nbytes
        self.counters.disk_restores += 1
        self.counters.disk_restored_bytes += nbytes
        self.events.append(
            CacheEvent(CacheEventKind.DISK_RESTORED, rec.index, rec.hash, rec.parent_hash)
        )

    def _spill(self, rec: PageRecord) -> None:
        """Queue a full content page for the disk tier (unless it is there already)."""
        disk = self.disk_tier
        if disk is None or not rec.has_content_hash or rec.fill < self.page_size:
            return
        if rec.hash not in disk:
            assert self.storage is not None
            if disk.put(rec.hash, rec.parent_hash, self.storage.read_page(rec.index)):
                self.counters.disk_spills += 1

    def _spill_host_entry(self, h: bytes, parent: bytes | None, payload: bytes) -> None:
        """The host tier's eviction hands its victim here before reusing the slot."""
        assert self.disk_tier is not None
        if h not in self.disk_tier and self.disk_tier.put(h, parent, payload):
            self.counters.disk_spills += 1

    def write_through(self) -> int:
        """Queue every full content page (device pool, then host tier) that the disk tier
        lacks: run when the engine is idle, so the pages of finished jobs survive a quit
        or a crash. Parents before children. Returns the pages queued."""
        disk = self.disk_tier
        if disk is None or not disk.writable:
            return 0
        before = self.counters.disk_spills
        for rec in sorted(self.pages, key=lambda r: (r.access_serial, r.index)):
            if rec.fill == self.page_size:
                self._spill(rec)
        host = self.host_tier
        if host is not None:
            for entry in sorted(host.entries.values(), key=lambda e: e.access_serial):
                if entry.hash not in disk:
                    self._spill_host_entry(
                        entry.hash, entry.parent_hash, host.read_slot(entry.hash)
                    )
        return self.counters.disk_spills - before

    # -- per-page state changes (the only places records change) ------------------

    def _map_of(self, rec: PageRecord) -> dict[bytes, PageRecord]:
        return self.referenced if rec.ref_count > 0 else self.unreferenced

    def _set_hash(self, rec: PageRecord, new_hash: bytes, children_follow: bool = False) -> None:
        """Re-key a page. Children follow only when a placeholder completes into its
        content hash; a page reused for other content leaves its children orphaned."""
        old = rec.hash
        if old == new_hash:
            return
        assert self.referenced.get(new_hash) is None and self.unreferenced.get(new_hash) is None
        table = self._map_of(rec)
        del table[old]
        table[new_hash] = rec
        rec.hash = new_hash
        if children_follow:
            kids = self._children.pop(old, set())
            for k in kids:
                self.pages[k].parent_hash = new_hash
            if kids:
                self._children.setdefault(new_hash, set()).update(kids)
        else:
            for k in self._children.get(old, ()):
                self._m_parent[k] = -1  # orphaned
        for k in self._children.get(new_hash, ()):
            self._m_parent[k] = rec.index  # pages naming this hash find their parent
        self._sync(rec)

    def _set_parent(self, rec: PageRecord, parent_hash: bytes | None) -> None:
        if rec.parent_hash == parent_hash:
            return
        siblings = self._children.get(rec.parent_hash)
        if siblings is not None:
            siblings.discard(rec.index)
            if not siblings and rec.parent_hash is not None:
                del self._children[rec.parent_hash]
        rec.parent_hash = parent_hash
        self._children.setdefault(parent_hash, set()).add(rec.index)
        parent = self.page_for_hash(parent_hash) if parent_hash is not None else None
        self._m_parent[rec.index] = parent.index if parent is not None else -1

    def _assign(
        self, rec: PageRecord, h: bytes, parent: bytes | None, tokens: list[int], fill: int
    ) -> None:
        """Key an empty page to content hash ``h`` (before it holds data, §2)."""
        self._set_hash(rec, h)
        self._set_parent(rec, parent)
        rec.tokens = list(tokens)
        rec.fill = fill
        self.events.append(
            CacheEvent(CacheEventKind.STORED, rec.index, h, parent, tokens=tuple(tokens))
        )
        self._sync(rec)

    def _reset_empty(self, rec: PageRecord) -> None:
        had_content = rec.fill > 0 or rec.has_content_hash
        stored = rec.hash if rec.has_content_hash else None  # announced by a STORED event
        self._set_hash(rec, new_placeholder_hash())
        self._set_parent(rec, None)
        rec.tokens = []
        rec.fill = 0
        if had_content:
            self.events.append(CacheEvent(CacheEventKind.REMOVED, rec.index, stored))
        self._sync(rec)

    def _add_ref(self, rec: PageRecord, job_id: int) -> None:
        assert job_id not in rec.owners, f"job {job_id} already holds page {rec.index}"
        if rec.ref_count == 0:
            del self.unreferenced[rec.hash]
            self.referenced[rec.hash] = rec
        rec.ref_count += 1
        rec.owners.add(job_id)
        self._serial = next(self._clock)
        rec.access_serial = self._serial
        self._sync(rec)

    def _drop_ref(self, rec: PageRecord, job_id: int) -> None:
        assert job_id in rec.owners, f"job {job_id} does not hold page {rec.index}"
        rec.ref_count -= 1
        rec.owners.discard(job_id)
        if rec.ref_count == 0:
            del self.referenced[rec.hash]
            self.unreferenced[rec.hash] = rec
            self._victims.stale = True
            if rec.has_content_hash and rec.fill < self.page_size:
                # Keyed but never completed (cancelled prefill): the hash would lie.
                keep = rec.tokens[: rec.fill]
                self._set_hash(rec, new_placeholder_hash())
                rec.tokens = keep
            if rec.fill == 0:
                self._reset_empty(rec)
        self._sync(rec)

    def _sync(self, rec: PageRecord) -> None:
        i = rec.index
        self._m_state[i] = rec.state
        self._m_ref[i] = rec.ref_count
        self._m_fill[i] = rec.fill
        self._m_serial[i] = rec.access_serial
        self._m_prefix[i] = int.from_bytes(rec.hash[:8], "little") if rec.has_content_hash else 0
        self._m_owners[i] = tuple(sorted(rec.owners))

    # -- filling -------------------------------------------------------------------

    def _owned(self, alloc: Allocation, logical: int) -> PageRecord:
        assert self.allocations.get(alloc.job_id) is alloc, f"job {alloc.job_id} is not live"
        return self.pages[alloc.block_table[logical]]

    def _prev_hash(self, alloc: Allocation, logical: int) -> bytes | None:
        return self.pages[alloc.block_table[logical - 1]].hash if logical > 0 else None

    def mark_filled(
        self, alloc: Allocation, logical_page: int, tokens: Sequence[int], fill: int
    ) -> int:
        """Record that ``fill`` rows of the job's page hold K/V for ``tokens`` (the
        page's tokens so far). A page that becomes full gets its content hash
        (``complete_page``). Returns the physical page now at that position."""
        rec = self._owned(alloc, logical_page)
        tokens = [int(t) for t in tokens]
        if not 0 <= fill <= self.page_size or len(tokens) != fill:
            raise ValueError(f"fill {fill} with {len(tokens)} tokens on a {self.page_size} page")
        if rec.has_content_hash:
            assert tokens == rec.tokens[:fill], f"page {rec.index} keyed to other tokens"
            rec.fill = max(rec.fill, fill)
            self._sync(rec)
            return rec.index
        common = min(fill, rec.fill)
        assert tokens[:common] == rec.tokens[:common], f"page {rec.index} rewritten"
        if rec.ref_count == 1:
            # The writer fixes a page's parent: a shared page may still name a parent
            # that one of its holders has since replaced by a private copy.
            self._set_parent(rec, self._prev_hash(alloc, logical_page))
        if fill >= rec.fill:
            rec.tokens = tokens
            rec.fill = fill
        self._sync(rec)
        if rec.fill == self.page_size:
            return self.complete_page(alloc, logical_page)
        return rec.index

    def complete_page(self, alloc: Allocation, logical_page: int) -> int:
        """Give a full page its content hash. If a page with that hash and full data
        already exists, the job switches to it and releases its own (§7 dedup).
        Returns the physical page now at that position."""
        rec = self._owned(alloc, logical_page)
        if rec.has_content_hash or rec.fill < self.page_size:
            return rec.index
        parent = self._prev_hash(alloc, logical_page)
        if rec.ref_count == 1:
            self._set_parent(rec, parent)
        if rec.parent_hash != parent:
            return rec.index  # shared and its holders disagree on the parent
        if parent is not None and not is_content_hash(parent):
            return rec.index  # parent not complete: stays a placeholder
        h = chain_hash(self._parent_digest(parent), rec.tokens)
        other = self.referenced.get(h) or self.unreferenced.get(h)
        if other is not None and other.fill < self.page_size:
            if other.ref_count > 0:
                return rec.index  # someone is still prefilling it; keep ours unhashed
            self._reset_empty(other)
            self._victims.stale = True
            other = None
        if other is None:
            self._set_hash(rec, h, children_follow=True)
            self.events.append(
                CacheEvent(CacheEventKind.STORED, rec.index, h, parent, tokens=tuple(rec.tokens))
            )
            return rec.index
        # Switch to the existing page.
        self._add_ref(other, alloc.job_id)
        alloc.block_table[logical_page] = other.index
        self._drop_ref(rec, alloc.job_id)
        if rec.ref_count == 0:
            self._reset_empty(rec)  # a duplicate of `other`: free it first
        self.counters.dedup_switches += 1
        return other.index

    def ensure_writable(self, alloc: Allocation, logical_page: int) -> int:
        """Copy-on-write: before the job writes into a page it shares, give it its own
        copy of the rows written so far. Returns the physical page to write."""
        rec = self._owned(alloc, logical_page)
        if rec.has_content_hash:
            # A page keyed to a content hash is written identically by every holder.
            return rec.index
        if rec.ref_count == 1:
            self._set_parent(rec, self._prev_hash(alloc, logical_page))
            return rec.index
        if rec.fill >= self.page_size:
            raise ValueError(f"page {rec.index} is full; nothing may write to it")
        fresh = self._take_page(frozenset())
        if self.storage is not None and rec.fill > 0:
            self.storage.copy_rows(rec.index, fresh.index, rec.fill)
        self._set_parent(fresh, self._prev_hash(alloc, logical_page))
        fresh.tokens = rec.tokens[: rec.fill]
        fresh.fill = rec.fill
        self._add_ref(fresh, alloc.job_id)
        alloc.block_table[logical_page] = fresh.index
        self._drop_ref(rec, alloc.job_id)
        return fresh.index

    # -- release and sharing -------------------------------------------------------

    def release(self, job: int | Allocation) -> None:
        job_id = job.job_id if isinstance(job, Allocation) else job
        alloc = self.allocations.pop(job_id)
        for idx in reversed(alloc.block_table):
            self._drop_ref(self.pages[idx], job_id)

    def fork(self, alloc: Allocation, job_id: int) -> Allocation:
        """A new job sharing every page of ``alloc`` (parallel sampling, beam search);
        writes go through ``ensure_writable``."""
        assert self.allocations.get(alloc.job_id) is alloc, f"job {alloc.job_id} is not live"
        if job_id in self.allocations:
            raise ValueError(f"job {job_id} already holds an allocation")
        child = Allocation(
            job_id,
            list(alloc.block_table),
            alloc.prompt_len,
            alloc.num_context_pages,
            alloc.cached_tokens,
            list(alloc.prefill_pages),
        )
        for idx in child.block_table:
            self._add_ref(self.pages[idx], job_id)
        self.allocations[job_id] = child
        return child

    # -- eviction, defrag, clear ---------------------------------------------------

    def next_victims(self, count: int) -> list[int]:
        """The first ``count`` unreferenced pages the next allocations would take. Uses
        (and, when stale, rebuilds) the order allocation consumes, so a UI asking every
        frame costs a rebuild only after pages were released."""
        v = self._victims
        if v.stale:
            v.order, v.position, v.stale = self.eviction_order(), 0, False
        out = []
        for idx in itertools.islice(v.order, v.position, None):
            if self.pages[idx].ref_count == 0:
                out.append(idx)
                if len(out) == count:
                    break
        return out

    def eviction_order(self, protected: frozenset[bytes] | set[bytes] = frozenset()) -> list[int]:
        return eviction_order(self.pages, protected, self.policy)

    def defrag(self) -> DefragResult | None:
        """Lay trees out contiguously (§5). Only when no page is referenced."""
        if self.referenced:
            raise RuntimeError("defrag needs drained queues: pages are still referenced")
        plan = plan_defrag(self.pages)
        if plan is None:
            return None
        copies = 0
        for cycle in plan.cycles:
            if all(self.pages[i].fill == 0 for i in cycle):
                continue  # only empty pages: nothing to copy
            if self.storage is not None:
                copies += self.storage.move_cycle(cycle)
            else:
                copies += len(cycle) + 1
        new_pages: list[PageRecord | None] = [None] * self.num_pages
        for rec in self.pages:
            dst = plan.target[rec.index]
            if dst != rec.index and rec.fill > 0:
                self.events.append(
                    CacheEvent(CacheEventKind.DEFRAG_MOVE, rec.index, rec.hash, None, dst)
                )
            rec.index = dst
            new_pages[dst] = rec
        assert all(p is not None for p in new_pages)
        self.pages = new_pages  # type: ignore[assignment]
        self._children = {}
        for rec in self.pages:
            self._children.setdefault(rec.parent_hash, set()).add(rec.index)
            parent = self.page_for_hash(rec.parent_hash) if rec.parent_hash else None
            self._m_parent[rec.index] = parent.index if parent is not None else -1
            self._sync(rec)
        self._children.setdefault(None, set())
        self._victims.stale = True
        self.counters.defrags += 1
        self.counters.defrag_moved_pages += plan.moved_pages
        self.counters.defrag_copies += copies
        return DefragResult(plan.moved_pages, len(plan.cycles), copies)

    def clear(self) -> None:
        """Forget every cached page (nothing may be referenced)."""
        if self.referenced:
            raise RuntimeError("clear needs drained queues: pages are still referenced")
        for rec in self.pages:
            self._reset_empty(rec)
        if self.host_tier is not None:
            self.host_tier.clear()
        self._victims.stale = True
        self.events.append(CacheEvent(CacheEventKind.CLEARED))

    # -- inspection ----------------------------------------------------------------

    def page_for_hash(self, h: bytes) -> PageRecord | None:
        return self.referenced.get(h) or self.unreferenced.get(h)

    def snapshot(self) -> CacheSnapshot:
        children = np.flatnonzero(self._m_parent >= 0).astype(np.int32)
        edges = np.stack([children, self._m_parent[children]], axis=1)
        return CacheSnapshot(
            state=self._m_state.copy(),
            ref_count=self._m_ref.copy(),
            fill=self._m_fill.copy(),
            tier=np.full(self.num_pages, Tier.DEVICE, dtype=np.uint8),
            access_serial=self._m_serial.copy(),
            owners=list(self._m_owners),
            hash_prefix=self._m_prefix.copy(),
            edges=edges,
            host=self.host_tier.snapshot() if self.host_tier is not None else None,
            counters=asdict(self.counters),
            disk=self.disk_tier.stats() if self.disk_tier is not None else None,
            disk_records=self.disk_tier.snapshot() if self.disk_tier is not None else None,
        )

    def stats(self) -> CacheStats:
        """The pool's figures now, read in place: what the generator records every step,
        without the copies a `snapshot` makes for other threads."""
        host = len(self.host_tier.entries) if self.host_tier is not None else 0
        disk = len(self.disk_tier) if self.disk_tier is not None else 0
        return page_stats(
            self._m_state,
            self._m_ref,
            self._m_fill,
            host,
            asdict(self.counters),
            self.page_size,
            disk,
        )

    def validate(self) -> None:
        """Check every invariant of §1; AssertionError with the reason otherwise."""
        ps = self.page_size
        assert len(self.pages) == self.num_pages, "page list length changed"
        assert not (self.referenced.keys() & self.unreferenced.keys()), "hash in both maps"
        assert len(self.referenced) + len(self.unreferenced) == self.num_pages, (
            f"maps hold {len(self.referenced)}+{len(self.unreferenced)} pages, "
            f"expected {self.num_pages}"
        )
        holders: dict[int, list[int]] = {}
        for job_id, alloc in self.allocations.items():
            assert alloc.job_id == job_id, f"allocation keyed {job_id} is job {alloc.job_id}"
            assert len(set(alloc.block_table)) == len(alloc.block_table), (
                f"job {job_id} holds a page twice: {alloc.block_table}"
            )
            for idx in alloc.block_table:
                holders.setdefault(idx, []).append(job_id)
        children: dict[bytes | None, set[int]] = {}
        for i, rec in enumerate(self.pages):
            where = f"page {i}"
            assert rec.index == i, f"{where} records index {rec.index}"
            assert rec.tier is Tier.DEVICE, f"{where} not in the device tier"
            table = self.referenced if rec.ref_count > 0 else self.unreferenced
            assert table.get(rec.hash) is rec, f"{where} missing from its map (ref {rec.ref_count})"
            jobs = holders.get(i, [])
            assert rec.ref_count == len(jobs), (
                f"{where} ref_count {rec.ref_count} but held by jobs {jobs}"
            )
            assert rec.owners == set(jobs), f"{where} owners {rec.owners} != holders {jobs}"
            assert 0 <= rec.fill <= ps, f"{where} fill {rec.fill} outside 0..{ps}"
            assert rec.access_serial <= self._serial, f"{where} serial from the future"
            if rec.has_content_hash:
                assert len(rec.tokens) == ps, f"{where} content page holds {len(rec.tokens)} tokens"
                assert rec.parent_hash is None or is_content_hash(rec.parent_hash), (
                    f"{where} content page under a placeholder parent"
                )
                expect = chain_hash(self._parent_digest(rec.parent_hash), rec.tokens)
                assert expect == rec.hash, f"{where} hash does not match its tokens and parent"
                if rec.ref_count == 0:
                    assert rec.fill == ps, f"{where} unreferenced content page not full"
            else:
                assert len(rec.tokens) == rec.fill, (
                    f"{where} placeholder holds {len(rec.tokens)} tokens, fill {rec.fill}"
                )
                if rec.ref_count == 0 and rec.fill == 0:
                    assert rec.parent_hash is None, f"{where} empty page keeps a parent"
            assert rec.parent_hash != rec.hash, f"{where} is its own parent"
            children.setdefault(rec.parent_hash, set()).add(i)
            # mirrors
            assert self._m_state[i] == rec.state, f"{where} snapshot state stale"
            assert self._m_ref[i] == rec.ref_count, f"{where} snapshot ref stale"
            assert self._m_fill[i] == rec.fill, f"{where} snapshot fill stale"
            assert self._m_serial[i] == rec.access_serial, f"{where} snapshot serial stale"
            assert self._m_owners[i] == tuple(sorted(rec.owners)), f"{where} owners stale"
            parent = self.page_for_hash(rec.parent_hash) if rec.parent_hash else None
            expect_parent = parent.index if parent is not None else -1
            assert self._m_parent[i] == expect_parent, f"{where} snapshot parent stale"
        mine = {k: v for k, v in self._children.items() if v}
        assert mine == children, "children index out of step with parent hashes"
        for job_id, alloc in self.allocations.items():
            for logical in range(1, len(alloc.block_table)):
                rec = self.pages[alloc.block_table[logical]]
                prev = self.pages[alloc.block_table[logical - 1]]
                # Content pages chain exactly; a private page being written names its
                # predecessor; an unwritten shared page is re-parented when written.
                must_chain = rec.has_content_hash or (rec.ref_count == 1 and rec.fill > 0)
                assert not must_chain or rec.parent_hash == prev.hash, (
                    f"job {job_id} logical page {logical} (page {rec.index}) does not chain "
                    f"from page {prev.index}"
                )
            if alloc.block_table:
                first = self.pages[alloc.block_table[0]]
                assert first.fill == 0 or first.parent_hash is None, (
                    f"job {job_id} first page has a parent"
                )
        if self.host_tier is not None:
            self.host_tier.validate()
        if self.disk_tier is not None:
            self.disk_tier.validate()
