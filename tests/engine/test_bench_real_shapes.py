"""`folio bench forward --shape`: the figures it prints come from the run, and its
bytes-per-token arithmetic is the file's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.bench import real_shapes, shapes
from engine.model.gguf_file import GGUFFile


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_decode_bytes_count_the_head_once(name, tmp_path, smollm2_path):
    """Every matrix is read once per decode token; the embedding table only when it is
    also the head (tied), and then once."""
    path = shapes.make_shape_gguf(name, "q4_k_m", tmp_path, vocab_source=smollm2_path)
    tensors = GGUFFile(path).tensors
    matrices = sum(t.nbytes for t in tensors.values() if len(t.shape) == 2)
    embedding = tensors["token_embd.weight"].nbytes
    tied = "output.weight" not in tensors
    assert tied == shapes.SHAPES[name].tied
    assert real_shapes.decode_bytes(path) == (matrices if tied else matrices - embedding)


def test_shape_bench_prints_figures_of_the_run(tmp_path, smollm2_path):
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    folder = tmp_path / "folio" / "bench-shapes"  # engine.paths.cache_dir() under that env
    path = shapes.make_shape_gguf("tiny-llama", "q8_0", folder, vocab_source=smollm2_path)
    out = subprocess.run(
        [sys.executable, "-m", "folio", "bench", "forward", "--shape", "tiny-llama", "--quant", "q8_0",
         "--tg", "4", "--batch", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=600, env=env, check=True,
    ).stdout  # fmt: skip
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    mix, folio = records[0], records[1]
    assert mix["mix"]["tensors"]["Q8_0"] > 0
    assert folio["engine"] == "folio" and folio["weights"] == "native"
    assert sorted(p.name for p in folder.iterdir()) == [path.name]
    assert folio["file_bytes"] == path.stat().st_size
    per_token = real_shapes.decode_bytes(path)
    assert folio["decode_gb_s"] == pytest.approx(per_token * folio["decode_tok_s"] / 1e9, abs=0.01)
    assert 0 < folio["weight_bytes"] <= 1.05 * path.stat().st_size
    assert folio["prefill_tok_s"] > 0 and folio["s_tg"]["2"] > 0
    assert folio["warm_up_s"] > 0 and folio["first_token_s"] > 0
    assert folio["peak_rss_bytes"] > folio["weight_bytes"]
    # where the peak went: the file's pages, the cache's, and the rest
    assert 0 < folio["rss_loaded_bytes"] <= folio["peak_rss_bytes"]
    assert folio["kv_cache_bytes"] > 0
    assert folio["peak_over_file_and_kv_bytes"] == (
        folio["peak_rss_bytes"] - folio["file_bytes"] - folio["kv_cache_bytes"]
    )


def test_forward_bench_runs_only_the_weight_mode_asked_for(tmp_path, smollm2_path, capsys):
    """Without --shape, --weights picks one weight mode (else every mode is measured)."""
    from argparse import Namespace

    from engine.bench.forward import run_forward_bench

    path = shapes.make_shape_gguf("tiny-llama", "q8_0", tmp_path, vocab_source=smollm2_path)
    args = Namespace(
        model=path, weights="dequant", skip_transformers=True, rounds=1, prefill_tokens=4,
        decode_tokens=2, device="cpu",
    )  # fmt: skip
    run_forward_bench(args)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["engine"], r["weights"]) for r in records] == [("folio", "dequant")]
    assert records[0]["decode_tokens_per_s"] > 0


def test_best_of_rounds_takes_each_figures_best_round():
    """Speeds and times: each one's best round; memory: its largest round, the peak and
    what it is over the file and the cache from the same round."""
    rounds = [
        {"engine": "folio", "prefill_tok_s": 100.0, "decode_tok_s": 40.0, "load_s": 0.5,
         "first_token_s": 0.3, "peak_rss_bytes": 1500, "peak_over_file_and_kv_bytes": 500,
         "s_tg": {"4": 90.0, "16": 110.0}},
        {"engine": "folio", "prefill_tok_s": 120.0, "decode_tok_s": 35.0, "load_s": 0.4,
         "first_token_s": 0.35, "peak_rss_bytes": 1600, "peak_over_file_and_kv_bytes": 600,
         "s_tg": {"4": 80.0, "16": 115.0}},
    ]  # fmt: skip
    best = real_shapes.best_of(rounds)
    assert (best["prefill_tok_s"], best["decode_tok_s"]) == (120.0, 40.0)
    assert (best["load_s"], best["first_token_s"]) == (0.4, 0.3)
    assert (best["peak_rss_bytes"], best["peak_over_file_and_kv_bytes"]) == (1600, 600)
    assert best["s_tg"] == {"4": 90.0, "16": 115.0} and best["rounds"] == 2
    assert rounds[0]["decode_tok_s"] == 40.0 and rounds[1]["s_tg"]["16"] == 115.0  # untouched
