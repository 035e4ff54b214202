"""Pages: the record of one physical page, its state and tier, and the chained hash."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

DIGEST_SIZE = 16
# Placeholder hashes are 9 bytes: a marker byte then a counter. Content hashes are
# 16-byte digests, so the two can never collide.
_PLACEHOLDER_MARK = b"\xfe"
_placeholder_counter = itertools.count()


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1


class PageState(IntEnum):
    """What a snapshot shows for a page."""

    FREE = 0  # unreferenced and empty (fill 0)
    REFERENCED = 1  # held by at least one live allocation
    CACHED = 2  # unreferenced, holds content (a prompt-cache candidate)
    HOST = 3  # an entry of the host tier
    DISK = 4  # a record of the disk tier


class CacheFullError(ValueError):
    """A job needs more pages than the whole cache has: it can never run."""

    def __init__(self, pages_needed: int, pages_total: int, tokens: int, page_size: int):
        self.pages_needed = pages_needed
        self.pages_total = pages_total
        super().__init__(
            f"job needs {pages_needed} pages ({tokens} tokens at {page_size} tokens/page) "
            f"but the cache has only {pages_total} pages"
        )


class PagesUnavailableError(RuntimeError):
    """Not enough unreferenced pages right now (admission should have waited)."""


@dataclass(frozen=True)
class CacheFingerprint:
    """What makes K/V of two caches interchangeable: model and cache format.

    ``calibration`` identifies the key mean a quantized K cache stores its keys relative to
    (a digest of it, ``engine.cache.kv_cache.KeyCalibration``): pages written against one
    mean read back wrong against another."""

    model: str
    page_size: int
    k_bits: int = 32
    v_bits: int = 32
    calibration: str = ""

    def root_digest(self) -> bytes:
        """The digest every root page chains from."""
        text = f"folio-kv|{self.model}|page={self.page_size}|k={self.k_bits}|v={self.v_bits}"
        if self.calibration:
            text += f"|kmean={self.calibration}"
        return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()


def chain_hash(parent_digest: bytes, token_ids: Sequence[int] | np.ndarray) -> bytes:
    """blake2b-128 over the parent's digest then the token ids as int64 little-endian."""
    h = hashlib.blake2b(parent_digest, digest_size=DIGEST_SIZE)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


def new_placeholder_hash() -> bytes:
    return _PLACEHOLDER_MARK + next(_placeholder_counter).to_bytes(8, "little")


def is_content_hash(h: bytes | None) -> bool:
    return h is not None and len(h) == DIGEST_SIZE


@dataclass(eq=False)
class PageRecord:
    """One physical page of the device pool. Only PageTable mutates these."""

    index: int
    hash: bytes
    parent_hash: bytes | None = None  # None: a root (chains from the fingerprint)
    ref_count: int = 0
    access_serial: int = 0
    fill: int = 0  # kv_position: token rows written
    tokens: list[int] = field(default_factory=list)
    tier: Tier = Tier.DEVICE
    owners: set[int] = field(default_factory=set)  # job ids of live allocations

    @property
    def has_content_hash(self) -> bool:
        return is_content_hash(self.hash)

    @property
    def state(self) -> PageState:
        if self.ref_count > 0:
            return PageState.REFERENCED
        return PageState.CACHED if self.fill > 0 else PageState.FREE


def suggest_page_size(observed_prompt_lengths: Sequence[int]) -> int:
    """max(64, 2**floor(log2(mean / 4))) clipped to powers of two in [16, 1024]."""
    if len(observed_prompt_lengths) == 0:
        return 256
    mean = float(np.mean(observed_prompt_lengths))
    exponent = math.floor(math.log2(mean / 4)) if mean >= 4 else 0
    size = max(64, 2**exponent)
    return int(min(1024, max(16, size)))
