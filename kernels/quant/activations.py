"""Activations quantized once per matmul: int8 per 32 elements (llama.cpp's Q8_0 block).

Every decode kernel of :mod:`kernels.quant` reads this one format, so a layer input shared
by several weights of different types (q/k/v, gate/up) is quantized once. llama.cpp uses a
coarser block of 256 (Q8_K) for the k-quants to save scale multiplies; here the scales are
applied per 4-element lane anyway (:func:`~kernels.quant.simd.scaled_dot`), so the finer
block costs one broadcast per 64 elements and halves the activation rounding error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from kernels.quant.blocks import JIT
from kernels.quant.simd import quantize32

ACT_BLOCK = 32


@dataclass
class Q8Activations:
    """``[B, K]`` activations as int8 codes ``q`` with float32 ``scale`` per 32 elements;
    ``sum16`` / ``sum32`` are the sums of the *dequantized* values (``scale * q``) per 16 /
    32 elements, which the weight types with an offset (``w = d * q + m``) multiply by
    ``m``."""

    q: np.ndarray  # int8 [B, K], values in [-127, 127]
    scale: np.ndarray  # float32 [B, K // 32]
    sum16: np.ndarray  # float32 [B, K // 16]
    sum32: np.ndarray  # float32 [B, K // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        """float32 ``[B, K]``: exactly the values the kernels multiply by."""
        b, k = self.q.shape
        return (self.q.reshape(b, -1, ACT_BLOCK) * self.scale[:, :, None]).reshape(b, k)


@numba.njit(**JIT)
def _quantize(x, q, scale, sum16, sum32):
    batch, k = x.shape
    four = np.empty(4, np.float32)
    for b in range(batch):
        x_at = x[b].ctypes.data
        q_at = q[b].ctypes.data
        for blk in range(k // 32):
            quantize32(x_at + 128 * blk, q_at + 32 * blk, four.ctypes.data)
            scale[b, blk] = four[0]
            sum16[b, 2 * blk] = four[1]
            sum16[b, 2 * blk + 1] = four[2]
            sum32[b, blk] = four[3]


def quantize_activations(x: np.ndarray) -> Q8Activations:
    """float32 ``[B, K]`` (K a multiple of 32) -> :class:`Q8Activations`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % ACT_BLOCK:
        raise ValueError(f"activations must be [B, K] with K a multiple of 32, got {x.shape}")
    b, k = x.shape
    act = Q8Activations(
        np.empty((b, k), np.int8),
        np.empty((b, k // 32), np.float32),
        np.empty((b, k // 16), np.float32),
        np.empty((b, k // 32), np.float32),
    )
    _quantize(x, act.q, act.scale, act.sum16, act.sum32)
    return act
