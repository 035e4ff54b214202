"""Decode kernels that unpack k-quant super-blocks in registers (Q4_K, Q6_K).

The generic decode path (:func:`kernels.quant.rows.decode_rows`) writes each weight row's
codes to a buffer and reads them back for the dot product. For the two types that hold
nearly all the bytes of a Q4_K_M file (Q4_K, and Q6_K for the head, ``attn_v`` and
``ffn_down`` of some layers), :func:`kblock_dot` instead turns each 64 bytes of codes into
a vector, dots it with the int8 activations and scales the 16 integer lanes, all in
registers, over a whole row of super-blocks: no store, no reload, one pass. Profile that
led here (Llama-3.2-1B shape, Q4_K_M, 2 threads, AMD EPYC): the buffered kernels read
5-7 GB/s of a 21 GB/s bound, 123 of the 157 ms a token took.

Activations come per 256 (:class:`~kernels.quant.activations.Q8KActivations`), so each
super-block is summed in integers (exact): the codes' products per 4 elements, times the
block's integer sub-block scales (folded into ``vpmaddwd`` or ``vpdpwssd`` on x86), and
the integer offsets times the activations' integer sums; then one float32 step per block
and row, ``llvm.fma`` by ``d * xd`` and ``dmin * xd``, and a fixed summation tree at the
end. Several weight rows go block by block together, two of them unpacked at a time,
each token's activation vectors loaded once for both (:data:`ROW_GROUP`). A projection's
two levels of int8 (:func:`~kernels.quant.activations.
quantize_super_blocks`: the second at 1/256 of the first's scale) are paired per token:
``256 * isum_0 + isum_1`` in one float step, the offsets by integer sums of both levels.
Above :data:`FEW_TOKENS` tokens on AVX-512 VNNI, Q4_K and Q6_K take that integer
directly (:func:`wide_levels`): the two levels as one int16 per element, the codes times
their scales as int16 once per row, one ``vpdpwssd`` per 32 elements and token where the
two int8 levels take four instructions per 64, and the same value rounded once. With the
16 vector registers of AVX2 and AVX-VNNI a row's super-block as int16 codes times their
scales fills them all, so from :data:`WALK_MIN` tokens on :func:`kblock_walk` unpacks it
into an L1 buffer once and walks it a chunk (64 elements) at a time for four tokens,
their integer sums in registers: a ``vpmaddwd`` and an add per 16 elements and token
(AVX-VNNI: LLVM fuses some into ``vpdpwssd``), where the two int8 levels take six
instructions per 64. Q6_K's
codes carry a zero point (32), taken off inside the integer products on every path
(``vpmaddubsw`` of 32 and the activations subtracted from the pair sums, or the codes
less 32 as int16), so its blocks have no offsets to sum apart.
Every instruction set reaches the same integers, so every path gives the same bits, and
each activation row's arithmetic is the same whatever the number of rows (batch
invariance).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kernels.quant.blocks import INLINE, part_of, part_rows, walk_row
from kernels.quant.simd import (
    F32,
    HAS_F16C,
    HOST_ISA,
    I8,
    I16,
    I32,
    I64,
    ISA_CODES,
    ISAS,
    _dot4,
    _fma,
    _fn,
    _literal,
    _splat,
    _tree_sum,
    _vec,
    scale_field,
    stream_ahead,
)

__all__ = ["KBLOCK_CODES", "KBLOCK_KINDS", "kblock_dot", "kblock_rows"]

ISA = ISA_CODES[HOST_ISA]  # a compile-time constant of every kernel (see _cache.py)


def _load(builder, addr, t: ir.Type, align: int = 1):
    return builder.load(builder.inttoptr(addr, ir.PointerType(t)), align=align)


def _pick(builder, v, index: list[int]):
    """Lanes ``index`` of vector ``v`` (a constant shuffle)."""
    return builder.shuffle_vector(
        v, ir.Constant(v.type, ir.Undefined), ir.Constant(_vec(I32, len(index)), index)
    )


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(_vec(I32, 2 * n), list(range(2 * n))))


def _half(builder, addr):
    """The IEEE half at ``addr`` as float32: ``vcvtph2ps`` with F16C, else the integer
    conversion of :func:`kernels.quant.blocks._half_soft`."""
    bits = _load(builder, addr, I16, align=1)
    if HAS_F16C:
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)
    h = builder.zext(bits, I32)
    sign = builder.shl(builder.and_(h, I32(0x8000)), I32(16))
    exp = builder.and_(builder.lshr(h, I32(10)), I32(0x1F))
    man = builder.and_(h, I32(0x3FF))
    sub = builder.fmul(builder.uitofp(man, F32), F32(2.0**-24))
    sub = builder.select(builder.icmp_unsigned("!=", sign, I32(0)), builder.fneg(sub), sub)
    normal = builder.or_(
        sign,
        builder.or_(builder.shl(builder.add(exp, I32(112)), I32(23)), builder.shl(man, I32(13))),
    )
    special = builder.or_(sign, builder.or_(I32(0x7F800000), builder.shl(man, I32(13))))
    bits32 = builder.select(builder.icmp_unsigned("==", exp, I32(31)), special, normal)
    value = builder.bitcast(bits32, F32)
    return builder.select(builder.icmp_unsigned("==", exp, I32(0)), sub, value)


def _pair_scales(builder, sc16, w_lanes: list[int]):
    """``<32 x i16>``: the scale of each 2-element pair of a 64-byte chunk (what
    ``vpmaddwd`` multiplies ``vpmaddubsw``'s pair sums by), picked from the block's
    scales ``sc16`` (i16) by the sub-block of each 4-element lane (a splat per 16 pairs
    for Q4_K: one ``vpbroadcastw``)."""
    return _pick(builder, sc16, [w_lanes[j // 2] for j in range(32)])


def _scaled_lanes(builder, isa: str, codes, x, lane_scales, pair_scales, acc, zero: int = 0):
    """``acc`` (``<16 x i32>`` or None) plus lanes ``j`` = (sum of the 4 products of
    elements 4j..4j+3, each code less ``zero``) times ``lane_scales[j]``, exact. The x86
    paths fold the scales into the pair step: ``vpmaddubsw`` (u8 x i8 -> i16 pair sums;
    codes <= 63 and |x| <= 127 never saturate; with a zero point, less ``vpmaddubsw`` of
    ``zero`` and the same activations: |pair| <= 2 * 32 * 127) then ``vpmaddwd`` by
    ``pair_scales`` and an add (AVX2, AVX-VNNI), or ``vpdpwssd`` accumulating straight
    into ``acc`` (AVX-512 VNNI): two instructions per 64 bytes, where a ``vpdpbusd`` then
    a multiply of its lanes and an add took three. The generic path multiplies the dot
    product's lanes."""
    if isa == "generic":
        if zero:  # codes - zero fit in i8 (Q6_K: -32..31); |x| <= 127, so no sign overflow
            signed = builder.sub(codes, ir.Constant(codes.type, [zero] * codes.type.count))
            dots = _dot4(builder, isa, signed, x, 64, True)
        else:
            dots = _dot4(builder, isa, codes, x, 64, False)
        part = builder.mul(dots, lane_scales)
        return part if acc is None else builder.add(acc, part)
    v16i = _vec(I32, 16)
    if acc is None:
        acc = ir.Constant(v16i, None)
    if isa == "avx512vnni":
        v64, v32s = _vec(I8, 64), _vec(I16, 32)
        maddubs = _fn(builder, "llvm.x86.avx512.pmaddubs.w.512", v32s, [v64, v64])
        dpwssd = _fn(builder, "llvm.x86.avx512.vpdpwssd.512", v16i, [v16i, v16i, v16i])
        pairs = builder.call(maddubs, [codes, x])
        if zero:
            shift = builder.call(maddubs, [ir.Constant(v64, [zero] * 64), x])
            pairs = builder.sub(pairs, shift)
        pairs = builder.bitcast(pairs, v16i)
        return builder.call(dpwssd, [acc, pairs, builder.bitcast(pair_scales, v16i)])
    # AVX2, and AVX-VNNI the same way: its ``vpdpwssd`` accumulating into ``acc`` chained
    # every chunk's product on the last one's (5 cycles each; :func:`_chunk_sums` adds the
    # chunks in a tree instead)
    v32, v16s, v8i = _vec(I8, 32), _vec(I16, 16), _vec(I32, 8)
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16s, [v32, v32])
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i, [v16s, v16s])
    halves = []
    for h in range(2):
        lo = list(range(32 * h, 32 * h + 32))
        x_h = _pick(builder, x, lo)
        pairs = builder.call(maddubs, [_pick(builder, codes, lo), x_h])
        if zero:
            pairs = builder.sub(pairs, builder.call(maddubs, [ir.Constant(v32, [zero] * 32), x_h]))
        scale = _pick(builder, pair_scales, list(range(16 * h, 16 * h + 16)))
        acc_h = _pick(builder, acc, list(range(8 * h, 8 * h + 8)))
        halves.append(builder.add(acc_h, builder.call(maddwd, [pairs, scale])))
    return _concat(builder, halves[0], halves[1])


def _chunk_sums(builder, isa: str, terms, zero: int):
    """``<16 x i32>``: the sum over a block's chunks (``terms``: codes, activations, lane
    and pair scales each) of :func:`_scaled_lanes`. On AVX-512 VNNI each chunk's
    ``vpdpwssd`` accumulates into the last one's; elsewhere each chunk alone, then added in
    a tree, so that no chain of multiply-adds waits on the one before it (LLVM fuses an add
    of ``vpmaddwd`` into AVX-VNNI's ``vpdpwssd`` where it can; the chain through it cost
    the 1B shape's decode on AVX-VNNI 16.5-16.7 against 18.4-18.9 tok/s, S_TG at 4
    sequences 28 against 38). Integer sums: the same value either way."""
    if isa == "avx512vnni" or isa == "generic":
        isum = None
        for codes, x, lanes, pairs in terms:
            isum = _scaled_lanes(builder, isa, codes, x, lanes, pairs, isum, zero)
        return isum
    return _int_tree(
        builder, [_scaled_lanes(builder, isa, c, x, ln, pr, None, zero) for c, x, ln, pr in terms]
    )


def _int_tree(builder, values: list):
    """The sum of integer vectors ``values``, added pairwise in a balanced tree."""
    while len(values) > 1:
        values = [
            builder.add(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
            for i in range(0, len(values), 2)
        ]
    return values[0]


def _block_scales(builder, isa: str, sc, chunks) -> tuple[list, list]:
    """Per chunk, the sub-block scales as :func:`_scaled_lanes` takes them: the 32-bit
    scale of each 4-element lane (generic) or the 16-bit scale of each pair (x86)."""
    if isa == "generic":
        return [_pick(builder, sc, w_lanes) for _, _, w_lanes in chunks], [None] * len(chunks)
    sc16 = builder.trunc(sc, _vec(I16, sc.type.count))
    return [None] * len(chunks), [_pair_scales(builder, sc16, w) for _, _, w in chunks]


def _chunk_activations(builder, xb, span):
    """The 64 int8 activations a chunk of codes meets: elements ``span[0]`` and
    ``span[1]`` on, 32 each (one load where they are contiguous)."""
    e_lo, e_hi = span
    if e_hi == e_lo + 32:  # 64 contiguous elements
        return _load(builder, builder.add(xb, I64(e_lo)), _vec(I8, 64))
    lo = _load(builder, builder.add(xb, I64(e_lo)), _vec(I8, 32))
    hi = _load(builder, builder.add(xb, I64(e_hi)), _vec(I8, 32))
    return _concat(builder, lo, hi)


def _q4_k(builder, base):
    """One Q4_K super-block: ``d[2] dmin[2] scales[12] qs[128]``; element
    ``e = 64c + 32t + l`` is ``(qs[32c + l] >> 4t) & 15`` in sub-block ``2c + t``, weight
    ``d * sc[s] * q - dmin * m[s]``. Returns the float factors of the integer sums
    (codes, offsets), the integer sub-block scales and mins, and per 64 code bytes
    (codes, offsets of its two 32-element halves in the activations' Q4_K order, sub-block
    of each 4-lane)."""
    d = _half(builder, base)
    dmin = _half(builder, builder.add(base, I64(2)))
    raw = _load(builder, builder.add(base, I64(4)), _vec(I8, 12))
    sc = scale_field(builder, raw, "k4_scale")
    mins = scale_field(builder, raw, "k4_min")
    chunks = []
    lo_mask = ir.Constant(_vec(I8, 64), [15] * 64)
    four = ir.Constant(_vec(I8, 64), [4] * 64)
    for h in range(2):
        q = _load(builder, builder.add(base, I64(16 + 64 * h)), _vec(I8, 64))
        # low nibbles: bytes 0-31 are sub-block 4h, bytes 32-63 sub-block 4h + 2, which
        # the activations in Q4_K order (Q8KActivations.q_k4) hold as 64 contiguous codes
        chunks.append(
            (builder.and_(q, lo_mask), (128 * h, 128 * h + 32), [4 * h] * 8 + [4 * h + 2] * 8)
        )
        chunks.append(
            (builder.lshr(q, four), (128 * h + 64, 128 * h + 96), [4 * h + 1] * 8 + [4 * h + 3] * 8)
        )
    return d, builder.fneg(dmin), sc, mins, chunks


def _q6_k(builder, base):
    """One Q6_K super-block: ``ql[128] qh[64] scales[16] d[2]``; element
    ``e = 128h + 64t + l`` has low bits ``(ql[64h + l] >> 4t) & 15``, element
    ``e = 128h + 32t + l`` high bits ``(qh[32h + l] >> 2t) & 3``; code = low | high << 4
    (0..63), weight ``d * scales[e // 16] * (code - 32)``: the codes' zero point 32
    (:data:`KBLOCK_KINDS`) is taken off in the integer products, so the block has no
    offsets (its ``mins`` and their factor are None)."""
    d = _half(builder, builder.add(base, I64(208)))
    sc = builder.sext(_load(builder, builder.add(base, I64(192)), _vec(I8, 16)), _vec(I32, 16))

    def const(n, value):
        return ir.Constant(_vec(I8, n), [value] * n)

    chunks = []
    for h in range(2):
        ql = _load(builder, builder.add(base, I64(64 * h)), _vec(I8, 64))
        qh = _load(builder, builder.add(base, I64(128 + 32 * h)), _vec(I8, 32))
        highs = [builder.and_(builder.lshr(qh, const(32, 2 * t)), const(32, 3)) for t in range(4)]
        for t in range(2):
            low = builder.and_(ql, const(64, 15)) if t == 0 else builder.lshr(ql, const(64, 4))
            high = builder.shl(_concat(builder, highs[2 * t], highs[2 * t + 1]), const(64, 4))
            e0 = 128 * h + 64 * t
            # 16 lanes of 4 elements: sub-block (e0 + 4j) // 16
            chunks.append(
                (builder.or_(low, high), (e0, e0 + 32), [e0 // 16 + j // 4 for j in range(16)])
            )
    return d, None, sc, None, chunks


# kind code -> (GGUF type name, bytes per super-block, the body, sub-blocks per block,
# the codes' zero point: Q4_K has offsets per sub-block instead, summed apart)
KBLOCK_KINDS = {0: ("Q4_K", 144, _q4_k, 8, 0), 1: ("Q6_K", 210, _q6_k, 16, 32)}
KBLOCK_CODES = {name: code for code, (name, *_) in KBLOCK_KINDS.items()}
# Weight rows one kernel call walks block by block together, two at a time unpacked in
# registers, so that each activation vector is loaded once for two rows: at 16 tokens of
# two levels, 2048 x 2048 on one thread, Q4_K 0.94-1.13 ms against 1.24-1.43 for one row
# at a time, Q6_K 0.95-1.34 against 1.34-1.47 (the loads of activations bound the dot
# products there: packing the sums to 16 bits to save a multiply in four gained nothing).
# Eight rows (four pairs) read each super-block of the tokens' activations from L1 three
# times in four (two row pairs: once in two, the other from L2): 32 tokens of two levels,
# 2048 x 8192, one thread, rows of activations apart (activations.padded_rows), Q4_K
# 4.49-4.74 ms against 5.41-5.59, Q6_K 6.50-7.35 against 6.79-7.50
ROW_GROUP = 8
# Up to here kblock_rows runs kblock_pass (unrolled passes, accumulators in registers)
FEW_TOKENS = 4
# by kind code: the lanes of a block's offsets (one per sub-block; none with a zero point)
_N_OFFSETS = tuple(0 if zero else n_sub for _, _, _, n_sub, zero in KBLOCK_KINDS.values())


# ``levels`` of kblock_dot for two levels as one int16 per element
# (:meth:`~kernels.quant.activations.Q8KActivations.widened`), where WIDE_PATHS has it
WIDE = 3
# ``levels`` of kblock_rows for those int16 activations through kblock_walk (WALK_PATHS)
WALKED = 4
# (instruction set, kind): the codes (less their zero point) times their scales as int16,
# by int16 activations (|256 q_0 + q_1| <= 32,640), 16 products per lane and block:
# Q4_K's reach 15 * 63 < 2^10, Q6_K's 32 * 128 = 2^12, so |a lane| <= 16 * 4,096 *
# 32,640 = 2,139,095,040 < 2^31: exact in int32
# (AVX2 and AVX-VNNI take int16 activations through kblock_walk, WALK_PATHS)
WIDE_PATHS = {("avx512vnni", k) for k in ("Q4_K", "Q6_K")}


def wide_levels(kind_name: str, tokens: int) -> int:
    """The ``levels`` :func:`kblock_rows` takes ``tokens`` rows of two levels in, for this
    kind on this CPU: as int16 activations on AVX-512 VNNI above :data:`FEW_TOKENS`
    tokens (:data:`WIDE`: one ``vpdpwssd`` per 32 elements and token where the two int8
    levels take two ``vpmaddubsw`` and two ``vpdpwssd`` per 64; unpacking, once per row,
    multiplies the codes by their scales), on AVX2 and AVX-VNNI from :data:`WALK_MIN`
    tokens on (:data:`WALKED`, :func:`kblock_walk`: a ``vpmaddwd`` and an add per 16
    elements, where two levels take ``vpmaddubsw``, ``vpmaddwd`` and an add per 32 and
    level); else as two int8 rows (2)."""
    if (HOST_ISA, kind_name) in WALK_PATHS and tokens >= WALK_MIN:
        return WALKED
    if (HOST_ISA, kind_name) in WIDE_PATHS and tokens > FEW_TOKENS:
        return WIDE
    return 2


def _wide_codes(builder, codes, pair_scales, zero: int):
    """A chunk's 64 codes (u8) less their zero point, times their sub-block scales, as
    two ``<32 x i16>``: elements 4j, 4j + 1 then 4j + 2, 4j + 3 at positions 2j, 2j + 1,
    so that lane j of ``vpdpwssd`` sums elements 4j..4j+3, the lane :func:`_scaled_lanes`
    gives them."""
    out = []
    for h in range(2):
        picked = _pick(builder, codes, [4 * (i // 2) + 2 * h + i % 2 for i in range(32)])
        wide = builder.zext(picked, _vec(I16, 32))
        if zero:
            wide = builder.sub(wide, ir.Constant(_vec(I16, 32), [zero] * 32))
        out.append(builder.mul(wide, pair_scales))
    return out


def _wide_isum(builder, isa: str, wide_codes, xs):
    """float ``<16 x float>`` of the lanes' exact integer sums: each chunk's two i16 code
    vectors times the token's two i16 activation vectors (256 x level 0 + level 1).
    The same value, rounded once, as ``fma(float(isum_0), 256, float(isum_1))``: the same
    bits as the two-level path. AVX-512 VNNI's ``vpdpwssd`` of 512 bits (the other paths
    walk, :func:`kblock_walk`)."""
    assert isa == "avx512vnni", isa
    v16i = _vec(I32, 16)
    dpwssd = _fn(builder, "llvm.x86.avx512.vpdpwssd.512", v16i, [v16i, v16i, v16i])
    isum = ir.Constant(v16i, None)
    for codes, x in zip(wide_codes, xs):
        for h in range(2):
            isum = builder.call(
                dpwssd, [isum, builder.bitcast(codes[h], v16i), builder.bitcast(x[h], v16i)]
            )
    return builder.sitofp(isum, _vec(F32, 16))


def _offsets_fma(builder, mins, bsum, fm, acc):
    """A block and token's offsets in float: ``acc + float(mins) * float(bsum) * fm``,
    lane-wise (``mins``, ``bsum``: the sub-blocks' mins and the token's paired sums as
    float vectors; ``fm``: ``dmin * xd`` splat). Both are exact in float32 (|bsum| <
    2^24), so their product rounded once is ``float(mins * bsum)``, the integer product
    (< 2^31) converted: the same bits as multiplying in integers, without ``vpmulld``
    (two micro-ops, ten cycles' latency) and with ``mins`` converted once per block."""
    return _fma(builder, builder.fmul(mins, bsum), fm, acc)


class _Accumulators:
    """The float32 accumulators of :func:`kblock_dot` and :func:`kblock_walk` at ``at``:
    per row-token (``n_w`` rows x ``tokens``, row-major) 16 lanes, then the kind's
    offsets' lanes (none with a zero point); zeroed when made."""

    def __init__(self, builder, at, kind_v: int, n_w, tokens):
        self.builder, self.at, self.n_w, self.tokens = builder, at, n_w, tokens
        self.n_off = _N_OFFSETS[kind_v]
        self.lanes, self.offsets = _vec(F32, 16), _vec(F32, max(self.n_off, 1))
        with cgutils.for_range(builder, builder.mul(n_w, tokens)) as loop:
            a, a_o = self.of(loop.index)
            builder.store(ir.Constant(self.lanes, None), a, align=4)
            if a_o is not None:
                builder.store(ir.Constant(self.offsets, None), a_o, align=4)

    def of(self, wj):
        """Row-token ``wj``'s 16 lanes, and its offsets' (None without)."""
        b = self.builder
        at = b.add(self.at, b.mul(wj, I64(4 * (16 + self.n_off))))
        offsets = None
        if self.n_off:
            offsets = b.inttoptr(b.add(at, I64(64)), ir.PointerType(self.offsets))
        return b.inttoptr(at, ir.PointerType(self.lanes)), offsets

    def write(self, out, out_tok):
        """Each row-token's lanes summed by a fixed tree (the offsets' apart, then added),
        into the float32 at ``out + 4 * w + j * out_tok``."""
        b = self.builder
        with cgutils.for_range(b, b.mul(self.n_w, self.tokens)) as loop:
            wj = loop.index
            a, a_o = self.of(wj)
            total = _tree_sum(b, b.load(a, align=4))
            if a_o is not None:
                total = b.fadd(total, _tree_sum(b, b.load(a_o, align=4)))
            w, j = b.udiv(wj, self.tokens), b.urem(wj, self.tokens)
            dst = b.add(b.add(out, b.mul(j, out_tok)), b.mul(w, I64(4)))
            b.store(total, b.inttoptr(dst, ir.PointerType(F32)), align=4)


@intrinsic
def kblock_dot(
    typingctx, row, row_step, n_w, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, bs, bs_tok, out, out_tok, tokens,
    acc, isa, kind, levels
):  # fmt: skip
    """For ``w < n_w`` and ``j < tokens``: the float32 at ``out + 4 * w + j * out_tok`` =
    the dot product of the weight row at ``row + w * row_step`` (``nblk`` super-blocks of
    ``kind``, a :data:`KBLOCK_CODES` value) with token ``j``'s activations in super-block format
    (:class:`~kernels.quant.activations.Q8KActivations`): level ``l`` of its int8 at
    ``x + j * x_tok + l * x_lvl``, one float32 scale per 256 likewise from ``xd``
    (``xd_tok``, ``xd_lvl``), and the integer sums of its codes per sub-block (32 for
    Q4_K; with two levels the paired sums) at ``bs + j * bs_tok`` (unread for Q6_K, whose
    zero point leaves no offsets). ``acc``: float32 scratch of ``n_w * tokens * (16 +
    offsets)``, ``offsets`` the kind's :data:`_N_OFFSETS`. The ``n_w`` rows go block by
    block together (:data:`ROW_GROUP`). ``isa``, ``kind`` and ``levels``
    (1 or 2) are compile-time; ``tokens`` is not.

    Each super-block is unpacked once, into registers, for all tokens (a loop over the
    tokens inside the loop over blocks, the accumulators in ``acc``), two rows at a time
    where ``n_w`` allows, so that each activation vector is loaded once for both rows (the
    loads, not the multiplies, bound the dot products at several tokens). Per super-block
    and token, exact: ``isum = sum_s sc[s] * dot_s`` in integers, ``imin = mins * bsum``
    per sub-block (in float, :func:`_offsets_fma`); then in float32
    ``acc += float(isum) * (d * xd) + imin * (dm * xd)``, lane-wise with
    ``llvm.fma`` and summed by a fixed tree at the end: the same operations for a token
    whatever the number of tokens (batch invariance).

    Two levels (the second at 1/256 of the first's scale) are paired: one float step per
    block and token, ``float(256 * isum_0 + isum_1) * (d * xd_1)`` (the 256 applied in
    float) and the offsets times the paired sums ``256 * bsum_0 + bsum_1`` (exact)."""
    lit = (
        _literal(isa, range(len(ISAS))),
        _literal(kind, tuple(KBLOCK_KINDS)),
        _literal(levels, (1, 2, WIDE)),
    )
    if any(v is None for v in lit):
        return None
    isa_name, kind_v, n_levels = ISAS[lit[0]], lit[1], lit[2]
    _, block_bytes, body, n_sub, zero = KBLOCK_KINDS[kind_v]
    wide_ok = n_levels != WIDE or (isa_name, KBLOCK_KINDS[kind_v][0]) in WIDE_PATHS
    u, i = types.uintp, types.intp
    sig = types.void(u, i, i, i, u, i, i, u, i, i, u, i, u, i, i, u, isa, kind, levels)

    def codegen(context, builder, signature, args):
        if not wide_ok:  # never called (wide_levels says where it is): trap if it were
            builder.call(_fn(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        row_a, row_step, n_w, nblk_v = args[:4]
        x_a, x_tok, x_lvl, xd_a, xd_tok, xd_lvl, bs_a, bs_tok = args[4:12]
        out_a, out_tok, tokens_v, acc_a = args[12:16]
        v16, vo = _vec(F32, 16), _vec(F32, n_sub)
        accs = _Accumulators(builder, acc_a, kind_v, n_w, tokens_v)

        def unpack(blk, w):
            base = builder.add(
                builder.add(row_a, builder.mul(w, row_step)), builder.mul(blk, I64(block_bytes))
            )
            stream_ahead(builder, base, block_bytes)
            d, dm, sc, mins, chunks = body(builder, base)
            if not zero:
                mins = builder.sitofp(mins, vo)
            lanes, pairs = _block_scales(builder, isa_name, sc, chunks)
            codes = [c for c, _, _ in chunks]
            if n_levels == WIDE:  # the codes times their scales, as i16, once per block
                codes = [_wide_codes(builder, c, pr, zero) for c, pr in zip(codes, pairs)]
            return d, dm, mins, codes, lanes, pairs

        # the elements of each chunk (the same for every block: read off the IR of one,
        # which nothing uses and LLVM drops)
        spans = [span for _, span, _ in body(builder, row_a)[4]]

        def activations(xb):
            return [_chunk_activations(builder, xb, span) for span in spans]

        def isum_of(unpacked, xs):
            _, _, _, codes, lanes, pairs = unpacked
            terms = [(codes[c], xv, lanes[c], pairs[c]) for c, xv in enumerate(xs)]
            return builder.sitofp(_chunk_sums(builder, isa_name, terms, zero), v16)

        def rows_step(blk, ws):
            """Weight rows ``ws`` (1 or 2) of block ``blk`` unpacked, then each token's
            activations loaded once for them all."""
            rows = [unpack(blk, w) for w in ws]
            with cgutils.for_range(builder, tokens_v) as tok:
                j = tok.index
                xb = builder.add(
                    builder.add(x_a, builder.mul(j, x_tok)), builder.mul(blk, I64(256))
                )
                xd_j = builder.add(
                    builder.add(xd_a, builder.mul(j, xd_tok)), builder.mul(blk, I64(4))
                )
                if n_levels == WIDE:  # i16 activations: two vectors of 32 per chunk
                    xb = builder.add(
                        builder.add(x_a, builder.mul(j, x_tok)), builder.mul(blk, I64(512))
                    )
                    xs = [
                        [_load(builder, builder.add(xb, I64(128 * c + 64 * h)), _vec(I16, 32))
                         for h in range(2)]
                        for c in range(len(spans))
                    ]  # fmt: skip
                else:
                    xs = [activations(xb)]
                if n_levels != 1:
                    xs.append(activations(builder.add(xb, x_lvl)))
                    xd_j = builder.add(xd_j, xd_lvl)  # the second level's scale: the first's / 256
                xd_v = _load(builder, xd_j, F32, 4)
                if not zero:  # the offsets' sums (a zero point leaves none)
                    bs_j = builder.add(
                        builder.add(bs_a, builder.mul(j, bs_tok)), builder.mul(blk, I64(4 * n_sub))
                    )
                    bsum = builder.sitofp(_load(builder, bs_j, _vec(I32, n_sub), 4), vo)
                for w, unpacked in zip(ws, rows):
                    d, dm, mins = unpacked[:3]
                    if n_levels == WIDE:
                        total = _wide_isum(builder, isa_name, unpacked[3], xs)
                    elif n_levels == 2:
                        total = _fma(
                            builder,
                            isum_of(unpacked, xs[0]),
                            ir.Constant(v16, [256.0] * 16),
                            isum_of(unpacked, xs[1]),
                        )
                    else:
                        total = isum_of(unpacked, xs[0])
                    f = _splat(builder, builder.fmul(d, xd_v), 16)
                    a, a_o = accs.of(builder.add(builder.mul(w, tokens_v), j))
                    builder.store(_fma(builder, total, f, builder.load(a, align=4)), a, align=4)
                    if zero:
                        continue
                    fm = _splat(builder, builder.fmul(dm, xd_v), n_sub)
                    step = _offsets_fma(builder, mins, bsum, fm, builder.load(a_o, align=4))
                    builder.store(step, a_o, align=4)

        with cgutils.for_range(builder, nblk_v) as loop:
            blk = loop.index
            # two rows at a time: each activation vector loaded once for both
            with cgutils.for_range(builder, builder.udiv(n_w, I64(2))) as pair:
                w0 = builder.mul(pair.index, I64(2))
                rows_step(blk, [w0, builder.add(w0, I64(1))])
            odd = builder.icmp_unsigned("!=", builder.and_(n_w, I64(1)), I64(0))
            with builder.if_then(odd):
                rows_step(blk, [builder.sub(n_w, I64(1))])
        accs.write(out_a, out_tok)
        return context.get_dummy_value()

    return sig, codegen


def _walk_codes(builder, codes, pair_scales, zero: int) -> list:
    """A chunk's 64 codes (u8, as the kind's body gives them) less their zero point,
    times their sub-block scales (``pair_scales``, as :func:`_wide_codes` takes them), as
    four ``<16 x i16>``: :func:`_wide_codes`'s two vectors in 256-bit halves, made by
    in-lane byte shuffles (one ``vpshufb`` each, zero bytes from the second operand)
    where that picking of 32 of 64 bytes took ``vpsrld``, ``vpblendw`` and ``vpackusdw``
    on AVX2. Vector ``k`` holds, of the chunk's bytes ``32 (k % 2)`` on, the pairs
    ``4 (i // 2) + 2 (k // 2) + i % 2`` (``i < 16``), its scales ``pair_scales[16 (k % 2)
    .. 16 (k % 2) + 15]``."""
    v32, v16s = _vec(I8, 32), _vec(I16, 16)
    zeros = ir.Constant(v32, None)
    out = []
    for h in range(2):
        for r in range(2):
            half = _pick(builder, codes, list(range(32 * r, 32 * r + 32)))
            index = []
            for i in range(16):
                index += [4 * (i // 2) + 2 * h + i % 2, 32]  # the byte, then a zero byte
            wide = builder.bitcast(
                builder.shuffle_vector(half, zeros, ir.Constant(_vec(I32, 32), index)), v16s
            )
            if zero:
                wide = builder.sub(wide, ir.Constant(v16s, [zero] * 16))
            scale = _pick(builder, pair_scales, list(range(16 * r, 16 * r + 16)))
            out.append(builder.mul(wide, scale))
    return out


def _rolled_loop(builder, count: int, values: list, step) -> list:
    """``for i in range(count): values = step(i, values)`` as a loop LLVM does not unroll
    (``llvm.loop.unroll.disable``), ``values`` carried in registers (phi nodes); returns
    the last ``values``."""
    module = builder.module
    cond = builder.append_basic_block("rolled.cond")
    body = builder.append_basic_block("rolled.body")
    end = builder.append_basic_block("rolled.end")
    pre = builder.basic_block
    builder.branch(cond)
    builder.position_at_end(cond)
    index = builder.phi(I64)
    index.add_incoming(I64(0), pre)
    carried = []
    for v in values:
        phi = builder.phi(v.type)
        phi.add_incoming(v, pre)
        carried.append(phi)
    builder.cbranch(builder.icmp_unsigned("<", index, I64(count)), body, end)
    builder.position_at_end(body)
    new = step(index, carried)
    latch_block = builder.basic_block
    index.add_incoming(builder.add(index, I64(1)), latch_block)
    for phi, v in zip(carried, new):
        phi.add_incoming(v, latch_block)
    latch = builder.branch(cond)
    # a loop's ID is a node whose first operand is itself (llvmlite makes no such node:
    # made with a unique placeholder, then pointed at itself)
    option = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
    loop_id = module.add_metadata([ir.MetaDataString(module, f"rolled.{len(module.metadata)}")])
    loop_id.operands = (loop_id, option)
    latch.set_metadata("llvm.loop", loop_id)
    builder.position_at_end(end)
    return carried


# Tokens whose integer sums :func:`kblock_walk` keeps in registers while it walks a
# super-block's chunks: two 8-lane accumulators each (8 of AVX2's 16 vector registers),
# the chunk's four int16 code vectors beside them
WALK_GROUP = 4
# (instruction set, kind) where kblock_rows takes int16 activations through kblock_walk
WALK_PATHS = {(isa, k) for isa in ("avxvnni", "avx2") for k in ("Q4_K", "Q6_K")}

# kblock_rows takes int16 activations through kblock_walk on this CPU, from this many
# tokens on (one goes through kblock_pass's two int8 levels: no int16 activations to make)
WALK = (HOST_ISA, "Q4_K") in WALK_PATHS
WALK_MIN = 2


@intrinsic
def kblock_walk(
    typingctx, row, row_step, n_w, nblk, x, x_tok, xd, xd_tok, bs, bs_tok, out, out_tok, tokens,
    acc, codes_buf, isa, kind
):  # fmt: skip
    """:func:`kblock_dot` at ``levels`` :data:`WIDE` for the 16 vector registers of AVX2
    and AVX-VNNI: the same integers and float steps, so the same bits, walked so that
    nothing spills. There a row's super-block as int16 codes times their scales fills all
    16 registers, and unpacked two rows at a time ``kblock_dot`` reloads most of it from
    the stack for every token. Here each weight row's block is unpacked once into
    ``codes_buf`` (512 bytes, L1), then read a chunk (64 elements, four vectors) at a time
    for :data:`WALK_GROUP` tokens whose integer sums stay in registers (then two and one
    for the tokens left), each activation vector an operand of its ``vpmaddwd``.

    Arguments as :func:`kblock_dot` without the levels' distances: ``x`` the tokens'
    int16 activations (:meth:`~kernels.quant.activations.Q8KActivations.widened`),
    ``xd`` their second level's scales, ``bs`` the paired sums (unread for Q6_K); ``acc``
    float32 scratch of ``n_w * tokens * (16 + offsets)``; ``isa`` (avx2 or avxvnni) and
    ``kind`` compile-time."""
    lit = (_literal(isa, range(len(ISAS))), _literal(kind, tuple(KBLOCK_KINDS)))
    if any(v is None for v in lit):
        return None
    isa_name, kind_v = ISAS[lit[0]], lit[1]
    name, block_bytes, body, n_sub, zero = KBLOCK_KINDS[kind_v]
    walk_ok = (isa_name, name) in WALK_PATHS
    u, i = types.uintp, types.intp
    sig = types.void(u, i, i, i, u, i, u, i, u, i, u, i, i, u, u, isa, kind)

    def codegen(context, builder, signature, args):
        if not walk_ok:  # never called (wide_levels says where it is): trap if it were
            builder.call(_fn(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        row_a, row_step, n_w, nblk_v, x_a, x_tok, xd_a, xd_tok, bs_a, bs_tok = args[:10]
        out_a, out_tok, tokens_v, acc_a, buf_a = args[10:15]
        v16, vo, v8i, v16s = _vec(F32, 16), _vec(F32, n_sub), _vec(I32, 8), _vec(I16, 16)
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i, [v16s, v16s])
        accs = _Accumulators(builder, acc_a, kind_v, n_w, tokens_v)

        def group(blk, w, first, size, d_v, dm_v, mins):
            """Tokens ``first .. first + size`` times row ``w``'s block in codes_buf
            (``d_v``, ``dm_v``: its ``d`` and ``dmin`` splat; ``mins`` as float)."""
            xbs = [
                builder.add(
                    builder.add(x_a, builder.mul(builder.add(first, I64(t)), x_tok)),
                    builder.mul(blk, I64(512)),
                )
                for t in range(size)
            ]

            def chunk(c, sums):
                """Chunk ``c`` of the block for every token of the group: vector ``k`` of
                its codes (:func:`_walk_codes`) makes lanes ``8 (k % 2) ..`` of the
                block's integer sum, ``sums[2 t + k % 2]``."""
                at = builder.mul(c, I64(128))
                codes = [_load(builder, builder.add(buf_a, builder.add(at, I64(32 * k))), v16s, 2)
                         for k in range(4)]  # fmt: skip
                sums = list(sums)
                for t in range(size):
                    for k in range(4):
                        xv = _load(builder, builder.add(xbs[t], builder.add(at, I64(32 * k))), v16s)
                        lanes = 2 * t + k % 2
                        sums[lanes] = builder.add(sums[lanes], builder.call(maddwd, [codes[k], xv]))
                return sums

            # a loop LLVM keeps rolled: unrolled, it reassociated the sums and spilled them
            flat = _rolled_loop(builder, 256 // 64, [ir.Constant(v8i, None)] * (2 * size), chunk)
            isums = [flat[2 * t : 2 * t + 2] for t in range(size)]
            for t in range(size):
                j = builder.add(first, I64(t))
                total = builder.sitofp(_concat(builder, isums[t][0], isums[t][1]), v16)
                xd_v = _load(
                    builder,
                    builder.add(
                        builder.add(xd_a, builder.mul(j, xd_tok)), builder.mul(blk, I64(4))
                    ),
                    F32,
                    4,
                )
                a, a_o = accs.of(builder.add(builder.mul(w, tokens_v), j))
                # d * xd in every lane (the same product as a scalar one, splat)
                f = builder.fmul(d_v, _splat(builder, xd_v, 16))
                builder.store(_fma(builder, total, f, builder.load(a, align=4)), a, align=4)
                if zero:
                    continue
                bs_j = builder.add(
                    builder.add(bs_a, builder.mul(j, bs_tok)), builder.mul(blk, I64(4 * n_sub))
                )
                bsum = builder.sitofp(_load(builder, bs_j, _vec(I32, n_sub), 4), vo)
                fm = builder.fmul(dm_v, _splat(builder, xd_v, n_sub))
                step = _offsets_fma(builder, mins, bsum, fm, builder.load(a_o, align=4))
                builder.store(step, a_o, align=4)

        with cgutils.for_range(builder, nblk_v) as blk_loop:
            blk = blk_loop.index
            with cgutils.for_range(builder, n_w) as row_loop:
                w = row_loop.index
                base = builder.add(
                    builder.add(row_a, builder.mul(w, row_step)), builder.mul(blk, I64(block_bytes))
                )
                stream_ahead(builder, base, block_bytes)
                d, dm, sc, mins, chunks = body(builder, base)
                _, pairs = _block_scales(builder, isa_name, sc, chunks)
                for c, ((codes, _, _), pr) in enumerate(zip(chunks, pairs)):
                    for k, wide in enumerate(_walk_codes(builder, codes, pr, zero)):
                        at = builder.add(buf_a, I64(128 * c + 32 * k))
                        builder.store(
                            wide, builder.inttoptr(at, ir.PointerType(wide.type)), align=2
                        )
                d_v, dm_v = _splat(builder, d, 16), None
                if not zero:
                    dm_v = _splat(builder, dm, n_sub)
                    mins = builder.sitofp(mins, vo)
                full = builder.udiv(tokens_v, I64(WALK_GROUP))
                with cgutils.for_range(builder, full) as g:
                    first = builder.mul(g.index, I64(WALK_GROUP))
                    group(blk, w, first, WALK_GROUP, d_v, dm_v, mins)
                left = builder.sub(tokens_v, builder.mul(full, I64(WALK_GROUP)))
                first = builder.mul(full, I64(WALK_GROUP))
                with builder.if_then(builder.icmp_unsigned(">=", left, I64(2))):
                    group(blk, w, first, 2, d_v, dm_v, mins)
                odd = builder.icmp_unsigned("!=", builder.and_(left, I64(1)), I64(0))
                with builder.if_then(odd):
                    group(blk, w, builder.sub(tokens_v, I64(1)), 1, d_v, dm_v, mins)
        accs.write(out_a, out_tok)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def kblock_pass(
    typingctx, row, nblk, x, x_a, x_b, xd, xd_a, xd_b, bs, bs_a, bs_b, out, rows, isa, kind, paired
):
    """The kernel of :func:`kblock_rows` up to :data:`FEW_TOKENS` tokens: unrolled over
    ``rows`` activation rows with the accumulators in registers (faster there than
    :func:`kblock_dot`'s loop over tokens: Llama-3.2-1B shape, one thread, S_TG at B=4
    29.6-34.0 against 20.0 tok/s), the same arithmetic per row, so the same bits.

    For ``r < rows``: ``out[r]`` (float32 at ``out``) = the dot product of the weight
    row at ``row`` (``nblk`` super-blocks of ``kind``, a :data:`KBLOCK_CODES` value) with
    activation row ``r`` in super-block format (:class:`~kernels.quant.activations.
    Q8KActivations`): int8 at ``x + (r >> 1) * x_a + (r & 1) * x_b``, one float32 scale
    per 256 at the same offsets from ``xd`` (``xd_a``, ``xd_b``), int32 sums of the codes
    per sub-block (32 for Q4_K, 16 for Q6_K) likewise from ``bs``: consecutive rows
    (``x_a = 2 * x_b``), or pairs of a row and its second level (``x_b`` the distance
    between the levels). ``rows`` (1, 2 or 4), ``isa``, ``kind`` and ``paired`` are
    compile-time.

    Per super-block and row, exact: ``isum = sum_s sc[s] * dot_s`` in integers,
    ``imin = mins * bsum`` per sub-block (in float, :func:`_offsets_fma`); then in float32
    ``acc += float(isum) * (d * xd) + imin * (dm * xd)``, lane-wise with
    ``llvm.fma`` and summed by a fixed tree at the end.

    ``paired``: rows ``2j`` and ``2j + 1`` are the two levels of token ``j``, the second
    at 1/256 of the first's scale: ``out[j]`` for ``j < rows / 2``, one float step per
    block and token, ``float(256 * isum_0 + isum_1) * (d * xd_1)`` (the 256 applied in
    float) and the offsets times the token's paired sums at ``bs + j * bs_a``
    (``256 * bsum_0 + bsum_1``, exact)."""
    lit = (
        _literal(rows, (1, 2, 4)),
        _literal(isa, range(len(ISAS))),
        _literal(kind, tuple(KBLOCK_KINDS)),
        _literal(paired, (0, 1)),
    )
    if any(v is None for v in lit) or (lit[3] and lit[0] == 1):
        return None
    n_rows, isa_name, kind_v, pair = lit[0], ISAS[lit[1]], lit[2], bool(lit[3])
    _, block_bytes, body, n_sub, zero = KBLOCK_KINDS[kind_v]
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, i, u, i, i, u, i, i, u, rows, isa, kind, paired)
    n_out = n_rows // 2 if pair else n_rows

    def codegen(context, builder, signature, args):
        row_a, nblk_v = args[:2]
        out_a = args[11]

        def rows_of(at, a, b):
            return [
                builder.add(
                    at, builder.add(builder.mul(a, I64(r >> 1)), builder.mul(b, I64(r & 1)))
                )
                for r in range(n_rows)
            ]

        xr, xdr = rows_of(*args[2:5]), rows_of(*args[5:8])
        if pair:  # the paired sums: one row per token
            bsr = [builder.add(args[8], builder.mul(args[9], I64(j))) for j in range(n_out)]
        else:
            bsr = rows_of(*args[8:11])
        v16, vo = _vec(F32, 16), _vec(F32, n_sub)

        def zeros(t):
            return [cgutils.alloca_once_value(builder, ir.Constant(t, None)) for _ in range(n_out)]

        acc, acc_o = zeros(v16), (None if zero else zeros(vo))
        with cgutils.for_range(builder, nblk_v) as loop:
            blk = loop.index
            base = builder.add(row_a, builder.mul(blk, I64(block_bytes)))
            stream_ahead(builder, base, block_bytes)
            d, dm, sc, mins, chunks = body(builder, base)
            if not zero:
                mins = builder.sitofp(mins, vo)
            lanes, pairs = _block_scales(builder, isa_name, sc, chunks)

            def isum_of(r):
                xb = builder.add(xr[r], builder.mul(blk, I64(256)))
                terms = [
                    (codes, _chunk_activations(builder, xb, span), lanes[c], pairs[c])
                    for c, (codes, span, _) in enumerate(chunks)
                ]
                return builder.sitofp(_chunk_sums(builder, isa_name, terms, zero), v16)

            for j in range(n_out):
                if pair:
                    total = _fma(
                        builder,
                        isum_of(2 * j),
                        ir.Constant(v16, [256.0] * 16),
                        isum_of(2 * j + 1),
                    )
                    scale_row = 2 * j + 1  # the second level's scale: the first's / 256
                else:
                    total, scale_row = isum_of(j), j
                xd_v = _load(builder, builder.add(xdr[scale_row], builder.mul(blk, I64(4))), F32, 4)
                f = _splat(builder, builder.fmul(d, xd_v), 16)
                builder.store(_fma(builder, total, f, builder.load(acc[j])), acc[j])
                if zero:  # no offsets
                    continue
                bs_j = builder.add(bsr[j], builder.mul(blk, I64(4 * n_sub)))
                bsum = builder.sitofp(_load(builder, bs_j, _vec(I32, n_sub), 4), vo)
                fm = _splat(builder, builder.fmul(dm, xd_v), n_sub)
                builder.store(
                    _offsets_fma(builder, mins, bsum, fm, builder.load(acc_o[j])), acc_o[j]
                )
        for j in range(n_out):
            total = _tree_sum(builder, builder.load(acc[j]))
            if not zero:
                total = builder.fadd(total, _tree_sum(builder, builder.load(acc_o[j])))
            dst = builder.inttoptr(builder.add(out_a, I64(4 * j)), ir.PointerType(F32))
            builder.store(total, dst, align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**INLINE)
def _dots(kind, row_at, nblk, x_at, xd_at, bs_at, steps, dots_at, rows, paired):
    """One pass of :func:`kblock_pass` over ``rows`` (4, 2 or 1) activation rows, the
    literal row count picked at run time (numba needs it at compile time)."""
    xa, xb, da, db, sa, sb = steps[0], steps[1], steps[2], steps[3], steps[4], steps[5]
    if paired:
        if rows == 4:
            kblock_pass(
                row_at, nblk, x_at, xa, xb, xd_at, da, db, bs_at, sa, sb, dots_at, 4, ISA, kind, 1
            )
        else:
            kblock_pass(
                row_at, nblk, x_at, xa, xb, xd_at, da, db, bs_at, sa, sb, dots_at, 2, ISA, kind, 1
            )
    elif rows == 4:
        kblock_pass(
            row_at, nblk, x_at, xa, xb, xd_at, da, db, bs_at, sa, sb, dots_at, 4, ISA, kind, 0
        )
    elif rows == 2:
        kblock_pass(
            row_at, nblk, x_at, xa, xb, xd_at, da, db, bs_at, sa, sb, dots_at, 2, ISA, kind, 0
        )
    else:
        kblock_pass(
            row_at, nblk, x_at, xa, xb, xd_at, da, db, bs_at, sa, sb, dots_at, 1, ISA, kind, 0
        )


@numba.njit(**INLINE)
def _passes(kind, row_at, nblk, levels, tokens, xq_at, xd_at, bs_at, steps, dots, out, n):
    """Weight row ``n`` (at ``row_at``) times every token in passes of 4, 2 or 1
    activation rows (:func:`kblock_pass`), for up to :data:`FEW_TOKENS` tokens."""
    # one token's rows apart: steps[1] for consecutive rows, steps[0] for pairs
    if levels == 1:
        qs, ds, ss = steps[1], steps[3], steps[5]
    else:
        qs, ds, ss = steps[0], steps[2], steps[4]
    b = 0
    while b < tokens:
        step = min(4 // levels, tokens - b)
        if step == 3:
            step = 2
        rows = levels * step
        x_at, d_at, s_at = xq_at + b * qs, xd_at + b * ds, bs_at + b * ss
        _dots(kind, row_at, nblk, x_at, d_at, s_at, steps, dots.ctypes.data, rows, levels == 2)
        for r in range(step):
            out[b + r, n] = dots[r]
        b += step


@numba.njit(**INLINE)
def kblock_rows(kind, parts, row_bytes, levels, xq, xd, bsum, out, tasks):
    """``out[t, n]`` = weight row ``n`` dotted with activation row ``t`` (``levels`` 1),
    or with the two levels of token ``t``, rows ``t`` and ``t + T`` (``levels`` 2: an
    activation and what its int8 rounding left, at 1/256 of its scale,
    :func:`~kernels.quant.activations.quantize_super_blocks`; ``bsum`` then the paired
    sums, one row per token), for every ``t < T`` and ``n``. ``levels`` :data:`WIDE` or
    :data:`WALKED` (as :func:`wide_levels` says): the two levels as one int16 per element
    (``xq``: :meth:`~kernels.quant.activations.Q8KActivations.widened`, one row per token;
    ``xd`` both levels' scales as for 2), through :func:`kblock_dot` or
    :func:`kblock_walk`.

    The weight rows are those of ``parts`` in order (int64 ``[P, 2]``: the address of a
    part's first row, its row count; every part ``row_bytes`` per row, of one ``kind``):
    the parts of a fused projection (q/k/v, gate/up) in one call, wherever each lies in
    the mapped file. The rows are split in ``tasks`` ranges over numba's threads; each
    weight row is read and unpacked once for all tokens (:func:`kblock_dot`), the bytes
    :data:`~kernels.quant.simd.STREAM_AHEAD` on asked into L2 block by block."""
    if levels == WIDE and out.shape[0] <= FEW_TOKENS:
        raise ValueError("int16 activations (WIDE) are for more than FEW_TOKENS tokens")
    if levels == WALKED:
        if not WALK:
            raise ValueError("kblock_walk (WALKED) is for AVX2 and AVX-VNNI")
        if out.shape[0] < WALK_MIN:
            raise ValueError("int16 activations (WALKED) are for WALK_MIN tokens or more")
    n_rows = part_rows(parts)
    tokens = out.shape[0]
    nblk = xq.shape[1] // 256
    tasks = max(1, min(n_rows, tasks))
    per = (n_rows + tasks - 1) // tasks
    xq_at, xd_at, bs_at, out_at = xq.ctypes.data, xd.ctypes.data, bsum.ctypes.data, out.ctypes.data
    qs, ds, ss, os_ = xq.strides[0], xd.strides[0], bsum.strides[0], out.strides[0]
    n_off = _N_OFFSETS[kind]
    steps = np.empty(6, np.int64)
    # row r of a pass at (r >> 1) * steps[0] + (r & 1) * steps[1] (int8; then scales, sums)
    for j, stride in enumerate((qs, ds, ss)):
        if levels == 2:  # pairs (row t, row t + T); the paired sums one row per token
            steps[2 * j], steps[2 * j + 1] = stride, tokens * stride
        else:  # consecutive rows
            steps[2 * j], steps[2 * j + 1] = 2 * stride, stride
    for t in numba.prange(tasks):
        dots = np.empty(4, np.float32)
        # the accumulators, then (kblock_walk) a row's super-block as int16 (512 bytes)
        acc = np.empty(ROW_GROUP * tokens * (16 + n_off) + 128, np.float32)
        acc_at = acc.ctypes.data
        buf_at = acc_at + 4 * (acc.size - 128)
        first = t * per
        last = min(first + per, n_rows)
        p, base = part_of(parts, first)
        n = first
        while n < last:
            p, base, row_at = walk_row(parts, p, base, n, last, row_bytes, False)
            # up to ROW_GROUP consecutive rows of one part; one token alone goes row by
            # row (two Q6_K rows in registers spill: 130 against 103 us, 2048 x 2048)
            group = min(ROW_GROUP if tokens > 1 else 1, last - n, base + parts[p, 1] - n)
            # (levels, not the constant WALK, picks the kernel here: numba 0.68 pruned
            # `if tokens <= FEW_TOKENS and not walk` as never taken in this inlined
            # function, for `walk = levels == WIDE and WALK`, and rows were skipped)
            if tokens <= FEW_TOKENS and levels != WALKED:
                group = 1
            o_at = out_at + 4 * n
            if levels == WALKED:  # int16 activations in 16 vector registers
                kblock_walk(
                    row_at, row_bytes, group, nblk, xq_at, qs, xd_at + tokens * ds, ds, bs_at,
                    ss, o_at, os_, tokens, acc_at, buf_at, ISA, kind
                )  # fmt: skip
            elif tokens <= FEW_TOKENS:
                _passes(
                    kind, row_at, nblk, levels, tokens, xq_at, xd_at, bs_at, steps, dots, out, n
                )
            elif levels == WIDE:  # int16 activations, one row per token
                kblock_dot(
                    row_at, row_bytes, group, nblk, xq_at, qs, 0, xd_at, ds,
                    tokens * ds, bs_at, ss, o_at, os_, tokens, acc_at, ISA, kind, WIDE
                )  # fmt: skip
            # the second level of token t is row t + T (levels 2)
            elif levels == 2:
                kblock_dot(
                    row_at, row_bytes, group, nblk, xq_at, qs, tokens * qs, xd_at, ds,
                    tokens * ds, bs_at, ss, o_at, os_, tokens, acc_at, ISA, kind, 2
                )  # fmt: skip
            else:
                kblock_dot(
                    row_at, row_bytes, group, nblk, xq_at, qs, 0, xd_at, ds, 0, bs_at, ss,
                    o_at, os_, tokens, acc_at, ISA, kind, 1
                )  # fmt: skip
            n += group
