"""Plain reference implementations every fast kernel is tested against.

The weights' reference is the ``gguf`` package's numpy dequantizer (a port of
``ggml-quants.c``); :func:`reference_matmul` is what a decode kernel computes, written the
obvious way: the dequantized weight times the dequantized int8 activations, in float64.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kernels.quant.activations import quantize_activations


def reference_dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> np.ndarray:
    """float32 ``[N, K]`` from the raw bytes ``[N, row_bytes]`` (or flat) of a GGUF tensor."""
    n, k = shape
    rows = np.ascontiguousarray(raw).reshape(n, -1)
    return np.asarray(gguf_quants.dequantize(rows, qtype), dtype=np.float32).reshape(n, k)


def reference_matmul(
    x: np.ndarray,
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    quantize_x: bool = True,
) -> np.ndarray:
    """float64 ``[B, N]``: ``x @ W.T`` with ``W`` from :func:`reference_dequantize` and
    ``x`` first rounded to the kernels' int8 activation format when ``quantize_x``."""
    w = reference_dequantize(raw, qtype, shape).astype(np.float64)
    xs = quantize_activations(x).dequantize() if quantize_x else np.asarray(x, np.float32)
    return xs.astype(np.float64) @ w.T
