"""The blocks of 32 elements: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.

Same contract as :mod:`kernels.quant.kquants` (see :mod:`kernels.quant.rows`); one
sub-block per block. The unpackers serve the prefill path (dequantized tiles); the decode
kernels unpack in registers (:mod:`kernels.quant.block32`). Element ``e`` of a 4-bit block
is the low nibble of ``qs[e]`` for ``e < 16`` and the high nibble of ``qs[e - 16]``
after; the fifth bit of Q5_* is bit ``e`` of the little-endian ``qh``.
"""

from __future__ import annotations

import numba

from kernels.quant.block32 import BLOCK32_CODES, block32_rows
from kernels.quant.blocks import INLINE, JIT, half, one_part
from kernels.quant.rows import dequantize_rows
from kernels.quant.simd import bitfield, bitplane

PARALLEL = {**JIT, "parallel": True}
_B32_Q8_0 = BLOCK32_CODES["Q8_0"]
_B32_Q4_0 = BLOCK32_CODES["Q4_0"]
_B32_Q4_1 = BLOCK32_CODES["Q4_1"]
_B32_Q5_0 = BLOCK32_CODES["Q5_0"]
_B32_Q5_1 = BLOCK32_CODES["Q5_1"]


@numba.njit(**INLINE)
def _nibbles_32(dst, src):
    bitfield(dst, src, 16, 0, 15, 0, False)
    bitfield(dst + 16, src, 16, 4, 15, 0, False)


# Q8_0: d[2] qs[32] (int8); w = d * q  (signed codes, no offset)
@numba.njit(**INLINE)
def unpack_q8_0(row, codes, fw, fo):
    row_at, codes_at = row.ctypes.data, codes.ctypes.data
    for blk in range(row.shape[0] // 34):
        o = blk * 34
        fw[blk] = half(row, o)
        bitfield(codes_at + 32 * blk, row_at + o + 2, 32, 0, 255, 0, False)


# Q4_0: d[2] qs[16]; w = d * (q - 8)
@numba.njit(**INLINE)
def unpack_q4_0(row, codes, fw, fo):
    row_at, codes_at = row.ctypes.data, codes.ctypes.data
    for blk in range(row.shape[0] // 18):
        o = blk * 18
        d = half(row, o)
        fw[blk] = d
        fo[blk] = -8 * d
        _nibbles_32(codes_at + 32 * blk, row_at + o + 2)


# Q4_1: d[2] m[2] qs[16]; w = d * q + m
@numba.njit(**INLINE)
def unpack_q4_1(row, codes, fw, fo):
    row_at, codes_at = row.ctypes.data, codes.ctypes.data
    for blk in range(row.shape[0] // 20):
        o = blk * 20
        fw[blk] = half(row, o)
        fo[blk] = half(row, o + 2)
        _nibbles_32(codes_at + 32 * blk, row_at + o + 4)


# Q5_0: d[2] qh[4] qs[16]; w = d * (q - 16)
@numba.njit(**INLINE)
def unpack_q5_0(row, codes, fw, fo):
    row_at, codes_at = row.ctypes.data, codes.ctypes.data
    for blk in range(row.shape[0] // 22):
        o = blk * 22
        d = half(row, o)
        fw[blk] = d
        fo[blk] = -16 * d
        _nibbles_32(codes_at + 32 * blk, row_at + o + 6)
        bitplane(codes_at + 32 * blk, row_at + o + 2, 16)


# Q5_1: d[2] m[2] qh[4] qs[16]; w = d * q + m
@numba.njit(**INLINE)
def unpack_q5_1(row, codes, fw, fo):
    row_at, codes_at = row.ctypes.data, codes.ctypes.data
    for blk in range(row.shape[0] // 24):
        o = blk * 24
        fw[blk] = half(row, o)
        fo[blk] = half(row, o + 2)
        _nibbles_32(codes_at + 32 * blk, row_at + o + 8)
        bitplane(codes_at + 32 * blk, row_at + o + 4, 16)


# ---- kernels: (w, xq, xs, xsum, out, tasks) / (w, first, out32, out16, tasks) ---------------------


@numba.njit(**PARALLEL)
def decode_q8_0(w, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q8_0, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q8_0(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q8_0, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q8_0(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q8_0, 32, True, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q4_0(w, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q4_0, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q4_0(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q4_0, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q4_0(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q4_0, 32, False, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q4_1(w, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q4_1, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q4_1(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q4_1, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q4_1(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q4_1, 32, False, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q5_0(w, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q5_0, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q5_0(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q5_0, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q5_0(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q5_0, 32, False, w, first, out32, out16, tasks)


@numba.njit(**PARALLEL)
def decode_q5_1(w, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q5_1, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def decode_parts_q5_1(parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    block32_rows(_B32_Q5_1, parts, row_bytes, levels, xq, xs, xsum, out, tasks)


@numba.njit(**PARALLEL)
def dequant_q5_1(w, first, out32, out16, tasks):
    dequantize_rows(unpack_q5_1, 32, False, w, first, out32, out16, tasks)
