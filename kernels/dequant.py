"""Vectorized torch dequantizers for GGUF (ggml) tensor types.

The block layouts follow ``gguf.quants`` (the numpy reference implementation, itself a port
of ``ggml-quants.c``).  Every decoder here works on a whole ``[n_blocks, type_size]`` uint8
view at once; the only Python loop is over large chunks of blocks, which keeps the
intermediate buffers cache-sized and bounds peak memory for very large tensors.

Public API:
    dequantize(raw, qtype, shape, dtype=torch.float32) -> torch.Tensor
    block_geometry(qtype) -> (block_size_elems, type_size_bytes)
    SUPPORTED_TYPES
    UnsupportedTensorType
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

__all__ = [
    "SUPPORTED_TYPES",
    "UnsupportedTensorType",
    "block_geometry",
    "dequantize",
]

Q = GGMLQuantizationType


class UnsupportedTensorType(ValueError):
    """Raised for a GGUF tensor type that this module cannot dequantize."""


# Blocks decoded per chunk: big enough for torch's intra-op parallelism to kick in, small
# enough that the uint8/float intermediates of one chunk stay (mostly) in cache.
_CHUNK_ELEMS = 1 << 20


def _to_qtype(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(int(qtype))
    except ValueError:
        raise UnsupportedTensorType(
            f"unknown GGUF tensor type id {int(qtype)}; supported: {_supported_names()}"
        ) from None


def _supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def block_geometry(qtype: int | GGMLQuantizationType) -> tuple[int, int]:
    """Return ``(elements per block, bytes per block)`` for a GGUF tensor type."""
    qt = _to_qtype(qtype)
    if qt not in GGML_QUANT_SIZES:
        raise UnsupportedTensorType(f"no block geometry known for GGUF type {qt.name}")
    return GGML_QUANT_SIZES[qt]


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

_SHIFT_CACHE: dict[tuple[int, ...], torch.Tensor] = {}


def _shifts(*values: int, shape: tuple[int, ...]) -> torch.Tensor:
    key = (*values, -1, *shape)
    t = _SHIFT_CACHE.get(key)
    if t is None:
        t = torch.tensor(values, dtype=torch.uint8).reshape(shape)
        _SHIFT_CACHE[key] = t
    return t


def _f16(cols: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 little-endian fp16 fields -> [n, 1] float32."""
    return cols.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, B] packed bytes -> [n, 2, B] (low nibbles first, then high nibbles)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1)


def _bits_le(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] bits (bit i = element i)."""
    n = qh.shape[0]
    return ((qh.unsqueeze(-1) >> _shifts(*range(8), shape=(1, 1, 8))) & 1).reshape(n, 32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K -> two [n, 8] uint8 tensors."""
    d = scales[:, 0:4]
    m = scales[:, 4:8]
    m_d = scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


# ---------------------------------------------------------------------------------------
# per-type block decoders: uint8 [n, type_size] -> float32 [n, block_size]
# ---------------------------------------------------------------------------------------


def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    return b[:, 2:].view(torch.int8).to(torch.float32) * d


def _dq_q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:]).reshape(n, 32).to(torch.float32) - 8.0
    return q.mul_(d)


def _dq_q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).reshape(n, 32).to(torch.float32)
    return q.mul_(d).add_(m)


def _dq_q5_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qh = _bits_le(b[:, 2:6])
    ql = _nibbles(b[:, 6:]).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.float32) - 16.0
    return q.mul_(d)


def _dq_q5_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    qh = _bits_le(b[:, 4:8])
    ql = _nibbles(b[:, 8:]).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return q.mul_(d).add_(m)


def _dq_q2_k(b: torch.Tensor) -> torch.Tensor:
    # layout: scales[16] qs[64] d[2] dmin[2]
    n = b.shape[0]
    scales = b[:, 0:16]
    qs = b[:, 16:80]
    d = _f16(b[:, 80:82])
    dmin = _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).unsqueeze(-1)  # [n, 16, 1]
    ml = (dmin * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (q.mul_(dl).sub_(ml)).reshape(n, QK_K)


def _dq_q3_k(b: torch.Tensor) -> torch.Tensor:
    # layout: hmask[32] qs[64] scales[12] d[2]
    n = b.shape[0]
    hmask = b[:, 0:32]
    qs = b[:, 32:96]
    scales = b[:, 96:108]
    d = _f16(b[:, 108:110])
    lsc = (scales[:, 0:8].reshape(n, 1, 8) >> _shifts(0, 4, shape=(1, 2, 1))).reshape(n, 16)
    hsc = (scales[:, 8:12].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, shape=(1, 4, 1))).reshape(n, 16)
    sc = ((lsc & 0x0F) | ((hsc & 0x03) << 4)).to(torch.float32) - 32.0
    dl = (d * sc).unsqueeze(-1)  # [n, 16, 1]
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(*range(8), shape=(1, 1, 8, 1))) & 1
    # the high bit *subtracts* 4 when it is clear
    q = ql.reshape(n, 16, 16).to(torch.float32) - ((qh.reshape(n, 16, 16) ^ 1) << 2).to(
        torch.float32
    )
    return q.mul_(dl).reshape(n, QK_K)


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    # layout: d[2] dmin[2] scales[12] qs[128]
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)  # [n, 8, 1]
    ml = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    # 4 chunks of 32 bytes: low nibbles -> sub-block 2c, high nibbles -> sub-block 2c+1
    q = _nibbles(b[:, 16:144].reshape(n * 4, 32)).reshape(n, 8, 32).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    # layout: d[2] dmin[2] scales[12] qh[32] qs[128]
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)
    ml = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(*range(8), shape=(1, 8, 1))) & 1
    ql = _nibbles(b[:, 48:176].reshape(n * 4, 32)).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    # layout: ql[128] qh[64] scales[16] (int8) d[2]
    n = b.shape[0]
    ql = b[:, 0:128]
    qh = b[:, 128:192]
    scales = b[:, 192:208].view(torch.int8).to(torch.float32)
    d = _f16(b[:, 208:210])
    dl = (d * scales).unsqueeze(-1)  # [n, 16, 1]
    lo = (ql.reshape(n, 2, 1, 64) >> _shifts(0, 4, shape=(1, 1, 2, 1))) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 0x03
    q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)).to(torch.float32) - 32.0
    return q.reshape(n, 16, 16).mul_(dl).reshape(n, QK_K)


_BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _dq_q8_0,
    Q.Q4_0: _dq_q4_0,
    Q.Q4_1: _dq_q4_1,
    Q.Q5_0: _dq_q5_0,
    Q.Q5_1: _dq_q5_1,
    Q.Q2_K: _dq_q2_k,
    Q.Q3_K: _dq_q3_k,
    Q.Q4_K: _dq_q4_k,
    Q.Q5_K: _dq_q5_k,
    Q.Q6_K: _dq_q6_k,
}

_FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
}

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    *_FLOAT_TYPES,
    *_BLOCK_DECODERS,
)


# ---------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------


def _as_bytes(raw: torch.Tensor) -> torch.Tensor:
    """Any contiguous tensor -> flat uint8 view of its bytes (no copy if possible)."""
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw must be a torch.Tensor, got {type(raw).__name__}")
    if raw.device.type != "cpu":
        raw = raw.cpu()
    raw = raw.contiguous().reshape(-1)
    if raw.dtype != torch.uint8:
        raw = raw.view(torch.uint8)
    return raw


def _view_as(raw_u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return raw_u8.view(dtype)
    except RuntimeError:  # misaligned storage offset: fall back to a copy
        return raw_u8.clone().view(dtype)


def dequantize(
    raw: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize the raw bytes of a GGUF tensor.

    Args:
        raw: the tensor's data exactly as stored in the GGUF file, normally a flat uint8
            tensor.  For F32/F16/BF16 an already-typed tensor is accepted as well (its bytes
            are reinterpreted).
        qtype: the GGUF tensor type (``GGMLQuantizationType`` or its integer id).
        shape: the logical torch shape (row-major; ``shape[-1]`` is GGUF ``ne[0]``).
        dtype: floating dtype of the result.

    Returns:
        A new contiguous CPU tensor of ``shape`` and ``dtype``.
    """
    qt = _to_qtype(qtype)
    if qt not in _FLOAT_TYPES and qt not in _BLOCK_DECODERS:
        raise UnsupportedTensorType(
            f"GGUF tensor type {qt.name} is not supported by kernels.dequant; "
            f"supported: {_supported_names()}"
        )
    shape = tuple(int(s) for s in shape)
    n_elems = math.prod(shape)
    block_size, type_size = GGML_QUANT_SIZES[qt]
    if shape and shape[-1] % block_size != 0:
        raise ValueError(
            f"{qt.name}: row size {shape[-1]} is not a multiple of the block size {block_size}"
        )
    n_blocks = n_elems // block_size
    n_bytes = n_blocks * type_size
    data = _as_bytes(raw)
    if data.numel() != n_bytes:
        raise ValueError(
            f"{qt.name} tensor of shape {shape} needs {n_bytes} bytes, got {data.numel()}"
        )

    if qt in _FLOAT_TYPES:
        src = _view_as(data, _FLOAT_TYPES[qt]).reshape(shape)
        out = src.to(dtype)
        if out.data_ptr() == src.data_ptr():  # same dtype: never alias the caller's bytes
            out = out.clone()
        return out

    decode = _BLOCK_DECODERS[qt]
    blocks = data.reshape(n_blocks, type_size)
    chunk = max(1, _CHUNK_ELEMS // block_size)
    if n_blocks <= chunk:
        out = decode(blocks)
        if out.dtype != dtype:
            out = out.to(dtype)
        return out.reshape(shape)

    out = torch.empty((n_blocks, block_size), dtype=dtype)
    for start in range(0, n_blocks, chunk):
        stop = min(start + chunk, n_blocks)
        out[start:stop] = decode(blocks[start:stop])
    return out.reshape(shape)
