"""KV-cache quantization (docs/ENGINE.md §6): Hadamard-rotated groups of 32, b-bit midpoint codes.

Each token's K (or V) vector, flattened over ``kv_heads x head_dim``, is cut into groups of
32 consecutive values.  Folio requires ``head_dim % 32 == 0`` for quantized formats (stricter
than ``kv_heads * head_dim % 32 == 0``) so that no group straddles two heads: the stores
keep a kv_heads axis and kernels work head by head.  SmolLM2 (64), Llama/Qwen (64 or 128)
and Gemma 3 (256) qualify; a head_dim-80 model (Phi-2) would need an unquantized cache.  A group ``x`` is rotated, ``y = x @ H`` with ``H`` the 32x32
Sylvester-Hadamard matrix scaled by ``1/sqrt(32)`` (orthogonal and symmetric, so ``H`` is
its own inverse), which spreads an outlier over the whole group.  Then, with
``s = absmax(y) + 1e-10`` stored as fp16 and ``m = 2^(b-1)``::

    q = clamp(floor(y / s * m + m), 0, 2^b - 1)        y' = (q - m + 0.5) * s / m

and the value read back is ``y' @ H``.  The fp16-rounded scale is used on both sides so
that quantizing and dequantizing agree exactly.

Packing is bit-exact dense: the 32 codes of a group are 32*b bits, i.e. exactly ``b``
int32 words; code ``i`` occupies bits ``[i*b, (i+1)*b)`` of that little-endian bit string
(it may straddle two words when ``b`` does not divide 32).  Per token that is
``G * (4*b + 2)`` bytes with ``G = kv_heads * head_dim / 32`` (codes plus one fp16 scale
per group), against ``128 * G`` for fp32 and ``64 * G`` for fp16.  SmolLM2 (3 KV heads x 64,
G = 6): 8-bit 204, 4-bit 108, 2-bit 60 bytes per token per layer for each of K and V,
against fp32 768 and fp16 384.

Because ``H`` is orthogonal, attention can also run in the rotated domain without ever
rotating keys back: ``q . (y' H) = (q H) . y'`` per group, and ``sum_j p_j (y'_j H) =
(sum_j p_j y'_j) H``; :func:`rotate` is exposed for kernels that do so.

Two refinements measured on SmolLM2 (docs/KV_QUANT.md), both keeping groups of 32, the
rotation, packed codes and fp16 parameters:

* **Asymmetric grid** (``KVFormat(bits, asymmetric=True)``, what the engine uses for V): per
  rotated group ``z = min y``, ``d = (max y - min y) / (2^b - 1)``, both fp16, and
  ``q = clamp(round((y - z) / d), 0, 2^b - 1)``, ``y' = q d + z``.  Values are not centred
  on zero, so spending the whole grid on ``[min, max]`` beats the symmetric absmax grid
  (SmolLM2 K4/V4 with the key offset: +2.91% -> +1.88% perplexity with it for K as well as
  V); it costs one more fp16 per group.
* **Key offset** (:class:`KeyOffset`, what the engine uses for quantized K): keys carry a
  large constant pre-RoPE offset ``mu`` per layer and head, which the rotation would spread
  over every group and so inflate every scale.  The cache stores ``k - R(p) mu`` (``R(p)``:
  the model's RoPE at the key's position ``p``) and every attention path adds ``q . R(p) mu``
  back exactly.  Since RoPE's cos/sin are the same in both halves of the head,
  ``q . R(p) mu = z . t_p`` with ``z`` from the query alone (:meth:`KeyOffset.query_terms`)
  and ``t_p = [cos_p, sin_p]`` one table row per position: one extra dot product per key.

Page-pool layout (every tensor starts with ``[num_pages, page_size]`` so that a page is
copied by indexing the first dimension):

* unquantized: ``{"data": dtype [P, S, kv_heads, head_dim]}``
* quantized:   ``{"codes": int32 [P, S, kv_heads, Gh, b], "scales": float16 [P, S, kv_heads, Gh]}``
  with ``Gh = head_dim / 32`` groups per head, plus ``"zeros": float16 [P, S, kv_heads, Gh]``
  (the group minima) for the asymmetric grid; ``scales`` then holds the steps ``d``
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cache

import torch

__all__ = [
    "GROUP_SIZE",
    "KVFormat",
    "KeyOffset",
    "allocate_pages",
    "decode",
    "dequantize",
    "dequantize_pages",
    "dequantize_rotated",
    "encode",
    "hadamard",
    "pack_codes",
    "quantize",
    "quantize_asymmetric",
    "quantize_into",
    "rope_table",
    "rotate",
    "unpack_codes",
]

GROUP_SIZE = 32
MIN_BITS = 2
MAX_BITS = 8
_SCALE_EPS = 1e-10
_FP16_MAX = 65504.0
_LITTLE_ENDIAN = sys.byteorder == "little"
_UNQUANTIZED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KVFormat:
    """How one of K or V is stored in the page pool: ``bits`` 2..8, or None for ``dtype``;
    ``asymmetric`` picks the min/max grid over the §6 midpoint grid."""

    bits: int | None = None
    dtype: torch.dtype = torch.float32
    asymmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits is None:
            if self.dtype not in _UNQUANTIZED_DTYPES:
                raise ValueError(f"unquantized KV dtype must be one of {_UNQUANTIZED_DTYPES}")
            if self.asymmetric:
                raise ValueError("the asymmetric grid needs quantized KV bits")
        elif not (isinstance(self.bits, int) and MIN_BITS <= self.bits <= MAX_BITS):
            raise ValueError(f"KV bits must be an int in {MIN_BITS}..{MAX_BITS}, got {self.bits}")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies in one layer's K (or V) pages."""
        width = kv_heads * head_dim
        if self.bits is None:
            return width * torch.empty((), dtype=self.dtype).element_size()
        params = 4 if self.asymmetric else 2  # fp16 scale, and the fp16 minimum
        return kv_heads * _groups_per_head(head_dim) * (4 * self.bits + params)


def _groups_per_head(head_dim: int) -> int:
    if head_dim % GROUP_SIZE != 0:
        raise ValueError(
            f"a quantized KV cache needs head_dim to be a multiple of {GROUP_SIZE} "
            f"(groups of {GROUP_SIZE} must not straddle heads), got head_dim={head_dim}"
        )
    return head_dim // GROUP_SIZE


def hadamard(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32x32 orthonormal Hadamard matrix (float32); symmetric and its own inverse."""
    return _hadamard(torch.device(device))


@cache
def _hadamard(device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < GROUP_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(GROUP_SIZE)).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Apply the group rotation to the last dimension of ``x`` (a multiple of 32), in float32.

    The rotation is an involution: ``rotate(rotate(x)) == x`` up to rounding.
    """
    shape = x.shape
    groups = x.reshape(*shape[:-1], shape[-1] // GROUP_SIZE, GROUP_SIZE).float()
    return (groups @ hadamard(x.device)).reshape(shape)


@cache
def _bit_layout(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per code i of a group: its low word, the word holding its spill-over, and bit offset."""
    start = torch.arange(GROUP_SIZE, dtype=torch.int64, device=device) * bits
    word_lo = start // 32
    offset = start % 32
    # a non-straddling code reads its own word twice; its "high" part is masked away
    word_hi = torch.where(offset + bits > 32, word_lo + 1, word_lo)
    return word_lo, word_hi, offset


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``[..., 32]`` in ``0..2^b-1`` -> int32 words ``[..., b]`` (dense)."""
    word_lo, word_hi, offset = _bit_layout(bits, codes.device)
    c = codes.to(torch.int64)
    lo = (c << offset) & 0xFFFFFFFF
    hi = torch.where(word_hi != word_lo, c >> (32 - offset), torch.zeros_like(c))
    words = torch.zeros(*codes.shape[:-1], bits, dtype=torch.int64, device=codes.device)
    # the bit ranges are disjoint, so adding is OR-ing
    words.index_add_(-1, word_lo, lo)
    words.index_add_(-1, word_hi, hi)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[..., b]`` -> integer codes ``[..., 32]`` (inverse of :func:`pack_codes`).

    uint8 for 2, 4 and 8 bits (a byte view of the words, no straddling codes), int64 otherwise.
    """
    if 8 % bits == 0 and _LITTLE_ENDIAN:
        # code i sits in byte (i * bits) // 8 of the little-endian words
        data = words.contiguous().view(torch.uint8)
        if bits == 8:
            return data
        mask = (1 << bits) - 1
        parts = [(data >> shift) & mask for shift in range(0, 8, bits)]
        return torch.stack(parts, -1).flatten(-2)
    word_lo, word_hi, offset = _bit_layout(bits, words.device)
    u = words.to(torch.int64) & 0xFFFFFFFF
    lo = u.index_select(-1, word_lo) >> offset
    hi = u.index_select(-1, word_hi) << (32 - offset)
    return (lo | hi) & ((1 << bits) - 1)


def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """§6 midpoint grid: ``values [..., kv_heads, head_dim]`` -> codes int32
    ``[..., kv_heads, Gh, b]`` and scales fp16 ``[..., kv_heads, Gh]``."""
    KVFormat(bits)  # validates bits
    gh = _groups_per_head(values.shape[-1])
    y = rotate(values).reshape(*values.shape[:-1], gh, GROUP_SIZE)
    scale16 = (y.abs().amax(-1) + _SCALE_EPS).clamp(max=_FP16_MAX).to(torch.float16)
    # an all-zero group has a scale that underflows fp16 to 0; any code then decodes to 0
    s = scale16.float().clamp(min=_SCALE_EPS).unsqueeze(-1)
    m = float(1 << (bits - 1))
    codes = torch.floor(y / s * m + m).clamp(0, (1 << bits) - 1)
    return pack_codes(codes, bits), scale16


def quantize_asymmetric(
    values: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max grid: codes int32 ``[..., kv_heads, Gh, b]``, steps and minima fp16
    ``[..., kv_heads, Gh]``."""
    KVFormat(bits)
    gh = _groups_per_head(values.shape[-1])
    y = rotate(values).reshape(*values.shape[:-1], gh, GROUP_SIZE)
    levels = (1 << bits) - 1
    # the step is taken from the fp16-rounded minimum, so that the top code still reaches
    # the maximum, and both sides use the fp16 values: quantize and dequantize agree exactly
    zero16 = y.amin(-1).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
    z = zero16.float().unsqueeze(-1)
    step16 = (
        ((y.amax(-1, keepdim=True) - z) / levels).squeeze(-1).clamp(max=_FP16_MAX).to(torch.float16)
    )
    # a constant group has step 0: every code decodes to the minimum, i.e. exactly
    d = step16.float().clamp(min=_SCALE_EPS).unsqueeze(-1)
    codes = torch.round((y - z) / d).clamp(0, levels)
    return pack_codes(codes, bits), step16, zero16


def dequantize_rotated(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantized values still in the rotated domain: float32 ``[..., kv_heads, head_dim]``.
    With ``zeros`` the groups are on the asymmetric grid (``scales`` are the steps)."""
    y = unpack_codes(codes, bits).float()
    # in place: these passes over the unpacked values dominate decode on quantized caches
    if zeros is None:
        m = float(1 << (bits - 1))
        y.sub_(m - 0.5).mul_(scales.float().unsqueeze(-1) / m)
    else:
        y.mul_(scales.float().unsqueeze(-1)).add_(zeros.float().unsqueeze(-1))
    return y.flatten(-2)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize` (or of :func:`quantize_asymmetric`, given ``zeros``):
    float32 ``[..., kv_heads, head_dim]``."""
    return rotate(dequantize_rotated(codes, scales, bits, zeros))


def encode(fmt: KVFormat, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """``values [..., kv_heads, head_dim]`` as the tensors a store of ``fmt`` holds per token."""
    if fmt.bits is None:
        return {"data": values.to(fmt.dtype)}
    if fmt.asymmetric:
        codes, scales, zeros = quantize_asymmetric(values, fmt.bits)
        return {"codes": codes, "scales": scales, "zeros": zeros}
    codes, scales = quantize(values, fmt.bits)
    return {"codes": codes, "scales": scales}


def decode(fmt: KVFormat, tensors: dict[str, torch.Tensor], rotated: bool = False) -> torch.Tensor:
    """Inverse of :func:`encode`: float32 ``[..., kv_heads, head_dim]``; with ``rotated``
    quantized values stay in the rotated domain (unquantized ones are returned as they are)."""
    if fmt.bits is None:
        return tensors["data"].float()
    y = dequantize_rotated(tensors["codes"], tensors["scales"], fmt.bits, tensors.get("zeros"))
    return y if rotated else rotate(y)


# Unquantized pages in host memory of at least this many bytes are mapped in 2 MB pages
# (`huge_page_zeros`): the CPU decode kernel reads a KV head's rows, one every
# ``kv_heads * head_dim`` elements, so in 4 KB pages it crossed a page every few slots, and
# the weights streamed between two layers had evicted their translations (Llama-3.2-1B
# shape, 540 tokens, fp16 pages, a decode step's attention over 16 layers, four pairs of
# runs in turns: 1.98-2.15 ms in 4 KB pages, 1.71-1.91 in 2 MB ones)
HUGE_PAGES_FROM = 4 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in anonymous memory that Linux backs with 2 MB pages where it
    can (``MADV_HUGEPAGE``, before any page is touched; the tensor holds the mapping).
    Untouched pages cost no memory until written. Elsewhere (no ``MADV_HUGEPAGE``:
    Windows, macOS) ``torch.zeros``."""
    import mmap

    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KB pages, still zeroed
        pass
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def allocate_pages(
    fmt: KVFormat, num_pages: int, page_size: int, kv_heads: int, head_dim: int, device=None
) -> dict[str, torch.Tensor]:
    """Zeroed storage for ``num_pages`` pages of one of K or V of one layer (unquantized
    ones in host memory in 2 MB pages where they are large enough: `huge_page_zeros`)."""
    if fmt.bits is None:
        shape = (num_pages, page_size, kv_heads, head_dim)
        nbytes = math.prod(shape) * fmt.dtype.itemsize
        if (device is None or torch.device(device).type == "cpu") and nbytes >= HUGE_PAGES_FROM:
            return {"data": huge_page_zeros(shape, fmt.dtype)}
        return {"data": torch.zeros(shape, dtype=fmt.dtype, device=device)}
    lead = (num_pages, page_size, kv_heads, _groups_per_head(head_dim))
    store = {
        "codes": torch.zeros((*lead, fmt.bits), dtype=torch.int32, device=device),
        "scales": torch.zeros(lead, dtype=torch.float16, device=device),
    }
    if fmt.asymmetric:
        store["zeros"] = torch.zeros(lead, dtype=torch.float16, device=device)
    return store


def quantize_into(
    fmt: KVFormat,
    store: dict[str, torch.Tensor],
    page_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write ``values [n, kv_heads, head_dim]`` at the ``n`` (page, slot) pairs."""
    for name, tensor in encode(fmt, values).items():
        store[name][page_idx, slot_idx] = tensor


def dequantize_pages(
    fmt: KVFormat, store: dict[str, torch.Tensor], page_ids: torch.Tensor
) -> torch.Tensor:
    """Pages ``page_ids [p]`` as float32 ``[p, page_size, kv_heads, head_dim]``."""
    return decode(fmt, {name: t[page_ids] for name, t in store.items()})


# ---- key offset: keys stored relative to R(p) mu ----------------------------------------


def rope_table(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """``[positions, 2 * len(inv_freq)]`` float32: ``cos(p f_i)`` then ``sin(p f_i)`` per row.

    Computed as the transformer's ``Rope`` computes its tables (the same float32 products
    and ``cos``/``sin``), so ``R(p) mu`` here is bit for bit the model's RoPE of ``mu``.
    """
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq.float().cpu())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@dataclass(frozen=True)
class KeyOffset:
    """The offset ``R(p) mu`` one layer's quantized keys are stored relative to.

    ``mean [kv_heads, head_dim]``: the pre-RoPE key mean ``mu``; ``table [N, head_dim]``:
    :func:`rope_table` of the layer's RoPE for positions ``0..N-1`` (at least the longest
    context attended).  Rotate-half RoPE: ``R(p) x = x cos_p + rotate_half(x) sin_p`` with
    ``cos_p``/``sin_p`` repeating ``table[p]``'s halves over both halves of the head.
    """

    mean: torch.Tensor
    table: torch.Tensor

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """``R(p) mu`` for each position: float32 ``[len(positions), kv_heads, head_dim]``."""
        half = self.mean.shape[-1] // 2
        rows = self.table[positions]
        cos = torch.cat((rows[:, :half], rows[:, :half]), -1).unsqueeze(-2)
        sin = torch.cat((rows[:, half:], rows[:, half:]), -1).unsqueeze(-2)
        # the transformer's apply_rope, term for term
        return self.mean * cos + _rotate_half(self.mean) * sin

    def query_terms(self, q: torch.Tensor) -> torch.Tensor:
        """``z [..., n_heads, head_dim]`` with ``z . table[p] == q . R(p) mu`` (GQA: query
        head ``i`` uses KV head ``i // (n_heads / kv_heads)``).

        ``q . R(p) mu = (q * mu) . cos_p + (q * rotate_half(mu)) . sin_p``, and as ``cos_p``
        and ``sin_p`` repeat over the two halves of the head, each half-pair folds into one
        term: ``z = [u_lo + u_hi, w_lo + w_hi]`` with ``u = q * mu``, ``w = q * rotate_half(mu)``.
        """
        kv_heads, head_dim = self.mean.shape
        group = q.shape[-2] // kv_heads
        # repeat_interleave by views: nothing here may wait on the device (CUDA graphs)
        mu = self.mean.unsqueeze(1).expand(kv_heads, group, head_dim).reshape(-1, head_dim)
        half = mu.shape[-1] // 2
        u = q.float() * mu
        w = q.float() * _rotate_half(mu)
        return torch.cat((u[..., :half] + u[..., half:], w[..., :half] + w[..., half:]), -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
