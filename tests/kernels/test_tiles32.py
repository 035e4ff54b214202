"""The blocks of 32 in tiles (kernels/quant/tiles32.py): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
repacked at load into the file's bytes, one kernel at every batch size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kernels.quant.activations import two_level_activations
from kernels.quant.bench import random_blocks
from kernels.quant.linear import BlockLinear, prompt_rows
from kernels.quant.reference import reference_dequantize
from kernels.quant.tiles import repack_parts, tiles_nbytes, tiles_supported
from kernels.quant.tiles32 import LAYOUTS, tile_rows32
from kernels.quant.weight import QuantWeight

K = 640  # Gemma 3 270M's width: not a multiple of 256
KINDS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]

pytestmark = pytest.mark.skipif(
    not tiles_supported("Q8_0"), reason="this CPU has no AVX-512 VNNI: these stay in file blocks"
)


def test_every_block_of_32_has_a_layout():
    assert sorted(k.name for k in LAYOUTS) == sorted(q.name for q in KINDS)
    for q in KINDS:
        assert tiles_supported(q.name)


def _product(qtype, tiles, n, x):
    act = two_level_activations(x)
    out = np.full((len(x), n), np.nan, np.float32)
    tile_rows32(qtype.name, tiles, n, act, out, 2)
    return out, act


def _exact(act, tokens: int) -> np.ndarray:
    """float64 ``[T, K]``: the two levels' values the kernel multiplies, summed."""
    v = act.dequantize().astype(np.float64)
    return v[:tokens] + v[tokens:]


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [1, 3, 9, 21])
def test_tiles_equal_the_dequantized_product(qtype, tokens):
    """37 rows (a short last tile) against the gguf dequantizer times the activations'
    exact values: float32 rounding only; the tiles take the file's bytes, no more."""
    rng = np.random.default_rng(tokens)
    raw = random_blocks(qtype, 37, K, rng)
    tiles = repack_parts([raw], qtype.name)
    assert tiles.nbytes == tiles_nbytes(37, K, qtype.name) == 3 * 16 * raw.shape[1]
    assert tiles.ctypes.data % 64 == 0
    x = rng.standard_normal((tokens, K)).astype(np.float32)
    out, act = _product(qtype, tiles, 37, x)
    w = reference_dequantize(raw, qtype, (37, K)).astype(np.float64)
    ref = _exact(act, tokens) @ w.T
    scale = np.abs(_exact(act, tokens)) @ np.abs(w).T
    assert np.abs(out - ref).max() / scale.max() < 1e-6
    # and the input itself, within the two levels' rounding
    assert np.abs(out - x.astype(np.float64) @ w.T).max() / scale.max() < 1e-4


def _extreme(raw: np.ndarray, qtype, top: bool) -> np.ndarray:
    """``raw``'s blocks, in place, every code at one extreme (Q8_0: -128 or 127; the
    others 0 or their largest, fifth bits included), d 0.5, minimums -2."""
    layout = next(k for k in LAYOUTS if k.name == qtype.name)
    blocks = raw.reshape(len(raw), -1, layout.block)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    if layout.has_min:
        blocks[:, :, 2:4] = np.frombuffer(np.float16(-2.0).tobytes(), np.uint8)
    if qtype == Q.Q8_0:
        blocks[:, :, 2:] = 0x7F if top else 0x80
    else:
        blocks[:, :, layout.qs_at :] = 0xFF if top else 0
        if layout.qh_at >= 0:
            blocks[:, :, layout.qh_at : layout.qh_at + 4] = 0xFF if top else 0
    return raw


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
@pytest.mark.parametrize("top", [False, True])
def test_extreme_codes_and_activations_do_not_wrap(qtype, top):
    """Every code at an extreme (Q8_0's -128 is stored as 0 after the offset of 128),
    activations at theirs, both levels: the integer sums stay exact."""
    rng = np.random.default_rng(0)
    raw = _extreme(random_blocks(qtype, 16, K, rng), qtype, top)
    tiles = repack_parts([raw], qtype.name)
    x = np.full((3, K), 3.0, np.float32)
    x[1, ::2] = -3.0
    x[2] = 126.5  # the second level at its top too
    x[2, ::32] = 127.0
    out, act = _product(qtype, tiles, 16, x)
    assert act.q[5].max() == 127 and act.q[2].max() == 127
    w = reference_dequantize(raw, qtype, (16, K)).astype(np.float64)
    assert w.min() == w.max()  # every weight at the extreme
    ref = _exact(act, 3) @ w.T
    assert np.allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_a_rows_result_does_not_depend_on_the_batch(qtype):
    """Each token alone, in calls of 8 / 4 / 2 / 1 within any batch, the same bits."""
    rng = np.random.default_rng(5)
    raw = random_blocks(qtype, 48, K, rng)
    tiles = repack_parts([raw], qtype.name)
    x = rng.standard_normal((21, K)).astype(np.float32)
    full, _ = _product(qtype, tiles, 48, x)
    for t in range(len(x)):
        alone, _ = _product(qtype, tiles, 48, x[t : t + 1])
        assert np.array_equal(alone[0], full[t])
    part, _ = _product(qtype, tiles, 48, x[3:10])
    assert np.array_equal(part, full[3:10])


def test_wrong_activations_are_refused():
    rng = np.random.default_rng(1)
    tiles = repack_parts([random_blocks(Q.Q8_0, 16, K, rng)], "Q8_0")
    act = two_level_activations(rng.standard_normal((2, K)).astype(np.float32))
    with pytest.raises(ValueError, match="two levels"):
        tile_rows32("Q8_0", tiles, 16, act, np.empty((4, 16), np.float32), 2)
    moved = np.empty(tiles.nbytes + 64, np.uint8)[8 : 8 + tiles.nbytes].reshape(tiles.shape)
    moved[:] = tiles  # its vector loads need 64-byte lines: an error, not a crash
    with pytest.raises(ValueError, match="64-byte"):
        tile_rows32("Q8_0", moved, 16, act, np.empty((2, 16), np.float32), 2)
    small = two_level_activations(rng.standard_normal((2, 320)).astype(np.float32))
    with pytest.raises(ValueError, match="activations of 320"):
        tile_rows32("Q8_0", tiles, 16, small, np.empty((2, 16), np.float32), 2)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q5_0], ids=lambda q: q.name)
def test_block_linear_takes_them_as_tiles_for_prompts_and_decode_steps(qtype):
    """A head (a vocabulary of rows that is not a whole number of tiles): held as tiles
    the size of its file bytes, every row count through them, so a prompt's rows, a
    batch's and a row decoded alone have the same bits; near the exact product."""
    rng = np.random.default_rng(2)
    n = 1000
    raw = random_blocks(qtype, n, K, rng)
    lin = BlockLinear([QuantWeight.from_raw(raw, qtype, (n, K))])
    assert lin._groups[0].tiles is not None and lin.repacked()
    assert lin.nbytes() == tiles_nbytes(n, K, qtype.name) <= raw.nbytes + 16 * raw.shape[1]
    x = torch.randn(70, K)
    prompt = lin(x)  # more rows than a decode call: a prompt's
    with prompt_rows(False):
        batch = lin(x[:16])
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(prompt, alone) and torch.equal(batch, alone[:16])
    w = reference_dequantize(raw, qtype, (n, K))
    exact = x.double() @ torch.from_numpy(w).double().T
    assert (prompt.double() - exact).abs().max() / exact.abs().max() < 1e-4


def test_the_tile_bench_times_both_kernels_on_the_same_activations():
    """``python -m kernels.quant.bench --tiles32``: each token count through the tiles and
    through the per-32 kernel, cold and warm, each a positive time per matrix."""
    from kernels.quant.bench import bench_tiles32

    res = bench_tiles32(Q.Q5_0, 1, np.random.default_rng(0), (32, 640), (1, 9), 1 << 15)
    expected = {
        (t, p, temp) for t in (1, 9) for p in ("tiles", "block32") for temp in ("cold", "warm")
    }
    assert set(res) == expected
    assert all(np.isfinite(sec) and sec > 0 for sec in res.values())
