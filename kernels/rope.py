"""Rotary embedding of a decode step's q/k heads in place, and the store of its K/V rows.

At decode sizes the torch version (``engine.model.transformer.apply_rope``: a ``cat``,
four products and a sum, then an indexed write per K and V store) costs microseconds of
dispatch per op on a few hundred floats; this is one numba call per layer. The
arithmetic is the same, elementwise and in the same order (``x * cos`` and the rotated
half times ``sin``, each rounded, then added): the same bits as the torch version. The
per-head RMSNorm of models with q/k norms can be done first in the same call.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels.quant.simd import floats_to_halves

__all__ = ["rope_and_store"]

_JIT = {"cache": True, "nogil": True, "boundscheck": False}
_NO_STORE = np.empty((0, 1, 1, 1), np.float32)
_NO_INDEX = np.empty(0, np.int64)
_NO_NORM = np.empty(0, np.float32)


@numba.njit(**_JIT)
def _rope_and_store(qkv, cos, sin, rotated, q_heads, q_norm, k_norm, eps, k_data, v_data, halves, pages, slots):  # fmt: skip
    tokens, n_heads, head_dim = qkv.shape
    half = head_dim // 2
    kv_heads = n_heads - rotated if k_data.shape[0] else 0
    first_k = rotated - kv_heads
    for t in range(tokens):
        for h in range(rotated):
            if q_norm.shape[0]:  # RMSNorm of each head first (Gemma 3, Qwen3)
                w = q_norm if h < q_heads else k_norm
                total = 0.0
                for d in range(head_dim):
                    total += np.float64(qkv[t, h, d]) * np.float64(qkv[t, h, d])
                inv = np.float32(1.0 / np.sqrt(total / head_dim + eps))
                for d in range(head_dim):
                    qkv[t, h, d] = qkv[t, h, d] * inv * w[d]
            for d in range(half):
                a = qkv[t, h, d]
                b = qkv[t, h, d + half]
                qkv[t, h, d] = a * cos[t, d] + -b * sin[t, d]
                qkv[t, h, d + half] = b * cos[t, d + half] + a * sin[t, d + half]
        for h in range(kv_heads):
            page, slot = pages[t], slots[t]
            if halves:  # fp16 pages (as float32 views of their bytes): rounded to nearest
                k_row = k_data.ctypes.data + page * k_data.strides[0] + slot * k_data.strides[1]
                v_row = v_data.ctypes.data + page * v_data.strides[0] + slot * v_data.strides[1]
                x_row = qkv.ctypes.data + t * qkv.strides[0]
                k_src = x_row + (first_k + h) * qkv.strides[1]
                v_src = x_row + (rotated + h) * qkv.strides[1]
                floats_to_halves(k_src, k_row + h * k_data.strides[2], head_dim)
                floats_to_halves(v_src, v_row + h * v_data.strides[2], head_dim)
                continue
            for d in range(head_dim):
                k_data[page, slot, h, d] = qkv[t, first_k + h, d]
                v_data[page, slot, h, d] = qkv[t, rotated + h, d]


def rope_and_store(
    qkv: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    rotated: int,
    stores: tuple[np.ndarray, np.ndarray] | None = None,
    pages: np.ndarray | None = None,
    slots: np.ndarray | None = None,
    head_norms: tuple[int, np.ndarray, np.ndarray, float] | None = None,
) -> None:
    """Rotate heads ``0 .. rotated - 1`` of ``qkv [T, heads, head_dim]`` (float32,
    C-contiguous: the q heads then the k heads) in place by ``cos`` / ``sin`` ``[T,
    head_dim]``; with ``stores`` (the K and V pages ``[P, S, kv_heads, head_dim]``,
    float32, or fp16 as their uint16 bit patterns: rounded to nearest as torch's
    ``.half()``), also write each token's k heads (the last ``kv_heads`` rotated ones,
    ``heads = rotated + kv_heads``) and v heads (after them) at ``(pages[t], slots[t])``.
    ``head_norms`` ``(q_heads, q_norm, k_norm, eps)``: RMSNorm each rotated head first,
    by ``q_norm`` below ``q_heads``, ``k_norm`` from there (float64 sums of squares, so
    within float32 rounding of torch's norm, not bit for bit)."""
    if qkv.dtype != np.float32 or not qkv.flags.c_contiguous or qkv.ndim != 3:
        raise ValueError("rope_and_store needs C-contiguous float32 [T, heads, head_dim]")
    halves = False
    if stores is None:
        k_data = v_data = _NO_STORE
        pages = slots = _NO_INDEX
    else:
        k_data, v_data = stores
        kv_heads = qkv.shape[1] - rotated
        if k_data.shape[2:] != (kv_heads, qkv.shape[2]) or v_data.shape != k_data.shape:
            raise ValueError(
                f"K/V pages {k_data.shape} do not hold {kv_heads} heads of {qkv.shape[2]}"
            )
        if k_data.dtype == np.uint16 and v_data.dtype == np.uint16:
            # one compiled kernel for both: fp16 pages go in as float32 views of their
            # bytes (the same byte strides; head_dim is even)
            k_data, v_data, halves = k_data.view(np.float32), v_data.view(np.float32), True
        elif k_data.dtype != np.float32 or v_data.dtype != np.float32:
            raise ValueError(f"K/V pages must be float32 or fp16 bits, not {k_data.dtype}")
    if head_norms is None:
        q_heads, q_norm, k_norm, eps = rotated, _NO_NORM, _NO_NORM, 0.0
    else:
        q_heads, q_norm, k_norm, eps = head_norms
    _rope_and_store(
        qkv, cos, sin, rotated, q_heads, q_norm, k_norm, eps, k_data, v_data, halves, pages, slots
    )
