"""The two loops the block types share, written once and inlined into each type's kernels
(decode: the types not unpacked in registers, Q2_K, Q3_K and Q5_K, see
:mod:`kernels.quant.superblock` and :mod:`kernels.quant.block32` for the others;
dequantize: every type).

The next weight row is prefetched while one is unpacked and dotted (measured, Q4_K
14336 x 4096 at B = 1, cold, on the noisy 2-core dev VM: +30% on one thread, +7% on two). A type contributes an
*unpacker* ``unpack(row, codes, fw, fo)``: one weight row's raw GGUF
bytes -> ``codes`` (uint8, or int8 bits for signed types; one per element, in element
order), ``fw`` / ``fo`` (float32 per sub-block of ``sw`` elements) such that the weight is

    w[i] = fw[i // sw] * codes[i] + fo[i // sw]

(``fo`` unused for signed types, whose offset is zero). :func:`decode_rows` is the
matrix-vector / small-batch kernel: each weight row is unpacked once into a cache-resident
buffer and dotted with every activation row of the batch; :func:`dequantize_rows` writes
``w`` itself (float32 or bf16) for the prefill path.

Both are ``inline="always"`` with a ``prange`` inside: each type's kernels are two-line
``parallel=True`` functions passing their unpacker (a global at inlining time, so numba
never sees a function-typed argument, which would defeat its cache). ``tasks`` (the number
of row ranges, a few per thread) comes from the caller: ``numba.get_num_threads()`` inside
a kernel makes numba refuse to cache it.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels.quant.blocks import INLINE, byte_row, one_part, part_of, part_rows, walk_row
from kernels.quant.simd import (
    HOST_ISA,
    ISA_CODES,
    expand_codes,
    float_dot,
    prefetch,
    scaled_dot,
)

ISA = ISA_CODES[HOST_ISA]  # a compile-time constant of every kernel (see _cache.py)


@numba.njit(**INLINE)
def _dot_rows(c_at, fw_at, fo_at, sw, signed, xq_at, xq_step, xs_at, xs_step, xsum_at, xsum_step, k, batch, dots, res):  # fmt: skip
    """``res[b]`` (float32) = the unpacked weight row (codes at ``c_at``, scales ``fw_at``
    / offsets ``fo_at``) dotted with activation row ``b``, for every ``b < batch``: passes
    of 4, 2 or 1 rows over the codes, the same bits per row whatever the pass."""
    n_sub = k // sw
    dots_at = dots.ctypes.data
    b = 0
    while b < batch:
        x_at, s_at = xq_at + b * xq_step, xs_at + b * xs_step
        if batch - b >= 4:
            scaled_dot(
                c_at, x_at, xq_step, fw_at, s_at, xs_step, k, dots_at, 4, ISA, sw, 32, signed
            )
            step = 4
        elif batch - b >= 2:
            scaled_dot(
                c_at, x_at, xq_step, fw_at, s_at, xs_step, k, dots_at, 2, ISA, sw, 32, signed
            )
            step = 2
        else:
            scaled_dot(
                c_at, x_at, xq_step, fw_at, s_at, xs_step, k, dots_at, 1, ISA, sw, 32, signed
            )
            step = 1
        for r in range(step):
            s = dots[r]
            if not signed:
                s += float_dot(fo_at, xsum_at + (b + r) * xsum_step, n_sub)
            res[b + r] = s
        b += step


@numba.njit(**INLINE)
def decode_rows(unpack, sw, signed, w, xq, xs, xsum, out, tasks):
    """out[b, n] = sum_i w[n, i] * xq[b, i] * xs[b, i // 32] for all b, n (the offsets
    ``fo`` times ``xsum``, the activations' sums per ``sw``, added per row); ``w``
    C-contiguous, as a :class:`~kernels.quant.weight.QuantWeight`'s bytes are."""
    decode_parts_rows(unpack, sw, signed, one_part(w), w.shape[1], 1, xq, xs, xsum, out, tasks)


@numba.njit(**INLINE)
def decode_parts_rows(unpack, sw, signed, parts, row_bytes, levels, xq, xs, xsum, out, tasks):
    """:func:`decode_rows` over the rows of several matrices of one type in one call
    (``parts``: int64 ``[P, 2]``, each part's first-row address and row count, every row
    ``row_bytes``; the q/k/v or gate/up of a layer, wherever each lies in the mapped
    file), with ``levels`` levels of activations per token (rows ``t``, ``T + t``, ...
    of ``xq`` for token ``t < T``, ``T`` the rows of ``out``) summed into ``out[t, n]``
    in level order (the same bits as adding the rows of :func:`decode_rows`'s output)."""
    n_rows = part_rows(parts)
    batch, k = xq.shape
    tokens = out.shape[0]
    n_sub = k // sw
    tasks = max(1, min(n_rows, tasks))
    per = (n_rows + tasks - 1) // tasks
    xq_at, xq_step = xq.ctypes.data, xq.strides[0]
    xs_at, xs_step = xs.ctypes.data, xs.strides[0]
    xsum_at, xsum_step = xsum.ctypes.data, xsum.strides[0]
    for t in numba.prange(tasks):
        codes = np.empty(k, np.uint8)
        fw = np.empty(n_sub, np.float32)
        fo = np.empty(n_sub, np.float32)
        dots = np.empty(4, np.float32)
        res = np.empty(batch, np.float32)
        c_at, fw_at, fo_at = codes.ctypes.data, fw.ctypes.data, fo.ctypes.data
        first = t * per
        last = min(first + per, n_rows)
        p, base = part_of(parts, first)
        for n in range(first, last):
            p, base, row_at = walk_row(parts, p, base, n, last, row_bytes, True)
            unpack(byte_row(row_at, row_bytes), codes, fw, fo)
            _dot_rows(
                c_at, fw_at, fo_at, sw, signed, xq_at, xq_step, xs_at, xs_step, xsum_at,
                xsum_step, k, batch, dots, res,
            )  # fmt: skip
            for b in range(tokens):
                s = res[b]
                for level in range(1, levels):
                    s += res[b + level * tokens]
                out[b, n] = s


@numba.njit(**INLINE)
def dequantize_rows(unpack, sw, signed, w, first, out32, out16, tasks):
    """Weight rows ``first ..`` into ``out32`` (float32 ``[rows, K]``) or, when ``out16``
    has rows, into ``out16`` (uint16 ``[rows, K]``: bf16 bit patterns, see
    :func:`~kernels.quant.simd.expand_codes`); the unused one is ``[0, K]``. One kernel for
    both keeps numba's compile time per type down (seconds per parallel kernel)."""
    to_bf16 = out16.shape[0] > 0
    n_out = out16.shape[0] if to_bf16 else out32.shape[0]
    k = out16.shape[1] if to_bf16 else out32.shape[1]
    n_sub = k // sw
    tasks = max(1, min(n_out, tasks))
    per = (n_out + tasks - 1) // tasks
    for t in numba.prange(tasks):
        codes = np.empty(k, np.uint8)
        fw = np.empty(n_sub, np.float32)
        fo = np.empty(n_sub, np.float32)
        c_at, fw_at, fo_at = codes.ctypes.data, fw.ctypes.data, fo.ctypes.data
        last = min((t + 1) * per, n_out)
        for r in range(t * per, last):
            if r + 1 < last:
                prefetch(w[first + r + 1].ctypes.data, w.shape[1])
            unpack(w[first + r], codes, fw, fo)
            if to_bf16:
                expand_codes(out16[r].ctypes.data, c_at, fw_at, fo_at, k, sw, signed, True)
            else:
                expand_codes(out32[r].ctypes.data, c_at, fw_at, fo_at, k, sw, signed, False)
