"""Will a model fit? Folio's own arithmetic: weights + KV cache + a margin, against free memory.

KV bytes per token are the page pool's own, priced by the cache's formats
(``engine.cache.formats.kv_bytes_per_token``): an unquantized cache stores
``layers * kv_heads * head_dim`` values for each of K and V at 2 (fp16, the default) or 4
(fp32) bytes; a quantized K or V groups 32 values as ``b``-bit codes plus fp16 parameters per
group, about ``b/8 + 4/32`` bytes per value. So the estimate follows the engine when its
formats change. The cache is allocated in whole pages, so the context is rounded up to the
page size.

This module imports torch (and the cache) only when KV bytes or CUDA memory are asked for,
so that importing the hub stays light.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "CachePlan",
    "Fit",
    "FitEstimate",
    "estimate_fit",
    "free_memory",
    "kv_bytes_per_token",
    "runtime_overhead_bytes",
]

# Python, torch, numba, the compiled kernels, the tokenizer and a step's activations,
# over the weights and the KV cache. Measured (peak RSS of a fresh process after the
# engine's warm-up, which drops the libraries' code from the resident set, a 512-token
# prompt and 32 tokens, native weights, a 4,096-token cache, less weights and KV;
# tests/engine/test_fit_rss.py): SmolLM2 (49,152-token vocabulary) 304-307 MB, Gemma 3
# 270M (262,144) 408-419 MB, the Llama-3.2-1B shape (128,256) 379-383 MB. A floor, and
# a part that grows with the vocabulary (the tokenizer's tables, the vocabulary's
# strings, logits): 281 MB + 505 B a token.
RUNTIME_FLOOR_BYTES = 281_000_000
RUNTIME_BYTES_PER_VOCAB_TOKEN = 505
TYPICAL_VOCAB = 128_256  # Llama 3's: the estimate where a model's vocabulary is unknown


def runtime_overhead_bytes(vocab_size: int | None = None) -> int:
    """The runtime's bytes beside weights and KV cache for a model of ``vocab_size``
    tokens (TYPICAL_VOCAB when unknown)."""
    vocab = vocab_size if vocab_size and vocab_size > 0 else TYPICAL_VOCAB
    return RUNTIME_FLOOR_BYTES + RUNTIME_BYTES_PER_VOCAB_TOKEN * vocab


RUNTIME_OVERHEAD_BYTES = runtime_overhead_bytes()  # at TYPICAL_VOCAB: 346 MB
# "Fits" leaves a fifth of the free memory to the rest of the system; between that and
# all of it the model will load but the machine may swap or the GPU run out: "Tight".
COMFORT_FRACTION = 0.8


class Fit(StrEnum):
    FITS = "Fits"
    TIGHT = "Tight"
    WONT_FIT = "Won't fit"
    UNKNOWN = "Unknown"


@dataclass(frozen=True)
class CachePlan:
    """The KV cache the user has chosen: context length, page size, K and V bits."""

    context_tokens: int = 4096
    page_size: int = 16
    k_bits: int | None = None  # 2..8 quantized, 16 / 32 fp16 / fp32; None: the default
    v_bits: int | None = None
    dense_bytes: int | None = None  # an unquantized default's bytes a value (None: the CPU's)

    def __post_init__(self) -> None:
        if self.context_tokens < 1 or self.page_size < 1:
            raise ValueError("context and page size must be positive")
        for bits in (self.k_bits, self.v_bits):
            if bits is not None and not (2 <= bits <= 8 or bits in (16, 32)):
                raise ValueError(f"KV cache bits must be 2..8, 16 or 32, got {bits}")
        if self.dense_bytes not in (None, 2, 4):
            raise ValueError("an unquantized KV cache stores 2 or 4 bytes per value")

    @property
    def cached_tokens(self) -> int:
        """Token slots actually allocated: the context rounded up to whole pages."""
        return math.ceil(self.context_tokens / self.page_size) * self.page_size


def kv_bytes_per_token(
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    k_bits: int | None = None,
    v_bits: int | None = None,
    dense_bytes: int | None = None,
) -> int:
    """Bytes one token takes in the KV cache, over all layers, K and V together; a K or V
    of no given width stores ``dense_bytes`` per value (4: fp32, 2: fp16; None: what the
    cache takes on this machine's CPU, `engine.cache.formats.default_dense`)."""
    import torch

    from engine.cache import formats

    if dense_bytes not in (None, 2, 4):
        raise ValueError("an unquantized KV cache stores 2 or 4 bytes per value")
    dense = {None: None, 4: torch.float32, 2: torch.float16}[dense_bytes]
    kv = formats.kv_formats(k_bits, v_bits, dense)
    return formats.kv_bytes_per_token(num_layers, kv_heads, head_dim, kv)


@dataclass(frozen=True)
class FitEstimate:
    label: Fit
    device: str
    weight_bytes: int
    kv_bytes: int
    need_bytes: int  # weights + KV + runtime overhead
    free_bytes: int | None
    note: str = ""  # why the estimate is rough or unknown, in plain words
    runtime_bytes: int = RUNTIME_OVERHEAD_BYTES  # runtime_overhead_bytes of the vocabulary

    @property
    def text(self) -> str:
        """One line for a table cell or tooltip."""
        free = (
            f"{self.free_bytes / 1e9:.1f} GB free"
            if self.free_bytes is not None
            else "free memory unknown"
        )
        line = f"{self.label.value}: needs about {self.need_bytes / 1e9:.2f} GB ({free} on {self.device})"
        return f"{line}; {self.note}" if self.note else line


def estimate_fit(
    weight_bytes: int,
    kv_per_token: int | None,
    plan: CachePlan,
    device: str = "cpu",
    free_bytes: int | None = None,
    note: str = "",
    vocab_size: int | None = None,
) -> FitEstimate:
    """Label a model Fits / Tight / Won't fit for ``plan`` on ``device``.

    ``free_bytes`` defaults to :func:`free_memory` (available RAM, or free VRAM on CUDA).
    Without ``kv_per_token`` (layer and head counts unknown) only the weights count and
    the note says so. ``vocab_size`` sizes the runtime's part (TYPICAL_VOCAB when None).
    """
    if free_bytes is None:
        free_bytes = free_memory(device)
    kv = kv_per_token * plan.cached_tokens if kv_per_token is not None else 0
    if kv_per_token is None:
        note = "; ".join(
            filter(None, (note, "KV cache not counted (layer and head counts unknown)"))
        )
    runtime = runtime_overhead_bytes(vocab_size)
    need = weight_bytes + kv + runtime
    if free_bytes is None:
        label = Fit.UNKNOWN
    elif need <= COMFORT_FRACTION * free_bytes:
        label = Fit.FITS
    elif need <= free_bytes:
        label = Fit.TIGHT
    else:
        label = Fit.WONT_FIT
    return FitEstimate(label, device, weight_bytes, kv, need, free_bytes, note, runtime)


def free_memory(device: str = "cpu") -> int | None:
    """Bytes available for a model now: free VRAM on ``cuda[:n]``, available RAM otherwise."""
    if device.startswith("cuda"):
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
            return int(torch.cuda.mem_get_info(index)[0])
        except (ImportError, RuntimeError, ValueError):
            return None
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return _meminfo_available()


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
