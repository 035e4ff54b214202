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

LOW, HIGH = -87.0, 88.0  # exp(v) stays a normal float32 over this range


@numba.njit(**INLINE)
def exp_parts(v):
    """``(p, bits)`` with ``exp(v) = p * (bits as float32)``, v clamped to [LOW, HIGH]."""
    v = min(max(v, np.float32(LOW)), np.float32(HIGH))
    k = np.rint(v * np.float32(1.4426950408889634))
    r = v - k * np.float32(0.693145751953125) - k * np.float32(1.428606765330187e-06)
    p = np.float32(0.0013888889) * r + np.float32(0.008333334)
    p = p * r + np.float32(0.041666668)
    p = p * r + np.float32(0.16666667)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
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
