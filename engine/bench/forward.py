"""`folio bench forward`: prefill and decode speed of Folio's forward pass, side by side
with transformers on the same model in the same run. One JSON object per line.

Shared 2-core machines are noisy, so every engine is loaded first and the measurements
are interleaved round by round; each figure is the best of `--rounds`.
"""

from __future__ import annotations

import json
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.model.loader import WEIGHT_MODES, load_model
from engine.model.runner import SequenceRunner


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _prompt(vocab: int, n: int) -> torch.Tensor:
    return torch.randint(100, vocab, (1, n), generator=torch.Generator().manual_seed(0))


class _Case:
    """One engine under test: `run(prefill, decode)` returns (prefill seconds, decode seconds)."""

    def __init__(
        self, name: str, weights: str, load_seconds: float, weight_bytes: int, run: Callable
    ):
        self.name, self.weights = name, weights
        self.load_seconds, self.weight_bytes, self.run = load_seconds, weight_bytes, run
        self.prefill_s: list[float] = []
        self.decode_s: list[float] = []


def _folio_case(path: Path, mode: str, device: torch.device) -> _Case:
    t = time.perf_counter()
    loaded = load_model(path, weight_mode=mode, load_tokenizer=False, device=device)
    load_s = time.perf_counter() - t

    cache = KVCache.for_model(loaded, CacheSettings(token_budget=8192))
    graphs = decode_graphs_for(loaded, cache)

    def run(prefill_tokens: int, decode_tokens: int) -> tuple[float, float]:
        return prefill_then_decode(loaded, cache, prefill_tokens, decode_tokens, graphs)

    return _Case("folio", mode, load_s, loaded.weight_bytes, run)


def decode_graphs_for(loaded, cache: KVCache, enabled: bool = True):
    """The CUDA graphs decode steps on ``cache`` replay from (None on the CPU, or off)."""
    from engine.model.decode_graphs import DecodeGraphs

    return DecodeGraphs(loaded.model, cache) if enabled and DecodeGraphs.supports(cache) else None


def prefill_then_decode(
    loaded, cache: KVCache, prefill_tokens: int, decode_tokens: int, graphs=None
) -> tuple[float, float]:
    """Seconds to prefill a random prompt to its first token, then to decode
    ``decode_tokens`` greedily, one sequence on ``cache`` (cleared first, so the prompt
    is computed rather than found); ``graphs`` (`decode_graphs_for`): decode steps
    replayed from CUDA graphs, captured by an earlier call."""
    ids = _prompt(loaded.config.vocab_size, prefill_tokens)[0].tolist()
    cache.pages.clear()
    t0 = time.perf_counter()
    runner = SequenceRunner(loaded, cache, ids, decode_tokens + 1, graphs=graphs)
    token = int(runner.step().argmax())
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        runner.append(token)
        token = int(runner.step().argmax())
    t2 = time.perf_counter()
    runner.release()
    return t1 - t0, t2 - t1


def _transformers_case(path: Path, device: torch.device) -> _Case:
    from transformers import AutoModelForCausalLM, DynamicCache

    t = time.perf_counter()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    model.to(device).eval()
    load_s = time.perf_counter() - t

    @torch.inference_mode()
    def run(prefill_tokens: int, decode_tokens: int) -> tuple[float, float]:
        ids = _prompt(model.config.vocab_size, prefill_tokens).to(device)
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        int(token)  # waits for the device
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        int(token)
        return t1 - t0, time.perf_counter() - t1

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return _Case("transformers", "fp32", load_s, weight_bytes, run)


def run_forward_bench(args: Namespace) -> None:
    path = args.model
    device = torch.device(getattr(args, "device", "cpu"))
    # int4 is a CPU format; a GPU runs the file's blocks and, side by side, bf16 matrices
    skip = {"int4", "dequant"} if device.type != "cpu" else {"int4"} if path.is_dir() else set()
    modes = [args.weights] if getattr(args, "weights", None) else WEIGHT_MODES
    cases = [_folio_case(path, mode, device) for mode in modes if mode not in skip]
    if not args.skip_transformers:
        cases.append(_transformers_case(path, device))
    for case in cases:
        case.run(32, 2)  # warm-up: first calls allocate and pick kernels
    rounds = args.rounds or 3
    for _ in range(rounds):
        for case in cases:
            prefill_s, decode_s = case.run(args.prefill_tokens, args.decode_tokens)
            case.prefill_s.append(prefill_s)
            case.decode_s.append(decode_s)
    base = {
        "bench": "forward",
        "model": path.name,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "prefill_tokens": args.prefill_tokens,
        "decode_tokens": args.decode_tokens,
        "rounds": rounds,
    }
    records = {}
    for case in cases:
        records[case.weights] = {
            **base,
            "engine": case.name,
            "weights": case.weights,
            "load_seconds": round(case.load_seconds, 2),
            "weight_bytes": case.weight_bytes,
            "prefill_tokens_per_s": round(args.prefill_tokens / min(case.prefill_s), 1),
            "decode_tokens_per_s": round(args.decode_tokens / min(case.decode_s), 1),
        }
        _emit(records[case.weights])
    ref = records.get("fp32") if not args.skip_transformers else None
    if ref is None:
        return
    for case in cases[:-1]:
        ours = records[case.weights]
        _emit(
            {
                **base,
                "engine": "ratio",
                "weights": case.weights,
                "folio_over_transformers": {
                    "prefill": round(ours["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"], 2),
                    "decode": round(ours["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 2),
                    "load_speedup": round(ref["load_seconds"] / max(ours["load_seconds"], 1e-3), 1),
                },
            }
        )
