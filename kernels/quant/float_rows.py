"""F16 and BF16 weights multiplied as the file stores them, at decode sizes.

torch multiplies float32 activations by float32 weights only, so a half-precision part
went through float32 tiles dequantized at every call (`linear._float_part`): the whole
matrix widened and written again before the product, 20-25 tok/s on SmolLM2 in F16 (270
MB a token) where this kernel gives 3.1-3.5x that. Here four weight rows at a time are
read as the file has them, widened to float32 in registers as they are loaded
(``vcvtph2ps``; bf16 by a shift, :func:`~kernels.quant.simd.weight_dots`) and dotted
with up to four tokens' rows at once (16 accumulators), 1,024 elements a call, the
weight bytes asked for 8 KB ahead: every weight byte read from memory once a step,
whatever the number of tokens.

Each token's dot with a row is the same sequence of float32 multiply-adds whatever the
other tokens (16 lanes in order, the lanes summed in a fixed order, the tail), so a
row's result does not depend on the batch; it is not torch's GEMM's order, so a prompt
(float32 tiles and torch) may differ from decoding in the last bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
from gguf import GGMLQuantizationType

from kernels.quant.blocks import INLINE, JIT
from kernels.quant.simd import HAS_F16C, WEIGHT_DOT_TOKENS, weight_dots

__all__ = ["float_rows", "float_rows_supported", "row_table", "rows_of_table"]

ROWS = 4  # weight rows a call: four accumulators per token
# elements a call (a longer row's dots summed chunk by chunk, in order): the four rows'
# 8 KB of halves stay in L1 while the next tokens read them
CHUNK = 1024


def float_rows_supported(qtype: GGMLQuantizationType) -> bool:
    """Whether :func:`float_rows` takes this type on this CPU (F16 needs F16C)."""
    return qtype == GGMLQuantizationType.BF16 or (qtype == GGMLQuantizationType.F16 and HAS_F16C)


@numba.njit(**INLINE)
def _dots(bits, a0, a1, a2, a3, b, b_step, n, out, nt):
    """:func:`~kernels.quant.simd.weight_dots` for ``nt`` tokens, the literal picked at run
    time (``bits`` a constant of each entry point)."""
    if nt == 4:
        weight_dots(a0, a1, a2, a3, b, b_step, n, out, bits, 4)
    elif nt == 3:
        weight_dots(a0, a1, a2, a3, b, b_step, n, out, bits, 3)
    elif nt == 2:
        weight_dots(a0, a1, a2, a3, b, b_step, n, out, bits, 2)
    else:
        weight_dots(a0, a1, a2, a3, b, b_step, n, out, bits, 1)


@numba.njit(**INLINE)
def _rows(bits, table, x, out, tasks):
    """The parts of ``table`` (:func:`row_table`) into their columns of ``out``."""
    tokens = x.shape[0]
    k = x.shape[1]
    n_parts = table.shape[0]
    groups = table[n_parts - 1, 3] + (table[n_parts - 1, 1] + ROWS - 1) // ROWS
    tasks = max(1, min(groups, tasks))
    per = (groups + tasks - 1) // tasks
    xs = x.strides[0]
    x_at = x.ctypes.data
    for task in numba.prange(tasks):
        dots = np.empty(4 * ROWS, np.float32)
        sums = np.empty((tokens, ROWS), np.float32)
        dots_at = dots.ctypes.data
        part = 0
        for g in range(task * per, min((task + 1) * per, groups)):
            while part + 1 < n_parts and g >= table[part + 1, 3]:
                part += 1
            w_at, n, ws = table[part, 0], table[part, 1], table[part, 2]
            r0 = (g - table[part, 3]) * ROWS
            # past the last row: the last row again (its results not stored), so every
            # row takes the same four-row sums
            a0 = w_at + r0 * ws
            a1 = w_at + min(r0 + 1, n - 1) * ws
            a2 = w_at + min(r0 + 2, n - 1) * ws
            a3 = w_at + min(r0 + 3, n - 1) * ws
            sums[:] = 0.0
            for c0 in range(0, k, CHUNK):
                kc = min(CHUNK, k - c0)
                c = 2 * c0
                t = 0
                while t < tokens:
                    nt = min(WEIGHT_DOT_TOKENS, tokens - t)
                    b = x_at + t * xs + 4 * c0
                    _dots(bits, a0 + c, a1 + c, a2 + c, a3 + c, b, xs, kc, dots_at, nt)
                    for u in range(nt):
                        for j in range(ROWS):
                            sums[t + u, j] += dots[ROWS * u + j]
                    t += nt
            first = table[part, 5] + r0
            for t in range(tokens):
                for j in range(min(ROWS, n - r0)):
                    out[t, first + j] = sums[t, j]


# one compiled function per type (the type a constant of each: numba specialises on it)
@numba.njit(**JIT, parallel=True)
def _f16_rows(table, x, out, tasks):
    _rows(16, table, x, out, tasks)


@numba.njit(**JIT, parallel=True)
def _bf16_rows(table, x, out, tasks):
    _rows(-16, table, x, out, tasks)


def float_rows(
    weights: Sequence[np.ndarray],
    qtype: GGMLQuantizationType,
    x: np.ndarray,
    out: np.ndarray,
    tasks: int,
) -> np.ndarray:
    """``out [B, N] = x [B, K] @ W.T`` for ``W`` the ``[N_p, K]`` F16 or BF16 values (or
    their 16-bit patterns) of ``weights`` one after the other (a fused q/k/v: one call),
    float32 products and sums; ``out`` may be a view into a wider output; the parts'
    groups of four rows split in ``tasks`` ranges over numba's threads. A part's rows
    come out as they do from a call of that part alone."""
    return rows_of_table(row_table(weights, qtype), qtype, x, out, tasks)


def row_table(weights: Sequence[np.ndarray], qtype: GGMLQuantizationType) -> np.ndarray:
    """What :func:`rows_of_table` reads of ``weights`` (made once per projection): int64
    ``[P, 6]``, each part's first-row address, rows, row stride in bytes, first group of
    four rows, row width and first output column. The arrays must outlive it."""
    if not float_rows_supported(qtype):
        raise ValueError(f"no float-rows kernel for {qtype.name} on this CPU")
    k = weights[0].shape[1]
    if any(w.ndim != 2 or w.shape[1] != k for w in weights):
        raise ValueError(f"weights of shapes {[w.shape for w in weights]}: one width needed")
    if any(w.itemsize != 2 or w.strides[1] != 2 for w in weights):
        raise ValueError("weights must be 16-bit values, each row contiguous")
    table = np.empty((len(weights), 6), np.int64)
    groups = column = 0
    for i, w in enumerate(weights):
        table[i] = (w.ctypes.data, w.shape[0], w.strides[0], groups, k, column)
        groups += (w.shape[0] + ROWS - 1) // ROWS
        column += w.shape[0]
    return table


def rows_of_table(
    table: np.ndarray, qtype: GGMLQuantizationType, x: np.ndarray, out: np.ndarray, tasks: int
) -> np.ndarray:
    """:func:`float_rows` of the weights of a :func:`row_table`."""
    n, k = int(table[-1, 5] + table[-1, 1]), int(table[0, 4])
    if x.ndim != 2 or x.shape[1] != k or out.shape != (x.shape[0], n):
        raise ValueError(f"x {x.shape} and out {out.shape} for weights of {n} x {k}")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    rows = _f16_rows if qtype == GGMLQuantizationType.F16 else _bf16_rows
    rows(table, x, out, tasks)
    return out
