"""The cache's page formats: how K and V pages store a token for given widths, and what
one token costs in them. Everything that prices a KV cache (the fit estimate before a
download, the kv-quant bench) asks here, so the figures follow the formats.
"""

from __future__ import annotations

import torch

from kernels.kvquant import KVFormat


def kv_formats(
    k_bits: int | None, v_bits: int | None, dense: torch.dtype = torch.float32
) -> tuple[KVFormat, KVFormat]:
    """The K and V page formats of a cache with these widths (None: unquantized, ``dense``).

    Quantized K and V both use the asymmetric min/max grid: measured on SmolLM2 K4/V4
    (with the key offset) +1.9% perplexity against +2.9% with the §6 midpoint grid for K,
    for one more fp16 per group of 32 (docs/KV_QUANT.md)."""

    def fmt(bits: int | None) -> KVFormat:
        return KVFormat(dtype=dense) if bits is None else KVFormat(bits=bits, asymmetric=True)

    return fmt(k_bits), fmt(v_bits)


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, formats: tuple[KVFormat, KVFormat]
) -> int:
    """Bytes one token's K and V take over all layers in these page formats (`kv_formats`).
    ValueError when a quantized format cannot hold heads of ``head_dim``."""
    return num_layers * sum(f.bytes_per_token(kv_heads, head_dim) for f in formats)
