"""`folio bench restore`: three processes on one prompt; the second and third find every
page of the first on disk (the prompt ends on a page boundary: all but its last token's
row), and answer as it did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine.bench import shapes
from engine.bench.restore import drop_page_cache
from engine.cache.formats import default_dense

PS = 32


def test_restore_bench_reads_back_every_full_page(tmp_path, smollm2_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    folder = tmp_path / "folio" / "bench-shapes"  # engine.paths.cache_dir() under that env
    shapes.make_shape_gguf("tiny-llama", "q8_0", folder, vocab_source=smollm2_path)
    tokens = 4 * PS
    out = subprocess.run(
        [sys.executable, "-m", "folio", "bench", "restore", "--shape", "tiny-llama",
         "--quant", "q8_0", "--tokens", str(tokens), "--page-size", str(PS)],
        capture_output=True, text=True, timeout=600, env=env, check=True,
    ).stdout  # fmt: skip
    (record,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    shape = shapes.SHAPES["tiny-llama"]
    # K and V of every layer for one page of tokens, unquantized (fp16, or fp32 on a CPU
    # without F16C)
    value_bytes = default_dense().itemsize
    page_bytes = shape.layers * 2 * shape.kv_heads * shape.head_dim * value_bytes * PS
    assert record["recompute"]["cached_tokens"] == 0 and record["recompute"]["disk_pages"] == 0
    for run in ("warm", "cold"):
        assert record[run]["disk_pages"] == 4
        assert record[run]["cached_tokens"] == tokens - 1
        assert record[run]["disk_bytes"] == 4 * page_bytes < record["store_bytes"]
        assert record[f"speedup_{run}"] > 0 and record[f"restore_gb_s_{run}"] > 0
    assert record["same_first_token"]


def test_a_bad_length_is_refused(capsys):
    from folio.main import main

    assert main(["bench", "restore", "--tokens", "10"]) != 0
    assert "--tokens must be more than one page" in capsys.readouterr().err


def test_dropping_the_page_cache_keeps_the_files(tmp_path):
    (tmp_path / "a").mkdir()
    data = os.urandom(1 << 16)
    (tmp_path / "a" / "seg").write_bytes(data)
    drop_page_cache(tmp_path)
    assert (tmp_path / "a" / "seg").read_bytes() == data
