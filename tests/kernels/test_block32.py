"""kernels.quant.block32: the decode kernels of the blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0), unpacked in registers, against the gguf package's dequantizer; their code on each
instruction-set path; their batch invariance."""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gq

from kernels.quant import QuantWeight, decode_matmul, quant_type
from kernels.quant.activations import two_level_activations
from kernels.quant.bench import random_blocks
from kernels.quant.block32 import BLOCK32_CODES, BLOCK32_KINDS, WIDE32
from kernels.quant.matmul import decode_tasks, parts_kernel_args
from kernels.quant.reference import reference_dequantize
from kernels.quant.simd import ISA_CODES
from tests.kernels.test_quant_matmul import _asm_for

Q = GGMLQuantizationType
TYPES = [Q[name] for name in BLOCK32_CODES]
# float32 rounding only (the integer products are exact): see test_quant_matmul's FP32_REL
FP32_REL = 1e-5


def _gguf_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks as the gguf package quantizes them (negative minima, real scales), with
    a few rows scaled up so that scales differ by orders of magnitude."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[::7] *= 300
    return gq.quantize(w, qtype).reshape(n, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 96, 544, 320, 576])
def test_fused_parts_match_the_gguf_dequantizer(qtype, k):
    """Two levels of activations as one int16 per element for 1-7 tokens (passes of 4, 2
    and 1 tokens), a row table of two parts in separate arrays, rows split over many
    tasks; K leaves every tail of the two-block loop. Against the gguf dequantizer times
    the same two levels of activations in float64; each token's row bit for bit what it
    is alone. And the one-level kernel (decode_matmul on the 2T rows) against the same
    reference per level."""
    kind = quant_type(qtype)
    a, b = _gguf_blocks(qtype, 23, k, k), random_blocks(qtype, 14, k, np.random.default_rng(k))
    table = np.array([[a.ctypes.data, 23], [b.ctypes.data, 14]], np.int64)
    ref_w = np.concatenate(
        [reference_dequantize(a, qtype, (23, k)), reference_dequantize(b, qtype, (14, k))]
    ).astype(np.float64)
    both = QuantWeight.from_raw(np.concatenate([a, b]), qtype, (37, k))
    x = np.random.default_rng(k + 1).standard_normal((7, k)).astype(np.float32)
    x[:, 3] = 40.0  # an outlier channel
    for tokens in (1, 3, 7):
        act = two_level_activations(x[:tokens])
        got = np.empty((tokens, 37), np.float32)
        levels, *args = parts_kernel_args(kind, act, tokens)
        assert levels == WIDE32
        kind.decode_parts(table, a.shape[1], levels, *args, got, 7)
        xq = act.dequantize().astype(np.float64)
        ref = (xq[:tokens] + xq[tokens:]) @ ref_w.T
        scale = np.abs(xq[:tokens] + xq[tokens:]) @ np.abs(ref_w).T
        assert np.all(np.abs(got - ref) <= FP32_REL * scale), tokens
        per_level = decode_matmul(act, both)
        full = xq @ ref_w.T
        assert np.all(np.abs(per_level - full) <= FP32_REL * (np.abs(xq) @ np.abs(ref_w).T))
        alone = two_level_activations(x[tokens - 1 : tokens])
        one = np.empty((1, 37), np.float32)
        kind.decode_parts(table, a.shape[1], *parts_kernel_args(kind, alone, 1), one, 1)
        assert np.array_equal(one[0], got[-1]), tokens


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_two_levels_are_one_product_at_the_extremes(qtype):
    """Codes and activations at their extremes (Q8_0's -128 and 127, both levels at
    +-127 / -127, every fifth bit set): the int16 lanes of 4 products reach 4 * 128 *
    32,639, still exact, so the kernel equals the float64 product of the dequantized
    values within float32 rounding, and a row of all-zero activations gives 0."""
    kind = quant_type(qtype)
    k, n = 256, 9
    raw = random_blocks(qtype, n, k, np.random.default_rng(1))
    blocks = raw.reshape(n, -1, raw.shape[1] // (k // 32))
    if qtype == Q.Q8_0:
        blocks[0, :, 2:] = np.uint8(128)  # -128 everywhere in row 0
        blocks[1, :, 2:] = np.uint8(127)
    else:
        spec = BLOCK32_KINDS[BLOCK32_CODES[qtype.name]]
        blocks[0, :, spec.qs_at : spec.qs_at + 16] = 0xFF  # code 15 (31 with the bit)
        if spec.qh_at is not None:
            blocks[0, :, spec.qh_at : spec.qh_at + 4] = 0xFF
    x = np.zeros((3, k), np.float32)
    x[0] = 1.0  # amax everywhere: q0 = 127, nothing left
    # -127 and codes 126 with 127 left at the second level: |256 q_0 + q_1| = 32,383
    x[1, ::2], x[1, 1::2] = -1.0, (126 + 0.498) / 127
    act = two_level_activations(x)
    assert np.abs(act.widened()).max() >= 256 * 127 and act.q[3:].max() == 127
    got = np.empty((3, n), np.float32)
    kind.decode_parts(np.array([[raw.ctypes.data, n]], np.int64), raw.shape[1],
                      *parts_kernel_args(kind, act, 3), got, 2)  # fmt: skip
    w = reference_dequantize(raw, qtype, (n, k)).astype(np.float64)
    xq = act.dequantize().astype(np.float64)
    xq = xq[:3] + xq[3:]
    ref = xq @ w.T
    assert np.all(np.abs(got - ref) <= FP32_REL * (np.abs(xq) @ np.abs(w).T) + 1e-30)
    assert np.all(got[2] == 0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_row_is_the_same_whatever_the_task_split(qtype):
    kind = quant_type(qtype)
    raw = random_blocks(qtype, 41, 320, np.random.default_rng(3))
    table = np.array([[raw.ctypes.data, 41]], np.int64)
    act = two_level_activations(
        np.random.default_rng(4).standard_normal((2, 320)).astype(np.float32)
    )
    outs = []
    for tasks in (1, 3, decode_tasks(), 100):
        out = np.empty((2, 41), np.float32)
        kind.decode_parts(table, raw.shape[1], *parts_kernel_args(kind, act, 2), out, tasks)
        outs.append(out)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_two_levels_need_int16_activations():
    """WIDE32 with the int8 codes (a caller's mistake) is refused, not read as int16."""
    kind = quant_type(Q.Q8_0)
    raw = random_blocks(Q.Q8_0, 4, 64, np.random.default_rng(0))
    act = two_level_activations(np.ones((1, 64), np.float32))
    table = np.array([[raw.ctypes.data, 4]], np.int64)
    out = np.empty((1, 4), np.float32)
    with pytest.raises(ValueError, match="int16"):
        kind.decode_parts(table, raw.shape[1], WIDE32, act.q, act.scale, act.pair32, out, 1)


# The dot product on each path: vpdpbusd on zmm (AVX-512 VNNI), on ymm (AVX-VNNI),
# vpmaddubsw + vpmaddwd (AVX2); the nibbles split by a shift per 64-bit lane everywhere
_CPUS = [
    ("avx512vnni", "znver4", r"vpdpbusd\s[^\n]*%zmm", r"vpmaddubsw"),
    ("avxvnni", "alderlake", r"\{vex\}\s+vpdpbusd", r"zmm"),
    ("avx2", "haswell", r"vpmaddwd", r"zmm|vpdpbusd"),
]


@pytest.mark.parametrize("name", list(BLOCK32_CODES))
@pytest.mark.parametrize(("isa", "cpu", "want", "absent"), _CPUS)
def test_codegen_for_other_cpus(isa, cpu, want, absent, name):
    """Each path emitted by LLVM for a CPU that has it (whatever this machine has): the
    instructions it was written for, none of a wider ISA, no scratch memory in the loop
    beyond the loads of blocks and activations (the codes never stored)."""
    from numba import types

    from kernels.quant.block32 import block32_pass

    u, lit = types.uintp, types.literal
    args = [u] * 10 + [lit(1), lit(ISA_CODES[isa]), lit(BLOCK32_CODES[name])]
    asm = _asm_for(block32_pass, args, cpu)
    assert re.search(want, asm) and not re.search(absent, asm)
    if name != "Q8_0":
        assert re.search(r"vpsrlvq", asm)


# Two levels as int16: vpdpwssd (VNNI; VEX-encoded on AVX-VNNI; LLVM makes the first of a
# block's two a vpmaddwd, its accumulator being zero), vpmaddwd (AVX2), never the int8
# dot products
_WIDE_CPUS = [
    ("avx512vnni", "znver4", r"vpdpwssd", r"vpmaddubsw|vpdpbusd"),
    ("avxvnni", "alderlake", r"\{vex\}\s+vpdpwssd", r"zmm|vpdpbusd|vpmaddubsw"),
    ("avx2", "haswell", r"vpmaddwd", r"zmm|vpdpwssd|vpmaddubsw"),
]


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("name", list(BLOCK32_CODES))
@pytest.mark.parametrize(("isa", "cpu", "want", "absent"), _WIDE_CPUS)
def test_wide_codegen_for_other_cpus(isa, cpu, want, absent, name, tokens):
    from numba import types

    from kernels.quant.block32 import block32_wide_pass

    u, lit = types.uintp, types.literal
    args = [u] * 10 + [lit(tokens), lit(ISA_CODES[isa]), lit(BLOCK32_CODES[name])]
    asm = _asm_for(block32_wide_pass, args, cpu)
    assert re.search(want, asm) and not re.search(absent, asm)


def test_soft_fp16_scales_are_exact(monkeypatch):
    """The block scales on CPUs without F16C (integer IR, which never runs where F16C
    exists): every half exactly, eight at a time, run through LLVM's JIT."""
    import ctypes

    import llvmlite.binding as llvm
    from llvmlite import ir

    from kernels.quant import block32, superblock

    monkeypatch.setattr(block32, "HAS_F16C", False)
    monkeypatch.setattr(superblock, "HAS_F16C", False)  # its _half, which block32 calls
    i16, i64 = ir.IntType(16), ir.IntType(64)
    module = ir.Module("soft_halves")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i64, i64]), "halves")
    builder = ir.IRBuilder(fn.append_basic_block())
    src, dst = fn.args
    bits = builder.load(builder.inttoptr(src, ir.PointerType(ir.VectorType(i16, 8))), align=2)
    out = block32._halves(builder, bits)
    builder.store(out, builder.inttoptr(dst, ir.PointerType(out.type)), align=4)
    builder.ret_void()
    machine = llvm.Target.from_default_triple().create_target_machine()
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(str(module)), machine)
    engine.finalize_object()
    halves = ctypes.CFUNCTYPE(None, ctypes.c_uint64, ctypes.c_uint64)(
        engine.get_function_address("halves")
    )
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    for i in range(0, bits.size, 8):
        halves(bits[i:].ctypes.data, out[i:].ctypes.data)
    ref = bits.view(np.float16).astype(np.float32)
    assert np.all((out == ref) | (np.isnan(out) & np.isnan(ref)))
