"""`folio bench cache`: page-table and cache-storage speed. One JSON object per line.

Measures allocation + release throughput (pages/s) on a 4096-page table, snapshot
time, eviction-order build time, defrag time, host-tier push/restore bandwidth and
KV bytes per token for fp32 and, when ``kernels.kvquant`` exists, its formats.
Each timing is the best (or median where noted) of a few repeats: 2-core machines
are noisy.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from argparse import Namespace

import torch

from engine.cache import (
    CacheFingerprint,
    HostTier,
    PagedKVStorage,
    PageTable,
    dense_allocator,
)

# SmolLM2-135M shapes (ENGINE_SPEC §9)
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _opt(args: Namespace | None, name: str, default):
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def _fill_job(table: PageTable, alloc, seq: list[int], upto: int) -> None:
    ps = table.page_size
    for logical in range(-(-upto // ps)):
        rec = table.pages[alloc.block_table[logical]]
        hi = min((logical + 1) * ps, upto)
        if rec.fill < hi - logical * ps:
            table.mark_filled(alloc, logical, seq[logical * ps : hi], hi - logical * ps)


def _bench_alloc(num_pages: int, page_size: int) -> None:
    table = PageTable(num_pages, page_size, CacheFingerprint("bench", page_size))
    job_pages = 32
    seqs = [
        [k * 100_000 + t for t in range(job_pages * page_size - 1)]
        for k in range(num_pages // job_pages)
    ]
    # cold: every context page a miss
    t0 = time.perf_counter()
    allocs = [table.allocate(k, seq, 1) for k, seq in enumerate(seqs)]
    t_alloc = time.perf_counter() - t0
    for alloc, seq in zip(allocs, seqs):
        _fill_job(table, alloc, seq, len(seq))
    t0 = time.perf_counter()
    for alloc in allocs:
        table.release(alloc)
    t_release = time.perf_counter() - t0
    # warm: every context page a prompt-cache hit
    t0 = time.perf_counter()
    allocs = [table.allocate(10_000 + k, seq, 1) for k, seq in enumerate(seqs)]
    t_hit = time.perf_counter() - t0
    hits = sum(a.hit_pages for a in allocs)
    for alloc in allocs:
        table.release(alloc)
    table.validate()
    pages = len(seqs) * job_pages
    _emit(
        {
            "bench": "cache_alloc",
            "num_pages": num_pages,
            "page_size": page_size,
            "job_pages": job_pages,
            "alloc_miss_pages_per_s": round(pages / t_alloc),
            "alloc_hit_pages_per_s": round(pages / t_hit),
            "release_pages_per_s": round(pages / t_release),
            "hit_pages": hits,
        }
    )


def _churned_table(num_pages: int, page_size: int, seed: int = 0) -> PageTable:
    """Trees of shared prefixes, released and partly evicted: a fragmented pool."""
    rng = random.Random(seed)
    table = PageTable(num_pages, page_size, CacheFingerprint("bench", page_size))
    prefixes = [[r * 1_000_000 + t for t in range(8 * page_size)] for r in range(64)]
    job_id = 0
    for _ in range(num_pages // 4):
        base = rng.choice(prefixes)
        cut = rng.randint(1, len(base))
        tail = [rng.randint(0, 50_000) for _ in range(rng.randint(1, 6 * page_size))]
        seq = base[:cut] + tail
        if not table.can_allocate(seq, 0):
            continue
        alloc = table.allocate(job_id, seq, 0)
        job_id += 1
        _fill_job(table, alloc, seq, len(seq) - 1)
        table.release(alloc)
    return table


def _bench_table_ops(num_pages: int, page_size: int, repeats: int) -> None:
    t0 = time.perf_counter()
    table = _churned_table(num_pages, page_size)
    build_s = time.perf_counter() - t0
    # some live jobs so the snapshot shows every state
    for k in range(8):
        seq = [k * 7 + t for t in range(3 * page_size)]
        table.allocate(900_000 + k, seq, page_size)
    snap_times, order_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        table.snapshot()
        snap_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        table.eviction_order()
        order_times.append(time.perf_counter() - t0)
    snap = table.snapshot()
    _emit(
        {
            "bench": "cache_snapshot",
            "num_pages": num_pages,
            "snapshot_ms_median": round(statistics.median(snap_times) * 1e3, 3),
            "snapshot_ms_best": round(min(snap_times) * 1e3, 3),
            "edges": int(snap.edges.shape[0]),
            "eviction_order_ms_median": round(statistics.median(order_times) * 1e3, 3),
            "validate_ms": round(_time(table.validate) * 1e3, 2),
            "churn_build_s": round(build_s, 2),
        }
    )
    for alloc in list(table.allocations.values()):
        table.release(alloc)
    # defrag on the churned pool: planning + record update (no storage)
    t0 = time.perf_counter()
    result = table.defrag()
    plan_s = time.perf_counter() - t0
    table.validate()
    # defrag with page copies: a small-format storage of the same page count
    table2 = _churned_table(num_pages, page_size, seed=1)
    table2.storage = PagedKVStorage(2, num_pages, page_size, dense_allocator(1, 8))
    t0 = time.perf_counter()
    result2 = table2.defrag()
    copy_s = time.perf_counter() - t0
    _emit(
        {
            "bench": "cache_defrag",
            "num_pages": num_pages,
            "moved_pages": result.moved_pages if result else 0,
            "cycles": result.cycles if result else 0,
            "defrag_ms_no_storage": round(plan_s * 1e3, 2),
            "defrag_ms_with_storage": round(copy_s * 1e3, 2),
            "storage_copies": result2.copies if result2 else 0,
            "storage_bytes_per_page": table2.storage.bytes_per_page,
        }
    )


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bench_tier(page_size: int, pages: int, repeats: int) -> None:
    device = PagedKVStorage(LAYERS, pages, page_size, dense_allocator(KV_HEADS, HEAD_DIM))
    for layer in device.k + device.v:
        layer["data"].normal_()
    tier = HostTier(pages * device.bytes_per_page, device)
    mb = device.bytes_per_page * pages / 1e6
    push_s, restore_s = [], []
    for r in range(repeats):
        tier.clear()
        t0 = time.perf_counter()
        for p in range(pages):
            tier.push(bytes([r, p]) * 8, None, [0] * page_size, device, p)
        push_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in range(pages):
            tier.restore(bytes([r, p]) * 8, device, pages - 1 - p)
        restore_s.append(time.perf_counter() - t0)
    _emit(
        {
            "bench": "cache_host_tier",
            "shape": f"{LAYERS} layers x {KV_HEADS} kv heads x {HEAD_DIM} dim, fp32",
            "page_size": page_size,
            "bytes_per_page": device.bytes_per_page,
            "pages": pages,
            "push_MB_per_s": round(mb / min(push_s)),
            "restore_MB_per_s": round(mb / min(restore_s)),
            "note": "CPU-only: device pool and host tier are both RAM",
        }
    )


def _bench_bytes_per_token(page_size: int) -> None:
    fp32 = PagedKVStorage.bytes_per_page_for(LAYERS, page_size, dense_allocator(KV_HEADS, HEAD_DIM))
    fp16 = PagedKVStorage.bytes_per_page_for(
        LAYERS, page_size, dense_allocator(KV_HEADS, HEAD_DIM, torch.float16)
    )
    record: dict = {
        "bench": "cache_kv_bytes_per_token",
        "shape": f"{LAYERS} layers x {KV_HEADS} kv heads x {HEAD_DIM} dim",
        "fp32": fp32 / page_size,
        "fp16": fp16 / page_size,
    }
    # §6 layout: b-bit codes plus one fp16 scale per group of 32 values
    values = LAYERS * KV_HEADS * HEAD_DIM * 2
    record["formula_bits"] = {str(b): values * (b / 8 + 2 / 32) for b in range(2, 9)}
    try:
        import kernels.kvquant as kvquant  # optional: another engineer's module
    except ImportError:
        record["kvquant"] = "kernels.kvquant not available"
    else:
        from engine.cache import kvformat_allocator

        measured = {}
        for bits in (8, 6, 5, 4, 3, 2):
            fmt = kvquant.KVFormat(bits=bits)
            alloc = kvformat_allocator(fmt, KV_HEADS, HEAD_DIM)
            per_page = PagedKVStorage.bytes_per_page_for(LAYERS, page_size, alloc)
            measured[str(bits)] = per_page / page_size
        record["kvquant_measured"] = measured
    _emit(record)


def run_cache_bench(args: Namespace | None = None) -> None:
    num_pages = int(_opt(args, "pages", 4096))
    page_size = int(_opt(args, "page_size", 16))
    repeats = int(_opt(args, "rounds", 20))
    tier_pages = int(_opt(args, "tier_pages", 8))
    _bench_alloc(num_pages, page_size)
    _bench_table_ops(num_pages, page_size, repeats)
    _bench_tier(256, tier_pages, 3)
    _bench_bytes_per_token(256)


if __name__ == "__main__":
    run_cache_bench()
