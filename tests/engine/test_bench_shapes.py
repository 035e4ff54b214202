"""Random-weight shape files (engine/bench/shapes.py) and the llama.cpp bench runner
(engine/bench/llama_cpp.py): the quantizer's type rule against a real llama-quantize
output, the files' shapes, types and scales, the cache, and the parsers on recorded
llama.cpp outputs."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.bench import llama_cpp, shapes
from engine.model.gguf_file import GGUFFile

DATA = Path(__file__).parent / "data" / "llama_cpp"
TINY = ("tiny-llama", "tiny-qwen2")


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-shapes")


@pytest.fixture(scope="module")
def tiny_files(shape_dir, smollm2_path) -> dict[tuple[str, str], Path]:
    made = {}
    for name in TINY:
        for quant in shapes.QUANTS:
            made[name, quant] = shapes.make_shape_gguf(
                name, quant, shape_dir, vocab_source=smollm2_path
            )
    return made


# -- the type rule ----------------------------------------------------------------------


def test_gemma3_q4_k_m_types_are_what_llama_quantize_wrote(gemma3_path):
    """Gemma 3 270M's rows of 640 values are not whole 256-blocks, so besides the Q4_K_M
    rule this checks its fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0, embedding -> Q8_0)."""
    gf = GGUFFile(gemma3_path)
    try:
        assert not [k for k in gf.metadata if k.startswith("quantize.")]  # no imatrix used
        found = [(t.name, t.shape, Q(t.qtype)) for t in gf.tensors.values()]
        meta = gf.metadata
    finally:
        gf.close()
    shape = shapes.SHAPES["gemma3-270m"]
    assert meta["gemma3.embedding_length"] == shape.hidden
    assert meta["gemma3.block_count"] == shape.layers
    assert meta["gemma3.feed_forward_length"] == shape.ffn
    ours = [(s.name, s.shape, s.qtype) for s in shapes.tensor_mix("gemma3-270m", "q4_k_m")]
    assert ours == found  # every name, in llama-quantize's order, with its shape and type
    # The same rule applied to the file's own tensor list.
    again = shapes.assign_types([(n, s) for n, s, _ in found], "q4_k_m", shape.layers)
    assert [s.qtype for s in again] == [t for _, _, t in found]


def test_use_more_bits_layers():
    more = [i for i in range(16) if shapes.use_more_bits(i, 16)]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    more = [i for i in range(32) if shapes.use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-3b", "qwen2-7b", "llama-3.1-8b"])
def test_q4_k_m_mix(name):
    shape = shapes.SHAPES[name]
    types = {s.name: s.qtype for s in shapes.tensor_mix(name, "q4_k_m")}
    more = {i for i in range(shape.layers) if shapes.use_more_bits(i, shape.layers)}
    for i in range(shape.layers):
        want = Q.Q6_K if i in more else Q.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == want
        assert types[f"blk.{i}.ffn_down.weight"] == want
        for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{role}.weight"] == Q.Q4_K
        assert types[f"blk.{i}.attn_norm.weight"] == types[f"blk.{i}.ffn_norm.weight"] == Q.F32
        if shape.qkv_bias:
            assert {types[f"blk.{i}.attn_{p}.bias"] for p in "qkv"} == {Q.F32}
    if shape.tied:
        assert "output.weight" not in types and types["token_embd.weight"] == Q.Q6_K
    else:
        assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    assert ("rope_freqs.weight" in types) == (shape.llama3_rope is not None)


def test_q4_0_and_q8_0_mixes():
    q4 = {s.name: s.qtype for s in shapes.tensor_mix("llama-3.1-8b", "q4_0")}
    assert q4.pop("output.weight") == Q.Q6_K  # the head is never below Q6_K
    assert {t for n, t in q4.items() if "norm" not in n and "rope" not in n} == {Q.Q4_0}
    q8 = {s.name: s.qtype for s in shapes.tensor_mix("llama-3.2-1b", "q8_0")}
    assert q8["token_embd.weight"] == Q.Q8_0  # tied: Q8_0 stays Q8_0
    assert set(q8.values()) == {Q.Q8_0, Q.F32}


def test_real_shapes_sizes():
    """Weights within 1% of the published files (808 MB Llama 3.2 1B, 4.68 GB Qwen2 7B at
    Q4_K_M; the rest of those files is their vocabulary)."""
    assert shapes.mix_report("llama-3.2-1b", "q4_k_m")["weight_bytes"] == pytest.approx(
        808e6, rel=0.015
    )
    assert shapes.mix_report("qwen2-7b", "q4_k_m")["weight_bytes"] == pytest.approx(
        4.68e9, rel=0.01
    )
    assert shapes.mix_report("llama-3.1-8b", "q4_k_m")["parameters"] == 8_030_261_312


def test_llama3_rope_factors():
    f = shapes.Llama3Rope(32.0).factors(64, 500000.0)
    assert f.shape == (32,) and f[0] == 1.0 and f[-1] == 32.0
    assert np.all(np.diff(f) >= 0) and np.all((f >= 1) & (f <= 32))


# -- the files ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_files_have_the_declared_tensors(tiny_files, name):
    for quant in shapes.QUANTS:
        reader = gguf.GGUFReader(tiny_files[name, quant])
        found = [
            (t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type)
            for t in reader.tensors
        ]
        want = [(s.name, s.shape, s.qtype) for s in shapes.tensor_mix(name, quant)]
        assert found == want
        for t, spec in zip(reader.tensors, shapes.tensor_mix(name, quant)):
            assert int(t.n_bytes) == spec.nbytes
        shape = shapes.SHAPES[name]
        tokens = reader.fields["tokenizer.ggml.tokens"]
        assert len(tokens.data) == shape.vocab
        assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
        assert reader.fields["general.file_type"].contents() == shapes.QUANTS[quant].ftype
        assert reader.fields[f"{shape.arch}.block_count"].contents() == shape.layers


def test_scales_are_finite_and_give_unit_outputs(tiny_files):
    for (name, quant), path in tiny_files.items():
        gf = GGUFFile(path)  # Folio's reader: GGUFReader takes ~1 s a file for the vocabulary
        for t in gf.tensors.values():
            data = gf.tensor_bytes(t.name)
            qtype = Q(t.qtype)
            if qtype in (Q.F32, Q.F16):
                assert np.isfinite(data.view(shapes.FLOAT_TYPES[qtype])).all(), t.name
                continue
            blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
            for offset, multiple in shapes.scale_fields(qtype):
                scale = blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float64)
                want = np.float16(shapes.weight_scale(qtype, t.shape[-1]) * multiple)
                assert np.isfinite(scale).all() and (scale > 0).all(), (name, quant, t.name)
                assert (scale == want).all(), (name, quant, t.name)
        gf.close()
    # Such a matrix maps unit-RMS inputs to unit-RMS outputs, with mean ~0.
    gf = GGUFFile(tiny_files["tiny-llama", "q4_k_m"])
    for name in ("blk.0.ffn_down.weight", "blk.2.ffn_down.weight", "blk.0.attn_q.weight"):
        t = gf.tensors[name]
        w = gguf.quants.dequantize(gf.tensor_bytes(name).reshape(t.shape[0], -1), Q(t.qtype))
        y = w @ np.random.default_rng(0).standard_normal((w.shape[1], 64))
        assert abs(w.mean()) < 0.1 * w.std(), name
        assert 0.8 < y.std() < 1.25, (name, y.std())
    gf.close()


def test_folio_loads_and_runs_the_tiny_files(tiny_files):
    from engine.cache.kv_cache import CacheSettings, KVCache
    from engine.model.loader import load_model
    from engine.model.runner import SequenceRunner

    for name in TINY:
        path = tiny_files[name, "q4_k_m"]
        bare = load_model(path, load_tokenizer=False)
        assert bare.tokenizer is None and bare.config.vocab_size == shapes.SHAPES[name].vocab
    loaded = load_model(tiny_files["tiny-qwen2", "q4_k_m"], weight_mode="dequant")
    ids = loaded.tokenizer.encode("The capital of France is Paris.")
    assert loaded.tokenizer.decode(ids) == "The capital of France is Paris."
    runner = SequenceRunner(
        loaded, KVCache.for_model(loaded, CacheSettings(page_size=16, token_budget=64)), ids
    )
    with torch.no_grad():
        logits = runner.step(all_logits=True)
    assert logits.shape == (len(ids), 8192) and torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3  # O(1), neither vanished nor exploded


def test_cache_reuses_a_complete_file_and_rewrites_a_truncated_one(tiny_files, smollm2_path):
    path = tiny_files["tiny-llama", "q4_k_m"]
    folder = path.parent
    before = path.stat()
    again = shapes.make_shape_gguf("tiny-llama", "q4_k_m", folder, vocab_source=smollm2_path)
    assert again == path and path.stat().st_mtime_ns == before.st_mtime_ns
    head = path.read_bytes()[: 1 << 20]
    with open(path, "r+b") as f:
        f.truncate(before.st_size - 1000)
    seen = []
    again = shapes.make_shape_gguf(
        "tiny-llama", "q4_k_m", folder, lambda fraction, what: seen.append((fraction, what)),
        vocab_source=smollm2_path,
    )  # fmt: skip
    assert again == path and path.stat().st_size == before.st_size
    assert path.read_bytes()[: 1 << 20] == head  # seeded: the same bytes again
    assert seen[-1] == (1.0, shapes.tensor_mix("tiny-llama", "q4_k_m")[-1].name)
    assert [f for f, _ in seen] == sorted(f for f, _ in seen)
    assert shapes.is_complete(path, shapes.tensor_mix("tiny-llama", "q4_k_m"))
    assert not shapes.is_complete(path, shapes.tensor_mix("tiny-llama", "q8_0"))
    assert not [p for p in folder.iterdir() if p.name.endswith(".part")]


def test_vocabulary_cut_and_padded(smollm2_path):
    small = shapes.vocabulary(4096, smollm2_path)
    assert len(small.tokens) == len(set(small.tokens)) == 4096
    kept = set(small.tokens)
    assert all(
        a in kept and b in kept and a + b in kept for a, b in (m.split(" ") for m in small.merges)
    )
    big = shapes.vocabulary(128256, smollm2_path)
    assert len(big.tokens) == len(set(big.tokens)) == len(big.token_types) == 128256
    assert big.tokens[:49152] == shapes.vocabulary(49152, smollm2_path).tokens


def test_unknown_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.make_shape_gguf("llama-9b", "q4_k_m", tmp_path)
    with pytest.raises(ValueError, match="unknown quant"):
        shapes.make_shape_gguf("tiny-llama", "q2_k", tmp_path)


# -- llama.cpp runner ---------------------------------------------------------------------


def test_parse_llama_bench_tiny_llama():
    report = llama_cpp.parse_llama_bench((DATA / "llama_bench_tiny_llama.json").read_text())
    assert report.model.endswith("tiny-llama-q4_k_m-random-v1.gguf")
    assert report.threads == 2 and report.n_prompt == 64 and report.n_gen == 16
    assert report.prompt.avg > report.decode.avg > 0
    assert len(report.prompt.samples) == len(report.decode.samples) == 3
    assert report.prompt.avg == pytest.approx(np.mean(report.prompt.samples), rel=1e-3)
    assert report.parameters == sum(
        math.prod(s.shape) for s in shapes.tensor_mix("tiny-llama", "q4_k_m")
    )


def test_parse_llama_bench_smollm2():
    report = llama_cpp.parse_llama_bench((DATA / "llama_bench_smollm2.json").read_text())
    assert "SmolLM2" in report.model and report.model_bytes > 90e6
    assert report.prompt.stddev >= 0 and report.decode.avg > 0


def test_parse_batched_bench():
    text = (DATA / "batched_bench_tiny_llama.txt").read_text()
    report = llama_cpp.parse_batched_bench(text)
    rows = report.by_batch()
    assert sorted(rows) == [1, 2, 4] and report.threads == 2 and not report.shared_prompt
    for b, row in rows.items():
        assert row.pp == 32 and row.tg == 16 and row.n_kv == b * (32 + 16)
        assert row.s_tg == pytest.approx(b * row.tg / row.t_tg, rel=1e-3)
        assert row.s == pytest.approx(b * (row.pp + row.tg) / row.t, rel=1e-3)


def test_parsers_refuse_other_output():
    with pytest.raises(llama_cpp.LlamaCppError, match="no tests"):
        llama_cpp.parse_llama_bench("| model | size |\n")
    with pytest.raises(llama_cpp.LlamaCppError, match="no results"):
        llama_cpp.parse_batched_bench("|    PP |     TG |    B |\n")


def test_find_tools_names_what_is_missing(tmp_path):
    with pytest.raises(llama_cpp.LlamaCppError, match="does not exist"):
        llama_cpp.find_tools(tmp_path / "nowhere")
    bench = tmp_path / "llama-bench"
    bench.write_text("#!/bin/sh\n")
    bench.chmod(0o755)
    with pytest.raises(llama_cpp.LlamaCppError, match="lacks llama-batched-bench"):
        llama_cpp.find_tools(tmp_path)
    assert llama_cpp.find_tools(tmp_path, ["llama-bench"]) == {"llama-bench": bench}


def test_run_measured_reports_the_child_peak_rss():
    grow = "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    out, _, rss = llama_cpp.run_measured([sys.executable, "-c", grow])
    assert out.strip() == "ok" and rss > 300 << 20
    out, _, rss_small = llama_cpp.run_measured([sys.executable, "-c", "print('ok')"])
    assert rss_small < 200 << 20  # this child's own peak, not the largest child's so far
    with pytest.raises(llama_cpp.LlamaCppError, match="exited with 3"):
        llama_cpp.run_measured([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(llama_cpp.LlamaCppError, match="timed out"):
        llama_cpp.run_measured([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)


FAKE_BATCHED_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
batches = [int(b) for b in args[args.index("-npl") + 1].split(",")]
for b in batches[:-1]:  # the last row lost at exit, as llama.cpp's logger may lose it
    print(json.dumps({{"n_threads": 2, "is_pp_shared": 0, "pp": 8, "tg": 4, "pl": b,
        "n_kv": 12 * b, "t_pp": 0.1, "speed_pp": 80.0 * b, "t_tg": 0.2, "speed_tg": 20.0 * b,
        "t": 0.3, "speed": 40.0 * b}}))
"""

FAKE_LLAMA_BENCH = """#!{python}
import os, signal, sys
if "--repack" not in sys.argv:  # as the AMX path of a -march=native build in a VM
    os.kill(os.getpid(), signal.{signal})
print(open({fixture!r}).read())
"""


def _fake_tool(folder: Path, name: str, text: str) -> None:
    tool = folder / name
    tool.write_text(text)
    tool.chmod(0o755)


def test_batched_bench_runs_again_the_rows_lost_at_exit(tmp_path):
    log = tmp_path / "calls"
    script = FAKE_BATCHED_BENCH.format(python=sys.executable, log=str(log))
    _fake_tool(tmp_path, "llama-batched-bench", script)
    report = llama_cpp.run_batched_bench(tmp_path, "m.gguf", 2, npp=8, ntg=4, npl=(1, 2, 4))
    assert [r.batch for r in report.rows] == [1, 2, 4] and report.rows[2].s_tg == 80.0
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "-npl 4,1" in calls[1] and "-c 48" in calls[0]


@pytest.mark.parametrize("sig", ["SIGILL", "SIGSEGV"])
def test_llama_bench_turns_repacking_off_after_a_refused_instruction(tmp_path, sig):
    """ggml's AMX path in a VM that refuses tile instructions: SIGILL on one host, a
    general protection fault (SIGSEGV) on another; either way run again without it."""
    fixture = str(DATA / "llama_bench_tiny_llama.json")
    script = FAKE_LLAMA_BENCH.format(python=sys.executable, fixture=fixture, signal=sig)
    _fake_tool(tmp_path, "llama-bench", script)
    report = llama_cpp.run_llama_bench(tmp_path, "m.gguf", 2, 64, 16, 3)
    assert not report.repack and report.decode.avg > 0
    code = 128 + getattr(signal, sig)
    with pytest.raises(llama_cpp.LlamaCppError, match=rf"exited with {code}(.|\n)*repack=False"):
        llama_cpp.run_llama_bench(tmp_path, "m.gguf", 2, repack=True)


@pytest.mark.skipif(not os.environ.get("FOLIO_LLAMA_CPP_BIN"), reason="FOLIO_LLAMA_CPP_BIN not set")
def test_llama_bench_runs_a_tiny_file(tiny_files):
    folder = os.environ["FOLIO_LLAMA_CPP_BIN"]
    path = tiny_files["tiny-llama", "q4_k_m"]
    report = llama_cpp.run_llama_bench(folder, path, 2, n_prompt=32, n_gen=8, repetitions=1)
    assert report.prompt.avg > 0 and report.decode.avg > 0 and report.peak_rss_bytes > 0
    batched = llama_cpp.run_batched_bench(folder, path, 2, npp=32, ntg=8, npl=(1, 2))
    assert sorted(batched.by_batch()) == [1, 2] and batched.repack == report.repack


def test_cli_offers_every_shape_and_quant_the_maker_knows():
    """`folio bench forward --shape/--quant` list their choices literally (the parser is
    built without importing the maker); they must be the maker's tables, no more, no less."""
    from engine.cli.main import _build_parser

    parser = _build_parser()
    bench = next(a for a in parser._subparsers._group_actions if "bench" in a.choices)
    forward = bench.choices["bench"]._subparsers._group_actions[0].choices["forward"]
    options = {a.dest: a for a in forward._actions}
    assert set(options["shape"].choices) == set(shapes.SHAPES)
    assert set(options["quant"].choices) == set(shapes.QUANTS)


FAKE_DEPTH_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
def arg(flag, default):
    return int(args[args.index(flag) + 1]) if flag in args else default
p, n, d = arg("-p", 512), arg("-n", 128), arg("-d", 0)
tests = []
for n_prompt, n_gen in ((p, 0), (0, n)):
    if n_prompt or n_gen:
        rate = 1000.0 - d if n_prompt else 50.0 - d / 64  # slower deeper in the context
        tests.append({{"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": d, "avg_ts": rate,
            "stddev_ts": 0.0, "samples_ts": [rate], "model_filename": "m.gguf",
            "model_type": "llama ?B Q4_K - Medium", "model_size": 1, "model_n_params": 1,
            "n_threads": 2, "build_commit": "x", "build_number": 1, "repack": True}})
print(json.dumps(tests))
"""


def test_llama_cpp_decodes_after_as_many_tokens_as_folio_did(tmp_path):
    """llama-bench's decode test starts on an empty context unless told `-d`; Folio's
    decode follows its prompt, so llama.cpp's must follow as many tokens."""
    from engine.bench.real_shapes import _llama_cpp_figures

    _fake_tool(tmp_path, "llama-bench", FAKE_DEPTH_BENCH.format(python=sys.executable))
    script = FAKE_BATCHED_BENCH.format(python=sys.executable, log=str(tmp_path / "calls"))
    _fake_tool(tmp_path, "llama-batched-bench", script)
    report = llama_cpp.run_llama_bench(tmp_path, "m.gguf", 2, n_prompt=0, n_gen=8, depth=256)
    assert report.prompt is None and report.decode.avg == 50.0 - 256 / 64
    got = _llama_cpp_figures(tmp_path, Path("m.gguf"), 2, 4, (1, 2), prompt=512)
    assert got["prefill_tok_s"] == 1000.0  # the prompt itself from an empty context
    assert got["decode_tok_s"] == 50.0 - 512 / 64 and got["decode_depth"] == 512


def test_a_downloaded_gguf_is_measured_beside_llama_cpp(tmp_path, tiny_files):
    """`folio bench forward --model FILE.gguf --llama-cpp DIR`: Folio's figures on the
    file, llama.cpp's from its tools on the same file and context, and their ratios."""
    import json
    import subprocess

    tools = tmp_path / "bin"
    tools.mkdir()
    _fake_tool(tools, "llama-bench", FAKE_DEPTH_BENCH.format(python=sys.executable))
    script = FAKE_BATCHED_BENCH.format(python=sys.executable, log=str(tmp_path / "calls"))
    _fake_tool(tools, "llama-batched-bench", script)
    path = tiny_files["tiny-llama", "q8_0"]
    out = subprocess.run(
        [sys.executable, "-m", "folio", "bench", "forward", "--model", str(path),
         "--llama-cpp", str(tools), "--tg", "4", "--batch", "2", "4", "--threads", "1",
         "--prompt-tokens", "64"],
        capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    ).stdout  # fmt: skip
    mix, folio, llama, ratio = [json.loads(line) for line in out.splitlines() if line[:1] == "{"]
    assert mix["model"] == path.name and "shape" not in mix
    counts = {}
    for t in GGUFFile(path).tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    assert mix["mix"]["tensors"] == counts and mix["mix"]["weight_bytes"] <= path.stat().st_size
    assert folio["engine"] == "folio" and folio["file_bytes"] == path.stat().st_size
    assert folio["prefill_tok_s"] > 0 and folio["s_tg"]["2"] > 0 and folio["s_tg"]["4"] > 0
    assert llama["engine"] == "llama.cpp" and llama["decode_tok_s"] == 50.0 - 64 / 64
    assert llama["s_tg"] == {"2": 40.0, "4": 80.0}  # the fake's 20 tok/s a sequence
    assert ratio["folio_over_llama_cpp"]["prefill"] == round(folio["prefill_tok_s"] / 1000.0, 2)
    assert ratio["folio_over_llama_cpp"]["decode"] == round(folio["decode_tok_s"] / 49.0, 2)
    assert ratio["folio_over_llama_cpp"]["s_tg_B4"] == round(folio["s_tg"]["4"] / 80.0, 2)

    # a llama.cpp tool that fails after Folio's half: one line that names it, no traceback
    failed = subprocess.run(
        [sys.executable, "-m", "folio", "bench", "forward", "--model", str(path),
         "--llama-cpp", str(tools), "--tg", "4", "--batch", "2", "--threads", "1",
         "--prompt-tokens", "64"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )  # fmt: skip
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert f"llama.cpp on {path.name}" in failed.stderr and "no results" in failed.stderr
    assert '"engine": "folio"' in failed.stdout


def test_beside_llama_cpp_a_bad_file_or_folder_is_said_before_anything_runs(tmp_path, capsys):
    from folio.main import main

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main(["bench", "forward", "--model", str(folder), "--llama-cpp", str(tmp_path)]) == 1
    assert "not a GGUF file" in capsys.readouterr().err
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert main(["bench", "forward", "--model", str(gguf_file), "--llama-cpp", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "lacks llama-bench" in err and "README" in err


def test_rounds_in_turns_give_each_pair_its_ratio_and_their_median():
    """With several rounds, the ratio record carries each round's Folio / llama.cpp and
    their median beside the best-of ratios: a pair runs minutes apart, where each
    engine's best round may come from a faster minute of the host than the other's."""
    from engine.bench.real_shapes import best_of, paired_ratios, speed_ratios

    def rec(prefill, decode, b16, rss):
        return {"prefill_tok_s": prefill, "decode_tok_s": decode, "s_tg": {"16": b16},
                "peak_rss_bytes": rss}  # fmt: skip

    folios = [rec(150.0, 30.0, 120.0, 100), rec(160.0, 40.0, 126.0, 100), rec(150.0, 33.0, 0.0, 90)]
    llamas = [rec(100.0, 32.0, 80.0, 200), rec(140.0, 36.0, 70.0, 200), rec(120.0, 30.0, 60.0, 200)]
    paired = paired_ratios(folios, llamas)
    # per round, in order; a missing figure (a zero rate) is None and left out of the median
    assert paired["rounds"]["decode"] == [0.94, 1.11, 1.1]
    assert paired["rounds"]["s_tg_B16"] == [1.5, 1.8, None]
    assert paired["median"]["decode"] == 1.1
    assert paired["median"]["prefill"] == 1.25  # 1.5, 1.14, 1.25
    assert paired["median"]["s_tg_B16"] == 1.65  # an even count: the middle two's mean
    assert paired["median"]["peak_rss"] == 0.5
    # the best rounds' ratio can differ from every pair's: 40 / 36 here
    best = speed_ratios(best_of(folios), best_of(llamas))
    assert best["decode"] == 1.11 and best["prefill"] == round(160 / 140, 2)
    with pytest.raises(ValueError):  # a round without its pair is a bug, not a figure
        paired_ratios(folios, llamas[:2])
