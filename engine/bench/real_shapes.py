"""`folio bench forward --shape NAME --quant Q`: Folio at the sizes users run, side by side
with llama.cpp on the same file (issue 14); `--model FILE.gguf --llama-cpp DIR`: the same
figures on a model file as downloaded.

The model is a random-weight GGUF with the exact shapes and tensor types llama.cpp's
quantizer writes for that model (engine/bench/shapes.py; speed and memory depend on
shapes and types, not on trained values). Each engine runs in its own process so that
its peak RSS is its own. Figures, one JSON object each:

* ``load_s`` (page cache warm: the file is read once before; weights repacked for this
  CPU's kernels mapped from the tile file an earlier load wrote, as in every load but a
  model's first: engine/model/tile_cache.py), ``load_repacking_s`` (a first load, the tile
  cache off), ``peak_rss_bytes`` (the
  process, with the model and a 4,096-token cache, through prefill and decode), and where
  it went: ``rss_loaded_bytes`` (after loading, tokenizer included), ``kv_cache_bytes``,
  and ``peak_over_file_and_kv_bytes`` (the peak less the file and the cache: Python,
  torch, numba, the kernels, the tokenizer and the activations);
* ``warm_up_s``: the engine's start after loading (`engine.model.runner.warm_up`: one
  token on a scratch page, which loads numba's typing context and the kernels from
  numba's cache, as in a user's second start: a child before the measured one compiles
  what the model needs, once per machine and version);
* ``first_token_s``: then a 32-token prompt to its first token (a user's first message);
* ``prefill_tok_s`` (512 tokens), ``decode_tok_s`` (batch 1, 32 tokens after the prompt:
  llama.cpp's with ``llama-bench -d 512``, the same context), ``s_tg`` at B=4 and B=16
  (llama-batched-bench's PP/TG/B table, different prompts);
* ``decode_gb_s``: the weight bytes one decode token reads (every matrix but the
  embedding table, which is only looked up) times tokens per second, beside ``bound_gb_s``,
  this machine's read bandwidth (``torch.sum`` over 1 GiB of float32, the threads of the run).

With ``--llama-cpp DIR`` (a folder holding ``llama-bench`` and ``llama-batched-bench``)
the same figures from llama.cpp (prefill and decode its fastest of two repetitions, as
Folio's are its faster of two runs), then the ratios Folio / llama.cpp. ``--rounds N``
runs the two engines in turns N times and adds each engine's best round
(:func:`best_of`): the host's speed swings by tens of percent within minutes, and a
slow minute then hits one round rather than one engine. Memory figures take the largest
round instead.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

from engine.model.weight_modes import DEFAULT_WEIGHT_MODE
from engine.units import peak_rss_bytes

PROMPT_TOKENS = 512
DECODE_TOKENS = 32  # decoded after the prompt, both engines
FIRST_TOKEN_PROMPT = 32


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def decode_bytes(path: Path) -> int:
    """Weight bytes one decode token reads: every 2-D tensor but the embedding table
    (looked up by row), which is read whole only when it is also the output head."""
    from engine.model.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    tied = "output.weight" not in tensors
    return sum(
        t.nbytes
        for t in tensors.values()
        if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied)
    )


def _warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _folio_figures(
    path: str,
    weights: str,
    threads: int,
    tg: int,
    batches: tuple[int, ...],
    device: str = "cpu",
    prompt_tokens: int = PROMPT_TOKENS,
    kv_bits: int | None = None,
) -> dict:
    """In a child process: load, first token, prefill, decode, S_TG; its own peak RSS
    (and on a GPU the allocator's peak). ``kv_bits``: 16 / 32 for fp16 / fp32 K/V pages
    (None: the cache's default)."""
    torch.set_num_threads(threads)
    from engine.bench.batched import batched_case
    from engine.bench.forward import decode_graphs_for, prefill_then_decode
    from engine.cache.kv_cache import CacheSettings, KVCache
    from engine.model.loader import load_model
    from engine.model.runner import warm_up
    from engine.units import rss_bytes

    t = time.perf_counter()
    loaded = load_model(path, weight_mode=weights, device=device)
    load_s = time.perf_counter() - t
    rss_loaded = rss_bytes()
    tokens = max(4096, prompt_tokens + 256)
    settings = CacheSettings(page_size=256, token_budget=tokens, k_bits=kv_bits, v_bits=kv_bits)
    t = time.perf_counter()
    warm_up(loaded, settings)
    warm_up_s = time.perf_counter() - t
    cache = KVCache.for_model(loaded, settings)
    graphs = decode_graphs_for(loaded, cache)  # captured by the first run, not timed again

    def run(prompt: int, decode: int) -> tuple[float, float]:
        return prefill_then_decode(loaded, cache, prompt, decode, graphs)

    first_token_s, _ = run(FIRST_TOKEN_PROMPT, 0)
    prefill_s, decode_s = run(prompt_tokens, DECODE_TOKENS)
    prefill_s2, decode_s2 = run(prompt_tokens, DECODE_TOKENS)
    # the model and its 4,096-token cache, through prefill and decode (the S_TG cases
    # below build caches of their own)
    peak_rss = peak_rss_bytes()
    s_tg = {}
    for b in batches:
        row = batched_case(loaded, 128, tg, b, False, kv_bits=kv_bits)
        s_tg[str(b)] = row["S_TG"]
    gpu = {}
    if loaded.device.type == "cuda":
        gpu = {
            "device": torch.cuda.get_device_name(loaded.device),
            "device_peak_bytes": torch.cuda.max_memory_allocated(loaded.device),
        }
    return {
        "engine": "folio",
        **gpu,
        "weights": loaded.weight_mode,
        "load_s": round(load_s, 2),
        **({"tiles": loaded.tile_cache.status} if loaded.tile_cache is not None else {}),
        "weight_bytes": loaded.weight_bytes,
        "warm_up_s": round(warm_up_s, 3),
        "first_token_s": round(first_token_s, 3),
        "prefill_tok_s": round(prompt_tokens / min(prefill_s, prefill_s2), 1),
        "decode_tok_s": round(DECODE_TOKENS / min(decode_s, decode_s2), 2),
        "s_tg": s_tg,
        "peak_rss_bytes": peak_rss,
        "rss_loaded_bytes": rss_loaded,
        "kv_cache_bytes": cache.nbytes(),
        "peak_over_file_and_kv_bytes": peak_rss - Path(path).stat().st_size - cache.nbytes(),
    }


def _compile_kernels(path: str, weights: str, device: str) -> None:
    """In a child process: every kernel a prompt, a prefill, decoding and batched
    decoding take on this model, compiled into numba's on-disk cache if it is not there yet (nothing on a GPU)."""
    if device != "cpu":
        return
    from engine.bench.forward import prefill_then_decode
    from engine.cache.kv_cache import CacheSettings, KVCache
    from engine.model.loader import load_model
    from kernels.quant import DECODE_MAX_ROWS

    loaded = load_model(path, weight_mode=weights)  # the batched cases' prompts need its tokenizer
    cache = KVCache.for_model(loaded, CacheSettings(page_size=256, token_budget=512))
    prefill_then_decode(loaded, cache, FIRST_TOKEN_PROMPT, 2)
    prefill_then_decode(loaded, cache, DECODE_MAX_ROWS + 8, 2)
    # batched decode steps take signatures of their own (a few tokens, and more than
    # FEW_TOKENS): compiled here, not inside the measured S_TG cases
    from engine.bench.batched import batched_case

    for batch in (4, 16):
        batched_case(loaded, 16, 2, batch, False)
    if loaded.tile_cache is not None:
        loaded.tile_cache.wait()  # the measured load maps what this one repacked


def _repacking_load_s(path: str, weights: str, device: str) -> float | None:
    """In a child process: a first load's seconds, repacking weights for this CPU's
    kernels (the tile cache off); None where nothing is repacked."""
    import os

    os.environ["FOLIO_TILES_BUDGET_GB"] = "0"
    from engine.model.loader import load_model

    t = time.perf_counter()
    loaded = load_model(path, weight_mode=weights, device=device)
    seconds = time.perf_counter() - t
    return seconds if loaded.tile_cache is not None else None


# figures where more is better; the times, best least; the memory, the largest round
# (a ceiling the user's machine must hold, not a speed the host lends for a minute)
_FASTER = ("prefill_tok_s", "decode_tok_s", "decode_gb_s")
_SOONER = ("load_s", "warm_up_s", "first_token_s")
_LARGEST = ("peak_rss_bytes", "rss_loaded_bytes", "peak_over_file_and_kv_bytes")


def best_of(records: list[dict]) -> dict:
    """One engine's rounds as one record: each speed's and time's best round (``s_tg``
    per batch size), each memory figure's largest, the rest as the first round has
    them."""
    best = dict(records[0])
    for key in _FASTER:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            best[key] = max(values)
    for key in _SOONER:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            best[key] = min(values)
    for key in _LARGEST:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            best[key] = max(values)
    best["s_tg"] = {
        b: max(r["s_tg"][b] for r in records if b in r.get("s_tg", {}))
        for b in records[0].get("s_tg", {})
    }
    best["rounds"] = len(records)
    return best


def _in_child(fn, *args):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def _llama_cpp_figures(
    folder: Path, path: Path, threads: int, tg: int, batches: tuple[int, ...], prompt: int
) -> dict:
    """llama.cpp's figures for the same file: prefill of ``prompt`` tokens, and decode of
    32 tokens after ``prompt`` tokens (``-d``), as Folio's decode is measured after its
    prompt: llama-bench's decode test otherwise starts on an empty context, where each
    token's attention reads nothing."""
    from engine.bench.llama_cpp import run_batched_bench, run_llama_bench

    t = time.perf_counter()
    pp = run_llama_bench(folder, path, threads, n_prompt=prompt, n_gen=0, repetitions=2)
    tg_report = run_llama_bench(
        folder, path, threads, n_prompt=0, n_gen=DECODE_TOKENS, repetitions=2, depth=prompt
    )
    batched = run_batched_bench(folder, path, threads, npp=128, ntg=tg, npl=batches)
    rows = batched.by_batch()
    peaks = [r.peak_rss_bytes for r in (pp, tg_report) if r.peak_rss_bytes is not None]
    return {
        "engine": "llama.cpp",
        "model_type": pp.model_type,
        "prefill_tok_s": round(_fastest(pp.prompt), 1) if pp.prompt else None,
        "decode_tok_s": round(_fastest(tg_report.decode), 2) if tg_report.decode else None,
        "decode_depth": prompt,
        "s_tg": {str(b): round(rows[b].s_tg, 2) for b in batches if b in rows},
        "peak_rss_bytes": max(peaks) if peaks else None,
        "wall_s": round(time.perf_counter() - t, 1),
    }


def _fastest(rate) -> float:
    """llama-bench's fastest repetition (Folio's figures are its best of two runs too),
    its average where it gave no samples."""
    return max(rate.samples) if rate.samples else rate.avg


def run_shape_bench(args: Namespace) -> None:
    """`folio bench forward --shape NAME --quant Q [--llama-cpp DIR]`: the figures on a
    random-weight GGUF with that model's shapes and types (written once, cached)."""
    from engine.bench.shapes import make_shape_gguf, mix_report

    _check_llama_cpp(args)

    def progress(fraction: float, what: str) -> None:
        print(
            f"\r  writing {args.shape} {args.quant}: {fraction:.0%} {what}"[:100],
            end="",
            file=sys.stderr,
        )

    path = make_shape_gguf(args.shape, args.quant, progress=progress)
    print(file=sys.stderr)
    named = {"shape": args.shape, "quant": args.quant}
    _side_by_side(args, path, named, mix_report(args.shape, args.quant))


def run_file_bench(args: Namespace) -> None:
    """`folio bench forward --model FILE.gguf --llama-cpp DIR`: the same figures, side by
    side with llama.cpp, on a model file as downloaded (SmolLM2's, Gemma 3's, a user's)."""
    path = Path(args.model)
    if path.is_dir() or path.suffix.lower() != ".gguf":
        raise ValueError(
            f"{path.name} is not a GGUF file: llama.cpp reads GGUF only, so --llama-cpp "
            "needs --model FILE.gguf or --shape NAME"
        )
    _check_llama_cpp(args)
    _side_by_side(args, path, {"model": path.name}, file_mix(path))


def file_mix(path: Path) -> dict:
    """The file's tensors by type: counts, bytes, parameters (as `mix_report` for a shape)."""
    from engine.bench.shapes import type_totals
    from engine.model.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors.values()
    return {"model": path.name, **type_totals((t.type_name, t.nbytes, t.shape) for t in tensors)}


def _check_llama_cpp(args: Namespace) -> None:
    """A --llama-cpp folder without the two tools fails now, not after Folio's half."""
    from engine.bench.llama_cpp import LlamaCppError, find_tools

    if getattr(args, "llama_cpp", None):
        try:
            find_tools(args.llama_cpp)
        except LlamaCppError as exc:
            raise ValueError(
                f"{exc}; build them as the README's 'At real model sizes' says"
            ) from None


def _side_by_side(args: Namespace, path: Path, named: dict, mix: dict) -> None:
    from engine.bench.llama_cpp import LlamaCppError
    from engine.cache.formats import width_name
    from kernels.quant.bench import read_bandwidth

    threads = args.threads or torch.get_num_threads()
    batches = tuple(args.batch)
    device = str(getattr(args, "device", "cpu"))
    prompt = getattr(args, "prompt_tokens", None) or PROMPT_TOKENS
    kv_bits = getattr(args, "kv_bits", None)
    base = {"bench": "forward", **named, "file_bytes": path.stat().st_size,
            "threads": threads, "device": device, "prompt_tokens": prompt, "tg": args.tg,
            "kv": width_name(kv_bits)}  # fmt: skip
    _emit({**base, "mix": mix})
    _warm_page_cache(path)
    torch.set_num_threads(threads)
    bound = read_bandwidth(device=device)
    per_token = decode_bytes(path)
    weights = getattr(args, "weights", None) or DEFAULT_WEIGHT_MODE
    _in_child(_compile_kernels, str(path), weights, device)
    repacking = _in_child(_repacking_load_s, str(path), weights, device)
    rounds = max(1, int(getattr(args, "rounds", 1) or 1))
    folios, llamas = [], []
    for r in range(rounds):  # in turns: a slow minute of the host hits one round, not an engine
        numbered = {"round": r + 1} if rounds > 1 else {}
        folio = _in_child(
            _folio_figures, str(path), weights, threads, args.tg, batches, device, prompt, kv_bits
        )
        if repacking is not None:
            folio["load_repacking_s"] = round(repacking, 2)
        folio["decode_gb_s"] = round(per_token * folio["decode_tok_s"] / 1e9, 2)
        folio["bound_gb_s"] = round(bound / 1e9, 2)
        folio["decode_bound_tok_s"] = round(bound / per_token, 2)
        folios.append(folio)
        _emit({**base, **numbered, **folio})
        if not args.llama_cpp:
            continue
        try:
            llama = _llama_cpp_figures(
                Path(args.llama_cpp), path, threads, args.tg, batches, prompt
            )
        except LlamaCppError as exc:  # Folio's figures are out; say what llama.cpp did
            raise ValueError(f"llama.cpp on {path.name}: {exc}") from None
        if llama["decode_tok_s"]:
            llama["decode_gb_s"] = round(per_token * llama["decode_tok_s"] / 1e9, 2)
        llamas.append(llama)
        _emit({**base, **numbered, **llama})
    if rounds > 1:
        folio = best_of(folios)
        _emit({**base, "round": "best", **folio})
        if llamas:
            llama = best_of(llamas)
            _emit({**base, "round": "best", **llama})
    if not args.llama_cpp:
        return
    record = {**base, "engine": "ratio", "folio_over_llama_cpp": speed_ratios(folio, llama)}
    if len(llamas) > 1:  # each round's pair too: the host's slow minutes hit pairs alike
        record["paired"] = paired_ratios(folios, llamas)
    _emit(record)


def speed_ratios(folio: dict, llama: dict) -> dict:
    """Folio's figures over llama.cpp's (two decimals; None where either is missing)."""

    def ratio(a, b):
        return round(a / b, 2) if a and b else None

    return {
        "prefill": ratio(folio["prefill_tok_s"], llama["prefill_tok_s"]),
        "decode": ratio(folio["decode_tok_s"], llama["decode_tok_s"]),
        **{f"s_tg_B{b}": ratio(folio["s_tg"].get(b), llama["s_tg"].get(b)) for b in folio["s_tg"]},
        "peak_rss": ratio(folio["peak_rss_bytes"], llama["peak_rss_bytes"]),
    }


def paired_ratios(folios: list[dict], llamas: list[dict]) -> dict:
    """Round by round, Folio's figures over llama.cpp's of the same round: each figure's
    ratios in round order (``rounds``) and their median (``median``; the mean of the
    middle two for an even count). On a shared host whose read bandwidth moves by a third
    from one minute to the next, the best of each engine's rounds may come from different
    minutes; a pair ran minutes apart at most."""
    per = [speed_ratios(f, ll) for f, ll in zip(folios, llamas, strict=True)]
    rounds = {key: [p[key] for p in per] for key in per[0]}
    median = {}
    for key, values in rounds.items():
        known = [v for v in values if v is not None]
        median[key] = round(statistics.median(known), 3) if known else None
    return {"median": median, "rounds": rounds}
