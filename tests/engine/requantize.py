"""Real weights written again in another GGUF type: what the every-type accuracy tests
run the trained models on.

The `gguf` package quantizes F16, BF16 and the blocks of 32 but not the super-block
types, so those are here: a plain quantizer per type (the range of each sub-block, its
scale and minimum rounded to the type's bits, the codes rounded to the nearest level),
laid out as the `gguf` package's dequantizers read them. Not llama.cpp's search for the
best scales: a file written here is a little less accurate than llama.cpp's, but every
byte of it is what the type allows, and the tests compare two ways of computing with the
same bytes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

QK = 256  # a super-block's elements

SUPER_BLOCK_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 ``[n]`` as its fp16 bytes ``[n, 2]``, and the fp16 values read back."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _levels(x: np.ndarray, step: np.ndarray, lo: int, hi: int, offset=0.0) -> np.ndarray:
    """``round((x + offset) / step)`` clipped to ``[lo, hi]``; 0 where ``step`` is 0."""
    safe = np.where(step == 0, 1.0, step)
    q = np.rint((x + offset) / safe)
    return np.clip(np.where(step == 0, 0, q), lo, hi).astype(np.int32)


def _scale_and_min(x: np.ndarray, levels: int, bits: int):
    """Sub-blocks ``x`` ``[n, s, m]`` as ``d * sc * q - dmin * mn`` with ``q < levels`` and
    ``sc``, ``mn`` of ``bits`` bits: the per-block fp16 bytes of ``d`` and ``dmin``, the
    integer ``sc``, ``mn`` ``[n, s]`` and codes ``q`` ``[n, s, m]``."""
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / (levels - 1)
    top = (1 << bits) - 1
    d_bytes, d = _f16(scale.max(-1) / top)
    dm_bytes, dmin = _f16(-lo.min(-1) / top)
    sc = _levels(scale, d[:, None], 0, top)
    mn = _levels(-lo, dmin[:, None], 0, top)
    q = _levels(x, (d[:, None] * sc)[..., None], 0, levels - 1, (dmin[:, None] * mn)[..., None])
    return d_bytes, dm_bytes, sc, mn, q


def _symmetric(x: np.ndarray, low: int, high: int, bits: int):
    """Sub-blocks ``x`` ``[n, s, m]`` as ``d * sc * q``, ``q`` in ``[low, high]``, ``sc``
    signed in ``bits`` bits, each sub-block's largest magnitude at ``low`` (the longer
    side): the fp16 bytes of ``d``, ``sc`` ``[n, s]`` and ``q`` ``[n, s, m]``."""
    at = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    scale = at / low
    half = 1 << (bits - 1)
    d_bytes, d = _f16(np.abs(scale).max(-1) / half)
    sc = _levels(scale, d[:, None], -half, half - 1)
    q = _levels(x, (d[:, None] * sc)[..., None], low, high)
    return d_bytes, sc, q


def _bit_planes(codes: np.ndarray, shifts: int, width: int) -> np.ndarray:
    """Codes ``[n, shifts * g * 32]`` of ``width`` bits each, packed as the dequantizers
    read them: ``g`` groups of 32 bytes, each byte holding ``shifts`` codes at
    ``width * j`` (element ``32 * (shifts * group + j) + l`` in byte ``32 * group + l``)."""
    n = codes.shape[0]
    c = codes.reshape(n, -1, shifts, 32).astype(np.uint8)
    out = np.zeros((n, c.shape[1], 32), np.uint8)
    for j in range(shifts):
        out |= c[:, :, j] << np.uint8(width * j)
    return out.reshape(n, -1)


def _q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block as Q4_K / Q5_K's 12 bytes."""
    s, m = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = s[:, :4] | ((s[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (s[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def quantize_super_blocks(x: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 ``[rows, cols]`` (``cols`` a multiple of 256) as the bytes of ``qtype``,
    ``[rows, cols / 256 * type_size]``."""
    rows, cols = x.shape
    if cols % QK:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK} values, not {cols}")
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)
    n = b.shape[0]
    if qtype == Q.Q2_K:  # scales[16] (scale | min << 4), qs[64], d, dmin
        d, dmin, sc, mn, q = _scale_and_min(b.reshape(n, 16, 16), 4, 4)
        parts = [(sc | (mn << 4)).astype(np.uint8), _bit_planes(q.reshape(n, QK), 4, 2), d, dmin]
    elif qtype == Q.Q3_K:  # hmask[32], qs[64], scales[12], d
        d, sc, q = _symmetric(b.reshape(n, 16, 16), -4, 3, 6)
        q = q.reshape(n, QK)
        high = (q >= 0).astype(np.uint8)  # set: the code as it is; clear: 4 less
        low = np.where(q >= 0, q, q + 4)
        hmask = np.zeros((n, 32), np.uint8)
        for bit in range(8):
            hmask |= high[:, 32 * bit : 32 * bit + 32] << np.uint8(bit)
        u = (sc + 32).astype(np.uint8)
        scales = np.empty((n, 12), np.uint8)
        scales[:, :8] = (u[:, :8] & 0xF) | ((u[:, 8:] & 0xF) << 4)
        hi2 = u >> 4
        scales[:, 8:] = hi2[:, 0:4] | (hi2[:, 4:8] << 2) | (hi2[:, 8:12] << 4) | (hi2[:, 12:] << 6)
        parts = [hmask, _bit_planes(low, 4, 2), scales, d]
    elif qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin, scales[12], (qh[32]), qs[128]
        levels = 16 if qtype == Q.Q4_K else 32
        d, dmin, sc, mn, q = _scale_and_min(b.reshape(n, 8, 32), levels, 6)
        q = q.reshape(n, QK)
        parts = [d, dmin, _q4_k_scales(sc, mn)]
        if qtype == Q.Q5_K:
            qh = np.zeros((n, 32), np.uint8)
            for sub in range(8):
                qh |= ((q[:, 32 * sub : 32 * sub + 32] >> 4) & 1).astype(np.uint8) << np.uint8(sub)
            parts.append(qh)
        parts.append(_bit_planes(q & 0xF, 2, 4))
    elif qtype == Q.Q6_K:  # ql[128], qh[64], scales[16] int8, d
        d, sc, q = _symmetric(b.reshape(n, 16, 16), -32, 31, 8)
        u = (q.reshape(n, QK) + 32).astype(np.uint8)
        # element 128 h + 64 k + j: low nibble k of ql byte 64 h + j; its top two bits at
        # 2 s of qh byte 32 h + l, for element 128 h + 32 s + l
        halves = u.reshape(n, 2, 2, 64)
        ql = (halves[:, :, 0] & 0xF) | ((halves[:, :, 1] & 0xF) << 4)
        top = (u >> 4).reshape(n, 2, 4, 32)
        qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d]
    else:
        raise ValueError(f"not a super-block type: {qtype.name}")
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
    return out.reshape(rows, -1)


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 ``[rows, cols]`` as ``qtype``'s bytes (F16 as float16 values)."""
    if qtype in SUPER_BLOCK_TYPES:
        return quantize_super_blocks(x, qtype)
    if qtype == Q.F16:
        return x.astype(np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for name, field in reader.fields.items():
        # the file type names the old mix (a label the library shows): left out
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)


def requantized(src: Path, dst: Path, choose) -> dict[str, str]:
    """Copy the GGUF ``src`` to ``dst`` with each 2-D tensor in the type ``choose(name,
    cols)`` gives (None: its bytes as they are), from the `gguf` package's dequantization
    of the file's; the new type of each tensor changed, by name."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer)
    changed = {}
    for t in reader.tensors:
        shape = [int(v) for v in reversed(t.shape)]  # rows, cols
        qtype = choose(t.name, shape[-1]) if len(shape) == 2 else None
        if qtype is None or qtype == t.tensor_type:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=qtype)
        changed[t.name] = qtype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed
