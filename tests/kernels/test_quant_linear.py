"""kernels.quant.linear: the model's projections and embedding on the file's blocks,
against the gguf package's dequantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kernels.quant import (
    DECODE_MAX_ROWS,
    QuantWeight,
    decode_matmul,
    prefill_matmul,
    quantize_activations,
)
from kernels.quant.activations import quantize_super_blocks
from kernels.quant.bench import random_blocks
from kernels.quant.lanes import lanes_supported
from kernels.quant.linear import BlockEmbedding, BlockLinear, two_level_activations
from kernels.quant.reference import reference_dequantize
from kernels.quant.registry import ActivationFormat
from kernels.quant.tiles import repack_parts, tiles_nbytes, tiles_supported
from kernels.quant.tiles32 import tile_rows32

Q = GGMLQuantizationType
K = 512


def _weight(qtype, n: int, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    raw = random_blocks(qtype, n, K, np.random.default_rng(seed))
    w = QuantWeight.from_raw(raw, qtype, (n, K))
    return w, torch.from_numpy(reference_dequantize(raw, qtype, (n, K)).astype(np.float32))


def test_two_level_activations_are_x_and_its_rounding_error():
    """Rows 0..B-1 are the one-level activations bit for bit; rows B..2B-1 quantize what
    they left at exactly 1/256 of the first level's scale (numpy's float32 steps), with
    the float sums of their codes, the sums of both levels per 32 (``pair32``) and each
    element's two codes as one int16; the two levels together are ~127x closer to x."""
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32) * 4
    x[1, 7] = 90.0  # an outlier channel
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, no second level
    one = quantize_activations(x)
    two = two_level_activations(x)
    assert np.array_equal(two.q[:3], one.q) and np.array_equal(two.scale[:3], one.scale)
    for name in ("sum16", "sum32"):
        assert np.array_equal(getattr(two, name)[:3], getattr(one, name))
    d = np.repeat(one.scale, 32, axis=1)
    rest = x - one.q * d
    inv = np.where(d > 0, np.float32(256) / np.where(d > 0, d, 1), np.float32(0))
    codes = np.clip(np.rint(rest * inv), -127, 127)
    assert np.array_equal(two.q[3:], codes)
    assert np.array_equal(two.scale[3:], one.scale / np.float32(256))
    q0, q1 = two.q[:3].astype(np.int64), two.q[3:].astype(np.int64)
    for size, sums in ((16, two.sum16[3:]), (32, two.sum32[3:])):
        scale = np.repeat(two.scale[3:], 32 // size, axis=1)
        assert np.array_equal(sums, q1.reshape(3, -1, size).sum(-1).astype(np.float32) * scale)
    paired = (256 * q0 + q1).reshape(3, -1, 32).sum(-1)
    assert np.array_equal(two.pair32, paired.astype(np.float32) * two.scale[3:])
    assert np.array_equal(two.widened(), 256 * q0 + q1) and two.widened().dtype == np.int16
    with pytest.raises(ValueError, match="two levels"):
        one.widened()
    deq = two.dequantize()
    err_one = np.abs(one.dequantize() - x).max()
    err_two = np.abs(deq[:3] + deq[3:] - x).max()
    assert err_two < err_one / 50, (err_one, err_two)


def test_two_level_super_blocks_are_x_and_its_rounding_error():
    """The per-256 format of the k-quant kernels: one amax per 256 elements, codes within
    [-127, 127] and at 127 where |x| is largest, integer sums per 16 and 32 of the codes;
    the second level quantizes what the first left at 1/256 of its scale, and the two are
    ~127x closer to x."""
    x = np.random.default_rng(2).standard_normal((3, K)).astype(np.float32) * 4
    x[1, 7] = 90.0  # an outlier channel, as LLM activations have
    two = quantize_super_blocks(x, levels=2)
    one = quantize_super_blocks(x)
    assert np.array_equal(two.q[:3], one.q) and np.array_equal(two.d[:3], one.d)
    amax = np.abs(x.reshape(3, -1, 256)).max(-1)
    assert np.allclose(one.d, amax / 127, rtol=1e-6)
    assert np.abs(one.q).max() == 127 and one.q.min() >= -127
    q = one.q.astype(np.int64)
    assert np.array_equal(one.bsum16, q.reshape(3, -1, 16).sum(-1))
    assert np.array_equal(one.bsum32, q.reshape(3, -1, 32).sum(-1))
    # Q4_K's order: the second and third 32 of every 128 swapped
    assert np.array_equal(one.q_k4, one.q.reshape(3, -1, 4, 32)[:, :, [0, 2, 1, 3]].reshape(3, K))
    assert np.array_equal(
        two.q_k4[3:], two.q[3:].reshape(3, -1, 4, 32)[:, :, [0, 2, 1, 3]].reshape(3, K)
    )
    # the second level: what the first left, at exactly 1/256 of its scale
    rest = x.reshape(3, -1, 256) - one.q.reshape(3, -1, 256) * one.d[:, :, None]
    codes = np.clip(np.rint(rest * (np.float32(256) / one.d[:, :, None])), -127, 127)
    assert np.array_equal(two.d[3:], one.d / np.float32(256))
    assert np.array_equal(two.q[3:], codes.reshape(3, K))  # numpy's float32 steps, exactly
    # the paired sums the kernels read per token: 256 x the first level's plus the second's
    for size, mine, pair in ((16, two.bsum16, two.pair16), (32, two.bsum32, two.pair32)):
        assert np.array_equal(pair, 256 * mine[:3] + mine[3:])
        assert np.array_equal(mine[3:], two.q[3:].astype(np.int64).reshape(3, -1, size).sum(-1))
    assert one.pair16 is None
    deq = two.dequantize()
    err_one = np.abs(one.dequantize() - x).max()
    err_two = np.abs(deq[:3] + deq[3:] - x).max()
    assert err_two < err_one / 50, (err_one, err_two)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_super_blocks(x[:, :96])


def test_activation_codes_are_round_half_even_of_x_over_scale():
    """Both formats' first level is ``rint(x * 127 / amax)`` in float32 (ties to even:
    the scale is chosen so that some values land on .5), with ``amax`` each block's
    largest magnitude, the block's sign bits ignored (-0.0 and 0.0 blocks alike give
    zeros and a zero scale)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, K)) * rng.exponential(1.0, (4, K))).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :256] = -0.0
    x[2, 0] = 127.0  # amax 127: the codes are x rounded, its half-integers ties
    x[2, 1:256] = np.arange(255, dtype=np.float32) % 253 - np.float32(125.5)
    x[3, 300] = -1e4  # the largest magnitude negative
    for size, act, codes, scale in (
        (32, quantize_activations(x), "q", "scale"),
        (256, quantize_super_blocks(x), "q", "d"),
    ):
        blocks = x.reshape(4, -1, size)
        amax = np.abs(blocks).max(-1)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
        want = np.clip(np.rint(blocks * inv.astype(np.float32)[..., None]), -127, 127)
        assert np.array_equal(getattr(act, codes), want.reshape(4, K).astype(np.int8)), size
        assert np.array_equal(getattr(act, scale), (amax / np.float32(127)).astype(np.float32))
    assert quantize_super_blocks(x).q[3, 300] == -127
    ties = quantize_super_blocks(x).q[2, 1:256].astype(int)
    assert np.array_equal(ties, 2 * np.round(x[2, 1:256] / 2))  # -125.5 -> -126, 0.5 -> 0


def test_a_nan_activation_makes_its_block_nan_not_a_number_in_range():
    """A NaN in a layer's input (a broken model or file) gives its block a NaN scale, so
    the products it reaches are NaN as float arithmetic would make them, rather than a
    finite value the NaN was silently clamped to; the other blocks are unchanged."""
    x = np.random.default_rng(6).standard_normal((2, K)).astype(np.float32)
    bad = x.copy()
    bad[1, 260] = np.nan
    for clean, broken in (
        (quantize_super_blocks(x, levels=2), quantize_super_blocks(bad, levels=2)),
        (quantize_activations(x), quantize_activations(bad)),
    ):
        scale = "d" if hasattr(clean, "d") else "scale"
        size = K // getattr(clean, scale).shape[1]
        s_clean, s_bad = getattr(clean, scale), getattr(broken, scale)
        assert np.isnan(s_bad[1, 260 // size])
        mask = np.ones_like(s_bad, bool)
        mask[1, 260 // size] = False
        if s_bad.shape[0] == 4:  # the second level's rows
            mask[3, 260 // size] = False
        assert np.array_equal(s_bad[mask], s_clean[mask])
        assert np.isnan(broken.dequantize()[1, 260])


def test_k_quant_only_projections_skip_the_per_32_format():
    """A fused Q4_K / Q6_K projection quantizes its input per 256 only, the same
    activations as the per-32 ones' own super-blocks; a per-32 type refuses the
    super-block format."""
    parts = [_weight(Q.Q4_K, 64, 1)[0], _weight(Q.Q6_K, 32, 2)[0]]
    lin = BlockLinear(parts)
    x = torch.randn(3, K)
    via_per32 = two_level_activations(x.numpy()).super_blocks()
    direct = quantize_super_blocks(x.numpy(), levels=2)
    for name in ("q", "q_k4", "d", "bsum16", "bsum32", "pair16", "pair32"):
        assert np.array_equal(getattr(via_per32, name), getattr(direct, name)), name
    # the two levels summed per token in the kernel (paired) or as two products: the same
    # integers, rounded in float in another order; where Q4_K is tiled, its columns from
    # the coarse levels (the second at 1/16 of the first's scale: kernels/quant/tiles.py)
    want = np.concatenate([decode_matmul(direct, p) for p in parts], axis=1)
    want = want[:3] + want[3:]
    got = lin(x).numpy()
    coarse = 64 if tiles_supported("Q4_K") else 0
    tol = 1e-5 * np.abs(got).max()
    assert np.allclose(got[:, coarse:], want[:, coarse:], rtol=1e-5, atol=tol)
    if coarse:  # (none without the tiles: an empty slice has no maximum)
        assert np.abs(got[:, :coarse] - want[:, :coarse]).max() < 100 * tol
    with pytest.raises(ValueError, match="per 32"):
        decode_matmul(quantize_super_blocks(x.numpy()), _weight(Q.Q8_0, 32, 3)[0])


def test_consecutive_parts_of_one_type_are_one_call():
    """Runs of parts of one block type (q/k as Q4_K, v as Q6_K in a Q4_K_M layer; q/k/v
    all Q4_1 in SmolLM2's file) are multiplied in one kernel call over their row tables,
    each run writing its own columns with the two levels summed in the kernel: the same
    bits as each part alone, and (per-32 types) the product of both levels' values."""
    qtypes = (Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q8_0, Q.Q4_K, Q.Q4_K)
    parts = [_weight(qt, 32 + 16 * i, seed=10 + i)[0] for i, qt in enumerate(qtypes)]
    lin = BlockLinear(parts)
    runs = [(g.first, g.columns, [p.qtype for p in g.parts]) for g in lin._groups]
    assert runs == [
        (0, 80, [Q.Q4_K, Q.Q4_K]),
        (80, 64, [Q.Q6_K]),
        (144, 176, [Q.Q8_0, Q.Q8_0]),
        (320, 240, [Q.Q4_K, Q.Q4_K]),
    ]
    for b in (1, 2, 3, 5):
        x = torch.randn(b, K)
        alone = torch.cat([BlockLinear([p])(x) for p in parts], dim=1)
        assert torch.equal(lin(x), alone)
        act = two_level_activations(x.numpy())
        if tiles_supported("Q8_0"):  # kernels/quant/tiles32.py: both levels in the kernel
            y = np.empty((b, 176), np.float32)
            tiles = repack_parts([p.data for p in parts[3:5]], "Q8_0")
            tile_rows32("Q8_0", tiles, 176, act, y, 2)
            assert torch.equal(alone[:, 144:320], torch.from_numpy(y))
        else:  # kernels/quant/block32.py: both levels as one int16 product
            xq = act.dequantize().astype(np.float64)
            xq = xq[:b] + xq[b:]
            refs = [_weight(qtypes[i], 32 + 16 * i, seed=10 + i)[1] for i in (3, 4)]
            w = torch.cat(refs).numpy().astype(np.float64)
            err = np.abs(alone[:, 144:320].numpy() - xq @ w.T)
            assert np.all(err <= 1e-5 * (np.abs(xq) @ np.abs(w).T))
    # a prompt's rows: the super-block runs through the prompt kernel in lanes, or where
    # the CPU has none the decode kernel (row by row the same bits), each run as its parts
    # alone; the Q8_0 parts in tiles as decoding each row alone, or through float32 tiles
    x = torch.randn(2 * DECODE_MAX_ROWS + 3, K)
    got = lin(x)
    alone = torch.cat([BlockLinear([p])(x) for p in parts], dim=1)
    assert torch.equal(got[:, :144], alone[:, :144]) and torch.equal(got[:, 320:], alone[:, 320:])
    # where the CPU takes Q4_K as tiles (kernels/quant/tiles.py) or has no lanes, a
    # prompt row's Q4_K columns are what decoding it alone gives
    rows = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    if tiles_supported("Q4_K") or not lanes_supported("Q4_K"):
        assert torch.equal(got[:, :80], rows[:, :80])
        assert torch.equal(got[:, 320:], rows[:, 320:])
    if not lanes_supported("Q6_K"):
        assert torch.equal(got[:, 80:144], rows[:, 80:144])
    if tiles_supported("Q8_0"):
        assert torch.equal(got[:, 144:320], rows[:, 144:320])
    else:
        tiles = [prefill_matmul(x, p, dtype=torch.float32) for p in parts[3:5]]
        assert torch.equal(got[:, 144:320], torch.cat(tiles, dim=1))


@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0,), (Q.Q4_0, Q.F16)])
def test_fused_parts_equal_the_dequantized_product(qtypes):
    """A fused q/k/v of mixed types (as Q4_K_M files have) with a bias and an output
    permutation: decode rows within 1e-4 of the exact product, prefill rows (float32
    tiles) within float32 rounding; with block types only, each row the same alone as in
    any batch."""
    parts, dense = [], []
    for i, qtype in enumerate(qtypes):
        if qtype == Q.F16:
            w16 = (torch.randn(64, K) * 0.05).half()
            parts.append(QuantWeight.from_raw(w16.numpy(), qtype, (64, K)))
            dense.append(w16.float())
        else:
            w, d = _weight(qtype, 96 + 32 * i, seed=i)
            parts.append(w)
            dense.append(d)
    full = torch.cat(dense)
    n = full.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(n)
    lin = BlockLinear(parts, bias, perm)
    # Q4_K / Q6_K parts on AVX-512 VNNI: their tiles (kernels/quant/tiles.py; Q6_K's
    # records padded to 64-byte lines)
    resident = sum(
        tiles_nbytes(*p.shape, p.qtype.name) if tiles_supported(p.qtype.name) else p.nbytes
        for p in parts
    )
    assert lin.out_features == n and lin.nbytes() == resident + 4 * n
    x = torch.randn(DECODE_MAX_ROWS + 5, K)
    exact = (x.double() @ full.double().T)[:, perm].float() + bias
    scale = (x.abs().double() @ full.abs().double().T)[:, perm].float()
    # two levels of int8 activations: within 1e-4, but Q4_K's tiles read them coarser
    # (the second level at 1/16 of the first's scale, ~12 bits: kernels/quant/tiles.py)
    tol = 1e-3 if Q.Q4_K in qtypes and tiles_supported("Q4_K") else 1e-4
    decode = lin(x[:7])
    assert ((decode - exact[:7]).abs() / scale[:7]).max() < tol
    prefill = lin(x)  # more rows than one decode call takes
    if all(p.kind.activation is ActivationFormat.Q8_256 for p in parts):
        if all(lanes_supported(p.kind.name) for p in parts):
            # the prompt kernel in lanes (tests/kernels/test_lanes.py): each row the
            # same in any prompt of more than DECODE_MAX_ROWS rows
            assert torch.equal(lin(x[4:]), prefill[4:])
        else:  # the decode kernel in chunks, each row as decoding it alone gives
            assert torch.equal(prefill, torch.cat([lin(x[i : i + 1]) for i in range(len(x))]))
        assert ((prefill - exact).abs() / scale).max() < tol
    else:  # float32 tiles
        assert ((prefill - exact).abs() / scale).max() < 1e-5
    if not any(p.is_float for p in parts):  # torch's GEMM (float parts) promises no such thing
        for b in (1, 2, 5):
            assert torch.equal(lin(x[:b]), decode[:b])
    assert lin(x[:7].reshape(7, 1, K)).shape == (7, 1, n)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.F32])
def test_float_parts_of_any_width_take_the_fused_norm_and_gate(qtype):
    """A projection whose parts are all float (a F16 / BF16 / F32 file's) reads no int8
    activations: its rows may be any width (576: SmolLM2's, not a multiple of the 256
    that super-block activations need), and the fused norm, gate and plain rows give
    the product of torch's norm and gate with the exact weights."""
    import torch.nn.functional as F

    from kernels.quant.registry import FLOAT_TYPES

    k, n = 576, 40
    dense = torch.randn(n, k) * 0.05
    if qtype == Q.BF16:
        dense = dense.bfloat16().float()
        raw = dense.bfloat16().view(torch.int16).numpy().view(np.uint16)
    else:
        dense = dense.to(torch.from_numpy(np.empty(0, FLOAT_TYPES[qtype])).dtype).float()
        raw = dense.numpy().astype(FLOAT_TYPES[qtype])
    lin = BlockLinear([QuantWeight.from_raw(raw, qtype, (n, k))])
    x = torch.randn(3, k) * 2
    norm_w = 1 + 0.1 * torch.randn(k)
    gate_up = torch.randn(3, 2 * k)
    exact = x.double() @ dense.double().T
    assert lin.fuses(x)
    assert torch.allclose(torch.from_numpy(lin.rows(x.numpy())), exact.float(), atol=1e-4)
    normed = F.rms_norm(x, (k,), norm_w, 1e-6)
    got = lin.normed(x.clone(), norm_w, 1e-6)
    assert torch.allclose(got, (normed.double() @ dense.double().T).float(), atol=1e-4)
    g, u = gate_up.split(k, dim=-1)
    got = lin.gated(gate_up, gelu=False)
    assert torch.allclose(got, ((F.silu(g) * u).double() @ dense.double().T).float(), atol=1e-4)
    # with a residual, added in place first as for the quantized parts
    stream, residual = x.clone(), torch.randn(3, k)
    got = lin.normed(stream, norm_w, 1e-6, residual)
    assert torch.equal(stream, x + residual)
    summed = F.rms_norm(x + residual, (k,), norm_w, 1e-6)
    assert torch.allclose(got, (summed.double() @ dense.double().T).float(), atol=1e-4)


def test_parts_must_agree():
    a, _ = _weight(Q.Q8_0, 32, 0)
    b = QuantWeight.from_raw(
        random_blocks(Q.Q8_0, 32, 256, np.random.default_rng(0)), Q.Q8_0, (32, 256)
    )
    with pytest.raises(ValueError, match="in_features"):
        BlockLinear([a, b])
    with pytest.raises(ValueError, match="bias"):
        BlockLinear([a], torch.zeros(31))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0, Q.Q4_K, Q.F16])
def test_embedding_rows_are_the_dequantized_rows(qtype):
    if qtype == Q.F16:
        dense = torch.randn(200, K).half()
        table = BlockEmbedding(QuantWeight.from_raw(dense.numpy(), qtype, (200, K)))
        dense = dense.float()
    else:
        w, dense = _weight(qtype, 200, seed=5)
        table = BlockEmbedding(w)
    ids = torch.tensor([[3, 199, 3], [0, 42, 7]])
    rows = table(ids)
    assert rows.shape == (2, 3, K) and rows.dtype == torch.float32
    assert torch.equal(rows, dense[ids])
    assert table(torch.tensor([], dtype=torch.long)).shape == (0, K)
    with pytest.raises(IndexError, match="vocabulary"):
        table(torch.tensor([200]))


@pytest.mark.parametrize("per32", [True, False])
def test_prepared_activations_quantize_the_op_they_compute(per32):
    """The norm before q/k/v or gate/up, and the gate before down, computed in the numba
    call that quantizes them: the float rows within float32 rounding of torch's ops, the
    codes exactly those of quantizing those rows, each row the same alone as in a batch."""
    import torch.nn.functional as F

    from kernels.quant.activations import (
        GELU_TANH_GATE,
        RMS_NORM,
        SILU_GATE,
        prepared_activations,
    )

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, K)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    gate_up = rng.standard_normal((3, 2 * K)).astype(np.float32) * 2
    g, u = torch.from_numpy(gate_up).split(K, dim=-1)
    cases = [
        (x, RMS_NORM, F.rms_norm(torch.from_numpy(x), (K,), torch.from_numpy(w), 1e-5)),
        (gate_up, SILU_GATE, F.silu(g) * u),
        (gate_up, GELU_TANH_GATE, F.gelu(g, approximate="tanh") * u),
    ]
    for rows, op, want in cases:
        act = prepared_activations(rows, op, per32, w if op == RMS_NORM else None, 1e-5)
        assert np.allclose(act.source, want.numpy(), rtol=1e-5, atol=1e-6), op
        again = (
            two_level_activations(act.source)
            if per32
            else quantize_super_blocks(act.source, levels=2)
        )
        assert np.array_equal(act.q, again.q), op
        if per32:
            assert np.array_equal(act.pair32, again.pair32), op
        alone = prepared_activations(rows[1:2], op, per32, w if op == RMS_NORM else None, 1e-5)
        assert np.array_equal(alone.source[0], act.source[1]), op
    with pytest.raises(ValueError, match="weight of shape"):
        prepared_activations(x, RMS_NORM, per32, w[:32])


@pytest.mark.parametrize(
    "per32, prepared, levels",
    # per 32 and prepared activations come in two levels only
    [(False, None, 1)] + [(p, op, 2) for p in (True, False) for op in (None, "norm", "gate")],
)
def test_many_rows_quantize_as_each_row_alone(per32, prepared, levels):
    """From PARALLEL_ROWS rows on, the activations are made with the rows over numba's
    threads: every array the same bits as each row made alone (the serial path)."""
    from kernels.quant.activations import (
        PARALLEL_ROWS,
        RMS_NORM,
        SILU_GATE,
        prepared_activations,
    )

    rows = PARALLEL_ROWS + 3
    rng = np.random.default_rng(9)
    x = rng.standard_normal((rows, 2 * K if prepared == "gate" else K)).astype(np.float32) * 3
    x[2, 5] = 70.0  # an outlier
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    residual = rng.standard_normal((rows, K)).astype(np.float32)

    def make(r: np.ndarray, res: np.ndarray | None):
        if prepared == "norm":
            return prepared_activations(r, RMS_NORM, per32, w, 1e-5, res)
        if prepared == "gate":
            return prepared_activations(r, SILU_GATE, per32)
        return two_level_activations(r) if per32 else quantize_super_blocks(r, levels)

    whole_x = x.copy()
    whole = make(whole_x, residual if prepared == "norm" else None)
    alone = []
    for b in range(rows):
        row = x[b : b + 1].copy()
        alone.append(make(row, residual[b : b + 1] if prepared == "norm" else None))
        if prepared == "norm":
            assert np.array_equal(row[0], whole_x[b])  # the residual added in place
    fields = ("q", "scale", "sum16", "sum32") if per32 else ("q", "q_k4", "d", "bsum16", "bsum32")
    if per32 and levels == 2:
        assert np.array_equal(whole.pair32, np.concatenate([a.pair32 for a in alone]))
        assert np.array_equal(whole.widened(), np.concatenate([a.widened() for a in alone]))
    for name in fields:
        got = getattr(whole, name)
        want = np.concatenate(
            [getattr(a, name)[level : level + 1] for level in range(levels) for a in alone]
        )
        assert np.array_equal(got, want), name
    if not per32 and levels == 2:
        for name in ("pair16", "pair32"):
            want = np.concatenate([getattr(a, name) for a in alone])
            assert np.array_equal(getattr(whole, name), want), name
        assert np.array_equal(
            whole.widened("q4_k"), np.concatenate([a.widened("q4_k") for a in alone])
        )


@pytest.mark.parametrize("per32", [True, False])
def test_prepared_norm_adds_the_residual_first(per32):
    """``RMS_NORM`` with a residual: ``x += residual`` in place, the float32 sums torch's
    add makes, then the activations of the sum exactly as without one."""
    from kernels.quant.activations import RMS_NORM, prepared_activations

    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, K)).astype(np.float32) * 3
    residual = rng.standard_normal((3, K)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    total = (torch.from_numpy(x) + torch.from_numpy(residual)).numpy()
    act = prepared_activations(x, RMS_NORM, per32, w, 1e-5, residual)
    assert np.array_equal(x, total)
    alone = prepared_activations(total, RMS_NORM, per32, w, 1e-5)
    assert np.array_equal(act.source, alone.source) and np.array_equal(act.q, alone.q)
    with pytest.raises(ValueError, match="C-contiguous"):
        prepared_activations(np.asfortranarray(x), RMS_NORM, per32, w, 1e-5, residual)
    with pytest.raises(ValueError, match="residual of shape"):
        prepared_activations(x, RMS_NORM, per32, w, 1e-5, residual[:2])


@pytest.mark.parametrize("qtypes", [(Q.Q4_1, Q.Q4_1, Q.Q4_1), (Q.Q4_K, Q.Q6_K)])
def test_normed_and_gated_projections_equal_the_ops_then_the_projection(qtypes):
    """`BlockLinear.normed` / `gated` (the model's decode path): the projection of the
    norm's or the gate's output to the error of its int8 activations, and each row the
    same bits alone as in any batch."""
    import torch.nn.functional as F

    parts = [_weight(qt, 48, seed=30 + i)[0] for i, qt in enumerate(qtypes)]
    lin = BlockLinear(parts)
    torch.manual_seed(3)
    x = torch.randn(5, K) * 2
    w = 1 + 0.1 * torch.randn(K)
    gate_up = torch.randn(5, 2 * K)
    # more rows than a decode call takes: fused only where every part is in tiles
    # (tests/kernels/test_tiles.py)
    many = torch.randn(DECODE_MAX_ROWS + 1, K)
    assert lin.fuses(x) and lin.fuses(many) == (lin.repacked() == parts)
    g, u = gate_up.split(K, dim=-1)
    for got, want in (
        (lin.normed(x, w, 1e-6), lin(F.rms_norm(x, (K,), w, 1e-6))),
        (lin.gated(gate_up, gelu=False), lin(F.silu(g) * u)),
        (lin.gated(gate_up, gelu=True), lin(F.gelu(g, approximate="tanh") * u)),
    ):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())
    for b in (1, 2, 4):
        assert torch.equal(lin.normed(x[b : b + 1], w, 1e-6)[0], lin.normed(x, w, 1e-6)[b])
        assert torch.equal(lin.gated(gate_up[b : b + 1], True)[0], lin.gated(gate_up, True)[b])
    assert np.array_equal(lin.rows(x.numpy()), lin(x).numpy())  # a decode step's o projection


def test_prefill_writes_into_the_columns_it_is_given():
    """``prefill_matmul(..., out=)`` into a column view of a wider output (how a projection
    of several parts fills one output instead of concatenating copies): those columns hold
    what a fresh output would, the others are untouched."""
    w, _ = _weight(Q.Q4_K, 96, seed=5)
    x = torch.randn(DECODE_MAX_ROWS + 5, K)
    out = torch.full((x.shape[0], 160), 7.0)
    got = prefill_matmul(x, w, dtype=torch.float32, out=out[:, 32:128])
    assert got.data_ptr() == out[:, 32:128].data_ptr()
    assert torch.equal(out[:, 32:128], prefill_matmul(x, w, dtype=torch.float32))
    assert (out[:, :32] == 7).all() and (out[:, 128:] == 7).all()
