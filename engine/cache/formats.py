"""The cache's page formats: how K and V pages store a token for given widths, and what
one token costs in them. Everything that prices a KV cache (the fit estimate before a
download, the kv-quant bench) asks here, so the figures follow the formats.
"""

from __future__ import annotations

import torch

from kernels.kvquant import KVFormat

# widths of the unquantized formats a cache may be asked for by bits: 16 or 32
DENSE_BITS = {16: torch.float16, 32: torch.float32}


def default_dense(device_type: str = "cpu") -> torch.dtype:
    """The unquantized page format a cache takes when asked for none: fp16 (half the
    bytes; llama.cpp's default too), except on a CPU whose kernels cannot read halves
    (no numba, or no F16C), where the pages stay float32."""
    if device_type != "cpu":
        return torch.float16
    from kernels.paged_attention import CPU_HALF_PAGES

    return torch.float16 if CPU_HALF_PAGES else torch.float32


def kv_formats(
    k_bits: int | None, v_bits: int | None, dense: torch.dtype | None = None
) -> tuple[KVFormat, KVFormat]:
    """The K and V page formats of a cache with these widths: 2..8 quantized, 16 / 32 an
    unquantized fp16 / fp32 page, None the unquantized ``dense`` (the CPU's
    `default_dense` when not given).

    Quantized K and V both use the asymmetric min/max grid: measured on SmolLM2 K4/V4
    (with the key offset) +1.9% perplexity against +2.9% with the §6 midpoint grid for K,
    for one more fp16 per group of 32 (docs/KV_QUANT.md)."""
    dense = default_dense() if dense is None else dense

    def fmt(bits: int | None) -> KVFormat:
        if bits is None:
            return KVFormat(dtype=dense)
        if bits in DENSE_BITS:
            return KVFormat(dtype=DENSE_BITS[bits])
        return KVFormat(bits=bits, asymmetric=True)

    return fmt(k_bits), fmt(v_bits)


def resolved_bits(bits: int | None) -> int:
    """A K or V width with None (the unquantized default, `default_dense`) as its 16 or 32."""
    return torch.finfo(default_dense()).bits if bits is None else bits


def width_name(bits: int | None) -> str:
    """A K or V width as settings and fit labels name it: "fp16" / "fp32" for unquantized
    pages (None: the default), "4-bit" for quantized ones."""
    bits = resolved_bits(bits)
    return f"fp{bits}" if bits in DENSE_BITS else f"{bits}-bit"


def format_bits(fmt: KVFormat) -> int:
    """The width a format stores a value in: its bits, or 16 / 32 for an unquantized page."""
    return fmt.bits if fmt.quantized else torch.finfo(fmt.dtype).bits


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, formats: tuple[KVFormat, KVFormat]
) -> int:
    """Bytes one token's K and V take over all layers in these page formats (`kv_formats`).
    ValueError when a quantized format cannot hold heads of ``head_dim``."""
    return num_layers * sum(f.bytes_per_token(kv_heads, head_dim) for f in formats)
