"""kernels.quant: matmuls on GGUF block bytes against the gguf package's dequantizer.

Tolerances (the decode kernels quantize activations to int8 per 32, as llama.cpp does):

* Against ``reference_matmul`` (the gguf dequantizer times the *same* int8 activations, in
  float64) only float32 rounding separates the two: integer products are exact, and each
  4-element lane sum is scaled by ``fw * fx`` (two roundings) and accumulated by FMA over
  at most K / 64 steps per lane, then summed over 32 lanes. With unit roundoff u = 2^-24
  that bounds the error by about (K / 64 + 8) u times sum |w x| (|x| the quantized
  activations): ``FP32_REL`` allows 1e-5 * sum |w x|, eight times that bound at K = 1024.
* Against the float activations, the rounding of x to int8 adds at most half a step per
  element: |x - x_q| <= amax_block / 254, so |y - y_q| <= sum_blocks (amax / 254) *
  sum |w| over the block (``int8_bound``), checked as a hard bound.
* Prefill multiplies bf16 weights and activations (8-bit mantissas): each product is off
  by at most about 2^-8 relative, so 1e-2 * sum |w x|.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from kernels.quant import (
    DECODE_MAX_ROWS,
    FLOAT_TYPES,
    HOST_ISA,
    QUANT_TYPES,
    ActivationFormat,
    QuantWeight,
    decode_matmul,
    dequantize_weight,
    prefill_matmul,
    quant_matmul,
    quant_type,
    quantize_activations,
)
from kernels.quant.bench import random_blocks
from kernels.quant.matmul import decode_tasks
from kernels.quant.reference import reference_dequantize, reference_matmul
from kernels.quant.simd import ISA_CODES
from tests.child_process import run_json

Q = GGMLQuantizationType
TYPES = list(QUANT_TYPES)
GGUF_QUANTIZABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
FP32_REL = 1e-5
BF16_REL = 1e-2


def _k_values(qtype) -> list[int]:
    """Row lengths: for blocks of 32, one that leaves a 32-element tail after the
    128-element pairs of the dot product (K % 64 == 32) and one with a 64 tail."""
    return [256, 768] if GGML_QUANT_SIZES[qtype][0] == 256 else [96, 544, 320]


def _weight(qtype, n, k, seed, source="random"):
    rng = np.random.default_rng(seed)
    if source == "gguf":
        raw = gq.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype).reshape(
            n, -1
        )
    else:
        raw = random_blocks(qtype, n, k, rng)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k))


def _super(qtype) -> bool:
    """The type's decode kernel reads activations per 256 (the k-quants of superblock.py)."""
    return quant_type(qtype).activation is ActivationFormat.Q8_256


def _abs_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_matches_gguf_dequantizer(qtype):
    for k in _k_values(qtype):
        for source in ("random", "gguf") if qtype in GGUF_QUANTIZABLE else ("random",):
            n = 37  # not a multiple of any task split
            raw, w = _weight(qtype, n, k, seed=k, source=source)
            x = np.random.default_rng(k + 1).standard_normal((5, k)).astype(np.float32)
            act = quantize_activations(x)
            got = decode_matmul(act, w).astype(np.float64)
            ref_w = reference_dequantize(raw, qtype, (n, k))
            # the activations as this type's kernel multiplies them (per 32 or per 256)
            xq = act.values(per_super_block=_super(qtype))
            ref = reference_matmul(xq, raw, qtype, (n, k), quantize_x=False)
            scale = _abs_product(xq, ref_w)
            assert np.all(np.abs(got - ref) <= FP32_REL * scale + 1e-30), (qtype.name, k, source)
            # against float activations: int8 rounding, bounded per activation block
            blk = 256 if _super(qtype) else 32
            exact = x.astype(np.float64) @ ref_w.astype(np.float64).T
            amax = np.abs(x.reshape(5, -1, blk)).max(-1)  # [B, K/blk]
            wsum = np.abs(ref_w.astype(np.float64)).reshape(n, -1, blk).sum(-1)  # [N, K/blk]
            int8_bound = (amax / 254.0) @ wsum.T
            assert np.all(np.abs(got - exact) <= int8_bound * (1 + 1e-4) + FP32_REL * scale)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fused_parts_kernel_of_every_type_takes_two_levels(qtype):
    """``decode_parts`` with the arguments ``parts_kernel_args`` gives it (what the model's
    projections call: per 32 as one int16 product for the blocks of 32, as two rows for
    Q2_K / Q3_K / Q5_K; in super-blocks for Q4_K / Q6_K) equals the float64 product of
    the dequantized weights and both levels of activations, for a few tokens and more."""
    from kernels.quant.activations import quantize_super_blocks, two_level_activations
    from kernels.quant.matmul import parts_kernel_args

    kind = quant_type(qtype)
    for k in _k_values(qtype):
        raw, w = _weight(qtype, 37, k, seed=k)
        table = np.array([[raw.ctypes.data, 37]], np.int64)
        ref_w = reference_dequantize(raw, qtype, (37, k)).astype(np.float64)
        for tokens in (2, 7):
            x = np.random.default_rng(k + tokens).standard_normal((tokens, k)).astype(np.float32)
            act = quantize_super_blocks(x, levels=2) if _super(qtype) else two_level_activations(x)
            got = np.empty((tokens, 37), np.float32)
            kind.decode_parts(table, raw.shape[1], *parts_kernel_args(kind, act, tokens), got, 3)
            xq = act.dequantize().astype(np.float64)
            xq = xq[:tokens] + xq[tokens:]
            scale = _abs_product(xq, ref_w)
            assert np.all(np.abs(got - xq @ ref_w.T) <= FP32_REL * scale + 1e-30), (k, tokens)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_row_is_independent_of_the_batch(qtype):
    k = _k_values(qtype)[-1]
    _, w = _weight(qtype, 19, k, seed=3)
    x = np.random.default_rng(4).standard_normal((DECODE_MAX_ROWS, k)).astype(np.float32)
    full = decode_matmul(quantize_activations(x), w)
    # batches that go through the 4-, 2- and 1-row passes in every combination
    for b in (1, 2, 3, 5, 7, 13):
        part = decode_matmul(quantize_activations(x[:b]), w)
        assert np.array_equal(part, full[:b]), b
    alone = decode_matmul(quantize_activations(x[6:7]), w)
    assert np.array_equal(alone[0], full[6])


def test_result_is_independent_of_the_row_split():
    kind = quant_type(Q.Q4_K)
    _, w = _weight(Q.Q4_K, 101, 512, seed=5)
    act = quantize_activations(
        np.random.default_rng(6).standard_normal((3, 512)).astype(np.float32)
    )
    outs = []
    for tasks in (1, 3, 8, 200):
        out = np.empty((3, 101), np.float32)
        ka = act.super_blocks()  # Q4_K's kernel reads the super-block format
        kind.decode(w.data, *ka.kernel_args(kind.activation_order, kind.sub_block), out, tasks)
        outs.append(out)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(qtype):
    k = _k_values(qtype)[0]
    raw, w = _weight(qtype, 21, k, seed=7)
    ref = reference_dequantize(raw, qtype, (21, k))
    got = dequantize_weight(w).numpy()
    # one multiply and one add, each rounded, as gguf does; Q6_K's fold of the -32 into
    # the offset can move the last bit
    np.testing.assert_allclose(got, ref, rtol=2.5e-7, atol=0)
    rows = dequantize_weight(w, first=5, rows=9, dtype=torch.bfloat16)
    assert torch.equal(rows, torch.from_numpy(got[5:14]).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
def test_prefill_tiles_match_the_reference(qtype):
    k = _k_values(qtype)[-1]
    n = 150
    raw, w = _weight(qtype, n, k, seed=8)
    x = torch.from_numpy(
        np.random.default_rng(9).standard_normal((DECODE_MAX_ROWS + 7, k)).astype(np.float32)
    )
    ref_w = reference_dequantize(raw, qtype, (n, k))
    exact = x.double().numpy() @ ref_w.astype(np.float64).T
    scale = _abs_product(x.numpy(), ref_w)
    for dtype in (torch.float32, torch.bfloat16):
        got = (
            prefill_matmul(x, w, tile_rows=64, dtype=dtype).double().numpy()
        )  # 3 tiles, the last short
        tol = FP32_REL if dtype == torch.float32 else BF16_REL
        assert np.all(np.abs(got - exact) <= tol * scale), dtype
    assert torch.equal(quant_matmul(x, w), prefill_matmul(x, w))


def test_quant_matmul_picks_decode_up_to_32_rows():
    raw, w = _weight(Q.Q4_K, 40, 256, seed=10)
    x = torch.from_numpy(
        np.random.default_rng(11).standard_normal((DECODE_MAX_ROWS, 256)).astype(np.float32)
    )
    got = quant_matmul(x, w)
    assert got.dtype == torch.float32 and got.shape == (DECODE_MAX_ROWS, 40)
    assert np.array_equal(got.numpy(), decode_matmul(quantize_activations(x.numpy()), w))
    with pytest.raises(ValueError):
        quant_matmul(x[:, :128], w)


@pytest.mark.parametrize("qtype", list(FLOAT_TYPES), ids=lambda t: t.name)
def test_float_types_go_through_torch(qtype):
    rng = np.random.default_rng(12)
    dense = torch.from_numpy(rng.standard_normal((24, 64)).astype(np.float32))
    stored = {Q.F32: dense, Q.F16: dense.half(), Q.BF16: dense.bfloat16()}[qtype]
    raw = stored.contiguous().view(torch.uint8).numpy().copy()
    w = QuantWeight.from_raw(raw, qtype, (24, 64))
    assert np.shares_memory(w.data, raw)
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    expect = x.to(stored.dtype).float() @ stored.float().t()
    torch.testing.assert_close(quant_matmul(x, w), expect, rtol=1e-2, atol=1e-2)


def test_weight_is_a_read_only_view_of_the_file_bytes(tmp_path):
    raw, _ = _weight(Q.Q6_K, 8, 512, seed=13)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    w = QuantWeight.from_raw(mapped, Q.Q6_K, (8, 512))
    assert np.shares_memory(w.data, mapped) and not w.data.flags.writeable
    assert w.data.shape == (8, quant_type(Q.Q6_K).row_bytes(512))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        as_tensor = torch.from_numpy(mapped)
    assert np.shares_memory(QuantWeight.from_raw(as_tensor, Q.Q6_K, (8, 512)).data, mapped)
    with pytest.raises(ValueError):
        QuantWeight.from_raw(mapped[:-1], Q.Q6_K, (8, 512))
    with pytest.raises(ValueError):
        quant_type(Q.Q6_K).row_bytes(300)


def test_registry_agrees_with_gguf():
    for qtype, kind in QUANT_TYPES.items():
        assert (kind.block_size, kind.type_size) == GGML_QUANT_SIZES[qtype]
        assert kind.block_size % kind.sub_block == 0 or kind.sub_block == kind.block_size
        assert kind.signed == (qtype == Q.Q8_0)
    with pytest.raises(KeyError, match="supported"):
        quant_type(Q.IQ2_XXS)


def test_kernels_cache_under_the_isa_and_package_stamp():
    from kernels.quant._cache import _InTree, _UserProvided, _UserWide

    kind = quant_type(Q.Q4_K)
    impl = kind.decode._cache._impl
    assert isinstance(impl.locator, _InTree | _UserWide | _UserProvided)
    assert impl.locator.get_cache_path().endswith(f"numba-{HOST_ISA}")


def test_attention_and_rope_kernels_are_stamped_with_the_intrinsics_they_inline(tmp_path):
    """The decode attention and rope kernels (kernels/, outside this package) inline
    kernels.quant.simd's intrinsics: their cached code must go stale when simd.py
    changes, which numba's own stamp (their file's) misses."""
    from kernels import paged_attention, rope
    from kernels.quant import _cache

    for kernel in (paged_attention._decode_kernel, rope._rope_and_store):
        locator = kernel._cache._impl.locator
        assert isinstance(locator, _cache._InTree | _cache._UserWide | _cache._UserProvided)
        assert locator.get_source_stamp() == _cache._STAMP
    # the stamp reads both folders: a change in either moves it
    quant, above = tmp_path / "quant", tmp_path
    quant.mkdir()
    (quant / "simd.py").write_text("A = 1\n")
    (above / "paged_attention.py").write_text("B = 1\n")
    before = _cache._package_stamp((quant, above))
    (quant / "simd.py").write_text("A = 2\n")
    after_simd = _cache._package_stamp((quant, above))
    (above / "paged_attention.py").write_text("B = 2\n")
    after_attention = _cache._package_stamp((quant, above))
    assert len({before, after_simd, after_attention}) == 3


_ISA_SCRIPT = """
import json, sys, numpy as np
from kernels.quant import HOST_ISA, QuantWeight, decode_matmul, quantize_activations
from kernels.quant.bench import random_blocks
from gguf import GGMLQuantizationType as Q
out = {"isa": HOST_ISA}
# unsigned and signed codes; blocks of 32 with a minimum, centred, with fifth bits
for name, k in (("Q4_K", 512), ("Q6_K", 512), ("Q8_0", 544), ("Q4_1", 544), ("Q5_0", 320)):
    qt = Q[name]
    w = QuantWeight.from_raw(random_blocks(qt, 23, k, np.random.default_rng(k)), qt, (23, k))
    x = np.random.default_rng(1).standard_normal((5, k)).astype(np.float32)
    out[name] = decode_matmul(quantize_activations(x), w).tolist()
    # the fused-parts decode kernel: both levels of a token in one kernel call (the
    # decode kernel itself: BlockLinear takes Q4_K as tiles on AVX-512 VNNI)
    from kernels.quant.activations import quantize_super_blocks, two_level_activations
    from kernels.quant.matmul import decode_tasks, parts_kernel_args
    per32 = w.kind.activation.name == "Q8_32"
    act = two_level_activations(x) if per32 else quantize_super_blocks(x, levels=2)
    levels, *args = parts_kernel_args(w.kind, act, len(x))
    table = np.array([[w.data.ctypes.data, w.out_features]], np.int64)
    paired = np.empty((len(x), w.out_features), np.float32)
    w.kind.decode_parts(table, w.data.shape[1], levels, *args, paired, decode_tasks())
    out["paired " + name] = paired.tolist()
    for tokens in (2, 3) if not per32 else ():  # kblock_pass, or kblock_walk (AVX2)
        levels, *args = parts_kernel_args(w.kind, quantize_super_blocks(x[:tokens], levels=2), tokens)
        few = np.empty((tokens, w.out_features), np.float32)
        w.kind.decode_parts(table, w.data.shape[1], levels, *args, few, decode_tasks())
        out[f"{tokens} tokens {name}"] = few.tolist()
"""


def _run_isa(isa: str | None) -> dict:
    env = dict(os.environ)
    env.pop("FOLIO_QUANT_ISA", None)
    if isa:
        env["FOLIO_QUANT_ISA"] = isa
    if isa is None:  # this process's own ISA
        scope: dict = {}
        exec(_ISA_SCRIPT, scope)
        return json.loads(json.dumps(scope["out"]))
    return run_json(_ISA_SCRIPT + "print(json.dumps(out))\n", env=env)


def test_every_isa_path_gives_the_same_bits():
    """The lower paths (AVX-VNNI, AVX2, generic: the floor on other machines) against
    this CPU's best: the same 4-element integer lanes and the same float order, so
    identical results."""
    lower = [isa for isa, code in ISA_CODES.items() if code < ISA_CODES[HOST_ISA]]
    if not lower:
        pytest.skip(f"this CPU's best ISA is {HOST_ISA}")
    best = _run_isa(None)
    for isa in lower:
        got = _run_isa(isa)
        assert got.pop("isa") == isa
        for name, values in got.items():
            assert values == best[name], (isa, name)


@pytest.mark.slow
def test_real_q4_k_m_file_in_place(gemma3_path):
    """Every block type of a real Q4_K_M file, read in place from the mapped file (the
    loader's GGUFFile.tensor_bytes: a read-only view of the mmap)."""
    from engine.model.gguf_file import GGUFFile

    gf = GGUFFile(gemma3_path)
    seen = set()
    rng = np.random.default_rng(14)
    try:
        for name, info in gf.tensors.items():
            qtype = GGMLQuantizationType(info.qtype)
            if qtype not in QUANT_TYPES or qtype in seen or len(info.shape) != 2:
                continue
            seen.add(qtype)
            n, k = info.shape
            raw = gf.tensor_bytes(name)
            w = QuantWeight.from_raw(raw, qtype, (n, k))
            assert np.shares_memory(w.data, raw)
            rows = min(n, 512)  # the embedding has 262144: its first rows, still in place
            part = QuantWeight.from_raw(w.data[:rows], qtype, (rows, k))
            x = rng.standard_normal((3, k)).astype(np.float32)
            act = quantize_activations(x)
            ref_w = reference_dequantize(part.data, qtype, (rows, k))
            xq = act.values(per_super_block=_super(qtype))
            ref = reference_matmul(xq, part.data, qtype, (rows, k), quantize_x=False)
            got = decode_matmul(act, part)
            assert np.all(np.abs(got - ref) <= FP32_REL * _abs_product(xq, ref_w)), name
    finally:
        gf.close()
    assert {Q.Q4_K, Q.Q6_K} <= seen


def _asm_for(intrinsic_fn, argtypes, cpu: str) -> str:
    """The assembly LLVM emits for ``cpu`` from the IR that ``intrinsic_fn`` builds, called
    with ``argtypes`` (integers for the addresses, literals for the compile-time
    arguments). Built without compiling for this machine: numba would compile for the
    host, and LLVM aborts the process when the host lacks the instructions."""
    import llvmlite.binding as llvm
    from llvmlite import ir
    from numba.core.registry import cpu_target

    ctx = cpu_target.target_context
    sig, codegen = intrinsic_fn._defn(ctx.typing_context, *argtypes)
    module = ir.Module("codegen_check")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * len(argtypes)), "f")
    builder = ir.IRBuilder(fn.append_basic_block())
    codegen(ctx, builder, sig, list(fn.args))
    builder.ret_void()
    machine = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features="", opt=3)
    return machine.emit_assembly(llvm.parse_assembly(str(module)))


_OTHER_CPUS = [
    ("avxvnni", "alderlake", r"\{vex\}\s+vpdpbusd", "zmm"),  # AVX-VNNI, no AVX-512
    ("avx512vnni", "znver4", r"vpdpbusd\s[^\n]*%zmm", "vpmaddubsw"),  # AMD with AVX-512
    ("avx2", "haswell", r"vpmaddubsw", "zmm|vpdpbusd"),  # the floor
]


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize(("isa", "cpu", "want", "absent"), _OTHER_CPUS)
def test_codegen_for_other_cpus(isa, cpu, want, absent, signed):
    """Every ISA path of the dot product, emitted by LLVM for a CPU that has it (whatever
    this machine has): the instructions it was written for, none of a wider ISA."""
    import re

    from numba import types

    from kernels.quant.simd import scaled_dot

    u, lit = types.uintp, types.literal
    argtypes = [u] * 8 + [lit(2), lit(ISA_CODES[isa]), lit(32), lit(32), lit(signed)]
    asm = _asm_for(scaled_dot, argtypes, cpu)
    assert re.search(want, asm) and not re.search(absent, asm)


# The super-block kernels fold the sub-block scales into the pair step: vpmaddubsw, then
# vpdpwssd (AVX-512 VNNI) or vpmaddwd and an add (AVX2; AVX-VNNI too, each chunk's added
# in a tree, where LLVM may fuse an add into AVX-VNNI's vpdpwssd), with no vpdpbusd and no
# multiply of 32-bit lanes (vpmulld: the block's offsets are multiplied in float, the
# same bits, superblock._offsets_fma).
_SUPERBLOCK_CPUS = [
    ("avxvnni", "alderlake", r"vpmaddwd|\{vex\}\s+vpdpwssd", "zmm|vpdpbusd"),
    ("avx512vnni", "znver4", r"vpdpwssd\s[^\n]*%zmm", "vpdpbusd|vpmaddwd"),
    ("avx2", "haswell", r"vpmaddwd", "zmm|vpdpwssd"),
]


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize(("isa", "cpu", "want", "absent"), _SUPERBLOCK_CPUS)
def test_superblock_codegen_for_other_cpus(isa, cpu, want, absent, kind, levels):
    """The in-register super-block kernels (superblock.py) on each ISA path, one level
    of int8 activations or two paired."""
    import re

    from numba import types

    from kernels.quant.superblock import KBLOCK_CODES, kblock_dot, kblock_pass

    u, lit = types.uintp, types.literal
    argtypes = [u] * 16 + [lit(ISA_CODES[isa]), lit(KBLOCK_CODES[kind]), lit(levels)]
    asm = _asm_for(kblock_dot, argtypes, cpu)
    assert re.search(want, asm) and re.search("vpmaddubsw", asm)
    assert not re.search(absent, asm) and "vpmulld" not in asm
    # the unrolled passes for a few tokens (kblock_pass): 2 rows, one token's two levels
    # paired or two tokens of one level
    paired = [lit(levels - 1)]
    args = [u] * 12 + [lit(2), lit(ISA_CODES[isa]), lit(KBLOCK_CODES[kind])] + paired
    asm = _asm_for(kblock_pass, args, cpu)
    assert re.search(want, asm) and re.search("vpmaddubsw", asm)
    assert not re.search(absent, asm) and "vpmulld" not in asm


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_wide_codegen(kind):
    """Two levels as int16 on AVX-512 VNNI (Q4_K, Q6_K, more than FEW_TOKENS tokens): one
    vpdpwssd per 32 elements and token, no vpmaddubsw (the codes are multiplied by their
    scales once, as i16). Elsewhere kblock_dot's int16 path traps: AVX2 and AVX-VNNI walk
    (kblock_walk)."""
    import re

    from numba import types

    from kernels.quant.superblock import KBLOCK_CODES, WIDE, WIDE_PATHS, kblock_dot

    u, lit = types.uintp, types.literal
    argtypes = [u] * 16 + [lit(ISA_CODES["avx512vnni"]), lit(KBLOCK_CODES[kind]), lit(WIDE)]
    asm = _asm_for(kblock_dot, argtypes, "znver4")
    assert re.search(r"vpdpwssd\s[^\n]*%zmm", asm) and re.search(r"vpmullw\s[^\n]*%zmm", asm)
    assert not re.search("vpmaddubsw|vpdpbusd|vpmaddwd", asm)
    assert {isa for isa, _ in WIDE_PATHS} == {"avx512vnni"}
    argtypes[-3] = lit(ISA_CODES["avx2"])
    assert "ud2" in _asm_for(kblock_dot, argtypes, "haswell")  # llvm.trap


def _inner_loops(asm: str) -> list[list[str]]:
    """The instructions of each innermost loop of ``asm`` (from a label to a jump back to
    it, with no other jump back in between)."""
    import re

    lines = asm.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"^\.?\w+:", line)}
    back = []  # (first line, jump line) of each jump back
    for i, line in enumerate(lines):
        jump = re.match(r"\s+j\w+\s+(\.\w+)", line)
        if jump and labels.get(jump.group(1), i) < i:
            back.append((labels[jump.group(1)], i))
    return [
        [
            x.strip()
            for x in lines[s : e + 1]
            if x.startswith("\t") and not x.strip().startswith(".")
        ]
        for s, e in back
        if not any(s <= s2 and e2 < e for s2, e2 in back)
    ]


_WALK_CPUS = [
    ("avx2", "haswell", r"vpmaddwd\s[^\n]*%ymm", "zmm|vpdpwssd"),
    ("avxvnni", "alderlake", r"\{vex\}\s+vpdpwssd\s[^\n]*%ymm", "zmm"),
]


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize(("isa", "cpu", "dot", "absent"), _WALK_CPUS)
def test_walk_codegen_keeps_the_sums_in_registers(kind, isa, cpu, dot, absent):
    """kblock_walk on the 16 vector registers of AVX2 / AVX-VNNI: the codes widened by
    in-lane byte shuffles (vpshufb), then the loop over a block's chunks with four tokens'
    integer sums in registers: no stack access in it (the point of the kernel: unpacked
    two rows at a time, kblock_dot reloaded most of a block from the stack per token)."""
    import re

    from numba import types

    from kernels.quant.superblock import KBLOCK_CODES, WALK_GROUP, kblock_walk

    u, lit = types.uintp, types.literal
    argtypes = [u] * 15 + [lit(ISA_CODES[isa]), lit(KBLOCK_CODES[kind])]
    asm = _asm_for(kblock_walk, argtypes, cpu)
    assert re.search(dot, asm) and re.search(r"vpshufb\s[^\n]*%ymm", asm)
    assert not re.search(f"vpmaddubsw|vpdpbusd|{absent}", asm)
    products = [
        sum(bool(re.match(r"(\{vex\}\s+)?vp(maddwd|dpwssd)", x)) for x in body)
        for body in _inner_loops(asm)
    ]
    dots = [body for body, n in zip(_inner_loops(asm), products) if n]
    # the chunk loops of WALK_GROUP, 2 and 1 tokens: a product per code vector and token
    assert sorted(n for n in products if n) == [4, 8, 4 * WALK_GROUP]
    for body in dots:
        assert not any("rsp" in x for x in body), body


_WALK_SCRIPT = """
import json, numpy as np
from gguf import GGMLQuantizationType as Q
from kernels.quant import HOST_ISA, quant_type
from kernels.quant.activations import quantize_super_blocks
from kernels.quant.bench import random_blocks
from kernels.quant.matmul import decode_tasks, parts_kernel_args
from kernels.quant.superblock import ROW_GROUP, WALK, WALK_MIN, WALKED
out = {"isa": HOST_ISA, "walk": WALK, "min": WALK_MIN, "checked": []}
rows = 2 * ROW_GROUP + 5  # two row groups and a remainder
for name in ("Q4_K", "Q6_K"):
    kind = quant_type(Q[name])
    raw = random_blocks(Q[name], rows, 1024, np.random.default_rng(5))
    if name == "Q6_K":  # rows 0-9 at the extremes: codes 0 (-32) or 63, scales -128 / 127
        blocks = raw[:10].reshape(10, -1, 210)
        blocks[:5, :, :192] = 0
        blocks[5:, :, :192] = 0xFF
        blocks[:5, :, 192:208] = np.array([-128] * 16, np.int8).view(np.uint8)
        blocks[5:, :, 192:208] = np.array([127] * 16, np.int8).view(np.uint8)
    table = np.array([[raw.ctypes.data, rows]], np.int64)
    for tokens in (2, 3, 4, 5, 6, 7, 9, 17):
        x = np.random.default_rng(tokens).standard_normal((tokens, 1024)).astype(np.float32) * 3
        x[:2] = [[3.0], [-3.0]]  # every activation at its level's largest code
        x[:, 5] = 80.0
        act = quantize_super_blocks(x, levels=2)
        levels, *args = parts_kernel_args(kind, act, tokens)
        walked = np.empty((tokens, rows), np.float32)
        kind.decode_parts(table, raw.shape[1], levels, *args, walked, decode_tasks())
        q, d, bsum = act.kernel_args(kind.activation_order, kind.sub_block, paired=True)
        two = np.empty((tokens, rows), np.float32)
        kind.decode_parts(table, raw.shape[1], 2, q, d, bsum, two, decode_tasks())
        assert levels == WALKED, (name, tokens)
        assert np.array_equal(walked, two), (name, tokens)
        out["checked"].append([name, tokens])
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
def test_walk_kernel_gives_the_two_level_bits(isa):
    """On AVX2 and AVX-VNNI, Q4_K and Q6_K take int16 activations from WALK_MIN tokens on
    (kblock_walk): the same bits as the two int8 levels paired (kblock_pass up to
    FEW_TOKENS tokens, kblock_dot above), for groups of four, two and one token and row
    groups with a remainder, Q6_K's codes and scales at their extremes (a lane's int32
    bound). The other ISA paths give those bits too (test_every_isa_path_gives_the_same_bits)."""
    if ISA_CODES[isa] > ISA_CODES[HOST_ISA]:
        pytest.skip(f"this CPU has no {isa}")
    env = dict(os.environ, FOLIO_QUANT_ISA=isa)
    got = run_json(_WALK_SCRIPT, env=env)
    assert got["isa"] == isa and got["walk"] and got["min"] == 2
    assert len(got["checked"]) == 16


def test_walk_refuses_what_it_is_not_for():
    """kblock_rows takes WALKED only where kblock_walk is built (else its kernel traps)
    and from WALK_MIN tokens on; WIDE only above FEW_TOKENS: each a clear error."""
    from kernels.quant.activations import quantize_super_blocks
    from kernels.quant.superblock import FEW_TOKENS, WALK, WALK_MIN, WALKED, WIDE

    kind = quant_type(Q.Q4_K)
    raw, _ = _weight(Q.Q4_K, 3, 256, seed=8)
    table = np.array([[raw.ctypes.data, 3]], np.int64)
    act = quantize_super_blocks(np.ones((FEW_TOKENS, 256), np.float32), levels=2)
    _, d, bsum = act.kernel_args(kind.activation_order, kind.sub_block, paired=True)
    x16 = act.widened(kind.activation_order)
    out = np.empty((FEW_TOKENS, 3), np.float32)
    with pytest.raises(ValueError, match="FEW_TOKENS"):
        kind.decode_parts(table, raw.shape[1], WIDE, x16, d, bsum, out, 1)
    one = WALK_MIN - 1
    match = "WALK_MIN" if WALK else "AVX2 and AVX-VNNI"
    with pytest.raises(ValueError, match=match):
        kind.decode_parts(table, raw.shape[1], WALKED, x16[:one], d, bsum, out[:one], 1)


@pytest.mark.parametrize("rows", [3, 11])
def test_wide_activations_pair_the_two_levels(rows):
    """``widened("q4_k")``: per token 256 x level 0 + level 1 in Q4_K's order, each 64 as the
    elements 4j, 4j+1 (j < 16) then 4j+2, 4j+3 (made row by row, or, from PARALLEL_ROWS
    rows on, over numba's threads)."""
    from kernels.quant.activations import PARALLEL_ROWS, quantize_super_blocks

    assert 3 < PARALLEL_ROWS <= 11
    x = np.random.default_rng(3).standard_normal((rows, 512)).astype(np.float32) * 5
    act = quantize_super_blocks(x, levels=2)
    wide = act.widened("q4_k")
    assert wide.dtype == np.int16 and wide.shape == (rows, 512)
    both = 256 * act.q_k4[:rows].astype(np.int64) + act.q_k4[rows:]
    for t in range(rows):
        for c in range(512 // 64):
            chunk = both[t, 64 * c : 64 * c + 64]
            want = [chunk[4 * (i // 2) + 2 * h + i % 2] for h in range(2) for i in range(32)]
            assert np.array_equal(wide[t, 64 * c : 64 * c + 64], want)
    assert act.widened("q4_k") is wide  # made once per activations
    with pytest.raises(ValueError, match="two levels"):
        quantize_super_blocks(x).widened("q4_k")


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("tokens", [5, 9, 33])
def test_wide_kernel_gives_the_two_level_bits(qtype, tokens):
    """The int16 path sums 256 x isum_0 + isum_1 in integers and rounds once: the same
    bits as the paired two-level path (which rounds the same value once, in an fma).
    Q6_K's scales at both ends of int8 and its codes at both ends of their range reach
    the int32 bound of a lane (16 x 4,096 x 32,640) and must not wrap."""
    from kernels.quant.activations import quantize_super_blocks
    from kernels.quant.superblock import WIDE, wide_levels

    if wide_levels(qtype.name, tokens) != WIDE:
        pytest.skip("no AVX-512 VNNI here: AVX2 and AVX-VNNI walk (test_walk_kernel_...)")
    kind = quant_type(qtype)
    raw, _ = _weight(qtype, 70, 1024, seed=21)
    if qtype == Q.Q6_K:  # rows 0-9 at the extremes: codes 0 (-32) or 63, scales -128 / 127
        blocks = raw[:10].reshape(10, -1, 210)
        blocks[:5, :, :192] = 0  # every code 0, i.e. -32
        blocks[5:, :, :192] = 0xFF  # every code 63
        blocks[:5, :, 192:208] = np.array([-128] * 16, np.int8).view(np.uint8)
        blocks[5:, :, 192:208] = np.array([127] * 16, np.int8).view(np.uint8)
    table = np.array([[raw.ctypes.data, 70]], np.int64)
    x = np.random.default_rng(22).standard_normal((tokens, 1024)).astype(np.float32) * 3
    x[:2] = [[3.0], [-3.0]]  # every activation at its level's largest code, 256 * 127
    x[:, 5] = 80.0  # an outlier channel
    act = quantize_super_blocks(x, levels=2)
    q, d, bsum = act.kernel_args(kind.activation_order, kind.sub_block, paired=True)
    two = np.empty((tokens, 80), np.float32)[:, 5:75]  # into columns of a wider output
    wide = np.empty((tokens, 70), np.float32)
    kind.decode_parts(table, raw.shape[1], 2, q, d, bsum, two, decode_tasks())
    x16 = act.widened(kind.activation_order)
    kind.decode_parts(table, raw.shape[1], WIDE, x16, d, bsum, wide, decode_tasks())
    assert np.array_equal(two, wide)
    with pytest.raises(ValueError, match="FEW_TOKENS"):
        kind.decode_parts(table, raw.shape[1], WIDE, x16[:4], d, bsum, wide[:4], 1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("tokens", [3, 9, 33])
def test_super_block_kernels_read_padded_activation_rows(qtype, tokens):
    """Activations in super-blocks lie in rows a super-block longer than K (so that a
    kernel reading one super-block of every token does not hit the same L1 sets each
    time), and the kernels go by the rows' stride: the same bits as from contiguous
    copies, for a row count that fills several row groups and leaves a remainder."""
    from kernels.quant.activations import padded_rows, quantize_super_blocks
    from kernels.quant.matmul import parts_kernel_args
    from kernels.quant.superblock import ROW_GROUP

    rows = 3 * ROW_GROUP + 3
    kind = quant_type(qtype)
    raw, _ = _weight(qtype, rows, 2048, seed=31)
    table = np.array([[raw.ctypes.data, rows]], np.int64)
    x = np.random.default_rng(32).standard_normal((tokens, 2048)).astype(np.float32)
    act = quantize_super_blocks(x, levels=2)
    assert act.q.strides[0] == 2048 + 256 and act.q_k4.strides[0] == 2048 + 256
    levels, codes, d, bsum = parts_kernel_args(kind, act, tokens)
    assert codes.strides[0] % 4096 != 0
    padded = np.empty((tokens, rows), np.float32)
    contiguous = np.empty((tokens, rows), np.float32)
    kind.decode_parts(table, raw.shape[1], levels, codes, d, bsum, padded, decode_tasks())
    kind.decode_parts(
        table, raw.shape[1], levels, np.ascontiguousarray(codes), d, bsum, contiguous, 1
    )
    assert np.array_equal(padded, contiguous)
    # the gguf dequantizer's weights times the activations the kernel multiplied (both
    # levels)
    weights = reference_dequantize(raw, qtype, (rows, 2048)).astype(np.float64)
    levels_xs = act.dequantize().astype(np.float64)
    reference = (levels_xs[:tokens] + levels_xs[tokens:]) @ weights.T
    assert np.allclose(padded, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
    block = padded_rows(5, 512, np.int16)
    assert block.shape == (5, 512) and block.strides == (2 * (512 + 256), 2)


def test_integer_fp16_fallback_is_exact():
    """CPUs without F16C decode the block scales in integer code: every half exactly."""
    import numba

    from kernels.quant.blocks import _half_soft

    @numba.njit
    def convert(bits, out):
        for i in range(bits.shape[0]):
            out[i] = _half_soft(bits[i])

    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.shape, np.float32)
    convert(bits, out)
    ref = bits.view(np.float16).astype(np.float32)
    assert np.all((out == ref) | (np.isnan(out) & np.isnan(ref)))


def test_superblock_soft_fp16_is_exact(monkeypatch):
    """The super-block kernels' fp16 scales on CPUs without F16C (integer IR, which never
    runs where F16C exists): every half exactly, run through LLVM's JIT."""
    import ctypes

    import llvmlite.binding as llvm
    from llvmlite import ir

    from kernels.quant import superblock

    monkeypatch.setattr(superblock, "HAS_F16C", False)
    i64, f32 = ir.IntType(64), ir.FloatType()
    module = ir.Module("soft_half")
    fn = ir.Function(module, ir.FunctionType(f32, [i64]), "half_at")
    builder = ir.IRBuilder(fn.append_basic_block())
    builder.ret(superblock._half(builder, fn.args[0]))
    machine = llvm.Target.from_default_triple().create_target_machine()
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(str(module)), machine)
    engine.finalize_object()
    half_at = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_uint64)(
        engine.get_function_address("half_at")
    )
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.array([half_at(bits[i : i + 1].ctypes.data) for i in range(bits.size)], np.float32)
    ref = bits.view(np.float16).astype(np.float32)
    assert np.all((out == ref) | (np.isnan(out) & np.isnan(ref)))
