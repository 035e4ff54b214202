"""`folio bench restore`: time to first token after a restart, a long conversation's pages
read back from the disk tier against prefilling it again.

Three processes run the same prompt of ``--tokens`` tokens, each loading the model anew
(a restart): the first on an empty store (it prefills, and its pages are written through
at shutdown), the second with the store's files in the page cache (warm), the third after
the store's files are dropped from it (cold: ``POSIX_FADV_DONTNEED`` on each of its files
after an fsync, which drops their clean pages and nothing else: the model file stays
cached, as it would be for a user who restarts the app). Time to first token is the
job's queue time plus its prefill time (submission to the first sampled token: the disk
read happens at admission, inside the queue time); the engine's start (its cache
allocated, its kernels loaded by a one-token warm-up, `engine.model.runner.warm_up`) comes
before the submission and is reported apart (``engine_start_s``), as is the model's load
(``load_s``). Restore rate: the pages' bytes over the seconds spent reading, checking and
copying them into the pool (``JobResult.disk_seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _child(model: str, store: str, tokens: int, page_size: int, seed: int, weights: str) -> dict:
    from engine.cache.kv_cache import CacheSettings
    from engine.engine import Engine
    from engine.generator.job import JobRequest
    from engine.generator.sampler import SamplingSettings
    from engine.model.loader import load_model

    loaded = load_model(model, weight_mode=weights, batched_weights="off")
    vocab = loaded.config.vocab_size
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(tokens)]
    budget = -(-(tokens + 8) // page_size) * page_size
    settings = CacheSettings(page_size=page_size, token_budget=budget, disk_dir=store)
    request = JobRequest(
        prompt=prompt,
        max_new_tokens=1,
        sampling=SamplingSettings(temperature=0),
        stop_token_ids=(),
    )
    start = time.perf_counter()
    with Engine(loaded, settings) as engine:
        started = time.perf_counter() - start
        result = engine.submit(request).wait(timeout=3600)
        first = result.token_ids[0][0] if result.token_ids and result.token_ids[0] else None
    return {
        "ttft_s": result.time_queued + result.time_prefill,
        "cached_tokens": result.cached_tokens,
        "disk_pages": result.disk_pages,
        "disk_bytes": result.disk_bytes,
        "disk_seconds": result.disk_seconds,
        "first_token": first,
        "load_s": loaded.load_seconds,
        "engine_start_s": started,
    }


def _run_child(args: argparse.Namespace, model: Path, store: Path) -> dict:
    cmd = [sys.executable, "-m", "engine.bench.restore", "--child", str(model), str(store)]
    cmd += [str(args.tokens), str(args.page_size), str(args.seed), args.weights]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench child failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def drop_page_cache(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (not the model's)."""
    for p in [p for p in folder.rglob("*") if p.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_restore_bench(args: argparse.Namespace) -> dict:
    from engine.bench.shapes import make_shape_gguf
    from engine.model.fetch import ensure_default_model

    if args.page_size < 1:
        raise ValueError(f"--page-size must be at least 1, got {args.page_size}")
    if args.tokens < args.page_size + 1:
        raise ValueError(
            f"--tokens must be more than one page ({args.page_size}), got {args.tokens}"
        )
    if args.shape:
        model = make_shape_gguf(args.shape, args.quant)
    else:
        model = Path(args.model) if args.model is not None else ensure_default_model()
    with tempfile.TemporaryDirectory(prefix="folio-restore-bench-") as tmp:
        store = Path(tmp)
        recompute = _run_child(args, model, store)
        warm = _run_child(args, model, store)
        drop_page_cache(store)
        cold = _run_child(args, model, store)
        store_bytes = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    out = {
        "bench": "restore",
        "model": model.name,
        "tokens": args.tokens,
        "page_size": args.page_size,
        "store_bytes": store_bytes,
        "recompute": recompute,
        "warm": warm,
        "cold": cold,
        "same_first_token": recompute["first_token"] == warm["first_token"] == cold["first_token"],
    }
    for name, run in (("warm", warm), ("cold", cold)):
        out[f"speedup_{name}"] = round(recompute["ttft_s"] / run["ttft_s"], 1)
        secs = run["disk_seconds"]
        out[f"restore_gb_s_{name}"] = round(run["disk_bytes"] / secs / 1e9, 2) if secs else None
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--child":
        _, _, model, store, tokens, page_size, seed, weights = sys.argv
        result = _child(model, store, int(tokens), int(page_size), int(seed), weights)
        print(json.dumps(result), flush=True)
    else:
        sys.exit("engine.bench.restore: run `folio bench restore`")
