"""`folio bench batched` and `folio bench serve`: the generator under load.

`batched` has the shape of llama.cpp's `llama-batched-bench`: B sequences, each a
PP-token prompt (one shared prompt, or B different ones) and TG generated tokens.
T_PP is the time until every sequence has its first token (its prompt in the cache),
T_TG the rest; S_PP = prompt tokens computed / T_PP, S_TG = B*TG / T_TG, S = all
tokens / (T_PP + T_TG). Side by side, when installed: transformers' `generate` on the
same model (B=1 and a left-padded B=8 batch).

`serve` replays requests arriving over time (Poisson, seeded): groups of requests share
a long system prompt, each adds its own question. It reports time to first token and
time per output token (median, p90), throughput and the prefix hit rate, with prefix
caching on and off and with tail-first and plain-LRU eviction, plus the time to first
token of one prompt with and without its system prompt in the cache.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass

import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generator.generator import Generator, GeneratorSettings
from engine.generator.job import EventKind, JobRequest
from engine.generator.sampler import SamplingSettings
from engine.model.calibration import calibration_for
from engine.model.loader import LoadedModel, load_model
from engine.reference_text import reference_text
from kernels.bf16 import BATCHED_FROM_ROWS

GREEDY = SamplingSettings(temperature=0)
PAGE_SIZE = 256


def _text_ids(loaded: LoadedModel, count: int, offset: int = 0) -> list[int]:
    """Real English tokens (the shipped reference text), so attention sees real text."""
    ids = _text_ids_cache.get(id(loaded))
    if ids is None:
        ids = loaded.tokenizer.encode(reference_text())
        _text_ids_cache[id(loaded)] = ids
    offset %= max(len(ids) - count, 1)
    return ids[offset : offset + count]


_text_ids_cache: dict[int, list[int]] = {}


def _generator(
    loaded: LoadedModel, tokens: int, cache: CacheSettings | None = None, **settings
) -> Generator:
    pages = -(-tokens // PAGE_SIZE) + 1
    cache = cache or CacheSettings(page_size=PAGE_SIZE, token_budget=pages * PAGE_SIZE)
    kv = KVCache.for_model(loaded, cache, calibration_for(loaded, cache))
    return Generator(loaded, kv, GeneratorSettings(**settings))


def _peak_pages(gen: Generator) -> int:
    return len(gen.pages.referenced)


# -- batched -------------------------------------------------------------------------------


def _weights_label(loaded: LoadedModel) -> str:
    return f"{loaded.weight_mode}+bf16" if loaded.batched_weights_bytes else loaded.weight_mode


def batched_case(
    loaded: LoadedModel,
    pp: int,
    tg: int,
    b: int,
    shared: bool,
    cuda_graphs: bool = True,
    kv_bits: int | None = None,
) -> dict:
    """One row of the table. On a GPU with ``cuda_graphs`` the decode steps replay CUDA
    graphs, which the case's first decode step of each batch size captures (in T_TG).
    ``kv_bits``: 16 / 32 for fp16 / fp32 K/V pages (None: the cache's default)."""
    # Every prompt prefilled in the first step, as llama-batched-bench does.
    pages = b * -(-(pp + tg) // PAGE_SIZE) + 2
    cache = CacheSettings(
        page_size=PAGE_SIZE, token_budget=pages * PAGE_SIZE, k_bits=kv_bits, v_bits=kv_bits
    )
    gen = _generator(
        loaded,
        pages * PAGE_SIZE,
        cache,
        max_batch_size=b,
        max_prefill_tokens=b * pp + 1,
        cuda_graphs=cuda_graphs,
    )
    if shared:
        # llama-batched-bench's shared prompt: computed once, then B sequences decode
        # from it (parallel sampling: the prompt's pages are shared, copy-on-write).
        requests = [
            JobRequest(
                prompt=_text_ids(loaded, pp),
                sampling=GREEDY,
                max_new_tokens=tg,
                n=b,
                stop_token_ids=(),
            )
        ]
    else:
        requests = [
            JobRequest(
                prompt=_text_ids(loaded, pp, 1 + i * pp),
                sampling=GREEDY,
                max_new_tokens=tg,
                stop_token_ids=(),
            )
            for i in range(b)
        ]
    for request in requests:
        gen.submit(request)
    # T_PP is the time in prefill forwards, T_TG the time in decode forwards (one per
    # generated token: the first feeds the prompt's last token), as in llama.cpp.
    t_pp = t_tg = 0.0
    tokens = 0
    peak = 0
    t0 = time.perf_counter()
    while not gen.idle:
        events: list = []
        t = time.perf_counter()
        gen.start_pending_jobs(events)
        gen.prefill(events)
        t_pp += time.perf_counter() - t
        t = time.perf_counter()
        gen.decode(events)
        t_tg += time.perf_counter() - t
        tokens += sum(e.result.new_tokens for e in events if e.eos)
        peak = max(peak, _peak_pages(gen))
    t_end = time.perf_counter()
    assert tokens == b * tg, f"{tokens} tokens generated, expected {b * tg}"
    pp_tokens = pp if shared else b * pp
    return {
        "PP": pp,
        "TG": tg,
        "B": b,
        "shared": shared,
        "T_PP": round(t_pp, 3),
        "S_PP": round(pp_tokens / t_pp, 2),
        "T_TG": round(t_tg, 3),
        "S_TG": round(b * tg / t_tg, 2) if t_tg > 0 else None,
        "T": round(t_end - t0, 3),
        "S": round((pp_tokens + b * tg) / (t_end - t0), 2),
        "pages": peak,
        "weights": _weights_label(loaded),
        **(
            {"cuda_graphs": gen.graphs.status if gen.graphs is not None else "off"}
            if loaded.device.type == "cuda"
            else {}
        ),
    }


def transformers_case(hf_model, loaded: LoadedModel, pp: int, tg: int, b: int) -> dict:
    prompts = [_text_ids(loaded, pp, 1 + i * pp) for i in range(b)]
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False
        )
        t_pp = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=tg, min_new_tokens=tg, do_sample=False
        )
        t_all = time.perf_counter() - t0
    t_tg = max(t_all - t_pp, 1e-9)
    return {
        "engine": "transformers",
        "PP": pp,
        "TG": tg,
        "B": b,
        "T_PP": round(t_pp, 3),
        "S_PP": round(b * pp / t_pp, 2),
        "T_TG": round(t_tg, 3),
        "S_TG": round(b * tg / t_tg, 2),
    }


def run_batched_bench(args: argparse.Namespace) -> None:
    loaded = load_model(
        args.model, batched_weights=args.batched_weights, device=getattr(args, "device", "cpu")
    )
    # Side by side: batches of BATCHED_FROM_ROWS and more again without the bf16 copies
    plain = None
    if loaded.batched_weights_bytes and args.batched_weights == "auto":
        plain = load_model(loaded.path, batched_weights="off", load_tokenizer=False)
        plain.tokenizer = loaded.tokenizer
    if args.quick:
        grid = [(128, 32, b, s) for b in (1, 4, 16) for s in (False, True)]
    else:
        grid = [
            (pp, tg, b, s)
            for pp in args.pp
            for tg in args.tg
            for b in args.batch
            for s in (False, True)
        ]
    batched_case(loaded, 64, 4, 2, False)  # warm-up: kernels compiled, caches touched
    if plain is not None:
        batched_case(plain, 64, 4, BATCHED_FROM_ROWS, False)
    print(
        f"weights: {_weights_label(loaded)} ({loaded.batched_weights_bytes / 1e6:.0f} MB of bf16 copies)"
    )
    rows = []
    if not args.json:
        print(
            f"{'PP':>5} {'TG':>5} {'B':>3} {'shared':>6} {'T_PP s':>8} {'S_PP t/s':>9} {'T_TG s':>8} {'S_TG t/s':>9} {'T s':>7} {'S t/s':>8} {'pages':>6} weights"
        )
    for pp, tg, b, shared in grid:
        models = [loaded] + ([plain] if plain is not None and b >= BATCHED_FROM_ROWS else [])
        for model in models:
            row = batched_case(model, pp, tg, b, shared, getattr(args, "cuda_graphs", "on") == "on")
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{pp:>5} {tg:>5} {b:>3} {str(shared):>6} {row['T_PP']:>8.3f} {row['S_PP']:>9.1f} "
                    f"{row['T_TG']:>8.3f} {row['S_TG']:>9.1f} {row['T']:>7.3f} {row['S']:>8.1f} {row['pages']:>6} "
                    f"{row['weights']}",
                    flush=True,
                )
    _print_batched_ratios([r for r in rows if r["weights"] == _weights_label(loaded)], args.json)
    if plain is not None:
        _print_weights_ratios(rows, _weights_label(loaded), _weights_label(plain), args.json)
    if not args.quick and not args.skip_transformers:
        _compare_transformers(loaded, rows, args)


def _print_batched_ratios(rows: list[dict], as_json: bool) -> None:
    by_key = {(r["PP"], r["TG"], r["B"], r["shared"]): r for r in rows}
    for (pp, tg, b, shared), row in sorted(by_key.items()):
        one = by_key.get((pp, tg, 1, shared))
        if b == 1 or one is None or not row["S_TG"] or not one["S_TG"]:
            continue
        summary = {
            "ratio": "S_TG(B) / S_TG(1)",
            "PP": pp,
            "TG": tg,
            "B": b,
            "shared": shared,
            "value": round(row["S_TG"] / one["S_TG"], 2),
        }
        if as_json:
            print(json.dumps(summary))
        elif b == max(r["B"] for r in rows):
            print(
                f"decode scaling PP={pp} TG={tg} shared={shared}: B={b} gives {summary['value']}x the B=1 rate"
            )


def _print_weights_ratios(rows: list[dict], fast: str, plain: str, as_json: bool) -> None:
    """S_TG with the bf16 batch copies over S_TG without, case by case (same run)."""
    by_key = {(r["PP"], r["TG"], r["B"], r["shared"], r["weights"]): r for r in rows}
    for (pp, tg, b, shared, weights), row in sorted(by_key.items()):
        other = by_key.get((pp, tg, b, shared, plain))
        if weights != fast or other is None or not row["S_TG"] or not other["S_TG"]:
            continue
        value = round(row["S_TG"] / other["S_TG"], 2)
        summary = {
            "ratio": f"S_TG({fast}) / S_TG({plain})",
            "PP": pp,
            "TG": tg,
            "B": b,
            "shared": shared,
            "value": value,
        }
        if as_json:
            print(json.dumps(summary))
        else:
            print(
                f"bf16 batch copies PP={pp} TG={tg} B={b} shared={shared}: {value}x the {plain}-only decode rate"
            )


def _compare_transformers(loaded: LoadedModel, rows: list[dict], args: argparse.Namespace) -> None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers is not installed: no side-by-side figures")
        return
    path = loaded.path
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
    by_key = {
        (r["PP"], r["TG"], r["B"]): r
        for r in rows
        if not r["shared"] and r["weights"] == _weights_label(loaded)
    }
    for pp in args.pp:
        tg = min(args.tg)
        for b in (1, 8):
            ref = transformers_case(hf, loaded, pp, tg, b)
            ours = by_key.get((pp, tg, b))
            if ours is not None and ours["S_TG"]:
                ref["folio_S_TG"] = ours["S_TG"]
                ref["ratio_S_TG"] = round(ours["S_TG"] / ref["S_TG"], 2)
                ref["ratio_S_PP"] = round(ours["S_PP"] / ref["S_PP"], 2)
            print(json.dumps(ref) if args.json else f"transformers {ref}", flush=True)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp figures in this run")


# -- serve ---------------------------------------------------------------------------------


@dataclass
class _Arrival:
    at: float
    group: int
    prompt: list[int]


def _workload(loaded: LoadedModel, args: argparse.Namespace) -> list[_Arrival]:
    rng = random.Random(1234)
    systems = [
        _text_ids(loaded, args.system_tokens, 5000 + g * args.system_tokens)
        for g in range(args.groups)
    ]
    t = 0.0
    arrivals = []
    for i in range(args.requests):
        g = rng.randrange(args.groups)
        question = _text_ids(loaded, rng.randint(16, 64), 60_000 + i * 97)
        arrivals.append(_Arrival(t, g, systems[g] + question))
        t += rng.expovariate(args.rate)
    return arrivals


def serve_case(
    loaded: LoadedModel,
    arrivals: list[_Arrival],
    args: argparse.Namespace,
    caching: bool,
    eviction: str,
    host_bytes: int = 0,
    disk_dir: str | None = None,
) -> dict:
    cache = CacheSettings(
        page_size=PAGE_SIZE,
        token_budget=args.cache_tokens,
        eviction=eviction,
        host_bytes=host_bytes,
        disk_dir=disk_dir,
    )
    gen = _generator(loaded, args.cache_tokens, cache, prefix_caching=caching, max_batch_size=16)
    pending = list(arrivals)
    arrived: dict[int, float] = {}
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    new_tokens: dict[int, int] = {}
    t0 = time.perf_counter()
    while pending or not gen.idle:
        now = time.perf_counter() - t0
        while pending and pending[0].at <= now:
            req = pending.pop(0)
            job = gen.submit(
                JobRequest(
                    prompt=req.prompt,
                    sampling=GREEDY,
                    max_new_tokens=args.new_tokens,
                    stop_token_ids=(),
                )
            )
            arrived[job.job_id] = req.at
        if gen.idle:
            time.sleep(max(0.0, pending[0].at - now))
            continue
        for e in gen.iterate():
            now = time.perf_counter() - t0
            if e.kind is EventKind.STREAMING and e.job_id not in first:
                first[e.job_id] = now
            if e.eos:
                done[e.job_id] = now
                new_tokens[e.job_id] = e.result.new_tokens
    makespan = time.perf_counter() - t0
    gen.cache.close()  # the disk tier's writer, when there is one
    ttft = [first[j] - arrived[j] for j in arrived]
    tpot = [(done[j] - first[j]) / max(new_tokens[j] - 1, 1) for j in arrived]
    counters = gen.pages.counters
    return {
        "caching": caching,
        "eviction": eviction,
        "requests": len(arrivals),
        "ttft_median": round(statistics.median(ttft), 3),
        "ttft_p90": round(_quantile(ttft, 0.9), 3),
        "tpot_median": round(statistics.median(tpot), 4),
        "tpot_p90": round(_quantile(tpot, 0.9), 4),
        "makespan": round(makespan, 2),
        "requests_per_s": round(len(arrivals) / makespan, 3),
        "output_tokens_per_s": round(sum(new_tokens.values()) / makespan, 2),
        "prefix_hit_rate": round(
            counters.prefix_hit_tokens / max(counters.prefix_query_tokens, 1), 3
        ),
        "evictions": counters.evictions,
        "host_mb": host_bytes // 2**20,
        "disk": disk_dir is not None,
        "tier_restores": counters.tier_restores,
        "disk_restores": counters.disk_restores,
    }


def _serve_tiers(loaded: LoadedModel, arrivals: list[_Arrival], args: argparse.Namespace) -> None:
    """The same workload with a host tier of ``--host-mb``, then with a disk tier behind
    it (a fresh store): prompt groups that fit neither the pool nor the host tier are
    prefilled again without the disk and read back with it."""
    import tempfile

    host = args.host_mb * 2**20
    rows = [serve_case(loaded, arrivals, args, True, "tail_first", host)]
    with tempfile.TemporaryDirectory(prefix="folio-serve-disk-") as store:
        rows.append(serve_case(loaded, arrivals, args, True, "tail_first", host, store))
    for row in rows:
        print(json.dumps(row) if args.json else f"serve {row}", flush=True)
    without, with_disk = rows
    summary = {
        "hit_rate_host_vs_host_disk": [without["prefix_hit_rate"], with_disk["prefix_hit_rate"]],
        "ttft_median_host_vs_host_disk": [without["ttft_median"], with_disk["ttft_median"]],
        "throughput_host_disk_vs_host": round(
            with_disk["output_tokens_per_s"] / without["output_tokens_per_s"], 2
        ),
    }
    print(json.dumps(summary) if args.json else f"tiers {summary}", flush=True)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ttft_cached_prefix(loaded: LoadedModel, system_tokens: int) -> dict:
    """One prompt's time to first token with its system prompt computed vs found in the cache."""
    system = _text_ids(loaded, system_tokens, 20_000)
    gen = _generator(loaded, 4 * (system_tokens + 128))

    def ttft(question_offset: int) -> tuple[float, int]:
        prompt = system + _text_ids(loaded, 32, question_offset)
        job = gen.submit(
            JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=1, stop_token_ids=())
        )
        t0 = time.perf_counter()
        while not gen.idle:
            gen.iterate()
        return time.perf_counter() - t0, job.job_id

    cold, _ = ttft(90_000)
    warm, _ = ttft(91_000)
    return {
        "system_tokens": system_tokens,
        "ttft_uncached": round(cold, 4),
        "ttft_cached": round(warm, 4),
        "ratio": round(cold / warm, 1),
    }


def run_serve_bench(args: argparse.Namespace) -> None:
    loaded = load_model(args.model)
    batched_case(loaded, 64, 4, 2, False)  # warm-up
    arrivals = _workload(loaded, args)
    if args.tiers:
        _serve_tiers(loaded, arrivals, args)
        return
    results = []
    for caching, eviction in ((True, "tail_first"), (False, "tail_first"), (True, "lru")):
        row = serve_case(loaded, arrivals, args, caching, eviction)
        results.append(row)
        print(json.dumps(row) if args.json else f"serve {row}", flush=True)
    on, off, lru = results
    summary = {
        "throughput_caching_on_vs_off": round(
            on["output_tokens_per_s"] / off["output_tokens_per_s"], 2
        ),
        "ttft_median_off_vs_on": round(off["ttft_median"] / on["ttft_median"], 2),
        "throughput_tail_first_vs_lru": round(
            on["output_tokens_per_s"] / lru["output_tokens_per_s"], 2
        ),
        "hit_rate_tail_first_vs_lru": [on["prefix_hit_rate"], lru["prefix_hit_rate"]],
    }
    print(json.dumps(summary) if args.json else f"ratios {summary}", flush=True)
    ttft = ttft_cached_prefix(loaded, args.system_tokens)
    print(
        json.dumps(ttft)
        if args.json
        else f"time to first token, {args.system_tokens}-token prefix: {ttft}",
        flush=True,
    )
