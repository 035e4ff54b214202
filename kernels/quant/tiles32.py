"""The blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) repacked at load into tiles of 16
rows, and their one kernel (AVX-512 VNNI).

Why: the per-32 block kernel (:mod:`kernels.quant.block32`) takes each weight row in
turn and up to four activation rows a pass, with a float step per pair of blocks and
activation row (Q8_0's signed codes through the sign trick besides): Gemma 3 270M's tied
Q8_0 head (262,144 x 640, 178 MB) took 75 ms of each 126 ms step of 16 sequences there,
its Q5_0 layers 22 (about 36 G multiply-adds a second on two threads), where llama.cpp's
whole step took 75; and prompts of these types went through float32 tiles dequantized
for torch's GEMM. With the rows interleaved once at load, as the k-quants' tiles do
(:mod:`kernels.quant.tiles`), one ``vpdpbusd`` with a token's 4 int8 activations
broadcast gives 16 rows' sums of 4 products, the weight bytes are read once for 8 tokens
and the float steps are per block and token for 16 rows at once. Two threads, weights
cold in 4 KB pages (``python -m kernels.quant.bench --tiles32``), against the per-32
kernel at 1 / 4 / 16 / 128 tokens: 1.14-1.30x / 1.61-2.37x / 3.08-3.61x / 3.58-3.96x
over the five types; one token reads 19-25 GB/s, four 16-19.

A tile holds 16 rows and, per block of 32 elements, their codes in lines of 64 bytes,
row ``r``'s four bytes of a line at ``4r``: Q8_0 8 lines (codes ``4k .. 4k + 3`` in line
``k``, each code plus 128: an unsigned byte, the operand ``vpdpbusd`` takes unsigned);
the 4-bit types 4 lines of the file's nibble bytes (``qs[4k .. 4k + 3]``: the low
nibbles are elements ``4k + i``, the high ``16 + 4k + i``); Q5_0 / Q5_1 one line more
with the fifth bits, bit ``v`` of byte ``i`` of a row's word the fifth bit of element
``i`` of code vector ``v`` (vectors 0-3 the low nibbles of lines 0-3, 4-7 the high).
After every block's lines, the 16 rows' fp16 scales per block, then (Q4_1 / Q5_1) their
fp16 minimums: the file's bytes, no more.

Per block, token and level of activations (:func:`~kernels.quant.activations.
two_level_activations`: one float32 scale ``xd`` per 32 each): ``v = dot - z * s`` in
integers (``z`` the codes' zero point, 128 / 8 / 16, or 0 where the block has a minimum;
``s`` the token's integer sum over the block), then ``acc = fma(float(v), d * xd,
acc)``, and where the block has a minimum ``m``, ``acc = fma(m, xsum, acc)`` (``xsum``
the float sum of the dequantized activations over the block); the first level then the
second, block by block. Every token's arithmetic is the same whatever the other tokens
(calls of 8, 4, 2 or 1 tokens), so a decode step, a batch of any size and a prompt give
a row the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kernels.quant.blocks import INLINE, JIT
from kernels.quant.simd import F32, I16, I32, I64, _fma, _fn, _literal, _splat, _vec, stream_ahead
from kernels.quant.superblock import _load

TILE_ROWS = 16
TOKENS = 8  # tokens a kernel call keeps in registers: 16 dot sums, 8 accumulators
V16 = _vec(F32, 16)


@dataclass(frozen=True)
class Layout:
    """A type's block in the file (``block`` bytes: fp16 ``d`` first, then where present
    the fp16 minimum at byte 2, the fifth bits ``qh[4]`` at ``qh_at``, the codes at
    ``qs_at``) and in a tile."""

    name: str
    block: int
    qs_at: int
    zero: int  # the codes' zero point (0 with a minimum)
    has_min: bool = False
    qh_at: int = -1

    @property
    def lines(self) -> int:
        """Lines of 64 bytes per block in a tile: codes, then fifth bits."""
        return (8 if self.name == "Q8_0" else 4) + (self.qh_at >= 0)

    @property
    def tile_block(self) -> int:
        """A tile's bytes per block: the lines, fp16 scales and minimums of 16 rows."""
        return 64 * self.lines + 32 * (1 + self.has_min)


LAYOUTS = (
    Layout("Q8_0", 34, 2, 128),
    Layout("Q4_0", 18, 2, 8),
    Layout("Q4_1", 20, 4, 0, has_min=True),
    Layout("Q5_0", 22, 6, 16, qh_at=2),
    Layout("Q5_1", 24, 8, 0, has_min=True, qh_at=4),
)
CODES = {k.name: code for code, k in enumerate(LAYOUTS)}
_Q8_0 = CODES["Q8_0"]
# per kind code, for the numba code: file block bytes, codes' offset, fifth bits' offset
# (-1: none), whether a minimum follows d, lines a block
_BLOCK = np.array([k.block for k in LAYOUTS], np.int64)
_QS_AT = np.array([k.qs_at for k in LAYOUTS], np.int64)
_QH_AT = np.array([k.qh_at for k in LAYOUTS], np.int64)
_HAS_MIN = np.array([k.has_min for k in LAYOUTS], np.bool_)
_LINES = np.array([k.lines for k in LAYOUTS], np.int64)


def tile_bytes(kind_name: str, nblk: int) -> int:
    """Bytes of one tile of rows ``nblk`` blocks long: the file's bytes for 16 rows."""
    return nblk * LAYOUTS[CODES[kind_name]].tile_block


@numba.njit(**JIT)
def _repack(kind, src, n, row_bytes, dst, first, last):
    """Rows (``n`` of ``row_bytes``, flat uint8 ``src``) of kind code ``kind`` into tiles
    ``first`` to ``last`` (flat uint8 ``dst``, :func:`tile_bytes` each); rows past ``n``
    zero codes and scales. Without the GIL (threads of
    :func:`~kernels.quant.tiles.repack_parts`)."""
    block, qs_at, qh_at = _BLOCK[kind], _QS_AT[kind], _QH_AT[kind]
    lines, has_min = _LINES[kind], _HAS_MIN[kind]
    nblk = row_bytes // block
    line_bytes = 64 * lines
    size = nblk * TILE_ROWS * block
    for t in range(first, last):
        rows = min(TILE_ROWS, n - t * TILE_ROWS)
        base = t * size
        scales = base + nblk * line_bytes
        for b in range(nblk):
            at = base + b * line_bytes
            for r in range(rows):
                blk = (t * TILE_ROWS + r) * row_bytes + b * block
                s = scales + 32 * b + 2 * r
                dst[s] = src[blk]
                dst[s + 1] = src[blk + 1]
                if has_min:
                    dst[s + 32 * nblk] = src[blk + 2]
                    dst[s + 32 * nblk + 1] = src[blk + 3]
                if kind == _Q8_0:
                    for k in range(8):
                        for i in range(4):
                            dst[at + 64 * k + 4 * r + i] = src[blk + qs_at + 4 * k + i] ^ 0x80
                    continue
                for k in range(4):
                    for i in range(4):
                        dst[at + 64 * k + 4 * r + i] = src[blk + qs_at + 4 * k + i]
                if qh_at >= 0:
                    qh = 0
                    for i in range(4):
                        qh |= np.uint32(src[blk + qh_at + i]) << np.uint32(8 * i)
                    for i in range(4):
                        byte = 0
                        for v in range(8):
                            e = 4 * v + i if v < 4 else 16 + 4 * (v - 4) + i
                            byte |= ((qh >> np.uint32(e)) & np.uint32(1)) << np.uint32(v)
                        dst[at + 256 + 4 * r + i] = byte
            if kind == _Q8_0:
                for r in range(rows, TILE_ROWS):  # zero codes: 128 with the offset
                    for k in range(8):
                        for i in range(4):
                            dst[at + 64 * k + 4 * r + i] = 0x80


def _fifth(b, qh, v: int):
    """Code vector ``v``'s fifth bits (16 rows x 4 bytes) at bit 4 of each byte."""
    mask = ir.Constant(_vec(I32, 16), [0x10101010] * 16)
    if v <= 4:
        moved = b.shl(qh, ir.Constant(_vec(I32, 16), [4 - v] * 16))
    else:
        moved = b.lshr(qh, ir.Constant(_vec(I32, 16), [v - 4] * 16))
    return b.and_(moved, mask)


@intrinsic
def tile_dot32(typingctx, tile, nblk, x, x_tok, x_lvl, xd, xd_tok, xd_lvl, cs, cs_tok, cs_lvl, xs, xs_tok, xs_lvl, out, kind, ntok):  # fmt: skip
    """``out`` (float32 ``[ntok, 16]``, 64-byte aligned) = the 16 rows of the tile at
    ``tile`` (``nblk`` blocks of kind code ``kind``, :func:`_repack`) dotted with ``ntok``
    tokens' two levels of per-32 int8 activations: token ``t``'s level ``l`` codes at
    ``x + t * x_tok + l * x_lvl``, its float32 scales per block likewise from ``xd``, its
    int32 sums per block times the zero point from ``cs``, its float32 sums of the
    dequantized values per block from ``xs`` (read where the blocks have a minimum).
    ``kind`` and ``ntok`` (1 to :data:`TOKENS`) are compile-time. The arithmetic: the
    module's docstring; the same operations for a token whatever the others."""
    nt = _literal(ntok, tuple(range(1, TOKENS + 1)))
    code = _literal(kind, tuple(range(len(LAYOUTS))))
    if nt is None or code is None:
        return None
    spec = LAYOUTS[code]
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, i, u, i, i, u, i, i, u, i, i, u, kind, ntok)

    def codegen(context, b, signature, args):
        tile_a, nblk_v = args[0], args[1]
        streams = [args[2 + 3 * j : 5 + 3 * j] for j in range(4)]  # x, xd, cs, xs
        out_a = args[14]
        v16i = _vec(I32, 16)
        dpbusd = _fn(b, "llvm.x86.avx512.vpdpbusd.512", v16i, [v16i, v16i, v16i])

        def rows(base, tok, lvl):
            return [
                [b.add(b.add(base, b.mul(tok, I64(t))), b.mul(lvl, I64(lv))) for lv in range(2)]
                for t in range(nt)
            ]

        xs_, xds, css, sums = (rows(*s) for s in streams)
        acc = [cgutils.alloca_once_value(b, ir.Constant(V16, None)) for _ in range(nt)]
        # (each level's sums in two chains below 4 tokens, against vpdpbusd's latency,
        # changed nothing measurable: Q8_0 262,144 x 640 at one token 8.54 -> 8.38 ms)
        dots = [
            [cgutils.alloca_once_value(b, ir.Constant(v16i, None)) for _ in range(2)]
            for _ in range(nt)
        ]
        line_bytes = 64 * spec.lines
        scales_a = b.add(tile_a, b.mul(nblk_v, I64(line_bytes)))
        mins_a = b.add(scales_a, b.mul(nblk_v, I64(32)))
        low = ir.Constant(v16i, [0x0F0F0F0F] * 16)
        with cgutils.for_range(b, nblk_v) as loop:
            blk = loop.index
            lines_a = b.add(tile_a, b.mul(blk, I64(line_bytes)))
            stream_ahead(b, lines_a, line_bytes)
            for t in range(nt):
                for lv in range(2):
                    b.store(ir.Constant(v16i, None), dots[t][lv])
            x_off = b.mul(blk, I64(32))

            def dot(q, e):  # code vector q (elements e .. e + 3 of each row) into every dot
                for t in range(nt):
                    for lv in range(2):
                        xa = b.add(b.add(xs_[t][lv], x_off), I64(e))
                        xv = _splat(b, _load(b, xa, I32, 4), 16)
                        slot = dots[t][lv]
                        b.store(b.call(dpbusd, [b.load(slot), q, xv]), slot)

            if spec.name == "Q8_0":
                for k in range(8):
                    dot(_load(b, b.add(lines_a, I64(64 * k)), v16i, 64), 4 * k)
            else:
                qh = _load(b, b.add(lines_a, I64(256)), v16i, 64) if spec.qh_at >= 0 else None
                for k in range(4):
                    q = _load(b, b.add(lines_a, I64(64 * k)), v16i, 64)
                    lo, hi = b.and_(q, low), b.and_(b.lshr(q, ir.Constant(v16i, [4] * 16)), low)
                    if qh is not None:
                        lo, hi = b.or_(lo, _fifth(b, qh, k)), b.or_(hi, _fifth(b, qh, 4 + k))
                    dot(lo, 4 * k)
                    dot(hi, 16 + 4 * k)

            def halves(at):
                h = _load(b, b.add(at, b.mul(blk, I64(32))), _vec(I16, 16), 2)
                return b.fpext(b.bitcast(h, _vec(ir.HalfType(), 16)), V16)

            d = halves(scales_a)
            m = halves(mins_a) if spec.has_min else None
            s_off = b.mul(blk, I64(4))
            for t in range(nt):
                a = b.load(acc[t])
                for lv in range(2):
                    v = b.load(dots[t][lv])
                    if spec.zero:
                        v = b.sub(v, _splat(b, _load(b, b.add(css[t][lv], s_off), I32, 4), 16))
                    xd_v = _splat(b, _load(b, b.add(xds[t][lv], s_off), F32, 4), 16)
                    a = _fma(b, b.sitofp(v, V16), b.fmul(d, xd_v), a)
                    if m is not None:
                        xsum = _splat(b, _load(b, b.add(sums[t][lv], s_off), F32, 4), 16)
                        a = _fma(b, m, xsum, a)
                b.store(a, acc[t])
        for t in range(nt):
            dst = b.inttoptr(b.add(out_a, I64(64 * t)), ir.PointerType(V16))
            b.store(b.load(acc[t]), dst, align=64)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**INLINE)
def _dot(kind, tile_at, nblk, x, xs, xl, xd, ds, dl, cs, css, csl, sm, sms, sml, tmp_at, nt):
    """:func:`tile_dot32` over ``nt`` tokens (8, 4, 2 or 1), the literal picked at run
    time."""
    if nt == 8:
        tile_dot32(
            tile_at, nblk, x, xs, xl, xd, ds, dl, cs, css, csl, sm, sms, sml, tmp_at, kind, 8
        )
    elif nt == 4:
        tile_dot32(
            tile_at, nblk, x, xs, xl, xd, ds, dl, cs, css, csl, sm, sms, sml, tmp_at, kind, 4
        )
    elif nt == 2:
        tile_dot32(
            tile_at, nblk, x, xs, xl, xd, ds, dl, cs, css, csl, sm, sms, sml, tmp_at, kind, 2
        )
    else:
        tile_dot32(
            tile_at, nblk, x, xs, xl, xd, ds, dl, cs, css, csl, sm, sms, sml, tmp_at, kind, 1
        )


@numba.njit(**INLINE)
def _tile_rows(kind, tiles, nblk, n_rows, q, xd, cs, sums, out, tasks):
    """``out[t, n]`` (float32, ``n < n_rows``; a view into a wider output is fine) = row
    ``n`` of ``tiles`` (uint8 ``[tiles, tile_bytes]``) dotted with token ``t``'s two levels
    (rows ``t`` and ``T + t`` of ``q``, ``xd``, ``cs``, ``sums``), tiles split in
    ``tasks`` ranges over numba's threads."""
    tokens = out.shape[0]
    n_tiles = tiles.shape[0]
    tasks = max(1, min(n_tiles, tasks))
    per = (n_tiles + tasks - 1) // tasks
    xs, ds, css, sms = q.strides[0], xd.strides[0], cs.strides[0], sums.strides[0]
    x_at, xd_at, cs_at, sm_at = q.ctypes.data, xd.ctypes.data, cs.ctypes.data, sums.ctypes.data
    for task in numba.prange(tasks):
        tmp_at, tmp = call_out(TOKENS)
        for tile in range(task * per, min((task + 1) * per, n_tiles)):
            n0 = tile * TILE_ROWS
            valid = min(TILE_ROWS, n_rows - n0)
            tile_at = tiles[tile].ctypes.data
            j = 0
            while j < tokens:
                nt = call_tokens(tokens - j, TOKENS)
                _dot(
                    kind, tile_at, nblk, x_at + j * xs, xs, tokens * xs, xd_at + j * ds, ds,
                    tokens * ds, cs_at + j * css, css, tokens * css, sm_at + j * sms, sms,
                    tokens * sms, tmp_at, nt,
                )  # fmt: skip
                tile_out(out, tmp, j, nt, n0, valid)
                j += nt


@numba.njit(**INLINE)
def call_out(tokens):
    """A kernel call's output for ``tokens`` tokens x 16 rows: its address (64-byte
    aligned, as the kernels store whole vectors) and the float32 view there."""
    raw = np.empty(64 * tokens + 64, np.uint8)
    at = (raw.ctypes.data + 63) & ~63
    off = at - raw.ctypes.data
    return at, raw[off : off + 64 * tokens].view(np.float32)


@numba.njit(**INLINE)
def call_tokens(left, most):
    """Tokens the next kernel call takes of ``left``, at most ``most`` (8): 8, 4, 2 or 1,
    the counts a tile kernel is compiled for."""
    nt = min(most, left)
    if 4 < nt < 8:
        return 4
    if nt == 3:
        return 2
    return nt


@numba.njit(**INLINE)
def tile_out(out, tmp, j, nt, n0, valid):
    """A call's results (``tmp``: ``nt`` tokens x 16 rows) into ``out``'s rows ``j ..
    j + nt``, columns ``n0 .. n0 + valid``."""
    for t in range(nt):
        for r in range(valid):
            out[j + t, n0 + r] = tmp[16 * t + r]


# one compiled function per kind (the kind a constant of each: numba specialises on it)
@numba.njit(**JIT, parallel=True)
def _rows_q8_0(tiles, nblk, n_rows, q, xd, cs, sums, out, tasks):
    _tile_rows(0, tiles, nblk, n_rows, q, xd, cs, sums, out, tasks)


@numba.njit(**JIT, parallel=True)
def _rows_q4_0(tiles, nblk, n_rows, q, xd, cs, sums, out, tasks):
    _tile_rows(1, tiles, nblk, n_rows, q, xd, cs, sums, out, tasks)


@numba.njit(**JIT, parallel=True)
def _rows_q4_1(tiles, nblk, n_rows, q, xd, cs, sums, out, tasks):
    _tile_rows(2, tiles, nblk, n_rows, q, xd, cs, sums, out, tasks)


@numba.njit(**JIT, parallel=True)
def _rows_q5_0(tiles, nblk, n_rows, q, xd, cs, sums, out, tasks):
    _tile_rows(3, tiles, nblk, n_rows, q, xd, cs, sums, out, tasks)


@numba.njit(**JIT, parallel=True)
def _rows_q5_1(tiles, nblk, n_rows, q, xd, cs, sums, out, tasks):
    _tile_rows(4, tiles, nblk, n_rows, q, xd, cs, sums, out, tasks)


_ROWS = (_rows_q8_0, _rows_q4_0, _rows_q4_1, _rows_q5_0, _rows_q5_1)


@numba.njit(**JIT)
def _offset_sums(q, zero, cs):
    """``cs[r, b]`` = ``zero`` x the sum of row ``r``'s int8 codes over block ``b``."""
    rows, nblk = cs.shape
    for r in range(rows):
        for b in range(nblk):
            s = 0
            for i in range(32):
                s += q[r, 32 * b + i]
            cs[r, b] = zero * s


def repack32(kind_name: str):
    """The repacking function of ``kind_name`` for :func:`~kernels.quant.tiles.repack_parts`
    (``(src, n, row_bytes, dst, first, last)``)."""
    code = CODES[kind_name]

    def repack(src, n, row_bytes, dst, first, last):
        _repack(code, src, n, row_bytes, dst, first, last)

    return repack


def tile_rows32(
    kind_name: str, tiles: np.ndarray, n_rows: int, act, out: np.ndarray, tasks: int
) -> None:
    """``out`` (float32 ``[T, n_rows]``) = the rows of ``kind_name`` ``tiles`` (uint8
    ``[tiles, nblk, tile block / 16]`` from :func:`~kernels.quant.tiles.repack_parts`)
    times ``act``, two levels of per-32 activations of ``T`` tokens
    (:func:`~kernels.quant.activations.two_level_activations`: ``2T`` rows)."""
    code = CODES[kind_name]
    tokens = out.shape[0]
    if act.q.shape[0] != 2 * tokens:
        raise ValueError(f"{act.q.shape[0]} activation rows for {tokens} tokens: two levels")
    nblk = tiles.shape[1]
    if tiles.ctypes.data % 64 or not tiles.flags.c_contiguous:
        raise ValueError("tiles must be C-contiguous from a 64-byte boundary (repack_parts)")
    if act.q.shape[1] != 32 * nblk:
        raise ValueError(f"activations of {act.q.shape[1]} for {kind_name} tiles of {32 * nblk}")
    cs = np.empty((2 * tokens, nblk), np.int32)
    zero = LAYOUTS[code].zero
    if zero:
        _offset_sums(act.q, zero, cs)
    flat = tiles.reshape(tiles.shape[0], -1)
    _ROWS[code](flat, nblk, n_rows, act.q, act.scale, cs, act.sum32, out, tasks)
