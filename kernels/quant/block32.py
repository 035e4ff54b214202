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
scale ``xd`` and the float sum ``xsum`` of the dequantized values per block). Per block
and activation row: the 32 products summed in integers as 8 lanes of 4 (exact; ``vpdpbusd``
on VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on AVX2, plain IR elsewhere: the same integers on
every path), each lane times ``d * xd`` added by ``llvm.fma`` into a 16-lane accumulator
(two blocks per vector), the offset ``m * xsum`` (``m`` the block's minimum, or
``-8 d`` / ``-16 d`` for the types centred on zero) into a 4-lane one; a fixed summation
tree at the end. Q8_0's signed codes go through the sign trick of
:func:`~kernels.quant.simd._dot4`. Each activation row's arithmetic is the same whatever
the other rows (batch invariance), and the two levels of a token
(:func:`~kernels.quant.activations.two_level_activations`) are two rows whose results are
added afterwards: the same bits as the sum of two single-level products.
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


def _widen(builder, v):
    """A float vector of fewer than 16 lanes as 16, the others 0."""
    n = v.type.count
    index = list(range(n)) + [n] * (16 - n)
    return builder.shuffle_vector(v, ir.Constant(v.type, None), ir.Constant(_vec(I32, 16), index))


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


@intrinsic
def block32_pass(
    typingctx, row, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, xs, xs_tok, xs_lvl, out, out_tok,
    tokens, levels, isa, kind
):  # fmt: skip
    """For ``j < tokens``: the float32 at ``out + j * out_tok`` = the dot product of the
    weight row at ``row`` (``nblk`` blocks of ``kind``, a :data:`BLOCK32_CODES` value)
    with token ``j``'s activations per 32 (:class:`~kernels.quant.activations.
    Q8Activations`), its ``levels`` activation rows summed in level order: level ``l``'s
    int8 at ``x + j * x_tok + l * x_lvl``, float32 scales and sums likewise from ``xd``
    and ``xs``. ``tokens`` and ``levels`` (``tokens * levels`` 1, 2 or 4), ``isa`` and
    ``kind`` are compile-time.

    The blocks go four at a time, as two vectors of 64 codes unpacked once for every
    activation row and their fp16 scales converted together; then a last pair, then a
    last block alone. Per pair and activation row: ``acc += float(lanes) * (d * xd)``
    (16 lanes of 4 products, 8 per block), ``acc_o += offset * xsum`` (a lane per block
    of the four); at the end one fixed tree over ``acc + acc_1 + acc_o`` (``acc_1`` the
    lone block's 8 lanes, it and ``acc_o`` widened with zeros). Each activation row's
    arithmetic is the same whatever ``tokens`` and ``levels``: so are the results. (A
    second accumulator for the second pair of each four, against the FMA latency, gained
    nothing with two rows and made AVX2, 16 registers, spill more.)"""
    lit = (
        _literal(tokens, (1, 2, 4)),
        _literal(levels, (1, 2)),
        _literal(isa, range(len(ISAS))),
        _literal(kind, tuple(BLOCK32_KINDS)),
    )
    if any(v is None for v in lit) or lit[0] * lit[1] > 4:
        return None
    tokens_v, levels_v, isa_name, spec = lit[0], lit[1], ISAS[lit[2]], BLOCK32_KINDS[lit[3]]
    rows_v = tokens_v * levels_v  # activation row r: token r // levels_v, level r % levels_v
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, i, u, i, i, u, i, i, u, i, tokens, levels, isa, kind)

    def codegen(context, builder, signature, args):
        row_a, nblk_v, x_a, x_tok, x_lvl, xd_a, xd_tok, xd_lvl = args[:8]
        xs_a, xs_tok, xs_lvl, out_a, out_tok = args[8:13]

        def per_row(base, tok, lvl):
            return [
                builder.add(
                    builder.add(base, builder.mul(tok, I64(r // levels_v))),
                    builder.mul(lvl, I64(r % levels_v)),
                )
                for r in range(rows_v)
            ]

        x_rows = per_row(x_a, x_tok, x_lvl)
        xd_rows = per_row(xd_a, xd_tok, xd_lvl)
        xs_rows = per_row(xs_a, xs_tok, xs_lvl)

        def zeros(n):
            return [cgutils.alloca_once_value(builder, ir.Constant(_vec(F32, n), None))
                    for _ in range(rows_v)]  # fmt: skip

        acc, acc_1, acc_o = zeros(16), zeros(8), zeros(4)

        def padded(v):
            """A vector of ``n`` < 4 lanes as 4, the others 0."""
            n = v.type.count
            if n == 4:
                return v
            zero = ir.Constant(v.type, None)
            return builder.shuffle_vector(
                v, zero, ir.Constant(_vec(I32, 4), [0, 1, 2, 3][:n] + [n] * (4 - n))
            )

        def step(blk, n, targets):
            """Blocks ``blk .. blk + n`` (n 4, 2 or 1), into ``targets`` (per row)."""
            blocks = [builder.add(row_a, builder.mul(builder.add(blk, I64(b)), I64(spec.block_bytes)))
                      for b in range(n)]  # fmt: skip
            chunks = [blocks[b : b + 2] for b in range(0, n, 2)]
            codes = [spec.codes(builder, c) for c in chunks]
            d, offset = spec.scales(builder, blocks)
            for r in range(rows_v):
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
                    xs_v = _load(builder, builder.add(xs_rows[r], at), _vec(F32, n), 4)
                    o = acc_o[r]
                    builder.store(_fma(builder, padded(offset), padded(xs_v), builder.load(o)), o)

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
        totals = []
        for r in range(rows_v):
            lanes = builder.fadd(builder.load(acc[r]), _widen(builder, builder.load(acc_1[r])))
            lanes = builder.fadd(lanes, _widen(builder, builder.load(acc_o[r])))
            totals.append(_tree_sum(builder, lanes))
        for j in range(tokens_v):
            total = totals[j * levels_v]
            for level in range(1, levels_v):
                total = builder.fadd(total, totals[j * levels_v + level])
            dst = builder.add(out_a, builder.mul(out_tok, I64(j)))
            builder.store(total, builder.inttoptr(dst, ir.PointerType(F32)), align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**INLINE)
def _pass(kind, tokens, levels, row_at, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, xs, xs_tok, xs_lvl, out, out_tok):  # fmt: skip
    """:func:`block32_pass` over ``tokens`` (up to 4 // ``levels``) tokens of ``levels``
    (1 or 2) rows, the literal counts picked at run time (numba needs them at compile
    time)."""
    if levels == 2:
        if tokens == 2:
            block32_pass(
                row_at, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, xs, xs_tok, xs_lvl, out,
                out_tok, 2, 2, ISA, kind,
            )  # fmt: skip
        else:
            block32_pass(
                row_at, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, xs, xs_tok, xs_lvl, out,
                out_tok, 1, 2, ISA, kind,
            )  # fmt: skip
    elif tokens == 4:
        block32_pass(
            row_at, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, xs, xs_tok, xs_lvl, out, out_tok,
            4, 1, ISA, kind,
        )  # fmt: skip
    elif tokens == 2:
        block32_pass(
            row_at, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, xs, xs_tok, xs_lvl, out, out_tok,
            2, 1, ISA, kind,
        )  # fmt: skip
    else:
        block32_pass(
            row_at, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, xs, xs_tok, xs_lvl, out, out_tok,
            1, 1, ISA, kind,
        )  # fmt: skip


@numba.njit(**INLINE)
def block32_rows(kind, parts, row_bytes, levels, xq, xd, xsum, out, tasks):
    """``out[t, n]`` = weight row ``n`` dotted with the ``levels`` (1 or 2) activation
    rows of token ``t`` (rows ``t`` and ``T + t`` of ``xq``, ``T`` the rows of ``out``),
    summed in level order, for every ``t`` and ``n``: per 32, ``xd`` the scales and
    ``xsum`` the float sums of each block.

    The weight rows are those of ``parts`` in order (int64 ``[P, 2]``: the address of a
    part's first row, its row count; every part ``row_bytes`` per row, of one ``kind``, a
    :data:`BLOCK32_CODES` value): the parts of a fused projection (q/k/v, gate/up) in one
    call, wherever each lies in the mapped file. The rows are split in ``tasks`` ranges
    over numba's threads; each weight row goes through passes of up to 4 activation rows
    (:func:`block32_pass`, which writes its tokens' results), the bytes ahead streamed
    into L2 block by block (the next row's whole bytes asked for at each row's start as
    well: Q8_0 49152 x 576, cold, 26.0 against 29.2-30.8 GB/s on one thread).

    One weight row at a time: walking 4 rows block by block together (each activation
    vector loaded once for all four) ran as fast on a matrix in cache, but slower from
    memory: Q4_1 8192 x 2048, one thread, 11.9 against 17.7 GB/s (in L3 both 21.4).
    Passes of 8 activation rows (AVX-512: four tokens' two levels) ran no faster than 4
    at 4 and 16 tokens: the float steps per pair and row bound the kernel there, not the
    unpacking."""
    if levels != 1 and levels != 2:
        raise ValueError("block32_rows: one or two levels of activations")
    n_rows = part_rows(parts)
    tokens = out.shape[0]
    nblk = xq.shape[1] // 32
    tasks = max(1, min(n_rows, tasks))
    per = (n_rows + tasks - 1) // tasks
    xq_at, xd_at, xs_at, out_at = xq.ctypes.data, xd.ctypes.data, xsum.ctypes.data, out.ctypes.data
    qs, ds, ss, os_ = xq.strides[0], xd.strides[0], xsum.strides[0], out.strides[0]
    # the second level of token t is row t + T
    q_lvl, d_lvl, s_lvl = tokens * qs, tokens * ds, tokens * ss
    most = 4 // levels
    for t in numba.prange(tasks):
        first = t * per
        last = min(first + per, n_rows)
        p, base = part_of(parts, first)
        for n in range(first, last):
            p, base, row_at = walk_row(parts, p, base, n, last, row_bytes, False)
            j = 0
            while j < tokens:
                step = min(most, tokens - j)
                if step == 3:
                    step = 2
                _pass(
                    kind, step, levels, row_at, nblk, xq_at + j * qs, qs, q_lvl, xd_at + j * ds,
                    ds, d_lvl, xs_at + j * ss, ss, s_lvl, out_at + j * os_ + 4 * n, os_,
                )  # fmt: skip
                j += step
