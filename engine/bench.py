"""`folio bench forward`: prefill and decode speed of Folio's forward pass, side by side
with transformers on the same model in the same run. One JSON object per line."""

from __future__ import annotations

import json
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

from engine.model.loader import WEIGHT_MODES, load_model
from engine.model.transformer import KVCache


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
    sys.stdout.flush()


def _prompt(vocab: int, n: int) -> torch.Tensor:
    return torch.randint(100, vocab, (1, n), generator=torch.Generator().manual_seed(0))


def _time_folio(loaded, prefill_tokens: int, decode_tokens: int) -> dict:
    ids = _prompt(loaded.config.vocab_size, prefill_tokens)
    model = loaded.model
    # Warm-up: first calls allocate and pick kernels.
    warm = KVCache(loaded.config, 1, 64)
    model.forward(ids[:, :32], warm)
    model.forward(ids[:, 32:33], warm)

    cache = KVCache(loaded.config, 1, prefill_tokens + decode_tokens + 1)
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)
    prefill_s = time.perf_counter() - t0
    token = int(logits[0].argmax())
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        token = int(model.forward(torch.tensor([[token]]), cache)[0].argmax())
    decode_s = time.perf_counter() - t1
    return {
        "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1),
        "decode_tokens_per_s": round(decode_tokens / decode_s, 1),
    }


def _time_transformers(path: Path, prefill_tokens: int, decode_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    t = time.perf_counter()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t
    ids = _prompt(model.config.vocab_size, prefill_tokens)
    with torch.inference_mode():
        model(ids[:, :32])  # warm-up
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - t1
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "load_seconds": round(load_s, 2),
        "weight_bytes": weight_bytes,
        "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1),
        "decode_tokens_per_s": round(decode_tokens / decode_s, 1),
    }


def run_forward_bench(args: Namespace) -> None:
    from engine.cli import _model_path

    path = _model_path(args.model)
    base = {"bench": "forward", "model": path.name, "threads": torch.get_num_threads(),
            "prefill_tokens": args.prefill_tokens, "decode_tokens": args.decode_tokens}
    results = {}
    for mode in WEIGHT_MODES:
        t = time.perf_counter()
        loaded = load_model(path, weight_mode=mode, load_tokenizer=False)
        load_s = time.perf_counter() - t
        if loaded.format != "gguf" and mode == "int4":
            continue
        record = {**base, "engine": "folio", "weights": mode, "load_seconds": round(load_s, 2),
                  "weight_bytes": loaded.weight_bytes, **_time_folio(loaded, args.prefill_tokens, args.decode_tokens)}
        results[mode] = record
        _emit(record)
        del loaded
    if args.skip_transformers:
        return
    ref = {**base, "engine": "transformers", "weights": "fp32", **_time_transformers(path, args.prefill_tokens, args.decode_tokens)}
    _emit(ref)
    for mode, record in results.items():
        _emit({**base, "engine": "ratio", "weights": mode, "folio_over_transformers": {
            "prefill": round(record["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"], 2),
            "decode": round(record["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 2),
            "load": round(ref["load_seconds"] / max(record["load_seconds"], 1e-3), 1),
        }})
