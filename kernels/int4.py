"""Keep 4-bit GGUF weights quantized and multiply with torch's CPU int4 kernel.

torch ships ``aten._convert_weight_to_int4pack_for_cpu`` / ``aten._weight_int4pack_mm_for_cpu``
(the CPU side of gpt-fast's int4 path).  Verified by experiment on torch 2.13, the kernel
computes ``y = x @ W.T`` with

    W[n, k] = (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]        q in [0, 15]

where ``scales_and_zeros`` is ``[K // G, N, 2]`` (``[..., 0]`` = scale, ``[..., 1]`` = zero),
in the same dtype as ``x`` (bf16, fp16 or fp32).  Constraints of the ops: the weight must be
int32 ``[N, K]``; ``N`` must be a multiple of 16 (we pad rows and slice the output); the group
size must be 32/64/128/256 and divide ``K``; ``x`` must be 2-D and contiguous.

GGUF's 4-bit formats map onto that exactly (per 32 elements):

* Q4_0: ``d * (q - 8)``          -> scale = d,      zero = 0
* Q4_1: ``d * q + m``            -> scale = d,      zero = m + 8 d
* Q4_K: ``d*sc * q - dmin*mn``   -> scale = d*sc,   zero = 8 d*sc - dmin*mn

so the only error introduced is rounding scale/zero to the compute dtype.

Notes:
* CPU only: the CUDA int4 kernel uses a different packed layout.  The CPU layout also
  depends on the CPU's vector ISA (AVX-512 vs AVX2 row blocking), so never cache ``packed``
  on disk; rebuild it from the GGUF bytes at load time.
* Use bf16 (the default).  The fp32/fp16 variants of the kernel are correct but were
  ~25-30x slower in our measurements (torch 2.13); they are useful for exact tests only.
* The kernel's cost grows linearly with the number of rows of ``x``: it wins for decode
  (small M) but for long prefill a dense bf16 matmul on freshly dequantized weights is faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.dequant import _as_bytes, _f16, _k_scale_min, _nibbles

__all__ = [
    "INT4_TYPES",
    "Int4Weight",
    "int4_from_gguf",
    "int4_linear",
    "int4_supported",
    "quantize_int4",
]

Q = GGMLQuantizationType

INT4_TYPES: tuple[GGMLQuantizationType, ...] = (Q.Q4_0, Q.Q4_1, Q.Q4_K)

_N_ALIGN = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
_PACK_ROW_BLOCK = 64  # the packer interleaves rows in independent blocks of 64
_PACK_CHUNK_ROWS = 64 * 64  # rows converted per call (bounds the int32 temporary)
_INNER_K_TILES = 8  # ignored by the CPU packer, kept for API compatibility
_GROUP_SIZES = (32, 64, 128, 256)
_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Int4Weight:
    """A linear weight ``[out_features N, in_features K]`` in torch's CPU int4 packed format.

    ``packed`` is uint8 ``[N_pad, K // 2]`` (``N_pad`` = N rounded up to 16),
    ``scales_and_zeros`` is ``[K // group_size, N_pad, 2]`` in the compute dtype.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    out_features: int
    in_features: int
    group_size: int = 32

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the matmul (that of ``scales_and_zeros``)."""
        return self.scales_and_zeros.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return (
            self.packed.numel() * self.packed.element_size()
            + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
        )


def _to_qtype(qtype) -> GGMLQuantizationType | None:
    try:
        return GGMLQuantizationType(int(qtype))
    except (ValueError, TypeError):
        return None


def int4_supported(qtype) -> bool:
    """True if a GGUF tensor of this type can be loaded losslessly by :func:`int4_from_gguf`."""
    return _to_qtype(qtype) in INT4_TYPES


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"int4 compute dtype must be one of {_COMPUTE_DTYPES}, got {dtype}")


def _pack(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype
) -> Int4Weight:
    """codes: integer [N, K] in 0..15; scales/zeros: float32 [N, K // group_size]."""
    n, k = codes.shape
    if group_size not in _GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {_GROUP_SIZES}, got {group_size}")
    if k % group_size != 0:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    n_pad = -(-n // _N_ALIGN) * _N_ALIGN
    if n_pad != n:
        pad = n_pad - n
        codes = torch.cat((codes, torch.full((pad, k), 8, dtype=codes.dtype)))
        scales = torch.cat((scales, torch.zeros(pad, scales.shape[1], dtype=scales.dtype)))
        zeros = torch.cat((zeros, torch.zeros(pad, zeros.shape[1], dtype=zeros.dtype)))

    packed = torch.empty((n_pad, k // 2), dtype=torch.uint8)
    # The packer treats row blocks of 64 independently; converting in row chunks that are
    # multiples of 64 keeps the int32 temporary small for huge matrices (embeddings).
    step = _PACK_CHUNK_ROWS
    assert step % _PACK_ROW_BLOCK == 0
    for start in range(0, n_pad, step):
        stop = min(start + step, n_pad)
        chunk = codes[start:stop].to(torch.int32).contiguous()
        packed[start:stop] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            chunk, _INNER_K_TILES
        )
    sz = torch.stack((scales.t(), zeros.t()), dim=-1).to(dtype).contiguous()
    return Int4Weight(packed, sz, out_features=n, in_features=k, group_size=group_size)


def int4_from_gguf(
    raw: torch.Tensor, qtype, shape, dtype: torch.dtype = torch.bfloat16
) -> Int4Weight:
    """Repack a Q4_0 / Q4_1 / Q4_K GGUF weight ``[N, K]`` for :func:`int4_linear`.

    The 4-bit codes are carried over unchanged; per-32 scales and zeros are computed in fp32
    and rounded once to ``dtype`` (the compute dtype: bf16, fp16 or fp32).
    """
    _check_dtype(dtype)
    codes, scales, zeros = _codes_scales_zeros(raw, qtype, shape)
    return _pack(codes, scales, zeros, 32, dtype)


def int4_from_gguf_parts(parts, dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    """One packed weight from several GGUF weights stacked along the output dim
    (fused q/k/v or gate/up): each part is ``(raw, qtype, shape)`` with the same K."""
    _check_dtype(dtype)
    decoded = [_codes_scales_zeros(raw, qtype, shape) for raw, qtype, shape in parts]
    if len({c.shape[1] for c, _, _ in decoded}) != 1:
        raise ValueError("int4_from_gguf_parts: parts must share in_features")
    codes, scales, zeros = (torch.cat(x, dim=0) for x in zip(*decoded))
    return _pack(codes, scales, zeros, 32, dtype)


def _codes_scales_zeros(
    raw: torch.Tensor, qtype, shape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes [N, K] and per-32 fp32 scales/zeros [N, K/32] of a Q4 GGUF weight."""
    qt = _to_qtype(qtype)
    if qt not in INT4_TYPES:
        name = qt.name if qt is not None else str(qtype)
        raise ValueError(
            f"int4_from_gguf supports {', '.join(t.name for t in INT4_TYPES)}; got {name}"
        )
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise ValueError(f"int4 weights must be 2-D [out_features, in_features], got {shape}")
    n, k = shape
    block_size, type_size = GGML_QUANT_SIZES[qt]
    if k % block_size != 0:
        raise ValueError(f"{qt.name}: in_features {k} is not a multiple of {block_size}")
    n_blocks = n * k // block_size
    data = _as_bytes(raw)
    if data.numel() != n_blocks * type_size:
        raise ValueError(
            f"{qt.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, "
            f"got {data.numel()}"
        )
    b = data.reshape(n_blocks, type_size)

    if qt == Q.Q4_0:
        d = _f16(b[:, 0:2])  # [nb, 1]
        codes = _nibbles(b[:, 2:18])  # [nb, 2, 16] -> 32 elements
        scales = d
        zeros = torch.zeros_like(d)
    elif qt == Q.Q4_1:
        d = _f16(b[:, 0:2])
        m = _f16(b[:, 2:4])
        codes = _nibbles(b[:, 4:20])
        scales = d
        zeros = m + 8.0 * d
    else:  # Q4_K: 8 sub-blocks of 32; sub-block 2c / 2c+1 = low / high nibbles of bytes c*32..
        d = _f16(b[:, 0:2])
        dmin = _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        scales = d * sc.to(torch.float32)  # [nb, 8]
        zeros = 8.0 * scales - dmin * mn.to(torch.float32)
        codes = _nibbles(b[:, 16:144].reshape(n_blocks * 4, 32))  # [nb*4, 2, 32]

    return codes.reshape(n, k), scales.reshape(n, k // 32), zeros.reshape(n, k // 32)


def quantize_int4(
    w: torch.Tensor, group_size: int = 32, dtype: torch.dtype = torch.bfloat16
) -> Int4Weight:
    """Asymmetric min/max 4-bit quantization of a dense weight ``[N, K]`` (per ``group_size``)."""
    _check_dtype(dtype)
    if w.dim() != 2:
        raise ValueError(f"quantize_int4 expects a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if group_size not in _GROUP_SIZES or k % group_size != 0:
        raise ValueError(
            f"group size must be one of {_GROUP_SIZES} and divide in_features {k}; got {group_size}"
        )
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    scale = (hi - lo) / 15.0
    # constant groups: any positive scale reproduces lo exactly with code 0 (zero = lo + 8s)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-4))
    # round the parameters to the compute dtype first, then pick codes against the rounded ones
    scale = scale.to(dtype).to(torch.float32)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-4))
    zero = (lo + 8.0 * scale).to(dtype).to(torch.float32)
    codes = torch.round((g - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8.0).clamp_(0, 15)
    return _pack(codes.to(torch.int32).reshape(n, k), scale, zero, group_size, dtype)


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """``x @ W.T`` for ``x`` of shape ``[..., K]``; returns ``[..., N]`` in ``x.dtype``.

    ``x`` is cast to the weight's compute dtype (``w.dtype``) for the kernel and back.
    """
    if x.shape[-1] != w.in_features:
        raise ValueError(
            f"int4_linear: input has {x.shape[-1]} features, weight expects {w.in_features}"
        )
    if x.device.type != "cpu":
        raise ValueError("int4_linear runs on CPU only (packed format of the CPU kernel)")
    out_dtype = x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if x2.dtype != w.dtype:
        x2 = x2.to(w.dtype)
    x2 = x2.contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, w.group_size, w.scales_and_zeros)
    if y.shape[-1] != w.out_features:
        y = y[:, : w.out_features]
    y = y.reshape(*lead, w.out_features)
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    elif not y.is_contiguous():
        y = y.contiguous()
    return y
