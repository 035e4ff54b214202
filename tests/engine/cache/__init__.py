"""Helpers for the cache tests: a tiny fp32 storage and recognisable K/V values.

The value written at a position is a rolling hash of every token up to it, so two
prefixes that differ anywhere give different rows: a cache hit that returns the
wrong page, or a copy that lands in the wrong place, shows up as a value mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache import (
    Allocation,
    HostTier,
    PagedKVStorage,
    PageTable,
    dense_allocator,
)

LAYERS = 2
HEADS = 1
HEAD_DIM = 2
MODULUS = 1_000_003  # rolling values stay below 2**24: exact in fp32


def make_storage(num_pages: int, page_size: int) -> PagedKVStorage:
    return PagedKVStorage(LAYERS, num_pages, page_size, dense_allocator(HEADS, HEAD_DIM))


def make_table(
    num_pages: int,
    page_size: int = 16,
    with_storage: bool = True,
    tier_slots: int = 0,
    eviction: str = "tail_first",
) -> PageTable:
    storage = make_storage(num_pages, page_size) if with_storage else None
    tier = None
    if tier_slots:
        assert storage is not None
        tier = HostTier(tier_slots * storage.bytes_per_page, storage)
    return PageTable(num_pages, page_size, "test-model", storage, tier, eviction=eviction)


def rolling(seq: Sequence[int]) -> list[int]:
    out, v = [], 0
    for t in seq:
        v = (v * 31 + int(t) + 1) % MODULUS
        out.append(v)
    return out


def expected_rows(seq: Sequence[int], logical: int, rows: int, page_size: int) -> torch.Tensor:
    """[layers, 2 (K, V), rows, heads, head_dim] for the given page of ``seq``."""
    lo = logical * page_size
    roll = torch.tensor(rolling(seq[: lo + rows])[lo:], dtype=torch.float32)
    pos = torch.arange(lo, lo + rows, dtype=torch.float32)
    out = torch.empty(LAYERS, 2, rows, HEADS, HEAD_DIM)
    for layer in range(LAYERS):
        out[layer, 0, :, :, 0] = roll[:, None]
        out[layer, 0, :, :, 1] = pos[:, None] + layer
        out[layer, 1, :, :, 0] = -roll[:, None]
        out[layer, 1, :, :, 1] = pos[:, None] * 2 + layer
    return out


def read_rows(storage: PagedKVStorage, page: int, rows: int) -> torch.Tensor:
    out = torch.empty(LAYERS, 2, rows, HEADS, HEAD_DIM)
    for layer in range(LAYERS):
        out[layer, 0] = storage.k[layer]["data"][page, :rows]
        out[layer, 1] = storage.v[layer]["data"][page, :rows]
    return out


def write_rows(storage: PagedKVStorage, page: int, start: int, values: torch.Tensor) -> None:
    n = values.shape[2]
    for layer in range(LAYERS):
        storage.k[layer]["data"][page, start : start + n] = values[layer, 0]
        storage.v[layer]["data"][page, start : start + n] = values[layer, 1]


def fill(table: PageTable, alloc: Allocation, seq: Sequence[int], upto: int) -> None:
    """Act as the generator: write K/V for positions [.., upto) of ``seq`` into the
    job's pages (copy-on-write first) and record the fills."""
    ps = table.page_size
    for logical in range(-(-upto // ps)):
        rec = table.pages[alloc.block_table[logical]]
        lo = logical * ps + rec.fill
        hi = min((logical + 1) * ps, upto)
        if hi <= lo:
            continue
        page = table.ensure_writable(alloc, logical)
        if table.storage is not None:
            all_rows = expected_rows(seq, logical, hi - logical * ps, ps)
            write_rows(table.storage, page, lo - logical * ps, all_rows[:, :, lo - logical * ps :])
        table.mark_filled(alloc, logical, seq[logical * ps : hi], hi - logical * ps)


def assert_prefix_content(table: PageTable, alloc: Allocation, seq: Sequence[int]) -> None:
    """Every row the allocation claims is present holds what was written for ``seq``."""
    ps = table.page_size
    for logical, page in enumerate(alloc.block_table):
        rows = table.pages[page].fill
        if rows == 0 or logical * ps >= len(seq):
            continue
        rows = min(rows, len(seq) - logical * ps)
        got = read_rows(table.storage, page, rows)
        want = expected_rows(seq, logical, rows, ps)
        assert torch.equal(got, want), f"job {alloc.job_id} logical page {logical} content"


def kill_after_writing(cut: int) -> None:
    """For a child process: SIGKILL it once the disk tier has written ``cut`` bytes,
    partway through a write (the torn record a crash or a power cut leaves)."""
    import os
    import signal

    import engine.cache.disk_tier as disk_tier

    real = disk_tier._write_all
    written = 0

    def cut_short(fd, data):
        nonlocal written
        if written + len(data) > cut:
            real(fd, data[: cut - written])
            os.kill(os.getpid(), signal.SIGKILL)
        written += len(data)
        real(fd, data)

    disk_tier._write_all = cut_short
