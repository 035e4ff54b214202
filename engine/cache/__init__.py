"""Paged KV cache: page table, storage, host tier, eviction order, defrag, and what other
threads read of it (snapshots and their figures)."""

from engine.cache.eviction import EvictionPolicy, eviction_order
from engine.cache.host_tier import HostTier, HostTierSnapshot, TierEntry
from engine.cache.page import (
    CacheFingerprint,
    CacheFullError,
    PageRecord,
    PageState,
    PagesUnavailableError,
    Tier,
    chain_hash,
    suggest_page_size,
)
from engine.cache.page_table import (
    Allocation,
    CacheCounters,
    CacheEvent,
    CacheEventKind,
    DefragResult,
    PageTable,
)
from engine.cache.snapshot import CacheSnapshot, CacheStats, cache_stats
from engine.cache.storage import (
    PagedKVStorage,
    dense_allocator,
    host_mirror,
    kvformat_allocator,
)

__all__ = [
    "Allocation",
    "CacheCounters",
    "CacheEvent",
    "CacheEventKind",
    "CacheFingerprint",
    "CacheFullError",
    "CacheSnapshot",
    "CacheStats",
    "DefragResult",
    "EvictionPolicy",
    "HostTier",
    "HostTierSnapshot",
    "PageRecord",
    "PageState",
    "PageTable",
    "PagedKVStorage",
    "PagesUnavailableError",
    "Tier",
    "TierEntry",
    "cache_stats",
    "chain_hash",
    "dense_allocator",
    "eviction_order",
    "host_mirror",
    "kvformat_allocator",
    "suggest_page_size",
]
