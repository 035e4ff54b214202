"""Byte-level helpers the unpackers share: little-endian fields of a GGUF block."""

from __future__ import annotations

import numba
import numpy as np

from kernels.quant.simd import HAS_F16C, f16_to_f32, prefetch, u8_pointer

# No fast-math: every rounding step is fixed (the sums that need a vector order are written
# out in simd.py), so fresh and cached code agree bit for bit.
JIT = {"cache": True, "nogil": True, "error_model": "numpy", "boundscheck": False}
INLINE = {**JIT, "inline": "always"}


@numba.njit(**INLINE)
def _half_soft(bits):
    """IEEE half -> float32 in integer code (CPUs without F16C)."""
    h = np.uint32(bits)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0:
        value = np.float32(man) * np.float32(2.0**-24)
        return -value if sign else value
    if exp == 31:
        out = sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    else:
        out = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))
    return np.array([out], dtype=np.uint32).view(np.float32)[0]


@numba.njit(**INLINE)
def half(row, off):
    """The fp16 at byte ``off`` of ``row`` (uint8) as float32."""
    bits = np.uint16(row[off]) | (np.uint16(row[off + 1]) << np.uint16(8))
    if HAS_F16C:
        return f16_to_f32(bits)
    return _half_soft(bits)


@numba.njit(**INLINE)
def u32(row, off):
    """The little-endian uint32 at byte ``off`` of ``row``."""
    return (
        np.uint32(row[off])
        | (np.uint32(row[off + 1]) << np.uint32(8))
        | (np.uint32(row[off + 2]) << np.uint32(16))
        | (np.uint32(row[off + 3]) << np.uint32(24))
    )


@numba.njit(**INLINE)
def byte_row(addr, n):
    """The ``n`` bytes at ``addr`` as a uint8 array (a row found through a part table)."""
    return numba.carray(u8_pointer(addr), n)


@numba.njit(**INLINE)
def one_part(w):
    """The part table (int64 ``[P, 2]``: each part's first-row address and row count) of
    one weight matrix ``w`` (uint8 ``[N, row bytes]``, C-contiguous)."""
    parts = np.empty((1, 2), np.int64)
    parts[0, 0] = w.ctypes.data
    parts[0, 1] = w.shape[0]
    return parts


@numba.njit(**INLINE)
def part_rows(parts):
    """The rows of all the parts of a part table together."""
    n = 0
    for p in range(parts.shape[0]):
        n += parts[p, 1]
    return n


@numba.njit(**INLINE)
def part_of(parts, row):
    """``(p, base)``: the part holding row ``row`` of a part table, and its first row's
    index among all the parts' rows."""
    p, base = 0, 0
    while p < parts.shape[0] - 1 and row >= base + parts[p, 1]:
        base += parts[p, 1]
        p += 1
    return p, base


@numba.njit(**INLINE)
def walk_row(parts, p, base, n, last, row_bytes, next_row):
    """``(p, base, address)`` of row ``n`` for a loop over the rows ``.. last`` of a part
    table, given part ``p`` and its first row ``base`` for row ``n - 1`` (or
    :func:`part_of` for the first); with ``next_row`` the next row, which may begin the
    next part, is prefetched (kernels that stream ahead block by block,
    :func:`~kernels.quant.simd.stream_ahead`, do without)."""
    if n - base == parts[p, 1]:
        base += parts[p, 1]
        p += 1
    row_at = parts[p, 0] + (n - base) * row_bytes
    if next_row and n + 1 < last:
        nxt = row_at + row_bytes if n + 1 - base < parts[p, 1] else parts[p + 1, 0]
        prefetch(nxt, row_bytes)
    return p, base, row_at
