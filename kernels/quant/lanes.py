"""The prompt kernel of Q4_K and Q6_K on AVX-512 VNNI, AVX-VNNI and AVX2: weight rows in
vector lanes.

:func:`~kernels.quant.superblock.kblock_dot` keeps a row's super-block in registers and
meets each token's activations with it: the 16 lanes of its integer sum are parts of one
dot product, so every row, token and block ends in a float step of its own (convert,
scale, add to the accumulator in memory) and the offsets' products beside it. On a Zen 4
core (one 512-bit ``vpdpwssd`` a cycle) those steps cost as many cycles as the 16 dot
instructions they follow: the kernel ran at 55 G multiply-adds a second of the 117 the
core issues.

Here a lane is a weight row. Sixteen rows' super-blocks are unpacked once per call into
an L2-resident buffer (:func:`lanes_unpack`): per pair of elements, one vector of the 16
rows' codes times their sub-block scales as int16 pairs (the codes less their zero point,
as on the int16 decode path), transposed from the rows' own vectors by shuffles. Then
(:func:`lanes_dot`) up to :data:`TOKEN_TILE` tokens' accumulators stay in registers for
the whole row: per pair, one weight vector load and, per token, one ``vpdpwssd`` of it
with the token's two int16 activations broadcast to every lane. A block ends with one
float step per token for all 16 rows (``d`` of each lane times the token's scale), and
for Q4_K eight multiply-adds of the rows' ``dmin * min`` by the token's scaled
sub-block sums. Prototype of the inner loop, Zen 4, in L1: 103 G multiply-adds a second
(88% of the issue rate) against 55 for the decode kernel's.

Without AVX-512 the same buffer is read as two 256-bit halves of 8 rows: per pair and
token a ``vpdpwssd`` per half (AVX-VNNI) or a ``vpmaddwd`` and an add (AVX2), 4 tokens'
accumulators (8 of the 16 vector registers). The same integers and float steps per lane,
so the same bits as on AVX-512. Before, a prompt's rows took the decode kernel there, 16 a
call, and each row's block ended in its own float step as above: 1B Q4_K_M shape, two
threads, in turns, prefill 512 68.0 / 74.0 -> 94.8 / 99.8 tok/s (AVX2), 76.1 / 74.9 ->
92.4 / 98.9 (AVX-VNNI). The price there: a prompt's row no longer has its decode bits
(float rounding apart), so its logits may differ in the last bits with how much of it
was cached (a suffix under :data:`~kernels.quant.linear.LANE_MIN_ROWS` rows takes the
decode kernel), as for a part no tile fits on AVX-512.

Each token's arithmetic is the same sequence whatever the other tokens of the call, so a
row's result does not depend on the batch; it is not the decode kernel's result (another
summation order), which is why this kernel serves prompts only
(:class:`~kernels.quant.linear.BlockLinear` above ``DECODE_MAX_ROWS`` rows).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kernels.quant.blocks import INLINE, part_of, part_rows
from kernels.quant.simd import (
    F32,
    HOST_ISA,
    I16,
    I32,
    I64,
    ISAS,
    _fma,
    _fn,
    _literal,
    _splat,
    _vec,
    stream_ahead,
)
from kernels.quant.superblock import (
    ISA,
    ISA_CODES,
    KBLOCK_KINDS,
    _block_scales,
    _concat,
    _load,
    _wide_codes,
)

__all__ = ["LANES", "TOKEN_TILE", "lane_rows", "lanes_supported"]

# weight rows per tile: one int32 lane each of a 512-bit vector (AVX2 / AVX-VNNI: two
# 256-bit halves, the same buffer)
LANES = 16
# instruction sets with the kernel: AVX-512 VNNI (``vpdpwssd`` of 512 bits), AVX-VNNI
# (``vpdpwssd`` of 256, a half's lanes each) and AVX2 (``vpmaddwd`` and an add)
LANE_ISAS = ("avx512vnni", "avxvnni", "avx2")
# tokens whose integer accumulators stay in registers, by instruction set: AVX-512 8 of
# its 32 vector registers (and the float ones beside them); AVX2 / AVX-VNNI 4 tokens of
# two halves, 8 of 16 registers (with the weight vector's two and the broadcast pair)
TOKEN_TILES = {"avx512vnni": 8, "avxvnni": 4, "avx2": 4}
_LANE_CODES = tuple(ISA_CODES[name] for name in LANE_ISAS)
TOKEN_TILE = TOKEN_TILES.get(HOST_ISA, 8)
# int16 pairs of a super-block: the weight vectors per block and tile
PAIRS = 128
_W_BLOCK = PAIRS * 64  # bytes of a tile's block in the buffer
_M_BLOCK = 8 * 64  # the rows' dmin * min per sub-block (Q4_K): 8 vectors of 16 float32
# Pairs summed in int32 before a lane goes to float, by kind: a lane of a run of n pairs
# sums 2n products of an int16 weight (Q4_K: code * scale <= 15 * 63 < 2^10; Q6_K:
# (code - 32) * scale, |.| <= 32 * 128 = 2^12) by an int16 activation (|.| <= 32,640),
# exact while 2n * max|w| * 32,640 < 2^31: Q4_K 64 * 945 * 32,640 = 1,974,067,200, Q6_K
# 16 * 4,096 * 32,640 = 2,139,095,040 (the int16 decode path's bound per lane)
_RUN = {"Q4_K": 32, "Q6_K": 8}
# the scratch a tile's unpacking goes through: 16 rows' int16 pairs, then their mins
_SCRATCH = LANES * 512 + LANES * 32


def lanes_supported(kind_name: str) -> bool:
    """Whether this CPU runs :func:`lane_rows` for the type (Q4_K / Q6_K, on the
    instruction sets of :data:`LANE_ISAS`)."""
    return HOST_ISA in LANE_ISAS and kind_name in ("Q4_K", "Q6_K")


def _store(builder, value, addr, align: int):
    builder.store(value, builder.inttoptr(addr, ir.PointerType(value.type)), align=align)


def _transpose(builder, rows: list):
    """The transpose of ``n`` vectors of ``n`` lanes (``n`` a power of two): ``log2 n``
    rounds of two-source shuffles, each swapping the lanes whose row and column indices
    differ in one bit (element ``(i, c)`` ends at ``(c, i)``)."""
    n = len(rows)
    rows = list(rows)
    b = n // 2
    while b:
        lo_mask = ir.Constant(_vec(I32, n), [c if not c & b else n + c - b for c in range(n)])
        hi_mask = ir.Constant(_vec(I32, n), [c + b if not c & b else n + c for c in range(n)])
        new = list(rows)
        for i in range(n):
            if i & b:
                continue
            new[i] = builder.shuffle_vector(rows[i], rows[i + b], lo_mask)
            new[i + b] = builder.shuffle_vector(rows[i], rows[i + b], hi_mask)
        rows = new
        b //= 2
    return rows


@intrinsic
def lanes_unpack(typingctx, rows, nblk, w, dv, mv, scratch, kind):
    """Sixteen weight rows (their addresses: int64 at ``rows``) of ``nblk`` super-blocks
    of ``kind`` (a :data:`~kernels.quant.superblock.KBLOCK_CODES` value, compile-time)
    into lanes: for block ``b`` and pair ``p``, the ``<16 x i32>`` at ``w + 8192 b + 64 p``
    holds in lane ``r`` row ``r``'s two elements of pair ``p`` (the pairs in the order of
    the kind's int16 activations, :meth:`~kernels.quant.activations.Q8KActivations.
    widened`), each its code less the zero point times its sub-block scale, as int16;
    ``d`` of each row as ``<16 x float>`` at ``dv + 64 b``; for a kind with offsets
    (Q4_K), ``dmin * min`` of each row and sub-block ``s`` at ``mv + 512 b + 64 s``.
    ``scratch``: 8,704 bytes. Every buffer 64-byte aligned."""
    lit = _literal(kind, tuple(KBLOCK_KINDS))
    if lit is None:
        return None
    _, block_bytes, body, _, zero = KBLOCK_KINDS[lit]
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, u, u, u, kind)
    v16i = _vec(I32, 16)

    def codegen(context, builder, signature, args):
        rows_a, nblk_v, w_a, d_a, m_a, s_a = args[:6]
        row_at = [_load(builder, builder.add(rows_a, I64(8 * r)), I64, 8) for r in range(LANES)]
        m_scratch = builder.add(s_a, I64(LANES * 512))
        with cgutils.for_range(builder, nblk_v) as loop:
            blk = loop.index
            off = builder.mul(blk, I64(block_bytes))
            d_blk = builder.add(d_a, builder.mul(blk, I64(64)))
            for r in range(LANES):
                base = builder.add(row_at[r], off)
                stream_ahead(builder, base, block_bytes)
                d, dm, sc, mins, chunks = body(builder, base)
                _, pairs = _block_scales(builder, "avx512vnni", sc, chunks)
                vecs = []
                for (codes, _, _), pr in zip(chunks, pairs):
                    vecs += _wide_codes(builder, codes, pr, zero)
                for g, v in enumerate(vecs):  # pairs 16 g .. 16 g + 15 of row r
                    _store(
                        builder,
                        builder.bitcast(v, v16i),
                        builder.add(s_a, I64(512 * r + 64 * g)),
                        64,
                    )
                _store(builder, d, builder.add(d_blk, I64(4 * r)), 4)
                if not zero:
                    m = builder.fmul(builder.sitofp(mins, _vec(F32, 8)), _splat(builder, dm, 8))
                    _store(
                        builder,
                        builder.bitcast(m, _vec(I32, 8)),
                        builder.add(m_scratch, I64(32 * r)),
                        32,
                    )
            w_blk = builder.add(w_a, builder.mul(blk, I64(_W_BLOCK)))
            for g in range(8):
                rows_g = [
                    _load(builder, builder.add(s_a, I64(512 * r + 64 * g)), v16i, 64)
                    for r in range(LANES)
                ]
                for j, v in enumerate(_transpose(builder, rows_g)):
                    _store(builder, v, builder.add(w_blk, I64(64 * (16 * g + j))), 64)
            if not zero:
                undef8 = ir.Constant(_vec(I32, 8), ir.Undefined)
                widen = ir.Constant(v16i, list(range(16)))
                rows_m = [
                    builder.shuffle_vector(
                        _load(builder, builder.add(m_scratch, I64(32 * r)), _vec(I32, 8), 32),
                        undef8,
                        widen,
                    )
                    for r in range(LANES)
                ]
                m_blk = builder.add(m_a, builder.mul(blk, I64(_M_BLOCK)))
                for s, v in enumerate(_transpose(builder, rows_m)[:8]):
                    _store(builder, v, builder.add(m_blk, I64(64 * s)), 64)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_dot(typingctx, w, dv, mv, nblk, x, x_tok, xd, xd_tok, bx, bx_tok, out, kind, ntok, isa):
    """``out`` (float32 ``[ntok, 16]``, 64-byte aligned) = the 16 unpacked rows of
    :func:`lanes_unpack` (``w``, ``dv``, ``mv``) dotted with ``ntok`` tokens' int16
    activations: token ``t``'s at ``x + t * x_tok`` (:meth:`~kernels.quant.activations.
    Q8KActivations.widened`, in the kind's order), its float32 scale per block (the
    second level's: the first's / 256) at ``xd + t * xd_tok``, and for Q4_K its paired
    sub-block sums times that scale, float32 per 32 elements, at ``bx + t * bx_tok``.
    ``kind``, ``ntok`` (1 to 8) and ``isa`` (a :data:`LANE_ISAS` code) are compile-time.

    Per block and token, in integers (exact, |lane| < 2^31 as on the int16 decode path):
    ``isum[r] = sum_p w[p][r] . x[p]``; then ``acc[r] += float(isum[r]) * (d[r] * xd)``
    (``llvm.fma``) and, with offsets, ``acc[r] += (dmin[r] * min[r][s]) * bx[s]`` for the
    8 sub-blocks in order: the same operations for a token whatever the others, and for a
    lane whatever the instruction set (AVX2 / AVX-VNNI take each 512-bit weight vector
    as two halves of 8 rows: the same integers, the same float steps per lane)."""
    lit = (
        _literal(kind, tuple(KBLOCK_KINDS)),
        _literal(ntok, tuple(range(1, 9))),
        _literal(isa, _LANE_CODES),
    )
    if any(v is None for v in lit):
        return None
    kind_v, nt, isa_name = lit[0], lit[1], ISAS[lit[2]]
    zero = KBLOCK_KINDS[kind_v][4]
    run = _RUN[KBLOCK_KINDS[kind_v][0]]
    u, i = types.uintp, types.intp
    sig = types.void(u, u, u, i, u, i, u, i, u, i, u, kind, ntok, isa)
    v16i, v16 = _vec(I32, 16), _vec(F32, 16)
    # the integer accumulators: one 512-bit vector a token, or two halves of 8 lanes
    halves = 1 if isa_name == "avx512vnni" else 2
    vi = _vec(I32, 16 // halves)

    def codegen(context, builder, signature, args):
        w_a, d_a, m_a, nblk_v, x_a, x_tok, xd_a, xd_tok, bx_a, bx_tok, out_a = args[:11]
        if isa_name == "avx512vnni":
            dpwssd = _fn(builder, "llvm.x86.avx512.vpdpwssd.512", v16i, [v16i, v16i, v16i])
        elif isa_name == "avxvnni":  # the VEX form: LLVM picks it without AVX-512
            dpwssd = _fn(builder, "llvm.x86.avx512.vpdpwssd.256", vi, [vi, vi, vi])
        else:
            v16s = _vec(I16, 16)
            maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", vi, [v16s, v16s])

        def dot(s, wv, pair):
            """``s`` plus each lane's two products of ``wv`` by ``pair`` (the token's int16
            pair in every lane)."""
            if isa_name != "avx2":
                return builder.call(dpwssd, [s, wv, pair])
            prods = builder.call(maddwd, [builder.bitcast(wv, v16s), builder.bitcast(pair, v16s)])
            return builder.add(s, prods)

        def zeros(t):
            return cgutils.alloca_once_value(builder, ir.Constant(t, None))

        acc = [zeros(v16) for _ in range(nt)]
        isum = [[zeros(vi) for _ in range(halves)] for _ in range(nt)]
        part = [zeros(v16) for _ in range(nt)]
        x_row = [builder.add(x_a, builder.mul(x_tok, I64(t))) for t in range(nt)]
        xd_row = [builder.add(xd_a, builder.mul(xd_tok, I64(t))) for t in range(nt)]
        bx_row = [builder.add(bx_a, builder.mul(bx_tok, I64(t))) for t in range(nt)]
        with cgutils.for_range(builder, nblk_v) as loop:
            blk = loop.index
            for t in range(nt):
                builder.store(ir.Constant(v16, None), part[t])
            w_blk = builder.add(w_a, builder.mul(blk, I64(_W_BLOCK)))
            x_blk = [builder.add(x_row[t], builder.mul(blk, I64(512))) for t in range(nt)]
            with cgutils.for_range(builder, I64(PAIRS // run)) as runs:
                first = builder.mul(runs.index, I64(run))
                for t in range(nt):
                    for h in range(halves):
                        builder.store(ir.Constant(vi, None), isum[t][h])
                with cgutils.for_range(builder, I64(run)) as pairs:
                    p = builder.add(first, pairs.index)
                    w_p = builder.add(w_blk, builder.mul(p, I64(64)))
                    wv = [
                        _load(builder, builder.add(w_p, I64(64 // halves * h)), vi, 64 // halves)
                        for h in range(halves)
                    ]
                    for t in range(nt):
                        xv = _load(builder, builder.add(x_blk[t], builder.mul(p, I64(4))), I32, 4)
                        pair = _splat(builder, xv, 16 // halves)  # once for both halves
                        for h in range(halves):
                            s = builder.load(isum[t][h])
                            builder.store(dot(s, wv[h], pair), isum[t][h])
                for t in range(nt):  # the run's exact sums, to float
                    lanes = [builder.load(isum[t][h]) for h in range(halves)]
                    whole = lanes[0] if halves == 1 else _concat(builder, *lanes)
                    f = builder.sitofp(whole, v16)
                    builder.store(builder.fadd(builder.load(part[t]), f), part[t])
            dvec = _load(builder, builder.add(d_a, builder.mul(blk, I64(64))), v16, 64)
            m_blk = builder.add(m_a, builder.mul(blk, I64(_M_BLOCK)))
            for t in range(nt):
                xd_v = _load(builder, builder.add(xd_row[t], builder.mul(blk, I64(4))), F32, 4)
                f = builder.fmul(dvec, _splat(builder, xd_v, 16))
                a = _fma(builder, builder.load(part[t]), f, builder.load(acc[t]))
                if not zero:
                    bx_blk = builder.add(bx_row[t], builder.mul(blk, I64(32)))
                    for s in range(8):
                        mv_s = _load(builder, builder.add(m_blk, I64(64 * s)), v16, 64)
                        bx_s = _load(builder, builder.add(bx_blk, I64(4 * s)), F32, 4)
                        a = _fma(builder, mv_s, _splat(builder, bx_s, 16), a)
                builder.store(a, acc[t])
        for t in range(nt):
            _store(builder, builder.load(acc[t]), builder.add(out_a, I64(64 * t)), 64)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**INLINE)
def _tile_dot(kind, w_at, d_at, m_at, nblk, x_at, xs, xd_at, ds, bx_at, bs, tmp_at, nt):
    """:func:`lanes_dot` over ``nt`` tokens (8 where :data:`TOKEN_TILE` is, 4, 2 or 1),
    the literal count picked at run time."""
    if TOKEN_TILE == 8 and nt == 8:
        lanes_dot(w_at, d_at, m_at, nblk, x_at, xs, xd_at, ds, bx_at, bs, tmp_at, kind, 8, ISA)
    elif nt == 4:
        lanes_dot(w_at, d_at, m_at, nblk, x_at, xs, xd_at, ds, bx_at, bs, tmp_at, kind, 4, ISA)
    elif nt == 2:
        lanes_dot(w_at, d_at, m_at, nblk, x_at, xs, xd_at, ds, bx_at, bs, tmp_at, kind, 2, ISA)
    else:
        lanes_dot(w_at, d_at, m_at, nblk, x_at, xs, xd_at, ds, bx_at, bs, tmp_at, kind, 1, ISA)


@numba.njit(**INLINE)
def lane_rows(kind, parts, row_bytes, xw, xd, bx, out, tasks):
    """``out[t, n]`` = weight row ``n`` of ``parts`` (int64 ``[P, 2]``: each part's
    first-row address and row count, ``row_bytes`` per row, one ``kind``) dotted with
    token ``t``'s int16 activations ``xw[t]`` (:meth:`~kernels.quant.activations.
    Q8KActivations.widened` in the kind's order; ``xd[t]`` its second level's scales per
    256; ``bx[t]`` for Q4_K its paired sums per 32 times those scales, float32), for all
    tokens, tiles of :data:`LANES` rows split in ``tasks`` ranges over numba's threads.
    Each tile's rows are unpacked once for all tokens (:func:`lanes_unpack`)."""
    n_rows = part_rows(parts)
    tokens = out.shape[0]
    nblk = xw.shape[1] // 256
    n_tiles = (n_rows + LANES - 1) // LANES
    tasks = max(1, min(n_tiles, tasks))
    per = (n_tiles + tasks - 1) // tasks
    xs, ds, bs = xw.strides[0], xd.strides[0], bx.strides[0]
    x_at, xd_at, bx_at = xw.ctypes.data, xd.ctypes.data, bx.ctypes.data
    for task in numba.prange(tasks):
        raw = np.empty(
            nblk * (_W_BLOCK + 64 + _M_BLOCK) + _SCRATCH + 64 * TOKEN_TILE + 64, np.uint8
        )
        w_at = (raw.ctypes.data + 63) & ~63
        d_at = w_at + nblk * _W_BLOCK
        m_at = d_at + nblk * 64
        s_at = m_at + nblk * _M_BLOCK
        tmp_at = s_at + _SCRATCH
        tmp = raw[tmp_at - raw.ctypes.data : tmp_at - raw.ctypes.data + 64 * TOKEN_TILE].view(
            np.float32
        )
        rows = np.empty(LANES, np.int64)
        for tile in range(task * per, min((task + 1) * per, n_tiles)):
            n0 = tile * LANES
            valid = min(LANES, n_rows - n0)
            for r in range(LANES):  # a short last tile repeats its last row
                n = n0 + min(r, valid - 1)
                p, base = part_of(parts, n)
                rows[r] = parts[p, 0] + (n - base) * row_bytes
            lanes_unpack(rows.ctypes.data, nblk, w_at, d_at, m_at, s_at, kind)
            j = 0
            while j < tokens:
                nt = min(TOKEN_TILE, tokens - j)
                if nt < TOKEN_TILE:
                    nt = 4 if nt >= 4 else (2 if nt >= 2 else 1)
                _tile_dot(
                    kind, w_at, d_at, m_at, nblk, x_at + j * xs, xs, xd_at + j * ds, ds,
                    bx_at + j * bs, bs, tmp_at, nt,
                )  # fmt: skip
                for t in range(nt):
                    for r in range(valid):
                        out[j + t, n0 + r] = tmp[16 * t + r]
                j += nt
