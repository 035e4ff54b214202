"""The k-quants (super-blocks of 256 elements): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Each unpacker turns one row of GGUF blocks into codes and per-sub-block float scales and
offsets (the contract of :mod:`kernels.quant.rows`), with byte-parallel IR helpers
(:func:`~kernels.quant.simd.bitfield`, :func:`~kernels.quant.simd.scale_lanes`). The
layouts are ``gguf.quants``' (``ggml-quants.c``); each type's formula heads its unpacker,
with ``e`` the element index within the 256 of a block.
"""

from __future__ import annotations

import numba

from kernels.quant.blocks import INLINE, JIT, half, one_part
from kernels.quant.lanes import lane_rows
from kernels.quant.rows import decode_parts_rows, decode_rows, dequantize_rows
from kernels.quant.simd import SCALE_KIND_CODES, bitfield, scale_lanes
from kernels.quant.superblock import KBLOCK_CODES, kblock_rows

PARALLEL = {**JIT, "parallel": True}
_I8 = SCALE_KIND_CODES["i8"]
_LO4 = SCALE_KIND_CODES["lo4"]
_HI4 = SCALE_KIND_CODES["hi4"]
_K4_SCALE = SCALE_KIND_CODES["k4_scale"]
_K4_MIN = SCALE_KIND_CODES["k4_min"]
_K3_SCALE = SCALE_KIND_CODES["k3_scale"]
# Q4_K and Q6_K decode in registers (superblock.py); the others through decode_rows
_KB_Q4_K = KBLOCK_CODES["Q4_K"]
_KB_Q6_K = KBLOCK_CODES["Q6_K"]


# ---- Q2_K: scales[16] qs[64] d[2] dmin[2] ------------------------------------------------
# 16 sub-blocks of 16: w = d * (scales[s] & 15) * q - dmin * (scales[s] >> 4),
# q = (qs[32h + l] >> 2t) & 3 for e = 128h + 32t + l.


@numba.njit(**INLINE)
def unpack_q2_k(row, codes, fw, fo):
    row_at, codes_at, fw_at, fo_at = (
        row.ctypes.data,
        codes.ctypes.data,
        fw.ctypes.data,
        fo.ctypes.data,
    )
    for blk in range(row.shape[0] // 84):
        o = blk * 84
        scale_lanes(fw_at + 64 * blk, row_at + o, _LO4, half(row, o + 80))
        scale_lanes(fo_at + 64 * blk, row_at + o, _HI4, -half(row, o + 82))
        for h in range(2):
            for t in range(4):
                bitfield(
                    codes_at + 256 * blk + 128 * h + 32 * t,
                    row_at + o + 16 + 32 * h,
                    32,
                    2 * t,
                    3,
                    0,
                    False,
                )


# ---- Q3_K: hmask[32] qs[64] scales[12] d[2] ----------------------------------------------
# 16 sub-blocks of 16: w = d * (sc[s] - 32) * (q - 4), q = low | high << 2 with
# low = (qs[32h + l] >> 2t) & 3 for e = 128h + 32t + l, high = (hmask[l] >> j) & 1 for
# e = 32j + l; the 6-bit sc are packed as in gguf.quants.Q3_K.


@numba.njit(**INLINE)
def unpack_q3_k(row, codes, fw, fo):
    row_at, codes_at, fw_at, fo_at = (
        row.ctypes.data,
        codes.ctypes.data,
        fw.ctypes.data,
        fo.ctypes.data,
    )
    for blk in range(row.shape[0] // 110):
        o = blk * 110
        d = half(row, o + 108)
        scale_lanes(fw_at + 64 * blk, row_at + o + 96, _K3_SCALE, d)
        scale_lanes(fo_at + 64 * blk, row_at + o + 96, _K3_SCALE, -4 * d)
        dst = codes_at + 256 * blk
        for h in range(2):
            for t in range(4):
                bitfield(dst + 128 * h + 32 * t, row_at + o + 32 + 32 * h, 32, 2 * t, 3, 0, False)
        for j in range(8):
            bitfield(dst + 32 * j, row_at + o, 32, j, 1, 2, True)


# ---- Q4_K: d[2] dmin[2] scales[12] qs[128] -----------------------------------------------
# 8 sub-blocks of 32: w = d * sc[s] * q - dmin * m[s], q = (qs[32c + l] >> 4t) & 15 for
# e = 64c + 32t + l; 6-bit (sc, m) packed as in gguf.quants.Q4_K.get_scale_min.


@numba.njit(**INLINE)
def _k4_scales(row, row_at, o, fw_at, fo_at, blk):
    scale_lanes(fw_at + 32 * blk, row_at + o + 4, _K4_SCALE, half(row, o))
    scale_lanes(fo_at + 32 * blk, row_at + o + 4, _K4_MIN, -half(row, o + 2))


@numba.njit(**INLINE)
def _nibbles_256(dst, src):
    """codes of a 256-block from 128 bytes: low nibbles, then high, per 32 bytes."""
    for c in range(4):
        bitfield(dst + 64 * c, src + 32 * c, 32, 0, 15, 0, False)
        bitfield(dst + 64 * c + 32, src + 32 * c, 32, 4, 15, 0, False)


@numba.njit(**INLINE)
def unpack_q4_k(row, codes, fw, fo):
    row_at, codes_at, fw_at, fo_at = (
        row.ctypes.data,
        codes.ctypes.data,
        fw.ctypes.data,
        fo.ctypes.data,
    )
    for blk in range(row.shape[0] // 144):
        o = blk * 144
        _k4_scales(row, row_at, o, fw_at, fo_at, blk)
        _nibbles_256(codes_at + 256 * blk, row_at + o + 16)


# ---- Q5_K: d[2] dmin[2] scales[12] qh[32] qs[128] ----------------------------------------
# Q4_K's scales and nibbles plus a fifth bit: q |= ((qh[l] >> j) & 1) << 4 for e = 32j + l.


@numba.njit(**INLINE)
def unpack_q5_k(row, codes, fw, fo):
    row_at, codes_at, fw_at, fo_at = (
        row.ctypes.data,
        codes.ctypes.data,
        fw.ctypes.data,
        fo.ctypes.data,
    )
    for blk in range(row.shape[0] // 176):
        o = blk * 176
        _k4_scales(row, row_at, o, fw_at, fo_at, blk)
        dst = codes_at + 256 * blk
        _nibbles_256(dst, row_at + o + 48)
        for j in range(8):
            bitfield(dst + 32 * j, row_at + o + 16, 32, j, 1, 4, True)


# ---- Q6_K: ql[128] qh[64] scales[16] (int8) d[2] -----------------------------------------
# 16 sub-blocks of 16: w = d * scales[s] * (q - 32), q = low | high << 4 with
# low = (ql[64h + l] >> 4t) & 15 for e = 128h + 64t + l (l < 64),
# high = (qh[32h + l] >> 2t) & 3 for e = 128h + 32t + l (l < 32).


@numba.njit(**INLINE)
def unpack_q6_k(row, codes, fw, fo):
    row_at, codes_at, fw_at, fo_at = (
        row.ctypes.data,
        codes.ctypes.data,
        fw.ctypes.data,
        fo.ctypes.data,
    )
    for blk in range(row.shape[0] // 210):
        o = blk * 210
        d = half(row, o + 208)
        scale_lanes(fw_at + 64 * blk, row_at + o + 192, _I8, d)
        scale_lanes(fo_at + 64 * blk, row_at + o + 192, _I8, -32 * d)
        for h in range(2):
            dst = codes_at + 256 * blk + 128 * h
            bitfield(dst, row_at + o + 64 * h, 64, 0, 15, 0, False)
            bitfield(dst + 64, row_at + o + 64 * h, 64, 4, 15, 0, False)
            for t in range(4):
                bitfield(dst + 32 * t, row_at + o + 128 + 32 * h, 32, 2 * t, 3, 4, True)


# ---- kernels: (w, xq, xs, xsum, out, tasks) / (w, first, out32, out16, tasks) ---------------------


@numba.njit(**PARALLEL)
def decode_q2_k(w, xq, xs, xsum, out, tasks):
    decode_rows(unpack_q2_k, 16, False, w, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q2_k(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    decode_parts_rows(unpack_q2_k, 16, False, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q2_k(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q2_k, 16, False, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q3_k(w, xq, xs, xsum, out, tasks):
    decode_rows(unpack_q3_k, 16, False, w, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q3_k(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    decode_parts_rows(unpack_q3_k, 16, False, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q3_k(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q3_k, 16, False, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q4_k(w, xq, xs, xsum, out, tasks):
    kblock_rows(_KB_Q4_K, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q4_k(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    kblock_rows(_KB_Q4_K, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def prompt_parts_q4_k(parts, row_bytes, xw, xd, bx, out, tasks):
    lane_rows(_KB_Q4_K, parts, row_bytes, xw, xd, bx, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q4_k(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q4_k, 32, False, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q5_k(w, xq, xs, xsum, out, tasks):
    decode_rows(unpack_q5_k, 32, False, w, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q5_k(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    decode_parts_rows(unpack_q5_k, 32, False, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q5_k(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q5_k, 32, False, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q6_k(w, xq, xs, xsum, out, tasks):
    kblock_rows(_KB_Q6_K, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q6_k(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    kblock_rows(_KB_Q6_K, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def prompt_parts_q6_k(parts, row_bytes, xw, xd, bx, out, tasks):
    lane_rows(_KB_Q6_K, parts, row_bytes, xw, xd, bx, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q6_k(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q6_k, 16, False, w, first, out32, out16, tasks)
