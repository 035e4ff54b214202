"""`folio bench cache`: page-table and cache-storage speed. One JSON object per line.

Measures allocation + release throughput (pages/s) on a 4096-page table, snapshot
time, eviction-order build time, defrag time, host-tier push/restore bandwidth and
KV bytes per token for fp32, fp16 and the quantized formats the engine uses,
and the prefix-cache hit rate of the two eviction orders (§4: tail first vs. plain LRU)
on the same multi-turn chat workload.
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

# SmolLM2-135M shapes (docs/ENGINE.md §9)
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
    # the engine's quantized layout (engine/cache/formats.py kv_formats): b-bit codes plus
    # an fp16 step and an fp16 minimum per group of 32 values
    values = LAYERS * KV_HEADS * HEAD_DIM * 2
    record["formula_bits"] = {str(b): values * (b / 8 + 4 / 32) for b in range(2, 9)}
    from engine.cache import kvformat_allocator
    from engine.cache.formats import kv_formats

    measured = {}
    for bits in (8, 6, 5, 4, 3, 2):
        fmt_k, fmt_v = kv_formats(bits, bits)
        k_alloc = kvformat_allocator(fmt_k, KV_HEADS, HEAD_DIM)
        v_alloc = kvformat_allocator(fmt_v, KV_HEADS, HEAD_DIM)
        per_page = PagedKVStorage.bytes_per_page_for(LAYERS, page_size, k_alloc, v_alloc)
        measured[str(bits)] = per_page / page_size
    record["kvquant_measured"] = measured
    _emit(record)


# -- eviction order: what tail first buys over plain LRU (docs/ENGINE.md §4) -------------

VOCAB = 49_152  # SmolLM2's vocabulary: the token ids are random, only equality matters


def _eviction_workload(
    cache_tokens: int, chats: int, steps: int, seed: int, oneoff_share: float = 0.25
) -> list[tuple[str, list[int], list[int]]]:
    """A deterministic stream of (kind, prompt, reply) requests.

    ``chats`` conversations run side by side, picked at random each step; they share
    a system prompt. A turn's prompt is the whole history (system prompt and every
    earlier user message and reply) plus a new user message, so consecutive turns of
    one chat share the history as a prefix. A conversation whose next turn would pass
    half the cache ends and a new one starts in its slot. With probability
    ``oneoff_share`` a step is instead a one-off prompt of random tokens (1/8 to 1/3
    of the cache) that nothing ever reuses: it flushes pages out of the cache.
    Lengths scale with the cache size so small caches are under the same pressure.
    """
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(max(1, cache_tokens // 64))]
    histories = [list(system) for _ in range(chats)]
    limit = cache_tokens // 2
    out: list[tuple[str, list[int], list[int]]] = []
    for _ in range(steps):
        if rng.random() < oneoff_share:
            n = rng.randint(cache_tokens // 8, cache_tokens // 3)
            prompt = [rng.randrange(VOCAB) for _ in range(n)]
            reply = [rng.randrange(VOCAB) for _ in range(rng.randint(1, cache_tokens // 64))]
            out.append(("oneoff", prompt, reply))
            continue
        k = rng.randrange(chats)
        user = [
            rng.randrange(VOCAB)
            for _ in range(rng.randint(cache_tokens // 256 or 1, cache_tokens // 32))
        ]
        reply = [
            rng.randrange(VOCAB)
            for _ in range(rng.randint(cache_tokens // 128 or 1, cache_tokens // 16))
        ]
        if len(histories[k]) + len(user) + len(reply) > limit:
            histories[k] = list(system)  # that conversation is over: a new one starts
        prompt = histories[k] + user
        out.append(("chat", prompt, reply))
        histories[k] = prompt + reply
    return out


def _replay_eviction(
    workload: list[tuple[str, list[int], list[int]]],
    num_pages: int,
    page_size: int,
    policy: str,
) -> dict:
    """Serve ``workload`` one request at a time on a table with no storage, as the
    generator would: allocate (prompt, room for the reply), write K/V for every token
    from the cached prefix on (prompt, then the reply but its last token), release.
    Prefilled tokens are the prompt tokens past the cached prefix (what
    ``SequenceRunner`` runs through the model)."""
    table = PageTable(num_pages, page_size, CacheFingerprint("bench", page_size), eviction=policy)
    prefilled = chat_query = chat_hit = chat_turns = oneoffs = 0
    for job_id, (kind, prompt, reply) in enumerate(workload):
        alloc = table.allocate(job_id, prompt, len(reply))
        prefilled += len(prompt) - alloc.cached_tokens
        if kind == "chat":
            chat_turns += 1
            chat_query += len(prompt) - 1
            chat_hit += alloc.cached_tokens
        else:
            oneoffs += 1
        seq = prompt + reply
        _fill_job(table, alloc, seq, len(seq) - 1)
        table.release(alloc)
    table.validate()
    c = table.counters
    return {
        "bench": "cache_eviction",
        "policy": policy,
        "num_pages": num_pages,
        "page_size": page_size,
        "chat_turns": chat_turns,
        "oneoff_prompts": oneoffs,
        "prefix_query_tokens": c.prefix_query_tokens,
        "prefix_hit_tokens": c.prefix_hit_tokens,
        "hit_rate": round(c.prefix_hit_tokens / max(1, c.prefix_query_tokens), 4),
        "chat_hit_rate": round(chat_hit / max(1, chat_query), 4),
        "evicted_pages": c.evictions,
        "prefilled_tokens": prefilled,
    }


def _bench_eviction_policies(
    num_pages: int = 256,
    page_size: int = 16,
    chats: int = 6,
    steps: int = 240,
    seed: int = 1234,
) -> dict[str, dict]:
    """Replay one chat workload under tail first and under plain LRU; one JSON line
    per policy and one with the ratios. Returns the per-policy records."""
    workload = _eviction_workload(num_pages * page_size, chats, steps, seed)
    results = {}
    for policy in ("tail_first", "lru"):
        t0 = time.perf_counter()
        rec = _replay_eviction(workload, num_pages, page_size, policy)
        rec.update(chats=chats, steps=steps, seed=seed)
        rec["replay_s"] = round(time.perf_counter() - t0, 3)
        results[policy] = rec
        _emit(rec)
    tf, lru = results["tail_first"], results["lru"]
    _emit(
        {
            "bench": "cache_eviction_ratio",
            "hit_tokens_tail_first_over_lru": (
                round(tf["prefix_hit_tokens"] / lru["prefix_hit_tokens"], 3)
                if lru["prefix_hit_tokens"]
                else None
            ),
            "prefilled_tokens_lru_over_tail_first": (
                round(lru["prefilled_tokens"] / tf["prefilled_tokens"], 3)
                if tf["prefilled_tokens"]
                else None
            ),
            "evicted_pages_lru_over_tail_first": (
                round(lru["evicted_pages"] / tf["evicted_pages"], 3)
                if tf["evicted_pages"]
                else None
            ),
        }
    )
    return results


def run_cache_bench(args: Namespace | None = None) -> None:
    num_pages = int(_opt(args, "pages", 4096))
    page_size = int(_opt(args, "page_size", 16))
    repeats = int(_opt(args, "rounds", 20))
    tier_pages = int(_opt(args, "tier_pages", 8))
    _bench_alloc(num_pages, page_size)
    _bench_table_ops(num_pages, page_size, repeats)
    _bench_tier(256, tier_pages, 3)
    _bench_bytes_per_token(256)
    # a cache of 4096 tokens (256 pages of 16) under pressure, whatever the page size
    _bench_eviction_policies(max(1, 4096 // page_size), page_size)


if __name__ == "__main__":
    run_cache_bench()
