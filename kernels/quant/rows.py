"""The two loops every block type shares, written once and inlined into each type's kernels.

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

from kernels.quant.blocks import INLINE
from kernels.quant.simd import HOST_ISA, ISA_CODES, expand_codes, float_dot, prefetch, scaled_dot

ISA = ISA_CODES[HOST_ISA]  # a compile-time constant of every kernel (see _cache.py)


@numba.njit(**INLINE)
def decode_rows(unpack, sw, signed, w, xq, xs, xsum, out, tasks):
    """out[b, n] = sum_i w[n, i] * xq[b, i] * xs[b, i // 32] for all b, n (the offsets
    ``fo`` times ``xsum``, the activations' sums per ``sw``, added per row)."""
    n_rows, row_bytes = w.shape
    batch, k = xq.shape
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
        c_at, fw_at, fo_at = codes.ctypes.data, fw.ctypes.data, fo.ctypes.data
        dots_at = dots.ctypes.data
        last = min((t + 1) * per, n_rows)
        for n in range(t * per, last):
            if n + 1 < last:
                prefetch(w[n + 1].ctypes.data, row_bytes)
            unpack(w[n], codes, fw, fo)
            b = 0
            while b < batch:
                # 4, 2 or 1 activation rows per pass over the codes: same bits per row
                x_at, s_at = xq_at + b * xq_step, xs_at + b * xs_step
                if batch - b >= 4:
                    scaled_dot(
                        c_at,
                        x_at,
                        xq_step,
                        fw_at,
                        s_at,
                        xs_step,
                        k,
                        dots_at,
                        4,
                        ISA,
                        sw,
                        32,
                        signed,
                    )
                    step = 4
                elif batch - b >= 2:
                    scaled_dot(
                        c_at,
                        x_at,
                        xq_step,
                        fw_at,
                        s_at,
                        xs_step,
                        k,
                        dots_at,
                        2,
                        ISA,
                        sw,
                        32,
                        signed,
                    )
                    step = 2
                else:
                    scaled_dot(
                        c_at,
                        x_at,
                        xq_step,
                        fw_at,
                        s_at,
                        xs_step,
                        k,
                        dots_at,
                        1,
                        ISA,
                        sw,
                        32,
                        signed,
                    )
                    step = 1
                for r in range(step):
                    s = dots[r]
                    if not signed:
                        s += float_dot(fo_at, xsum_at + (b + r) * xsum_step, n_sub)
                    out[b + r, n] = s
                b += step


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
