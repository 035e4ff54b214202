"""Folio's forward pass equals transformers' on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.model.loader import load_model
from engine.model.runner import SequenceRunner
from kernels.quant.tiles import tiles_supported
from tests.engine.tiny_models import FAMILIES, make_hf_model, save_hf_folder, write_gguf

PROMPT_LEN = 21  # longer than Gemma's test sliding window (8), not a multiple of anything


def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].float()


def _folio_logits(
    loaded, ids: torch.Tensor, chunks: tuple[int, ...] = (), page_size: int = 16
) -> torch.Tensor:
    """Logits for every position through the paged cache (16-token pages, so prompts
    cross page boundaries; fp32 pages, transformers' arithmetic), fed in the given chunk
    sizes (the rest in one go)."""
    settings = CacheSettings(
        page_size=page_size, token_budget=4 * ids.shape[1], k_bits=32, v_bits=32
    )
    cache = KVCache.for_model(loaded, settings)
    runner = SequenceRunner(loaded, cache, ids[0].tolist())
    out = []
    for size in (*chunks, ids.shape[1]):
        size = min(size, ids.shape[1] - runner.stored)
        if size <= 0:
            break
        out.append(runner.step(size, all_logits=True))
    cache.pages.validate()
    return torch.cat(out)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (ours - ref).norm() / ref.norm()
    assert err < rel, f"relative error {err:.2e} exceeds {rel:.0e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_safetensors_logits_match_transformers(family, tmp_path):
    model = make_hf_model(family)
    save_hf_folder(model, tmp_path / family)
    loaded = load_model(tmp_path / family, load_tokenizer=False)
    assert loaded.config.arch == family
    ids = torch.randint(
        0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1)
    )
    ref = _reference_logits(model, ids)
    _assert_close(_folio_logits(loaded, ids), ref, 1e-4)
    # Same logits when the prompt arrives in chunks and then token by token (KV cache path).
    _assert_close(_folio_logits(loaded, ids, chunks=(5, 7, 1, 1)), ref, 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_and_untied_heads(family, tmp_path):
    tie = family != "llama"
    model = make_hf_model(family, seed=3, tie_word_embeddings=not tie)
    save_hf_folder(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m", load_tokenizer=False)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2)
    )
    _assert_close(_folio_logits(loaded, ids), _reference_logits(model, ids), 1e-4)


# One GGUF per quant family (legacy blocks, K-quants, floats), across architectures;
# llama exercises llama.cpp's q/k row permutation.
GGUF_CASES = [
    (
        "llama",
        {
            "q": Q.Q4_0,
            "k": Q.Q4_1,
            "v": Q.Q5_0,
            "o": Q.Q5_1,
            "gate": Q.Q8_0,
            "up": Q.Q4_0,
            "down": Q.Q4_1,
            "embd": Q.Q8_0,
            "output": Q.Q6_K,
        },
    ),
    (
        "llama",
        {
            "q": Q.Q2_K,
            "k": Q.Q3_K,
            "v": Q.Q4_K,
            "o": Q.Q5_K,
            "gate": Q.Q6_K,
            "up": Q.Q4_K,
            "down": Q.Q6_K,
            "embd": Q.Q4_K,
            "output": Q.Q5_K,
        },
    ),
    (
        "qwen2",
        {
            "q": Q.F16,
            "k": Q.BF16,
            "v": Q.F32,
            "o": Q.Q8_0,
            "gate": Q.Q4_K,
            "up": Q.Q5_0,
            "down": Q.Q6_K,
            "embd": Q.F16,
        },
    ),
    ("qwen3", {"q": Q.Q4_1, "k": Q.Q8_0, "v": Q.Q4_K, "o": Q.Q4_0, "embd": Q.Q8_0}),
    (
        "gemma3",
        {"q": Q.Q5_0, "k": Q.Q5_0, "v": Q.Q8_0, "o": Q.Q4_K, "down": Q.Q6_K, "embd": Q.Q8_0},
    ),
]


@pytest.mark.parametrize(
    "family,qtypes",
    GGUF_CASES,
    ids=lambda v: v if isinstance(v, str) else "-".join(sorted({t.name for t in v.values()})),
)
def test_gguf_dequant_logits_match_transformers(family, qtypes, tmp_path):
    model = make_hf_model(family, seed=5)
    ref_state = write_gguf(model, tmp_path / "m.gguf", qtypes)
    model.load_state_dict(ref_state)
    loaded = load_model(tmp_path / "m.gguf", weight_mode="dequant", load_tokenizer=False)
    ids = torch.randint(
        0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(4)
    )
    _assert_close(_folio_logits(loaded, ids, chunks=(6, 1)), _reference_logits(model, ids), 1e-4)


def test_gguf_int4_mode_close_to_dequant(tmp_path):
    model = make_hf_model("llama", seed=6)
    write_gguf(model, tmp_path / "m.gguf", {}, default=Q.Q4_1)
    exact = load_model(tmp_path / "m.gguf", weight_mode="dequant", load_tokenizer=False)
    packed = load_model(tmp_path / "m.gguf", weight_mode="int4", load_tokenizer=False)
    assert packed.weight_bytes < exact.weight_bytes
    ids = torch.randint(
        0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7)
    )
    _assert_close(_folio_logits(packed, ids), _folio_logits(exact, ids), 2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sharded_half_precision_folder(dtype, tmp_path):
    """A folder saved in fp16/bf16 and split into several shards with an index."""
    model = make_hf_model("llama", seed=8)
    model.to(dtype).save_pretrained(tmp_path / "m", safe_serialization=True, max_shard_size="400KB")
    shards = list((tmp_path / "m").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "m" / "model.safetensors.index.json").exists()
    loaded = load_model(tmp_path / "m", load_tokenizer=False)
    assert loaded.quant_types == {
        "F16" if dtype == torch.float16 else "BF16": len(model.state_dict())
    }
    ids = torch.randint(
        0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(9)
    )
    ref = _reference_logits(model.float(), ids)  # the same half-precision weights, computed in fp32
    _assert_close(_folio_logits(loaded, ids), ref, 1e-4)


# The mixes llama.cpp's quantizer writes (Q4_K_M / Q5_K_M: Q6_K for attn_v, ffn_down and
# the output head), and whole-file Q6_K and Q8_0.
FILE_MIXES = {
    "Q4_K_M": {
        "q": Q.Q4_K,
        "k": Q.Q4_K,
        "v": Q.Q6_K,
        "o": Q.Q4_K,
        "gate": Q.Q4_K,
        "up": Q.Q4_K,
        "down": Q.Q6_K,
        "embd": Q.Q4_K,
        "output": Q.Q6_K,
    },
    "Q5_K_M": {
        "q": Q.Q5_K,
        "k": Q.Q5_K,
        "v": Q.Q6_K,
        "o": Q.Q5_K,
        "gate": Q.Q5_K,
        "up": Q.Q5_K,
        "down": Q.Q6_K,
        "embd": Q.Q5_K,
        "output": Q.Q6_K,
    },
    "Q6_K": {},
    "Q8_0": {},
}


@pytest.mark.parametrize("mix", FILE_MIXES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_mode_reads_the_files_blocks(family, mix, tmp_path):
    """The default weight mode keeps every weight as the file stores it (resident bytes
    within 5% of the file's tensor bytes) and computes what transformers computes on the
    dequantized weights, to the error of int8 activations: a prompt of more than
    DECODE_MAX_ROWS tokens takes dequantized tiles and a GEMM, then single tokens the
    integer kernels."""
    from engine.model.gguf_file import GGUFFile
    from kernels.quant import DECODE_MAX_ROWS

    model = make_hf_model(family, seed=11, tie_word_embeddings=False)
    default = Q[mix] if mix in ("Q6_K", "Q8_0") else Q.Q4_K
    model.load_state_dict(
        write_gguf(model, tmp_path / "m.gguf", FILE_MIXES[mix], default=default, seed=3)
    )
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    assert loaded.weight_mode == "native"
    tensor_bytes = sum(t.nbytes for t in GGUFFile(tmp_path / "m.gguf").tensors.values())
    assert loaded.weight_bytes <= 1.05 * tensor_bytes
    n = DECODE_MAX_ROWS + 8
    ids = torch.randint(
        0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(4)
    )
    ref = _reference_logits(model, ids)
    ours = _folio_logits(loaded, ids, chunks=(n - 4, 1, 1))
    _assert_close(ours, ref, 5e-2)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"argmax agrees at {agree:.0%} of positions"


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_native_mode_reads_half_precision_files_of_any_width(qtype, tmp_path):
    """An F16 / BF16 file (rows 320 wide, not a multiple of 256: no int8 activations are
    made for float weights) in the default mode: its matrices as the file has them, the
    logits of transformers on those weights, a prompt and then token by token (the
    decode kernel, kernels/quant/float_rows.py), and a K/V fingerprint of its own."""
    from engine.model.gguf_file import GGUFFile
    from engine.model.loader import _has_float_rows, _kernels
    from kernels.quant.float_rows import float_rows_supported

    model = make_hf_model("llama", seed=5, hidden_size=320, intermediate_size=448)
    model.load_state_dict(write_gguf(model, tmp_path / "m.gguf", {}, default=qtype, seed=2))
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    assert loaded.weight_mode == "native"
    tensor_bytes = sum(t.nbytes for t in GGUFFile(tmp_path / "m.gguf").tensors.values())
    assert loaded.weight_bytes <= 1.05 * tensor_bytes
    ids = torch.randint(
        0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(4)
    )
    ref = _reference_logits(model, ids)
    _assert_close(_folio_logits(loaded, ids, chunks=(8, 1, 1, 1, 1)), ref, 1e-4)
    assert _has_float_rows(GGUFFile(tmp_path / "m.gguf")) == float_rows_supported(qtype)
    write_gguf(model, tmp_path / "q.gguf", {}, default=Q.Q8_0, seed=2)
    assert not _has_float_rows(GGUFFile(tmp_path / "q.gguf"))
    assert _kernels("native", True).endswith(":fr") and ":fr" not in _kernels("native")
    assert _kernels("dequant", True) == ""


def test_native_mode_maps_the_file_instead_of_copying_it(tmp_path):
    """Loading in the default mode allocates (almost) nothing for the weights besides the
    tiles k-quants are repacked into where the CPU takes them (kernels/quant/tiles.py,
    their file pages released): the process's anonymous memory grows by those and a
    small fraction of the file."""
    model = make_hf_model(
        "llama", seed=12, tie_word_embeddings=False, intermediate_size=4096, vocab_size=16384
    )
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES["Q4_K_M"], default=Q.Q4_K)
    load_model(tmp_path / "m.gguf", load_tokenizer=False)  # first load: kernels, caches
    size = (tmp_path / "m.gguf").stat().st_size

    def anon() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        pytest.skip("no /proc/self/status RssAnon on this system")

    before = anon()
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    grown = anon() - before
    lins = [
        lin
        for layer in loaded.model.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    tiles = sum(
        g.tiles.nbytes
        for lin in [*lins, loaded.model.lm_head]
        for g in lin._groups
        if g.tiles is not None
    )
    assert (tiles > 0.5 * size) == tiles_supported("Q4_K")
    assert grown < tiles + 0.05 * size + (2 << 20), (
        f"anonymous memory grew by {grown:,} bytes for a {size:,}-byte file ({tiles:,} in tiles)"
    )
    assert loaded.weight_bytes > 0.9 * size


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_host_decode_layers_equal_the_torch_layers(family, mix, tmp_path, monkeypatch):
    """A decode step on the CPU over file blocks runs its layers on numpy arrays
    (`Transformer._host_layer`): the same logits and the same stored K/V, bit for bit, as
    the torch layers (per-head q/k permutation, q/k biases, q/k norms, post norms and
    sliding windows among the families)."""
    from engine.model.transformer import Transformer

    model = make_hf_model(family, seed=13, tie_word_embeddings=False)
    default = Q.Q8_0 if mix == "Q8_0" else Q.Q4_K
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES[mix], default=default, seed=5)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    host_arrays = Transformer._on_host_arrays
    host_layers = []
    monkeypatch.setattr(Transformer, "_host_layer", _counted(Transformer._host_layer, host_layers))
    prompt = torch.randint(
        0, model.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(6)
    )

    def decode(host: bool):
        monkeypatch.setattr(Transformer, "_on_host_arrays", lambda *a: host and host_arrays(*a))
        cache = KVCache.for_model(loaded, CacheSettings(page_size=16, token_budget=64))
        runner = SequenceRunner(loaded, cache, prompt.tolist(), 4)
        runner.step()
        logits = []
        for token in (5, 17, 2, 9):
            runner.append(token)
            logits.append(runner.step())
        pages = [t["data"].clone() for t in cache.storage.k + cache.storage.v]
        return torch.stack(logits), pages

    host_logits, host_pages = decode(True)
    assert len(host_layers) == 4 * len(loaded.model.layers)
    torch_logits, torch_pages = decode(False)
    assert len(host_layers) == 4 * len(loaded.model.layers)
    assert torch.equal(host_logits, torch_logits)
    assert all(torch.equal(a, b) for a, b in zip(host_pages, torch_pages))


def _counted(method, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    return counted


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0"])
def test_a_long_prompts_mlp_in_row_chunks_gives_the_same_bits(mix, tmp_path, monkeypatch):
    """Over super-block weights a prompt longer than MLP_ROWS goes through each MLP that
    many rows at a time (never leaving DECODE_MAX_ROWS rows or fewer, which would take the
    decode path): the logits and stored K/V equal one pass's bit for bit. So do weights
    of 32-element blocks where they are in tiles (kernels/quant/tiles32.py); elsewhere
    (a GEMM on dequantized tiles per call) they keep one pass."""
    import engine.model.transformer as transformer_module
    from kernels.quant import DECODE_MAX_ROWS
    from kernels.quant.linear import BlockLinear

    model = make_hf_model("llama", seed=14, tie_word_embeddings=False)
    default = Q.Q8_0 if mix == "Q8_0" else Q.Q4_K
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES[mix], default=default, seed=7)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    mlp_rows = DECODE_MAX_ROWS + 8
    n = 3 * mlp_rows + DECODE_MAX_ROWS  # the last 32 rows join the chunk before them
    prompt = torch.randint(
        0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(8)
    )
    calls = []  # rows of each projection's call (plain, or with its norm or gate fused)

    def counted(name):
        method = getattr(BlockLinear, name)
        monkeypatch.setattr(
            BlockLinear,
            name,
            lambda self, x, *args: calls.append(x.shape[0]) or method(self, x, *args),
        )

    for name in ("__call__", "normed", "gated"):
        counted(name)

    def prefill(rows: int):
        monkeypatch.setattr(transformer_module, "MLP_ROWS", rows)
        calls.clear()
        cache = KVCache.for_model(loaded, CacheSettings(page_size=16, token_budget=n + 16))
        logits = SequenceRunner(loaded, cache, prompt.tolist(), 2).step(n, all_logits=True)
        return logits, [t["data"].clone() for t in cache.storage.k + cache.storage.v], list(calls)

    whole, whole_pages, whole_calls = prefill(10 * n)
    chunked, chunked_pages, chunked_calls = prefill(mlp_rows)
    assert torch.equal(whole, chunked)
    assert all(torch.equal(a, b) for a, b in zip(whole_pages, chunked_pages))
    layers = len(loaded.model.layers)
    if mix == "Q4_K_M" or tiles_supported("Q8_0"):
        # gate_up and down 3 calls a layer, the last of 2 * 32 + 8 rows
        assert chunked_calls.count(mlp_rows + DECODE_MAX_ROWS) == 2 * layers
        assert min(chunked_calls) > DECODE_MAX_ROWS
    else:
        assert chunked_calls == whole_calls


@pytest.mark.skipif(
    not tiles_supported("Q4_K"),
    reason="this CPU has no AVX-512 VNNI: k-quants stay in file blocks, and a long "
    "prompt's norms are torch's (test_a_long_prompts_mlp_in_row_chunks_gives_the_same_bits)",
)
def test_a_prompt_gives_the_same_bits_however_much_of_it_was_cached(tmp_path):
    """Q4_K_M in tiles: a prompt's logits (and so its K/V, on float32 pages) do not
    depend on how it is split into forwards (a prefix found in the cache, the rest
    computed), since every forward's norms and gates are the decode step's at any row
    count (before, a forward of more than DECODE_MAX_ROWS rows took torch's norm and
    gate, and the logits moved by ~5e-3). (Decode steps attend through another kernel,
    test_paged_attention.py, so token by token is not the same bits.)"""
    from kernels.quant import DECODE_MAX_ROWS

    model = make_hf_model("llama", seed=14, tie_word_embeddings=False)
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=7)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    n = 2 * DECODE_MAX_ROWS + 8
    ids = torch.randint(
        0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(8)
    )
    whole = _folio_logits(loaded, ids)
    for chunks in ((48,), (n - DECODE_MAX_ROWS,), (8, 16), (9, 1, 30)):
        assert torch.equal(_folio_logits(loaded, ids, chunks), whole), chunks
