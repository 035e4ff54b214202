"""``exp`` in float32 arithmetic only, so that numba's loops over it are vectorised.

numba's ``np.exp`` (and ``np.tanh``) call libm once per element: a few ns each, which at
decode sizes is most of a small op (SiLU over the 8,192 gate values of a Llama-3.2-1B
layer: 33 us of a 35 us call) and a fifth of paged attention's time at 3,000 tokens.

`exp_parts` splits ``exp(v) = p * 2^k``: ``k = rint(v / ln 2)``, ``r = v - k ln 2`` (ln 2
in two parts, so ``r`` is exact to float32; ``|r| <= ln 2 / 2``) and ``p`` the Taylor
polynomial of ``exp(r)`` to ``r^6 / 6!``; ``2^k`` is returned as the bits of a float32,
which `exp_into`'s first loop writes to an int32 array and its second multiplies in
through a float32 view of it.
Relative error within 3e-7 over ``[-87, 88]``; ``v`` is clamped to that range, where
``exp`` is a normal float32 (below, the true value is smaller still than the 1.6e-38
given; above, it is infinite).
"""

from __future__ import annotations

import numba
import numpy as np

from kernels.quant.blocks import INLINE
from kernels.quant.simd import EXP_HIGH, EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_LOW, EXP_TAYLOR

LOW, HIGH = EXP_LOW, EXP_HIGH  # exp(v) stays a normal float32 over this range
# (simd.py holds the constants: its vector form of this exp, `shifted_exps`, must give
# these bits)
_C6, _C5, _C4, _C3, _C2, _C1, _C0 = EXP_TAYLOR


@numba.njit(**INLINE)
def exp_parts(v):
    """``(p, bits)`` with ``exp(v) = p * (bits as float32)``, v clamped to [LOW, HIGH]."""
    v = min(max(v, np.float32(LOW)), np.float32(HIGH))
    k = np.rint(v * np.float32(EXP_LOG2E))
    r = v - k * np.float32(EXP_LN2_HI) - k * np.float32(EXP_LN2_LO)
    p = np.float32(_C6) * r + np.float32(_C5)
    p = p * r + np.float32(_C4)
    p = p * r + np.float32(_C3)
    p = p * r + np.float32(_C2)
    p = p * r + np.float32(_C1)
    p = p * r + np.float32(_C0)
    return p, (np.int32(k) + np.int32(127)) << np.int32(23)


@numba.njit(**INLINE)
def exp_into(x, out, bits, n):
    """``out[i] = exp(x[i])`` for ``i < n`` (``out`` may be ``x``), ``bits`` an int32
    scratch array of at least ``n``: `exp_parts` in one loop, ``2^k`` multiplied in the
    next, both vectorised."""
    for i in range(n):
        p, e = exp_parts(x[i])
        out[i] = p
        bits[i] = e
    two_k = bits.view(np.float32)
    for i in range(n):
        out[i] *= two_k[i]
