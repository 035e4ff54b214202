"""A server's KV-cache pool as its KV events describe it (vLLM's wire format, which
Folio's `--kv-events` speaks too: docs/ENGINE.md §11), drawn as a snapshot.

Events say which blocks a server holds (`BlockStored`: block hashes, the parent's hash,
token ids, block size), which it dropped (`BlockRemoved`) and when it dropped all
(`AllBlocksCleared`). They say nothing of where a block sits in memory, who uses it, or
blocks not yet full; so `BlockPool` gives each block the lowest free cell, as a pool
hands out pages, and `snapshot` shows every held block as cached, full, owned by no one.
Those limits are written out in `LIMITS` for the memory panel to show.

A block hash becomes the 8-byte key the views use for a page (the first 8 bytes of a
Folio page's content hash, read little-endian): Folio publishes those bytes as a
big-endian integer, so the key of a Folio block equals the key of its page in Folio's
own snapshot. vLLM's hashes (integers, or bytes for sha256 hashing) are keyed the same
way, which keeps them apart as long as their first 8 bytes differ.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from engine.cache.page import PageState
from engine.cache.snapshot import CacheSnapshot, cache_stats
from engine.engine import EngineSnapshot, JobInfo

LIMITS = (
    "Drawn from the server's KV-cache events: which blocks it holds and how they chain. "
    "Events give no physical page index (cells are placed in the order blocks arrived), "
    "no reference counts (in-use and cached blocks both show as cached), no partly "
    "filled blocks and no per-chat owners; the queue lists only this app's requests."
)


def block_key(block_hash: int | bytes) -> int:
    """The views' 8-byte page key of a block hash (see the module's note)."""
    raw = block_hash[:8] if isinstance(block_hash, bytes) else (
        (block_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
    )  # fmt: skip
    return int.from_bytes(raw.ljust(8, b"\0"), "little")


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A batch's (timestamp, events), each event a dict with its "type". Events may be
    maps tagged by "type" or arrays with the tag first (msgspec's `array_like` structs);
    ValueError for anything else."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"a KV-event batch that is not msgpack: {exc}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV-event batch is not [ts, events, ...]")
    return float(batch[0]), [_event(ev) for ev in batch[1]]


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _event(ev: Any) -> dict[str, Any]:
    if isinstance(ev, dict):
        kind = ev.get("type")
        out = dict(ev)
    elif isinstance(ev, list | tuple) and ev and isinstance(ev[0], str):
        kind = ev[0]
        out = {"type": kind, **dict(zip(_FIELDS.get(kind, ()), ev[1:]))}
    else:
        raise ValueError(f"a KV event that is neither a map nor a tagged array: {ev!r:.80}")
    if kind not in _FIELDS:
        return {"type": kind}  # a newer kind: ignored by the pool
    return out


@dataclass
class Block:
    key: int
    parent: int | None  # the parent block's key
    tokens: list[int]
    cell: int
    serial: int


@dataclass
class BlockPool:
    """Blocks by key, each in a cell. Apply events with `apply`; read with `snapshot`."""

    num_blocks: int = 0  # the server's pool size when known (metrics), else grown as needed
    block_size: int = 0  # from the events (or the server's metrics)
    medium: str | None = None  # the first medium seen; events for others are counted apart
    blocks: dict[int, Block] = field(default_factory=dict)
    other_medium: set[int] = field(default_factory=set)
    batches: int = 0
    version: int = 0
    _free: list[int] = field(default_factory=list)
    _cells: int = 0
    _serial: int = 0

    def apply(self, events: Iterable[dict[str, Any]]) -> None:
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.blocks.clear()
                self.other_medium.clear()
                self._free, self._cells = [], 0
                continue
            medium = ev.get("medium")
            if self.medium is None and medium is not None:
                self.medium = medium
            elsewhere = medium is not None and medium != self.medium
            if kind == "BlockStored":
                self._stored(ev, elsewhere)
            elif kind == "BlockRemoved":
                for h in ev.get("block_hashes") or ():
                    key = block_key(h)
                    if elsewhere:
                        self.other_medium.discard(key)
                    else:
                        self._remove(key)
        self.batches += 1
        self.version += 1

    def _stored(self, ev: dict[str, Any], elsewhere: bool) -> None:
        hashes = [block_key(h) for h in ev.get("block_hashes") or ()]
        if elsewhere:
            self.other_medium.update(hashes)
            return
        size = int(ev.get("block_size") or self.block_size or 0)
        self.block_size = self.block_size or size
        tokens = list(ev.get("token_ids") or ())
        first = ev.get("parent_block_hash")
        parent = None if first is None else block_key(first)
        for i, key in enumerate(hashes):
            ids = tokens[i * size : (i + 1) * size] if size else []
            old = self.blocks.get(key)
            self._serial += 1
            if old is not None:  # stored again (a re-computed block): same cell
                old.parent, old.tokens, old.serial = parent, ids, self._serial
            else:
                self.blocks[key] = Block(key, parent, ids, self._take_cell(), self._serial)
            parent = key

    def _remove(self, key: int) -> None:
        block = self.blocks.pop(key, None)
        if block is not None:
            heapq.heappush(self._free, block.cell)

    def _take_cell(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._cells += 1
        return self._cells - 1

    def snapshot(
        self,
        version: int,
        counters: dict[str, int] | None = None,
        jobs: list[JobInfo] | None = None,
        note: str = LIMITS,
    ) -> EngineSnapshot:
        """The pool as the views draw a snapshot: one page per cell (at least the
        server's pool size), held blocks cached and full, the rest free."""
        n = max(self.num_blocks, self._cells)
        size = self.block_size
        state = np.full(n, PageState.FREE, np.uint8)
        fill = np.zeros(n, np.int32)
        serial = np.zeros(n, np.int64)
        prefix = np.zeros(n, np.uint64)
        page_tokens: list[list[int]] = [[] for _ in range(n)]
        edges = []
        for b in self.blocks.values():
            state[b.cell] = PageState.CACHED
            fill[b.cell] = len(b.tokens) or size
            serial[b.cell] = b.serial
            prefix[b.cell] = b.key
            page_tokens[b.cell] = b.tokens
            up = self.blocks.get(b.parent) if b.parent is not None else None
            if up is not None:
                edges.append((b.cell, up.cell))
        cache = CacheSnapshot(
            state=state,
            ref_count=np.zeros(n, np.int32),
            fill=fill,
            tier=np.zeros(n, np.uint8),
            access_serial=serial,
            owners=[()] * n,
            hash_prefix=prefix,
            edges=np.asarray(edges, np.int32).reshape(-1, 2),
            host=None,
            counters=dict(counters or {}),
        )
        jobs = jobs or []
        return EngineSnapshot(
            version=version,
            time=time.monotonic(),
            cache=cache,
            stats=cache_stats(cache, size or 1),
            page_size=size,
            num_pages=n,
            page_tokens=page_tokens,
            eviction_next=[],
            jobs=jobs,
            seq_jobs={},
            job_tags={j.job_id: j.tag for j in jobs},
            cache_bytes=0,
            host_bytes=0,
            note=note,
        )
