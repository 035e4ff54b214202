"""Decode kernels that unpack the blocks of 32 elements in registers (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0).

The generic decode path (:func:`kernels.quant.rows.decode_parts_rows`) writes each weight
row's codes and scales to buffers and reads them back for the dot product.
:func:`block32_pass` instead turns each four blocks of a row into two vectors of 64
codes, dots them with the int8 activations of every activation row in integers and
scales the lanes, all in registers, over the whole row. Profile that led here
(SmolLM2-135M, a Q4_1 file with a Q8_0 head, 2 threads, AMD EPYC with AVX-512 VNNI): the
Q4_1 kernels read 15 GB/s of weight bytes, 4.4 of the 8.5 ms a token took. Here, on the
same machine, one token (two levels), matrices cold, generic path -> this one: Q4_1
1536 x 576 8.9 -> 16.9 GB/s on one thread, 15.4 -> 26.5 on two; 49152 x 576 8.4 -> 17.1
and 15.7 -> 33.2; 8192 x 2048 15.0 -> 22.3 on one thread; Q8_0 49152 x 576 15.6 -> 24.4
and 31.2 -> 45.4; Q5_0 8192 x 2048 3.7 -> 17.7 on one thread. SmolLM2 on one thread:
12.9 -> 8.8 ms a token (Q4_1 7.7 -> 4.3 ms, the Q8_0 head 2.0 -> 1.3).

Activations come per 32 (:class:`~kernels.quant.activations.Q8Activations`: one float32
scale ``xd`` and the float sum ``xsum`` of the dequantized values per block).

* One level of int8 (:func:`block32_pass`, :func:`~kernels.quant.matmul.decode_matmul`):
  per block and token the 32 products summed in integers as 8 lanes of 4 (exact;
  ``vpdpbusd`` on VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on AVX2, plain IR elsewhere: the
  same integers on every path; Q8_0's signed codes through the sign trick of
  :func:`~kernels.quant.simd._dot4`), each lane times ``d * xd`` added by ``llvm.fma``
  into a 16-lane accumulator (two blocks per vector), the offset ``m * xsum`` (``m`` the
  block's minimum, or ``-8 d`` / ``-16 d`` for the types centred on zero) into a 4-lane
  one; a fixed summation tree at the end.
* Two levels, what the engine runs (:func:`block32_wide_pass`): the second level at
  exactly 1/256 of the first's scale, so each element's two codes are one int16,
  ``256 q_0 + q_1``; the codes widened to int16 once per row for every token, per block
  and token two ``vpmaddwd`` and an add (AVX2) or two ``vpdpwssd`` (VNNI) give 8 exact
  lanes, one float step per block, and the offset by the sum of both levels (``pair32``).
  Before, each level was a row of its own, with its own float steps: AVX2 code (LLVM's
  haswell), two threads, in G multiply-adds a second at 1 / 16 tokens, Q8_0 16384 x 640
  27 / 37 -> 39 / 79, Q5_0 2048 x 2048 27 / 36 -> 26 / 51, Q4_0 8192 x 2048 38 / 37 ->
  44 / 67.

Each token's arithmetic is the same whatever the other tokens of the call (batch
invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
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
    _tree_sum,
    _vec,
    stream_ahead,
)
from kernels.quant.superblock import _concat, _half, _load, _pick

__all__ = ["BLOCK32_CODES", "BLOCK32_KINDS", "block32_pass", "block32_rows"]

ISA = ISA_CODES[HOST_ISA]  # a compile-time constant of every kernel (see _cache.py)


def _halves(builder, bits) -> ir.Value:
    """A vector of IEEE half bit patterns (i16) as float32: one ``vcvtph2ps`` with F16C,
    else the integer conversion of :func:`~kernels.quant.superblock._half` per lane."""
    n = bits.type.count
    if HAS_F16C:
        return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), n)), _vec(F32, n))
    slot = cgutils.alloca_once(builder, bits.type)
    builder.store(bits, slot)
    at = builder.ptrtoint(slot, I64)
    out = ir.Constant(_vec(F32, n), ir.Undefined)
    for i in range(n):
        out = builder.insert_element(out, _half(builder, builder.add(at, I64(2 * i))), I32(i))
    return out


def _gather(builder, addrs: list, t: ir.Type, n: int):
    """The ``t`` (an integer type) at each of ``addrs`` as one vector, bitcast to ``n``
    lanes."""
    v = ir.Constant(_vec(t, len(addrs)), ir.Undefined)
    for i, a in enumerate(addrs):
        v = builder.insert_element(v, _load(builder, a, t), I32(i))
    return builder.bitcast(v, _vec(I16, n))


def _nibbles(builder, qs_addrs: list):
    """The 4-bit codes of blocks whose 16 bytes ``qs`` lie at ``qs_addrs`` (1 or 2), in
    element order: element ``e`` of a block is the low nibble of ``qs[e]`` for ``e < 16``,
    the high nibble of ``qs[e - 16]`` after. Each block's bytes twice, then a shift per
    64-bit lane (``vpsrlvq``) by 0 or 4 and a mask."""
    n = len(qs_addrs)
    qs = [_load(builder, a, _vec(I8, 16)) for a in qs_addrs]
    both = qs[0] if n == 1 else _concat(builder, qs[0], qs[1])
    twice = _pick(
        builder, both, [16 * b + i for b in range(n) for _ in range(2) for i in range(16)]
    )
    words = builder.bitcast(twice, _vec(I64, 4 * n))
    shifts = ir.Constant(_vec(I64, 4 * n), [0, 0, 4, 4] * n)
    codes = builder.bitcast(builder.lshr(words, shifts), _vec(I8, 32 * n))
    return builder.and_(codes, ir.Constant(_vec(I8, 32 * n), [15] * (32 * n)))


def _fifth_bits(builder, codes, qh_addrs: list):
    """``codes`` with 16 or-ed in where bit ``e`` of the block's little-endian ``qh`` is set
    (Q5_0 / Q5_1): the bits as a lane mask (``vpmovm2b`` / a masked move on AVX-512)."""
    n = len(qh_addrs)
    bits = _load(builder, qh_addrs[0], I32)
    if n == 2:
        high = builder.zext(_load(builder, qh_addrs[1], I32), I64)
        bits = builder.or_(builder.zext(bits, I64), builder.shl(high, I64(32)))
    mask = builder.bitcast(bits, _vec(ir.IntType(1), 32 * n))
    sixteen = builder.select(
        mask, ir.Constant(_vec(I8, 32 * n), [16] * (32 * n)), ir.Constant(_vec(I8, 32 * n), None)
    )
    return builder.or_(codes, sixteen)


def _widen(builder, v, lanes: int = 16):
    """A vector of at most ``lanes`` lanes as ``lanes``, the others 0."""
    n = v.type.count
    if n == lanes:
        return v
    index = list(range(n)) + [n] * (lanes - n)
    return builder.shuffle_vector(
        v, ir.Constant(v.type, None), ir.Constant(_vec(I32, lanes), index)
    )


def _add_offsets(builder, slot, offset, xs_at, n: int) -> None:
    """``slot`` (4 float lanes, a lane per block) ``+= offset * xsum`` for ``n`` (<= 4)
    blocks: their offsets times the activations' sums at ``xs_at``, in one FMA."""
    xs_v = _load(builder, xs_at, _vec(F32, n), 4)
    total = _fma(builder, _widen(builder, offset, 4), _widen(builder, xs_v, 4), builder.load(slot))
    builder.store(total, slot)


@dataclass(frozen=True)
class _Kind:
    """A 32-element type's block: ``d[2]`` first, then (where present) the fp16 minimum
    ``m`` at byte 2 (``has_min``), the fifth bits ``qh[4]`` at ``qh_at``, the codes at
    ``qs_at`` (16 bytes of nibbles, or 32 int8 when ``signed``). The weight is
    ``d * code + m``, or ``d * (code - zero)`` without a minimum (the offset ``-zero * d``
    exact: a power of two), or ``d * code`` for signed codes."""

    name: str
    block_bytes: int
    qs_at: int
    has_min: bool = False
    qh_at: int | None = None
    zero: int = 0
    signed: bool = False

    def codes(self, builder, base):
        """The codes of the 2 blocks at ``base`` (``<64 x i8>``) or of the 1 there
        (``<32 x i8>``); ``base`` a list of 1 or 2 addresses."""
        if self.signed:
            parts = [_load(builder, builder.add(a, I64(self.qs_at)), _vec(I8, 32)) for a in base]
            return parts[0] if len(parts) == 1 else _concat(builder, parts[0], parts[1])
        codes = _nibbles(builder, [builder.add(a, I64(self.qs_at)) for a in base])
        if self.qh_at is not None:
            codes = _fifth_bits(builder, codes, [builder.add(a, I64(self.qh_at)) for a in base])
        return codes

    def wide_codes(self, builder, base) -> tuple:
        """The codes of the block at ``base`` as int16 in element order, two ``<16 x
        i16>``: elements 0-15 and 16-31 (the low and the high nibbles of ``qs``)."""
        v16b, v16s = _vec(I8, 16), _vec(I16, 16)
        qs = builder.add(base, I64(self.qs_at))
        if self.signed:
            return tuple(
                builder.sext(_load(builder, builder.add(qs, I64(16 * h)), v16b), v16s)
                for h in range(2)
            )
        both = builder.zext(_load(builder, qs, v16b), v16s)
        codes = [
            builder.and_(both, ir.Constant(v16s, [15] * 16)),
            builder.lshr(both, ir.Constant(v16s, [4] * 16)),
        ]
        if self.qh_at is not None:  # bit e of qh: element e's fifth bit
            bits = _load(builder, builder.add(base, I64(self.qh_at)), I32)
            sixteen, zero = ir.Constant(v16s, [16] * 16), ir.Constant(v16s, None)
            for h in range(2):
                half = builder.trunc(builder.lshr(bits, I32(16 * h)), I16)
                mask = builder.bitcast(half, _vec(ir.IntType(1), 16))
                codes[h] = builder.or_(codes[h], builder.select(mask, sixteen, zero))
        return tuple(codes)

    def wide_block_codes(self, builder, blocks: list) -> list:
        """:meth:`wide_codes` of each block at ``blocks``; the 5-bit types' codes made as
        bytes for two blocks at once (:meth:`codes`: the fifth bits of 64 elements from one
        64-bit mask), then widened (AVX2, Q5_0 2048 x 2048, one token: 0.21 -> 0.16 ms;
        for Q4_0 the other way round, 0.38 -> 0.42)."""
        if self.qh_at is None:
            return [self.wide_codes(builder, a) for a in blocks]
        out = []
        for c in range(0, len(blocks), 2):
            chunk = self.codes(builder, blocks[c : c + 2])
            for b in range(chunk.type.count // 32):
                out.append(tuple(
                    builder.zext(_pick(builder, chunk, list(range(32 * b + 16 * h, 32 * b + 16 * h + 16))), _vec(I16, 16))
                    for h in range(2)
                ))  # fmt: skip
        return out

    def scales(self, builder, blocks: list):
        """``(d, offset)``: float32 vectors of the scales and the offsets (None for signed
        codes) of the blocks at ``blocks``, converted from fp16 together."""
        n = len(blocks)
        if self.has_min:  # d and m side by side: one 32-bit load per block
            dm = _halves(builder, _gather(builder, blocks, I32, 2 * n))
            d = _pick(builder, dm, [2 * b for b in range(n)])
            return d, _pick(builder, dm, [2 * b + 1 for b in range(n)])
        d = _halves(builder, _gather(builder, blocks, I16, n))
        if self.signed:
            return d, None
        return d, builder.fmul(d, ir.Constant(_vec(F32, n), [-float(self.zero)] * n))


_KINDS = (
    _Kind("Q4_0", 18, 2, zero=8),
    _Kind("Q4_1", 20, 4, has_min=True),
    _Kind("Q5_0", 22, 6, qh_at=2, zero=16),
    _Kind("Q5_1", 24, 8, has_min=True, qh_at=4),
    _Kind("Q8_0", 34, 2, signed=True),
)
BLOCK32_KINDS = dict(enumerate(_KINDS))
BLOCK32_CODES = {k.name: code for code, k in BLOCK32_KINDS.items()}


def _pass_types(tokens, isa, kind):
    """``(signature, tokens, isa name, kind)`` of a pass intrinsic (:func:`block32_pass`,
    :func:`block32_wide_pass`) typed with these literals, or None where one is not a
    literal it takes."""
    lit = (
        _literal(tokens, (1, 2, 4)),
        _literal(isa, range(len(ISAS))),
        _literal(kind, tuple(BLOCK32_KINDS)),
    )
    if any(v is None for v in lit):
        return None
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, u, i, u, i, u, i, tokens, isa, kind)
    return sig, lit[0], ISAS[lit[1]], BLOCK32_KINDS[lit[2]]


def _token_rows(builder, args, tokens: int) -> tuple[list, list, list]:
    """Each token's activation, scale and sum addresses from a pass's arguments (``x``,
    ``x_tok``, ``xd``, ``xd_tok``, ``xs``, ``xs_tok`` after the row and its block count)."""
    return tuple(
        [builder.add(args[a], builder.mul(args[a + 1], I64(j))) for j in range(tokens)]
        for a in (2, 4, 6)
    )


@intrinsic
def block32_pass(
    typingctx, row, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, tokens, isa, kind
):  # fmt: skip
    """For ``j < tokens``: the float32 at ``out + j * out_tok`` = the dot product of the
    weight row at ``row`` (``nblk`` blocks of ``kind``, a :data:`BLOCK32_CODES` value)
    with token ``j``'s one level of int8 activations per 32 (:class:`~kernels.quant.
    activations.Q8Activations`) at ``x + j * x_tok``, its float32 scales and sums at
    ``xd + j * xd_tok`` and ``xs + j * xs_tok``. ``tokens`` (1, 2 or 4), ``isa`` and
    ``kind`` are compile-time. (Two levels: :func:`block32_wide_pass`.)

    The blocks go four at a time, as two vectors of 64 codes unpacked once for every
    token and their fp16 scales converted together; then a last pair, then a last block
    alone. Per pair and token: ``acc += float(lanes) * (d * xd)`` (16 lanes of 4
    products, 8 per block), ``acc_o += offset * xsum`` (a lane per block of the four); at
    the end one fixed tree over ``acc + acc_1 + acc_o`` (``acc_1`` the lone block's 8
    lanes, it and ``acc_o`` widened with zeros). Each token's arithmetic is the same
    whatever ``tokens``: so are the results."""
    typed = _pass_types(tokens, isa, kind)
    if typed is None:
        return None
    sig, tokens_v, isa_name, spec = typed

    def codegen(context, builder, signature, args):
        row_a, nblk_v, out_a, out_tok = args[0], args[1], args[8], args[9]
        x_rows, xd_rows, xs_rows = _token_rows(builder, args, tokens_v)

        def zeros(n):
            return [cgutils.alloca_once_value(builder, ir.Constant(_vec(F32, n), None))
                    for _ in range(tokens_v)]  # fmt: skip

        acc, acc_1, acc_o = zeros(16), zeros(8), zeros(4)

        def step(blk, n, targets):
            """Blocks ``blk .. blk + n`` (n 4, 2 or 1), into ``targets`` (per row)."""
            blocks = [builder.add(row_a, builder.mul(builder.add(blk, I64(b)), I64(spec.block_bytes)))
                      for b in range(n)]  # fmt: skip
            chunks = [blocks[b : b + 2] for b in range(0, n, 2)]
            codes = [spec.codes(builder, c) for c in chunks]
            d, offset = spec.scales(builder, blocks)
            for r in range(tokens_v):
                at = builder.mul(blk, I64(4))
                xd_v = _load(builder, builder.add(xd_rows[r], at), _vec(F32, n), 4)
                scale = builder.fmul(d, xd_v)
                for p, c in enumerate(codes):
                    width = c.type.count
                    xv = _load(
                        builder,
                        builder.add(x_rows[r], builder.mul(builder.add(blk, I64(2 * p)), I64(32))),
                        c.type,
                    )
                    lanes = builder.sitofp(
                        _dot4(builder, isa_name, c, xv, width, spec.signed), _vec(F32, width // 4)
                    )
                    lane_scale = _pick(
                        builder, scale, [2 * p + e // 32 for e in range(0, width, 4)]
                    )
                    a = targets[r]
                    builder.store(_fma(builder, lanes, lane_scale, builder.load(a)), a)
                if offset is not None:
                    _add_offsets(builder, acc_o[r], offset, builder.add(xs_rows[r], at), n)

        quads = builder.udiv(nblk_v, I64(4))
        with cgutils.for_range(builder, quads) as loop:
            blk = builder.mul(loop.index, I64(4))
            first = builder.add(row_a, builder.mul(blk, I64(spec.block_bytes)))
            stream_ahead(builder, first, 4 * spec.block_bytes)
            step(blk, 4, acc)
        done = builder.mul(quads, I64(4))
        rest = builder.sub(nblk_v, done)
        with builder.if_then(builder.icmp_unsigned(">=", rest, I64(2))):
            step(done, 2, acc)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(rest, I64(1)), I64(0))):
            step(builder.sub(nblk_v, I64(1)), 1, acc_1)
        for j in range(tokens_v):
            lanes = builder.fadd(builder.load(acc[j]), _widen(builder, builder.load(acc_1[j])))
            lanes = builder.fadd(lanes, _widen(builder, builder.load(acc_o[j])))
            dst = builder.add(out_a, builder.mul(out_tok, I64(j)))
            builder.store(
                _tree_sum(builder, lanes), builder.inttoptr(dst, ir.PointerType(F32)), align=4
            )
        return context.get_dummy_value()

    return sig, codegen


# ``levels`` of block32_rows: two levels of activations as one int16 per element
# (:meth:`~kernels.quant.activations.Q8Activations.widened`)
WIDE32 = 3
# Blocks block32_wide_pass unpacks for its tokens at a time (their int16 codes in
# registers beside the tokens' accumulators: AVX2 has 16). AVX2 code (LLVM's haswell),
# two threads, 16 tokens, G blocks / tokens a pass: 2 / 4 79, 50 and 67 G multiply-adds a
# second on Q8_0, Q5_0, Q4_0; 4 / 4 62, 50, 52; 2 / 2 56, 38, 52; 1 / 4 49, 42, 40
WIDE_GROUP = 2


def _wide_lanes(builder, isa: str, codes, xs) -> ir.Value:
    """``<8 x i32>``, lane ``j`` the sum of elements ``2j, 2j + 1, 16 + 2j, 17 + 2j`` of a
    block: its int16 codes (elements 0-15, 16-31) times a token's int16 activations
    (the same halves). ``vpmaddwd`` of each half and an add (AVX2), two ``vpdpwssd``
    (AVX-VNNI, AVX-512 VNNI), or plain IR: the same integers (no saturation: |a pair|
    <= 2 * 128 * 32,639 < 2^31)."""
    v8i, v16s = _vec(I32, 8), _vec(I16, 16)
    if isa in ("avxvnni", "avx512vnni"):
        dp = _fn(builder, "llvm.x86.avx512.vpdpwssd.256", v8i, [v8i, v8i, v8i])
        acc = ir.Constant(v8i, None)
        for c, x in zip(codes, xs):
            acc = builder.call(dp, [acc, builder.bitcast(c, v8i), builder.bitcast(x, v8i)])
        return acc
    if isa == "avx2":
        madd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i, [v16s, v16s])
        return builder.add(*(builder.call(madd, [c, x]) for c, x in zip(codes, xs)))
    pairs = []
    for c, x in zip(codes, xs):
        p = builder.mul(builder.sext(c, _vec(I32, 16)), builder.sext(x, _vec(I32, 16)))
        even, odd = (
            _pick(builder, p, list(range(0, 16, 2))),
            _pick(builder, p, list(range(1, 16, 2))),
        )
        pairs.append(builder.add(even, odd))
    return builder.add(pairs[0], pairs[1])


@intrinsic
def block32_wide_pass(
    typingctx, row, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, tokens, isa, kind
):  # fmt: skip
    """For ``j < tokens`` (1, 2 or 4): the float32 at ``out + j * out_tok`` = the dot
    product of the weight row at ``row`` (``nblk`` blocks of ``kind``, a
    :data:`BLOCK32_CODES` value) with token ``j``'s two levels of activations per 32 as
    one int16 per element at ``x + j * x_tok`` (:meth:`~kernels.quant.activations.
    Q8Activations.widened`: ``256 q_0 + q_1``), the second level's float32 scales at
    ``xd + j * xd_tok`` (1/256 of the first's) and the sums of both levels at ``xs + j *
    xs_tok`` (``pair32``). ``tokens``, ``isa`` and ``kind`` are compile-time.

    :data:`WIDE_GROUP` blocks at a time have their codes widened to int16 once for every
    token (then a last block alone); per block and token the 8 lanes of 4 products in
    integers (:func:`_wide_lanes`, exact: |.| <= 4 * 128 * 32,639 < 2^24), ``acc =
    fma(float(lanes), d * xd, acc)`` (8 lanes), and per group ``acc_o = fma(offset, xsum,
    acc_o)`` (a lane per block); at the end one fixed tree over ``acc + acc_o``. Each
    token's arithmetic is the same whatever ``tokens``, so are its results (batch
    invariance). Both levels in one product: two ``vpmaddwd`` and an add per block and
    token on AVX2, where int8 levels apart took, per level, ``vpmaddubsw``, ``vpmaddwd``,
    a conversion and an FMA (and for Q8_0 the sign trick)."""
    typed = _pass_types(tokens, isa, kind)
    if typed is None:
        return None
    sig, tokens_v, isa_name, spec = typed

    def codegen(context, builder, signature, args):
        row_a, nblk_v, out_a, out_tok = args[0], args[1], args[8], args[9]
        x_rows, xd_rows, xs_rows = _token_rows(builder, args, tokens_v)
        zeros = [ir.Constant(_vec(F32, n), None) for n in (8, 4)]
        acc = [cgutils.alloca_once_value(builder, zeros[0]) for _ in range(tokens_v)]
        acc_o = [cgutils.alloca_once_value(builder, zeros[1]) for _ in range(tokens_v)]

        def step(blk, n):
            """Blocks ``blk .. blk + n``."""
            blocks = [builder.add(row_a, builder.mul(builder.add(blk, I64(b)), I64(spec.block_bytes)))
                      for b in range(n)]  # fmt: skip
            codes = spec.wide_block_codes(builder, blocks)
            d, offset = spec.scales(builder, blocks)
            at = builder.mul(blk, I64(4))
            for r in range(tokens_v):
                scale = builder.fmul(
                    d, _load(builder, builder.add(xd_rows[r], at), _vec(F32, n), 4)
                )
                for b in range(n):
                    x_at = builder.add(x_rows[r], builder.mul(builder.add(blk, I64(b)), I64(64)))
                    xs = [
                        _load(builder, builder.add(x_at, I64(32 * h)), _vec(I16, 16))
                        for h in range(2)
                    ]
                    lanes = builder.sitofp(
                        _wide_lanes(builder, isa_name, codes[b], xs), _vec(F32, 8)
                    )
                    a = acc[r]
                    builder.store(
                        _fma(builder, lanes, _pick(builder, scale, [b] * 8), builder.load(a)), a
                    )
                if offset is not None:
                    _add_offsets(builder, acc_o[r], offset, builder.add(xs_rows[r], at), n)

        groups = builder.udiv(nblk_v, I64(WIDE_GROUP))
        with cgutils.for_range(builder, groups) as loop:
            blk = builder.mul(loop.index, I64(WIDE_GROUP))
            first = builder.add(row_a, builder.mul(blk, I64(spec.block_bytes)))
            stream_ahead(builder, first, WIDE_GROUP * spec.block_bytes)
            step(blk, WIDE_GROUP)
        done = builder.mul(groups, I64(WIDE_GROUP))
        with cgutils.for_range(builder, builder.sub(nblk_v, done)) as loop:  # the last blocks
            step(builder.add(done, loop.index), 1)
        for j in range(tokens_v):
            lanes = builder.fadd(builder.load(acc[j]), _widen(builder, builder.load(acc_o[j]), 8))
            dst = builder.inttoptr(
                builder.add(out_a, builder.mul(out_tok, I64(j))), ir.PointerType(F32)
            )
            builder.store(_tree_sum(builder, lanes), dst, align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**INLINE)
def _wide_pass(kind, tokens, row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok):
    """:func:`block32_wide_pass` over 4, 2 or 1 tokens, picked at run time."""
    if tokens == 4:
        block32_wide_pass(
            row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, 4, ISA, kind
        )
    elif tokens == 2:
        block32_wide_pass(
            row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, 2, ISA, kind
        )
    else:
        block32_wide_pass(
            row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, 1, ISA, kind
        )


@numba.njit(**INLINE)
def _pass(kind, tokens, row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok):
    """:func:`block32_pass` over 4, 2 or 1 tokens, picked at run time (numba needs the
    count at compile time)."""
    if tokens == 4:
        block32_pass(row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, 4, ISA, kind)
    elif tokens == 2:
        block32_pass(row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, 2, ISA, kind)
    else:
        block32_pass(row_at, nblk, x, x_tok, xd, xd_tok, xs, xs_tok, out, out_tok, 1, ISA, kind)


@numba.njit(**INLINE)
def block32_rows(kind, parts, row_bytes, levels, xq, xd, xsum, out, tasks):
    """``out[t, n]`` = weight row ``n`` dotted with token ``t``'s activations per 32, for
    every ``t`` and ``n`` (``T`` the rows of ``out``). ``levels`` 1: row ``t`` of the int8
    ``xq``, ``xd`` and ``xsum`` its scales and float sums per block. ``levels``
    :data:`WIDE32` (two levels, :func:`~kernels.quant.activations.
    two_level_activations`): row ``t`` of the int16 ``xq`` (:meth:`~kernels.quant.
    activations.Q8Activations.widened`), row ``T + t`` of ``xd`` (the second level's
    scales), row ``t`` of ``xsum`` (``pair32``, the sums of both levels).

    The weight rows are those of ``parts`` in order (int64 ``[P, 2]``: the address of a
    part's first row, its row count; every part ``row_bytes`` per row, of one ``kind``, a
    :data:`BLOCK32_CODES` value): the parts of a fused projection (q/k/v, gate/up) in one
    call, wherever each lies in the mapped file. The rows are split in ``tasks`` ranges
    over numba's threads; each weight row goes through passes of up to 4 tokens
    (:func:`block32_wide_pass`, :func:`block32_pass`: they write their tokens' results),
    the bytes ahead streamed into L2 block by block (the next row's whole bytes asked for
    at each row's start as well: Q8_0 49152 x 576, cold, 26.0 against 29.2-30.8 GB/s on
    one thread).

    One weight row at a time: walking 4 rows block by block together (each activation
    vector loaded once for all four) ran as fast on a matrix in cache, but slower from
    memory: Q4_1 8192 x 2048, one thread, 11.9 against 17.7 GB/s (in L3 both 21.4)."""
    if levels != 1 and levels != WIDE32:
        raise ValueError("block32_rows: one level of int8 activations, or WIDE32")
    if levels == WIDE32 and xq.itemsize != 2:
        raise ValueError("block32_rows: WIDE32 reads int16 activations")
    n_rows = part_rows(parts)
    tokens = out.shape[0]
    nblk = xq.shape[1] // 32
    tasks = max(1, min(n_rows, tasks))
    per = (n_rows + tasks - 1) // tasks
    qs, ds, ss, os_ = xq.strides[0], xd.strides[0], xsum.strides[0], out.strides[0]
    # two levels: the second level's scales, rows T.. of xd
    xq_at, xd_at = xq.ctypes.data, xd.ctypes.data + (tokens * ds if levels == WIDE32 else 0)
    xs_at, out_at = xsum.ctypes.data, out.ctypes.data
    for t in numba.prange(tasks):
        first = t * per
        last = min(first + per, n_rows)
        p, base = part_of(parts, first)
        for n in range(first, last):
            p, base, row_at = walk_row(parts, p, base, n, last, row_bytes, False)
            j = 0
            while j < tokens:
                step = min(4, tokens - j)
                if step == 3:
                    step = 2
                q_at, d_at, s_at = xq_at + j * qs, xd_at + j * ds, xs_at + j * ss
                o_at = out_at + j * os_ + 4 * n
                if levels == WIDE32:
                    _wide_pass(kind, step, row_at, nblk, q_at, qs, d_at, ds, s_at, ss, o_at, os_)
                else:
                    _pass(kind, step, row_at, nblk, q_at, qs, d_at, ds, s_at, ss, o_at, os_)
                j += step
