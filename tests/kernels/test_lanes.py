"""kernels.quant.lanes: the prompt kernel of Q4_K / Q6_K with weight rows in vector lanes,
against the gguf package's dequantizer times the activations the kernel multiplies by."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kernels.quant import QuantWeight
from kernels.quant.activations import quantize_super_blocks
from kernels.quant.bench import random_blocks
from kernels.quant.lanes import LANES, TOKEN_TILE, lanes_supported
from kernels.quant.linear import LANE_PROMPT_ROWS, BlockLinear
from kernels.quant.matmul import DECODE_MAX_ROWS, decode_tasks, prompt_kernel_args
from kernels.quant.reference import reference_dequantize
from kernels.quant.registry import quant_type
from tests.kernels.test_quant_matmul import _asm_for

Q = GGMLQuantizationType
K = 1024
KINDS = [Q.Q4_K, Q.Q6_K]


def _needs_lanes(qtype):
    if not lanes_supported(qtype.name):
        pytest.skip("this CPU has no AVX2: prompts take the decode kernels here")


def _parts(qtype, counts, seed):
    """Weights of ``counts`` rows each, apart in memory (a fused projection's parts), as
    the part table the kernels take, and their dequantized rows (float64)."""
    rng = np.random.default_rng(seed)
    raws = [random_blocks(qtype, n, K, rng) for n in counts]
    table = np.array([[r.ctypes.data, r.shape[0]] for r in raws], np.int64)
    dense = np.concatenate([reference_dequantize(r, qtype, (r.shape[0], K)) for r in raws])
    return raws, table, dense.astype(np.float64)


def _run(qtype, table, row_bytes, act, out):
    kind = quant_type(qtype)
    kind.prompt_parts(table, row_bytes, *prompt_kernel_args(kind, act), out, decode_tasks())
    return out


def _values(act) -> np.ndarray:
    """float64 ``[T, K]``: the two levels' values, what the kernel multiplies by."""
    v = act.dequantize().astype(np.float64)
    t = v.shape[0] // 2
    return v[:t] + v[t:]


@pytest.mark.parametrize("qtype", KINDS)
@pytest.mark.parametrize("tokens", [1, 5, TOKEN_TILE, 13, 45])
def test_lane_kernel_is_the_dequantized_product(qtype, tokens):
    """Rows over two parts (37: two whole tiles of 16 and a short one), into some columns
    of a wider output: each the dot product of the gguf dequantizer's row with the two
    levels' values, within float32 rounding of the per-block steps; and close to the
    float activations themselves."""
    _needs_lanes(qtype)
    raws, table, dense = _parts(qtype, [21, 16], seed=1)
    assert dense.shape[0] > 2 * LANES and dense.shape[0] % LANES
    x = np.random.default_rng(2).standard_normal((tokens, K)).astype(np.float32) * 3
    x[:, 9] = 70.0  # an outlier channel
    act = quantize_super_blocks(x, levels=2)
    out = np.full((tokens, 45), np.nan, np.float32)
    got = _run(qtype, table, raws[0].shape[1], act, out[:, 3:40])
    assert np.isnan(out[:, :3]).all() and np.isnan(out[:, 40:]).all()  # only its columns
    want = _values(act) @ dense.T
    scale = np.abs(_values(act)) @ np.abs(dense).T
    assert (np.abs(got - want) / scale).max() < 2e-6
    exact = x.astype(np.float64) @ dense.T
    assert (np.abs(got - exact) / (np.abs(x) @ np.abs(dense).T)).max() < 1e-4


@pytest.mark.parametrize("qtype", KINDS)
def test_a_tokens_result_does_not_depend_on_the_others(qtype):
    """Tiles of 8, 4, 2 and 1 tokens do each token's arithmetic in the same order: the
    same bits for a token in any call, whatever its place and its neighbours."""
    _needs_lanes(qtype)
    raws, table, _ = _parts(qtype, [40], seed=3)
    x = np.random.default_rng(4).standard_normal((23, K)).astype(np.float32)

    def run(rows):
        act = quantize_super_blocks(x[rows], levels=2)
        return _run(qtype, table, raws[0].shape[1], act, np.empty((len(x[rows]), 40), np.float32))

    full = run(slice(0, 23))
    assert np.array_equal(run(slice(5, 12)), full[5:12])
    for t in (0, 9, 22):
        assert np.array_equal(run(slice(t, t + 1)), full[t : t + 1])


@pytest.mark.parametrize("qtype", KINDS)
def test_extreme_codes_and_activations_do_not_wrap(qtype):
    """Codes and scales at the ends of their ranges times activations at the largest int16
    (every element at its level's largest code): a lane's integer run stays within int32
    (Q4_K: 64 products of 15 * 63 by 32,512; Q6_K: 16 of -32 * -128 by 32,512). A run
    twice as long wraps, and the result is off by 2^32 times the block's scale."""
    _needs_lanes(qtype)
    raws, _, _ = _parts(qtype, [32], seed=5)
    raw = raws[0]
    blocks = raw.reshape(32, -1, quant_type(qtype).type_size)
    if qtype == Q.Q4_K:  # d, dmin (fp16) then 12 bytes of 6-bit scales and mins, codes
        blocks[:16, :, 4:] = 0xFF  # every scale and min 63, every code 15
        blocks[16:, :, 16:] = 0xFF  # every code 15
    else:  # ql, qh, 16 int8 scales, d
        blocks[:16, :, :192] = 0  # every code 0, i.e. -32
        blocks[:16, :, 192:208] = np.array([-128] * 16, np.int8).view(np.uint8)
        blocks[16:, :, :192] = 0xFF  # every code 63
        blocks[16:, :, 192:208] = np.array([127] * 16, np.int8).view(np.uint8)
    dense = reference_dequantize(raw, qtype, (32, K)).astype(np.float64)
    table = np.array([[raw.ctypes.data, 32]], np.int64)
    x = np.full((3, K), 2.5, np.float32)
    x[1] = -2.5
    x[2, ::2] = -1.0
    act = quantize_super_blocks(x, levels=2)
    assert (act.widened(quant_type(qtype).activation_order)[:2].__abs__() >= 32_512).all()
    got = _run(qtype, table, raw.shape[1], act, np.empty((3, 32), np.float32))
    want = _values(act) @ dense.T
    assert (np.abs(got - want) / (np.abs(_values(act)) @ np.abs(dense).T)).max() < 2e-6


# BlockLinear takes Q4_K as tiles where the CPU has lanes (kernels/quant/tiles.py); a
# part of Q4_K rows that no tile layout fits (a fused part of rows not a multiple of 16
# before another) still takes the lane kernel
@pytest.mark.parametrize("qtype, rows", [(Q.Q6_K, 24), (Q.Q4_K, 24)])
def test_prompts_take_the_lane_kernel_in_any_chunking(qtype, rows):
    """Above DECODE_MAX_ROWS rows a projection of these types runs the lane kernel,
    LANE_PROMPT_ROWS rows a call: a row's output is the same bits in a prompt of any
    length (no dependence on the chunk it falls in), and what the kernel gives alone."""
    _needs_lanes(qtype)
    raws, _, _ = _parts(qtype, [rows, 16], seed=6)
    w = QuantWeight.from_raw(raws[0], qtype, (rows, K))
    tail = QuantWeight.from_raw(raws[1], qtype, (16, K))
    lin = BlockLinear([w, tail])
    assert all(g.tiles is None for g in lin._groups)  # 24 rows, then more: no tiles
    rows = LANE_PROMPT_ROWS + 9
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(7))
    full = lin(x)[:, :24]
    assert torch.equal(lin(x[50:])[:, :24], full[50:])  # another chunking of the same rows
    assert torch.equal(lin(x[: DECODE_MAX_ROWS + 1])[:, :24], full[: DECODE_MAX_ROWS + 1])
    act = quantize_super_blocks(x[:40].numpy(), levels=2)
    table = np.array([[raws[0].ctypes.data, 24]], np.int64)
    alone = _run(qtype, table, raws[0].shape[1], act, np.empty((40, 24), np.float32))
    assert np.array_equal(alone, full[:40].numpy())


# (instruction set, a CPU with it, the dot instruction of the inner loop and how many at
# TOKEN_TILES tokens, what must not appear)
_LANE_CPUS = [
    # the token's activation pair broadcast from memory into the 512-bit multiply-add
    (
        "avx512vnni",
        "znver4",
        r"vpdpwssd\s+-?\d*\(%\w+(?:,%\w+)?(?:,\d)?\)\{1to16\}, %zmm",
        1,
        "ymm",
    ),
    # AVX-VNNI: the VEX form on the two 256-bit halves of each weight vector
    ("avxvnni", "alderlake", r"\{vex\}\s+vpdpwssd\s[^\n]*%ymm", 2, "zmm|vpmaddwd"),
    ("avx2", "haswell", r"vpmaddwd\s[^\n]*%ymm", 2, "zmm|vpdpwssd"),
]


@pytest.mark.parametrize("qtype", KINDS)
@pytest.mark.parametrize(("isa", "cpu", "dot", "per_token", "absent"), _LANE_CPUS)
def test_lane_kernel_codegen(qtype, isa, cpu, dot, per_token, absent):
    """The inner loop on every instruction set of the kernel, emitted by LLVM for a CPU
    that has it (whatever this machine has): one multiply-add of the weight vector (or
    each of its halves) by the token's broadcast activation pair per token, nothing of a
    wider instruction set, and nothing that widens or shuffles (the weights come unpacked
    and transposed, once per call, from :func:`lanes_unpack`)."""
    from numba import types

    from kernels.quant.lanes import TOKEN_TILES, lanes_dot
    from kernels.quant.simd import ISA_CODES
    from kernels.quant.superblock import KBLOCK_CODES

    u, lit = types.uintp, types.literal
    tokens = TOKEN_TILES[isa]
    argtypes = [u] * 11 + [lit(KBLOCK_CODES[qtype.name]), lit(tokens), lit(ISA_CODES[isa])]
    asm = _asm_for(lanes_dot, argtypes, cpu)
    assert len(re.findall(dot, asm)) >= per_token * tokens
    assert not re.search(absent, asm)
    assert not re.search(r"vpmovzx|vpermt2|vpmaddubsw|vpmullw|vpshufb", asm)
    if isa != "avx512vnni":  # the pair broadcast from memory, once per token and pair
        assert len(re.findall(r"vpbroadcastd\s+-?\d*\(%\w+", asm)) >= tokens


def test_a_forward_says_whether_its_rows_are_a_prompts():
    """Within a prompt's forward (prompt_rows(True)) rows from LANE_MIN_ROWS on take the
    lane kernel and fewer the decode kernel; within a decode step's (False) the decode
    kernel at any row count, so each row equals decoding it alone; the parts of another
    type beside them go as the decode path takes them."""
    from kernels.quant.linear import LANE_MIN_ROWS, prompt_rows

    _needs_lanes(Q.Q6_K)
    raws, _, _ = _parts(Q.Q6_K, [24, 16], seed=8)
    w = QuantWeight.from_raw(raws[0], Q.Q6_K, (24, K))
    tail = QuantWeight.from_raw(raws[1], Q.Q6_K, (16, K))  # 24 rows then more: no tiles
    q8 = QuantWeight.from_raw(
        random_blocks(Q.Q8_0, 16, K, np.random.default_rng(9)), Q.Q8_0, (16, K)
    )
    lin, other = BlockLinear([w, tail, q8]), BlockLinear([q8])
    x = torch.randn(DECODE_MAX_ROWS + 8, K, generator=torch.Generator().manual_seed(10))
    table = np.array([[raws[0].ctypes.data, 24]], np.int64)

    def lanes(rows):
        act = quantize_super_blocks(x[:rows].numpy(), levels=2)
        return _run(Q.Q6_K, table, raws[0].shape[1], act, np.empty((rows, 24), np.float32))

    with prompt_rows(False):
        one = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(lin(x), one) and not lin.takes_lanes(len(x))
    with prompt_rows(True):
        few = lin(x[: LANE_MIN_ROWS - 1])
        assert torch.equal(few, one[: LANE_MIN_ROWS - 1])
        got = lin(x[:LANE_MIN_ROWS])
        assert not lin.fuses(x[:LANE_MIN_ROWS]) and lin.fuses(x[: LANE_MIN_ROWS - 1])
        assert np.array_equal(got[:, :24].numpy(), lanes(LANE_MIN_ROWS))
        assert torch.equal(got[:, 40:], other(x[:LANE_MIN_ROWS]))
    assert np.array_equal(lin(x)[:, :24].numpy(), lanes(len(x)))  # outside: by row count
    assert torch.equal(lin(x[:LANE_MIN_ROWS]), one[:LANE_MIN_ROWS])
