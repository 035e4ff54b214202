"""What other threads read of the page pool: a snapshot of the page table's per-page
arrays (`CacheSnapshot`, from `PageTable.snapshot`) and the pool's figures (`CacheStats`:
free, referenced and cached pages, waste, sharing, prefix hit rate), read from a snapshot
or, by the page table itself at every step, from its arrays in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.cache.disk_tier import DiskTierSnapshot, DiskTierStats
from engine.cache.host_tier import HostTierSnapshot
from engine.cache.page import PageState


@dataclass
class CacheSnapshot:
    state: np.ndarray  # uint8 PageState per page
    ref_count: np.ndarray  # int32
    fill: np.ndarray  # int32
    tier: np.ndarray  # uint8 Tier
    access_serial: np.ndarray  # int64
    owners: list[tuple[int, ...]]  # job ids per page
    hash_prefix: np.ndarray  # uint64: first 8 bytes of the content hash, 0 for placeholders
    edges: np.ndarray  # [E, 2] int32: (child page, parent page)
    host: HostTierSnapshot | None
    counters: dict[str, int]
    disk: DiskTierStats | None = None  # the disk tier's figures, when there is one
    disk_records: DiskTierSnapshot | None = None  # its records (hash, parent, recency)


@dataclass(frozen=True)
class CacheStats:
    """What the page pool holds at one moment (docs/ENGINE.md §8 for waste and sharing)."""

    pages_free: int = 0
    pages_referenced: int = 0
    pages_cached: int = 0  # unreferenced with content: prompt-cache candidates
    pages_host: int = 0  # entries of the host tier
    tokens_stored: int = 0  # rows written in referenced pages
    waste: float = 0.0  # 1 - tokens_stored / (pages_referenced * page_size)
    sharing: float = 0.0  # pages with ref_count > 1 / pages_referenced
    prefix_hit_rate: float = 0.0  # prefix_hit_tokens / prefix_query_tokens, cumulative
    pages_disk: int = 0  # records of the disk tier


def cache_stats(snapshot: CacheSnapshot, page_size: int) -> CacheStats:
    host = snapshot.host
    pages_host = 0 if host is None else int(np.count_nonzero(host.state == PageState.HOST))
    pages_disk = 0 if snapshot.disk is None else snapshot.disk.pages
    return page_stats(
        snapshot.state,
        snapshot.ref_count,
        snapshot.fill,
        pages_host,
        snapshot.counters,
        page_size,
        pages_disk,
    )


def page_stats(
    state: np.ndarray,
    ref_count: np.ndarray,
    fill: np.ndarray,
    pages_host: int,
    counters: dict[str, int],
    page_size: int,
    pages_disk: int = 0,
) -> CacheStats:
    """The figures from per-page arrays (a snapshot's, or the page table's own, read in
    place by `PageTable.stats` at every step)."""
    referenced = state == PageState.REFERENCED
    n_ref = int(np.count_nonzero(referenced))
    tokens = int(fill[referenced].sum())
    shared = int(np.count_nonzero(ref_count[referenced] > 1))
    queried = counters.get("prefix_query_tokens", 0)
    hits = counters.get("prefix_hit_tokens", 0)
    return CacheStats(
        pages_free=int(np.count_nonzero(state == PageState.FREE)),
        pages_referenced=n_ref,
        pages_cached=int(np.count_nonzero(state == PageState.CACHED)),
        pages_host=pages_host,
        tokens_stored=tokens,
        waste=1.0 - tokens / (n_ref * page_size) if n_ref else 0.0,
        sharing=shared / n_ref if n_ref else 0.0,
        prefix_hit_rate=hits / queried if queried else 0.0,
        pages_disk=pages_disk,
    )
