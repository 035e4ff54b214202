"""`LayerKV`: one layer's K and V pages as every attention path reads them.

The cache (engine/cache/kv_cache.py) builds one per layer and hands it to
:func:`kernels.paged_attention.paged_attention`; the CPU paths and the Triton kernel all
read the stores through it and move queries into, and outputs out of, the pages' domain
the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.kvquant import KeyOffset, KVFormat, rotate

__all__ = ["LayerKV"]


@dataclass(frozen=True)
class LayerKV:
    """One layer's pages as attention reads them: the K and V stores (:mod:`kernels.kvquant`
    layout), their formats and, for a K cache stored relative to the calibrated key mean,
    the key offset."""

    k: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    fmt_k: KVFormat
    fmt_v: KVFormat
    k_offset: KeyOffset | None = None

    # cached: a decode step reads them once per layer
    @functools.cached_property
    def page_size(self) -> int:
        return next(iter(self.k.values())).shape[1]

    @functools.cached_property
    def kv_heads(self) -> int:
        return next(iter(self.k.values())).shape[2]

    def query_for_pages(self, q: torch.Tensor) -> torch.Tensor:
        """float32 queries in the K pages' domain: rotated when K is quantized, since the
        group rotation ``H`` is orthogonal and symmetric, ``q . (y H) = (q H) . y``, so the
        pages are read as stored and never rotated back."""
        if self.fmt_k.quantized:
            return rotate(q)
        return q if q.dtype == torch.float32 else q.float()

    def output_from_pages(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An output summed over V rows as stored, back in the model's domain and ``dtype``:
        rotated when V is quantized (``sum_j p_j (y_j H) = (sum_j p_j y_j) H``)."""
        out = rotate(out) if self.fmt_v.quantized else out
        return out if out.dtype == dtype else out.to(dtype)
