"""Q4_K tiles (kernels/quant/tiles.py): repacked at load, one kernel at every batch size."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kernels.quant.activations import quantize_super_blocks
from kernels.quant.amx import amx_ready
from kernels.quant.bench import random_blocks
from kernels.quant.linear import BlockEmbedding, BlockLinear, prompt_rows
from kernels.quant.reference import reference_dequantize
from kernels.quant.superblock import KBLOCK_CODES
from kernels.quant.tiles import (
    Q6_K_INT,
    RECORDS,
    TILE_ROWS,
    repack_parts,
    tile_rows,
    tiles_nbytes,
    tiles_supported,
)
from kernels.quant.weight import QuantWeight
from tests.smaps import covering

K = 768

pytestmark = pytest.mark.skipif(
    not tiles_supported("Q4_K"), reason="this CPU has no AVX-512 VNNI: k-quants stay in file blocks"
)
KINDS = [Q.Q4_K, Q.Q6_K]
# each tile kernel's arithmetic: Q6_K's scales in float steps, or in integers (where AMX
# serves Q6_K: tiles.Q6_K_INTEGER), each tested on every CPU
VARIANTS = [
    pytest.param(Q.Q4_K, None, id="Q4_K"),
    pytest.param(Q.Q6_K, False, id="Q6_K-float"),
    pytest.param(Q.Q6_K, True, id="Q6_K-int"),
]


def _exact(act, tokens: int, qtype=Q.Q4_K) -> np.ndarray:
    """float64 ``[T, K]``: the two levels' values the kernel multiplies, summed (Q4_K:
    its coarse levels, the second at 1/16 of the first's scale)."""
    if qtype != Q.Q4_K:
        v = act.dequantize().astype(np.float64)
        return v[:tokens] + v[tokens:]
    q, xd, _ = act.coarse_levels()
    k = act.q.shape[1]
    lv = q[:tokens].reshape(tokens, k // 32, 2, 32).astype(np.float64)
    v = (16 * lv[:, :, 0] + lv[:, :, 1]).reshape(tokens, k // 256, 256)
    return (v * xd[:, :, None]).reshape(tokens, k)


def _product(tiles, n, x, qtype=Q.Q4_K, integer=None):
    act = quantize_super_blocks(x, levels=2)
    out = np.full((len(x), n), np.nan, np.float32)
    tile_rows(KBLOCK_CODES[qtype.name], tiles, n, act, out, 2, integer=integer)
    return out, act


@pytest.mark.parametrize(("qtype", "integer"), VARIANTS)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 21])
def test_tiles_equal_the_dequantized_product(qtype, integer, tokens):
    """37 rows (a short last tile) against the gguf dequantizer times the activations'
    exact values: float32 rounding only."""
    rng = np.random.default_rng(tokens)
    raw = random_blocks(qtype, 37, K, rng)
    tiles = repack_parts([raw], qtype.name)
    record = RECORDS[KBLOCK_CODES[qtype.name]]
    assert tiles.shape == (3, K // 256, record) and tiles.ctypes.data % 64 == 0
    x = rng.standard_normal((tokens, K)).astype(np.float32)
    out, act = _product(tiles, 37, x, qtype, integer)
    w = reference_dequantize(raw, qtype, (37, K)).astype(np.float64)
    ref = _exact(act, tokens, qtype) @ w.T
    scale = np.abs(_exact(act, tokens, qtype)) @ np.abs(w).T
    assert np.abs(out - ref).max() / scale.max() < 1e-6


def _extreme_blocks(raw: np.ndarray, qtype, top: bool = False) -> np.ndarray:
    """``raw``'s blocks, in place, at the extremes: Q4_K every code 15, every scale and
    min 63 (d 0.5, dmin 0.25); Q6_K every code 0 (-32 from its zero point; with ``top``
    63, +31), every scale -128 (d 0.5)."""
    half = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    if qtype == Q.Q4_K:
        blocks = raw.reshape(len(raw), -1, 144)
        blocks[:, :, 0:2] = half
        blocks[:, :, 2:4] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
        blocks[:, :, 4:] = 0xFF
    else:
        blocks = raw.reshape(len(raw), -1, 210)
        blocks[:, :, :192] = 0xFF if top else 0
        blocks[:, :, 192:208] = 0x80
        blocks[:, :, 208:210] = half
    return raw


@pytest.mark.parametrize(("qtype", "integer"), VARIANTS)
@pytest.mark.parametrize("top", [False, True])
def test_extreme_codes_scales_and_activations_do_not_wrap(qtype, integer, top):
    """Q4_K: every code 15, every scale and min 63; Q6_K: every code 0 or 63 (-32 / +31
    from its zero point), every scale -128; activations at the int8 extremes, both
    levels: the integer sums stay exact (a wrap would be off by 2^32 times a scale)."""
    rng = np.random.default_rng(0)
    raw = _extreme_blocks(random_blocks(qtype, 16, K, rng), qtype, top)
    tiles = repack_parts([raw], qtype.name)
    x = np.full((3, K), 3.0, np.float32)
    x[1, ::2] = -3.0
    # a token whose second level is at its top too: 126.5 in units of the first level's
    # scale (127 for the block's largest), the first level 126, the second 127 at 1/256
    # (8 at 1/16)
    x[2] = 126.5
    x[2, ::256] = 127.0
    out, act = _product(tiles, 16, x, qtype, integer)
    assert act.q[5].max() == 127 and (qtype != Q.Q4_K or act.coarse_levels()[0][2].max() == 127)
    w = reference_dequantize(raw, qtype, (16, K)).astype(np.float64)
    ref = _exact(act, 3, qtype) @ w.T
    assert np.allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize(("qtype", "integer"), VARIANTS)
def test_a_rows_result_does_not_depend_on_the_batch(qtype, integer):
    """Each token alone, in tiles of 4 / 2 / 1 (and of 16 on AMX) within any batch, the
    same bits."""
    rng = np.random.default_rng(5)
    raw = random_blocks(qtype, 48, K, rng)
    tiles = repack_parts([raw], qtype.name)
    x = rng.standard_normal((21, K)).astype(np.float32)
    full, _ = _product(tiles, 48, x, qtype, integer)
    for t in range(len(x)):
        alone, _ = _product(tiles, 48, x[t : t + 1], qtype, integer)
        assert np.array_equal(alone[0], full[t])
    part, _ = _product(tiles, 48, x[3:10], qtype, integer)
    assert np.array_equal(part, full[3:10])


def test_fused_parts_each_start_a_tile():
    """Parts repacked together give each part's columns as it gives alone."""
    rng = np.random.default_rng(6)
    raws = [random_blocks(Q.Q4_K, n, K, rng) for n in (32, 16, 21)]
    fused = repack_parts(raws)
    assert fused.shape[0] == 2 + 1 + 2
    x = rng.standard_normal((5, K)).astype(np.float32)
    out, _ = _product(fused, fused.shape[0] * TILE_ROWS, x)
    first = 0
    for raw in raws:
        alone, _ = _product(repack_parts([raw]), raw.shape[0], x)
        assert np.array_equal(out[:, first : first + raw.shape[0]], alone)
        first += -(-raw.shape[0] // TILE_ROWS) * TILE_ROWS


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0])
def test_repacked_tiles_are_left_to_move_into_huge_pages(qtype):
    """Tiles are written into small pages (faulting huge ones in compacted memory for
    seconds), then marked MADV_HUGEPAGE as a whole, for the kernel's khugepaged to move
    them into huge pages in the background (a weight read at batch 1 is faster there)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or covering(0, 1) is None:
        pytest.skip("no MADV_HUGEPAGE or /proc/self/smaps on this system")
    raw = random_blocks(qtype, 64, K * 4, np.random.default_rng(9))
    tiles = repack_parts([raw], qtype.name)
    (mapping,) = covering(tiles.ctypes.data, tiles.nbytes)
    assert mapping.start <= tiles.ctypes.data and tiles.ctypes.data + tiles.nbytes <= mapping.end
    assert "hg" in mapping.flags


def _fused_qkv(rng) -> tuple[list[np.ndarray], list[QuantWeight]]:
    """A q/k/v as a Q4_K_M file has it: Q4_K q (64 rows) and k (32), Q6_K v (32)."""
    qtypes = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    raws = [random_blocks(q, n, K, rng) for q, n in zip(qtypes, (64, 32, 32))]
    return raws, [QuantWeight.from_raw(r, q, (r.shape[0], K)) for r, q in zip(raws, qtypes)]


def test_block_linear_takes_q4_k_as_tiles_for_prompts_and_decode_steps():
    """A fused q/k/v of Q4_K, Q4_K, Q6_K: each run as tiles, resident as tiles (the
    file's bytes not counted), and a prompt's rows equal to decoding each alone."""
    rng = np.random.default_rng(7)
    raws, parts = _fused_qkv(rng)
    lin = BlockLinear(parts)
    tiled = [g for g in lin._groups if g.tiles is not None]
    assert [len(g.parts) for g in tiled] == [2, 1] and lin.repacked() == parts
    assert lin.nbytes() == tiled[0].tiles.nbytes + tiled[1].tiles.nbytes
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(8))
    with prompt_rows(True):
        prompt = lin(x)
    with prompt_rows(False):
        one = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
        batch = lin(x)
    assert torch.equal(prompt, one) and torch.equal(batch, one)
    w = np.concatenate([reference_dequantize(r, Q.Q4_K, (r.shape[0], K)) for r in raws[:2]])
    ref = x.double().numpy() @ w.T.astype(np.float64)
    scale = np.abs(x.double().numpy()) @ np.abs(w.T.astype(np.float64))
    # the activations' rounding: Q4_K reads them within (1/32 + 1/512) / 127 of each
    # block's largest (its coarse levels), errors of random sign
    assert (np.abs(prompt[:, :96].numpy() - ref) / scale.max()).max() < 5e-4


def test_an_output_permutation_within_tiled_parts_goes_into_the_tiles():
    """llama's q/k rows, which the file holds permuted per head: tiled in the order the
    model reads them, so each output column is the unpermuted product's column, bit for
    bit, with nothing permuted after the product; the tiles' bytes are what they were.
    A permutation across parts stays on the products, to the same values."""
    rng = np.random.default_rng(11)
    raws, parts = _fused_qkv(rng)
    gen = torch.Generator().manual_seed(12)
    # per part (q, k: per head of 16 rows; v untouched), as the loader builds it
    heads = [torch.randperm(16, generator=gen) + 16 * h for h in range(6)]
    within = torch.cat([*heads, torch.arange(96, 128)])
    across = torch.randperm(128, generator=gen)
    plain = BlockLinear(parts)
    folded = BlockLinear(parts, perm=within)
    moved = BlockLinear(parts, perm=across)
    assert folded.nbytes() == plain.nbytes() == moved.nbytes()
    x = torch.randn(40, K, generator=gen)
    for prompt, rows in ((False, 1), (False, 5), (True, 40)):
        with prompt_rows(prompt):
            want = plain(x[:rows])
            assert torch.equal(folded(x[:rows]), want[:, within])
            assert torch.equal(moved(x[:rows]), want[:, across])


def test_a_prompts_norm_and_gate_in_tiles_are_the_decode_steps():
    """Every part in tiles: a prompt's rows (more than one call takes) go through the
    decode step's fused norm (the residual added in place first) and gate, each row the
    bits of decoding it alone, and near the torch ops followed by the projection."""
    import torch.nn.functional as F

    from kernels.quant.linear import LANE_PROMPT_ROWS

    rng = np.random.default_rng(9)
    raws = [random_blocks(q, n, K, rng) for q, n in ((Q.Q4_K, 32), (Q.Q6_K, 16))]
    parts = [QuantWeight.from_raw(r, q, (r.shape[0], K)) for r, q in zip(raws, KINDS)]
    lin = BlockLinear(parts)
    gen = torch.Generator().manual_seed(10)
    rows = LANE_PROMPT_ROWS + 21
    x = torch.randn(rows, K, generator=gen) * 2
    residual = torch.randn(rows, K, generator=gen)
    w = 1 + 0.1 * torch.randn(K, generator=gen)
    gate_up = torch.randn(rows, 2 * K, generator=gen)
    assert lin.fuses(x)
    summed = x + residual
    with prompt_rows(True):
        normed = lin.normed(x, w, 1e-6, residual)
        gated = lin.gated(gate_up, gelu=False)
        want_normed = lin(F.rms_norm(summed, (K,), w, 1e-6))
        g, u = gate_up.split(K, dim=-1)
        want_gated = lin(F.silu(g) * u)
    assert torch.equal(x, summed)  # the residual added in place, torch's float32 sums
    with prompt_rows(False):
        for b in (0, 5, LANE_PROMPT_ROWS - 1, LANE_PROMPT_ROWS, rows - 1):
            alone = summed[b : b + 1].clone()
            assert torch.equal(lin.normed(alone, w, 1e-6)[0], normed[b])
            assert torch.equal(lin.gated(gate_up[b : b + 1], gelu=False)[0], gated[b])
    for got, want in ((normed, want_normed), (gated, want_gated)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())


def _mapped_pages(a: np.ndarray) -> int:
    """Pages of ``a`` mapped into this process now (/proc/self/pagemap's present bit)."""
    first, last = a.ctypes.data // 4096, (a.ctypes.data + a.nbytes - 1) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


def test_a_loaded_models_repacked_file_bytes_leave_the_resident_set(tmp_path):
    """A Q4_K_M model: its Q4_K / Q6_K projections held as tiles, their file pages
    (read once to repack) unmapped and left out of the prefault, and so is the token
    embedding's table, whose rows are read from the file."""
    import threading

    from engine.model.loader import load_model
    from tests.engine.test_forward_tiny import FILE_MIXES
    from tests.engine.tiny_models import make_hf_model, write_gguf

    model = make_hf_model("llama", seed=4, tie_word_embeddings=False, hidden_size=256)
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=2)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    for t in threading.enumerate():
        if t.name == "folio-prefault":
            t.join(timeout=60)
    layer = loaded.model.layers[0]
    repacked = [p for lin in (layer.qkv, layer.gate_up, layer.down) for p in lin.repacked()]
    assert repacked and all(p.nbytes >= 3 * 4096 for p in repacked)
    # whole pages inside each part unmapped (a part's first and last may share a page)
    assert all(_mapped_pages(p.data) <= 2 for p in repacked)
    # the embedding's rows are read from the file (GGUFFile.row_reader): its pages are
    # neither prefaulted nor mapped by lookups, and the rows are the mapping's
    embedding = loaded.model.embedding
    assert embedding.read is not None and _mapped_pages(embedding.weight.data) <= 2
    tokens = torch.tensor([[0, 7, 300, embedding.shape[0] - 1]])
    rows = embedding(tokens)
    assert _mapped_pages(embedding.weight.data) <= 2
    assert torch.equal(rows, BlockEmbedding(embedding.weight)(tokens))


def test_q4_k_tiles_take_the_files_bytes():
    """A Q4_K tile record holds 16 rows' super-blocks in the file's 2,304 bytes (the
    scales and mins in 6 bits, as the file packs them): a weight's tiles are its bytes,
    padded to whole tiles of 16 rows only."""
    rng = np.random.default_rng(3)
    raw = random_blocks(Q.Q4_K, 48, K, rng)
    tiles = repack_parts([raw], "Q4_K")
    assert tiles.nbytes == raw.nbytes == tiles_nbytes(48, K, "Q4_K")
    assert tiles_nbytes(37, K, "Q4_K") == 48 * (K // 256) * 144


def test_amx_kernel_compiles_for_a_cpu_with_amx():
    """The AMX tile kernel's code for Sapphire Rapids, built on any machine (this one may
    have no AMX to run it): the matrix unit's dot products, the Q4_K record's scales and
    mins unpacked from their 6 bits (shifts and masks) and the VNNI steps that follow."""
    import re

    from numba import types

    from kernels.quant.amx import tile_dot_amx
    from tests.kernels.test_quant_matmul import _asm_for

    u, i, lit = types.uintp, types.intp, types.literal
    for kind in (KBLOCK_CODES["Q4_K"], Q6_K_INT):
        args = [u, i, u, i, i, u, i, u, i, u, u, lit(kind), lit(True)]
        asm = _asm_for(tile_dot_amx, args, "sapphirerapids")
        assert "tdpbsud" in asm and "tilerelease" in asm and re.search(r"vpdpwssd\s", asm)
        if kind == KBLOCK_CODES["Q4_K"]:
            assert re.search(r"vpsrld\s[^\n]*%zmm", asm) and re.search(r"vpandd?\s", asm)


@pytest.mark.skipif(not amx_ready(), reason="no AMX-INT8 here, or the tile state was refused")
@pytest.mark.parametrize("qtype", KINDS)
@pytest.mark.parametrize("tokens", [16, 21, 40])
def test_amx_gives_the_tiles_the_vnni_kernels_bits(qtype, tokens):
    """On AMX the tiles take 16 tokens at a time to the matrix unit: every token's
    result is the VNNI kernel's, bit for bit (the same integer sums, the same float
    steps in the same order), and matches the dequantized product; extreme codes,
    scales and activations too."""
    code = KBLOCK_CODES[qtype.name]

    def both(raw, x):
        tiles = repack_parts([raw], qtype.name)
        act = quantize_super_blocks(x, levels=2)
        outs = []
        for amx in (None, False):  # None: AMX, as the model's projections take it
            out = np.full((len(x), len(raw)), np.nan, np.float32)
            tile_rows(code, tiles, len(raw), act, out, 2, amx=amx)
            outs.append(out)
        assert np.array_equal(outs[0], outs[1])
        return outs[0], act

    rng = np.random.default_rng(tokens)
    raw = random_blocks(qtype, 37, K, rng)
    out, act = both(raw, rng.standard_normal((tokens, K)).astype(np.float32))
    w = reference_dequantize(raw, qtype, (37, K)).astype(np.float64)
    ref = _exact(act, tokens, qtype) @ w.T
    scale = np.abs(_exact(act, tokens, qtype)) @ np.abs(w).T
    assert np.abs(out - ref).max() / scale.max() < 1e-6
    _extreme_blocks(raw, qtype)
    x = np.full((tokens, K), 3.0, np.float32)
    x[1::2, ::2] = -3.0
    out, act = both(raw, x)
    ref = (
        _exact(act, tokens, qtype) @ reference_dequantize(raw, qtype, (37, K)).astype(np.float64).T
    )
    assert np.allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", KINDS)
def test_the_tile_bench_times_every_path_it_can_take(qtype):
    """``python -m kernels.quant.bench --tiles``: each token count through VNNI, and
    through AMX exactly where this CPU grants it, cold (copies in rotation) and warm, each
    a positive time per matrix."""
    from kernels.quant.bench import bench_tiles

    res = bench_tiles(qtype, 1, np.random.default_rng(0), (32, 512), (16, 19), 1 << 15)
    paths = {"vnni", "amx"} if amx_ready() else {"vnni"}
    expected = {(t, p, temp) for t in (16, 19) for p in paths for temp in ("cold", "warm")}
    assert set(res) == expected
    assert all(np.isfinite(sec) and sec > 0 for sec in res.values())


def test_each_q6_k_arithmetic_has_its_own_cache_fingerprint(monkeypatch):
    """K/V pages kept on disk under one Q6_K arithmetic (scales in float steps, or in
    integers where AMX serves Q6_K) are not reused under the other: the model's
    fingerprint names it; modes without tiles name neither."""
    from engine.model import loader

    tags = set()
    for integer in (False, True):
        monkeypatch.setattr(loader, "Q6_K_INTEGER", integer)
        tags.add(loader._kernels("native"))
        assert loader._kernels("dequant") == ""
    assert len(tags) == 2


def test_a_layout_with_the_same_bits_keeps_the_kv_fingerprint(monkeypatch):
    """K/V pages kept on disk follow the tiles' arithmetic, not their layout: a new tile
    format that computes the same bits (tiles4: Q4_K's scales in the file's 6 bits) keeps
    the model's fingerprint, so a prompt cache kept before an update is still read; a new
    arithmetic changes it."""
    from engine.model import loader

    before = loader._kernels("native")
    monkeypatch.setattr(loader, "TILES_FORMAT", "tiles-next", raising=False)
    monkeypatch.setattr("kernels.quant.tiles.TILES_FORMAT", "tiles-next")
    assert loader._kernels("native") == before
    monkeypatch.setattr(loader, "TILES_ARITHMETIC", "tiles-other")
    assert loader._kernels("native") != before
