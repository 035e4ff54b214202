"""The page map's model: the numbers behind the picture, derived from one snapshot.

Qt-free (numpy arrays and plain data), so it can be built and checked without a
display; `gui.views.page_map` draws it. `chat_key` and `chat_keys` say which chat a
page's colour follows, for every view that colours pages by chat.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.cache.page import PageState

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot
    from gui.palette import ChatColors


def chat_key(job_id: int, tag: Any) -> Any:
    """What a page's colour follows: the job's tag (its chat), or the job itself when
    the caller gave no tag, so untagged jobs still get told apart."""
    return ("job", job_id) if tag is None else tag


def chat_keys(snapshot: EngineSnapshot, owners: tuple[int, ...]) -> tuple[Any, ...]:
    """The chat keys of a page's owners (sequence ids -> jobs -> tags), each once, in
    the owners' order."""
    keys: list[Any] = []
    for seq in owners:
        job = snapshot.seq_jobs.get(seq)
        key = chat_key(job if job is not None else -seq, snapshot.job_tags.get(job))
        if key not in keys:
            keys.append(key)
    return tuple(keys)


def disk_pages(snapshot: EngineSnapshot) -> int:
    """Records of the disk tier as the snapshot's record list has them (what the page map
    draws; the tier's figures may run up to half a second ahead of the list)."""
    records = snapshot.cache.disk_records
    return 0 if records is None else len(records.hash_prefix)


def tier_counts(snapshot: EngineSnapshot) -> dict[str, int]:
    """Pages per state, keyed by the legend's words; tiers the engine lacks left out."""
    s = snapshot.stats
    counts = {"free": s.pages_free, "cached": s.pages_cached}
    if snapshot.cache.host is not None:
        counts["host tier"] = s.pages_host
    if snapshot.cache.disk_records is not None:
        counts["disk tier"] = disk_pages(snapshot)
    return counts


def disk_cell_cap(num_pages: int) -> int:
    """Disk-tier records drawn at most: a store holds thousands (4 GB of pages), and one
    cell each would bury the device pages; as many as the device has, 64 to 4,096."""
    return max(64, min(num_pages, 4096))


@dataclass
class PageMapModel:
    """The numbers behind the picture, derived from one snapshot (Qt-free arrays).

    Device pages are indices 0..num_pages-1; host-tier slots follow as
    num_pages..num_pages+host_slots-1, then the disk tier's newest records (at most
    `disk_cell_cap`, oldest of them first) as the last disk_cells cells."""

    num_pages: int
    host_slots: int
    page_size: int
    state: np.ndarray  # uint8 PageState per cell
    ref_count: np.ndarray  # int32 per cell (0 for host slots)
    fill: np.ndarray  # int32 rows written per cell
    parent: np.ndarray  # int32 parent page per device page, -1 for roots / none
    chat_slot: np.ndarray  # int32 colour slot of the first owning chat, -1 when unowned
    evict_rank: np.ndarray  # int32 position in the eviction order, -1 when not listed
    access_serial: np.ndarray  # int64 per cell
    hash_prefix: np.ndarray  # uint64 per cell
    owner_keys: list[tuple[Any, ...]]  # chat keys per device page
    version: int
    disk_cells: int = 0  # disk-tier records drawn (the newest)
    disk_pages: int = 0  # records the disk tier holds
    disk_parent: np.ndarray | None = None  # uint64 parent hash prefix per disk cell, 0: root
    restored: np.ndarray | None = None  # bool per cell: read back from disk a moment ago

    @classmethod
    def empty(cls) -> PageMapModel:
        z = np.zeros(0, np.int32)
        return cls(0, 0, 0, z.astype(np.uint8), z, z, z, z, z, z.astype(np.int64),
                   z.astype(np.uint64), [], -1)  # fmt: skip

    @property
    def cells(self) -> int:
        return self.num_pages + self.host_slots + self.disk_cells

    @classmethod
    def from_snapshot(
        cls, snapshot: EngineSnapshot, chats: ChatColors, restored: Collection[int] = ()
    ) -> PageMapModel:
        """``restored``: hash prefixes of pages lately read back from the disk tier (the
        page events say which), marked where a device page holds one."""
        cache = snapshot.cache
        n = snapshot.num_pages
        host = cache.host
        h = 0 if host is None else len(host.state)
        records = cache.disk_records
        total_disk = disk_pages(snapshot)
        d = min(total_disk, disk_cell_cap(n))
        end = n + h + d
        state = np.empty(end, np.uint8)
        state[:n] = cache.state
        ref = np.zeros(end, np.int32)
        ref[:n] = cache.ref_count
        fill = np.zeros(end, np.int32)
        fill[:n] = cache.fill
        serial = np.zeros(end, np.int64)
        serial[:n] = cache.access_serial
        prefix = np.zeros(end, np.uint64)
        prefix[:n] = cache.hash_prefix
        if host is not None:
            state[n : n + h] = host.state
            # A host slot holds a whole page (only full, hashed pages are pushed).
            fill[n : n + h] = np.where(host.state == PageState.HOST, snapshot.page_size, 0)
            serial[n : n + h] = host.access_serial
            prefix[n : n + h] = host.hash_prefix
        disk_parent = np.zeros(d, np.uint64)
        if d:
            state[n + h :] = PageState.DISK
            fill[n + h :] = snapshot.page_size  # only full pages go to disk
            serial[n + h :] = records.access_serial[-d:]
            prefix[n + h :] = records.hash_prefix[-d:]
            disk_parent = records.parent_prefix[-d:]
        mark = np.zeros(end, bool)
        if restored:
            wanted = np.fromiter(restored, np.uint64, len(restored))
            mark[:n] = np.isin(cache.hash_prefix, wanted) & (cache.hash_prefix != 0)
        parent = np.full(n, -1, np.int32)
        if len(cache.edges):
            parent[cache.edges[:, 0]] = cache.edges[:, 1]

        # owners are sequence ids: sequence -> job -> tag -> colour slot. Pages of one
        # sequence share one owners tuple, so a memo keeps this loop cheap at 16k pages.
        slot = np.full(end, -1, np.int32)
        owner_keys: list[tuple[Any, ...]] = [()] * n
        memo: dict[tuple[int, ...], tuple[tuple[Any, ...], int]] = {}
        for page in np.flatnonzero(cache.ref_count > 0).tolist():
            owners = cache.owners[page]
            hit = memo.get(owners)
            if hit is None:
                keys = chat_keys(snapshot, owners)
                hit = memo[owners] = (keys, chats.index_of(keys[0]) if keys else -1)
            owner_keys[page], slot[page] = hit

        rank = np.full(end, -1, np.int32)
        if snapshot.eviction_next:
            order = np.asarray(snapshot.eviction_next, np.int64)
            rank[order] = np.arange(len(order), dtype=np.int32)
        return cls(n, h, snapshot.page_size, state, ref, fill, parent, slot, rank, serial,
                   prefix, owner_keys, snapshot.version, d, total_disk, disk_parent,
                   mark)  # fmt: skip

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for child in np.flatnonzero(self.parent >= 0).tolist():
            kids.setdefault(int(self.parent[child]), []).append(child)
        return kids

    def chain(self, page: int) -> list[int]:
        """The page, its ancestors up to the root and every continuation below it:
        the prompts that run through this page."""
        if not 0 <= page < self.num_pages:
            return []
        up = [page]
        seen = {page}
        p = int(self.parent[page])
        while p >= 0 and p not in seen:  # `seen` guards a malformed (cyclic) snapshot
            up.append(p)
            seen.add(p)
            p = int(self.parent[p])
        kids = self.children()
        down, stack = [], list(kids.get(page, ()))
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            down.append(c)
            stack.extend(kids.get(c, ()))
        return sorted(up[::-1] + down)

    def pages_of_chat(self, key: Any) -> list[int]:
        return [i for i, keys in enumerate(self.owner_keys) if key in keys]
