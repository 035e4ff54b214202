"""Matrix products on GGUF block bytes as Triton kernels (issue 18, the CUDA path).

The weight stays as the file has it: its bytes uploaded once as a uint8 tensor
``[N, row_bytes]`` on the device, never repacked or widened. Two kernels read it:

* :func:`triton_quant_matmul`: decode and small batches, ``y = x W^T`` with ``x`` in
  float32 (not rounded to int8 as the CPU kernels do: a GPU has the arithmetic to spare),
  accumulated in float32. A program dequantizes a ``[BLOCK_N, BLOCK_K]`` tile once and
  multiplies it by each of up to ``BLOCK_B`` activation rows with the same reduction, so
  a row's result does not depend on the batch it is in.
* :func:`triton_dequantize`: tiles of the weight dequantized to fp16 / bf16 (or float32)
  into a buffer, for prefill through torch's matmul.

Each type's blocks are unpacked by :func:`_dequant_blocks` (``ggml-quants.c``'s
``dequantize_row_*``): a tile of whole blocks, each block's scale fields read once and its
code bytes as one contiguous run, the nibbles and high bits put in element order in
registers (``tl.join`` / ``tl.permute`` / ``tl.reshape``); both kernels share it. Tested against ``gguf.quants.dequantize`` under
``TRITON_INTERPRET=1`` (tests/kernels/test_triton_quant.py); whether this gather form
reaches the GPU's bandwidth is what the device check (tools/device_check.sh) measures.

Whether the interpreter is used is decided by ``TRITON_INTERPRET`` when this module is
imported (as for :mod:`kernels.triton_paged_attention`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "TRITON_TYPES", "triton_dequantize", "triton_quant_matmul"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# GGML type ids (gguf.GGMLQuantizationType) and their (elements, bytes) per block; kept here
# so that the CUDA path needs no gguf import.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
TRITON_TYPES: dict[int, tuple[int, int]] = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}
DECODE_BLOCK_N = 16  # weight rows per program of the decode kernel
DECODE_BLOCK_B = 16  # activation rows per program: each weight tile is dequantized once for them


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at byte address ``ptr`` (gathered byte by byte: block fields
    are only 2-byte aligned) as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(sc_ptr, j, mask):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block ``j`` (ggml's get_scale_min_k4)."""
    low = j < 4
    a = _u8(sc_ptr + j, mask)  # scales[j]
    b = _u8(sc_ptr + j + 4, mask & low)  # scales[j + 4]
    c = _u8(sc_ptr + tl.where(low, j, j + 4), mask)  # scales[j + 4] for j >= 4
    e = _u8(sc_ptr + tl.where(low, j, j - 4), mask)  # scales[j - 4] for j >= 4
    scale = tl.where(low, a & 63, (c & 0xF) | ((e >> 6) << 4))
    minimum = tl.where(low, b & 63, (c >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _nibbles(byte, BN: tl.constexpr, NB: tl.constexpr, LEAD: tl.constexpr, LANES: tl.constexpr):
    """``byte [BN, NB, LEAD, LANES]``'s low nibbles, then its high ones, per lead index:
    ``[BN, NB, LEAD * 2, LANES]`` (GGUF's 4-bit layouts put the low nibbles of a run of
    bytes first, the high nibbles of the same bytes next)."""
    both = tl.join(byte & 0xF, byte >> 4)  # [BN, NB, LEAD, LANES, 2]
    return tl.reshape(tl.permute(both, (0, 1, 2, 4, 3)), (BN, NB, LEAD * 2, LANES))


@triton.jit
def _dequant_blocks(
    rows_ptr,
    first,
    blocks,
    row_ok,
    QTYPE: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BN: tl.constexpr,
    NB: tl.constexpr,
):
    """float32 ``[BN, NB * block]``: blocks ``first .. first + NB`` (of ``blocks`` per row)
    of the rows starting at byte addresses ``rows_ptr [BN]``. Each block's scale fields
    are read once, its code bytes as one contiguous run, then unpacked in registers
    (ggml-quants.c's ``dequantize_row_*``, element for element)."""
    index = first + tl.arange(0, NB)
    blk = rows_ptr[:, None] + index.to(tl.int64)[None, :] * TYPE_SIZE  # [BN, NB]
    ok = row_ok[:, None] & (index < blocks)[None, :]
    ok3 = ok[:, :, None]
    if QTYPE == 8:  # Q8_0: d, qs[32] int8
        lane = tl.arange(0, 32)
        q = tl.load(blk[:, :, None] + 2 + lane[None, None, :], mask=ok3, other=0)
        w = _f16(blk, ok)[:, :, None] * q.to(tl.int8, bitcast=True).to(tl.float32)
        return tl.reshape(w, (BN, NB * 32))
    elif QTYPE == 2 or QTYPE == 3:  # Q4_0: d, qs[16]; Q4_1: d, m, qs[16]
        lane = tl.arange(0, 16)
        start = 2 if QTYPE == 2 else 4
        qs = _u8(blk[:, :, None, None] + start + lane[None, None, None, :], ok3[:, :, :, None])
        q = tl.reshape(_nibbles(qs, BN, NB, 1, 16), (BN, NB, 32)).to(tl.float32)
        d = _f16(blk, ok)[:, :, None]
        if QTYPE == 2:
            w = d * (q - 8.0)
        else:
            w = d * q + _f16(blk + 2, ok)[:, :, None]
        return tl.reshape(w, (BN, NB * 32))
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, scales[12], (qh[32],) qs[128]
        sub = tl.arange(0, 8)
        scale, minimum = _k_scale_min(blk[:, :, None] + 4, sub[None, None, :], ok3)
        chunk = tl.arange(0, 4)
        lane = tl.arange(0, 32)
        start = 16 if QTYPE == 12 else 48
        offsets = chunk[:, None] * 32 + lane[None, :]  # qs[32 c + l]: chunk c of 64 elements
        qs = _u8(blk[:, :, None, None] + start + offsets[None, None], ok3[:, :, :, None])
        q = _nibbles(qs, BN, NB, 4, 32)  # [BN, NB, 8 sub-blocks, 32]
        if QTYPE == 13:
            qh = _u8(blk[:, :, None] + 16 + lane[None, None, :], ok3)  # [BN, NB, 32]
            q = q | (((qh[:, :, None, :] >> sub[None, None, :, None]) & 1) << 4)
        d = _f16(blk, ok)[:, :, None, None]
        dmin = _f16(blk + 2, ok)[:, :, None, None]
        w = d * scale[:, :, :, None] * q.to(tl.float32) - dmin * minimum[:, :, :, None]
        return tl.reshape(w, (BN, NB * 256))
    else:  # Q6_K: ql[128], qh[64], scales[16] int8, d; element 128 n + 32 p + l
        two = tl.arange(0, 2)
        lane = tl.arange(0, 32)
        ok5 = ok[:, :, None, None, None]
        # ql[64 n + 32 (p % 2) + l] holds p = 0, 1 in its low nibble and p = 2, 3 in its high
        ql_at = two[:, None, None] * 64 + two[None, :, None] * 32 + lane[None, None, :]
        ql = _u8(blk[:, :, None, None, None] + ql_at[None, None], ok5)  # [BN, NB, 2, 2, 32]
        both = tl.join(ql & 0xF, ql >> 4)  # [BN, NB, n, p % 2, l, p // 2]
        low = tl.reshape(tl.permute(both, (0, 1, 2, 5, 3, 4)), (BN, NB, 2, 4, 32))
        qh_at = two[:, None] * 32 + lane[None, :]
        qh = _u8(blk[:, :, None, None] + 128 + qh_at[None, None], ok[:, :, None, None])
        quarter = tl.arange(0, 4)
        high = (qh[:, :, :, None, :] >> (2 * quarter)[None, None, None, :, None]) & 3
        q = ((low | (high << 4)) - 32).to(tl.float32)  # [BN, NB, 2, 4, 32]
        sc = tl.load(blk[:, :, None] + 192 + tl.arange(0, 16)[None, None, :], mask=ok3, other=0)
        sc = tl.reshape(sc.to(tl.int8, bitcast=True).to(tl.float32), (BN, NB, 2, 4, 2, 1))
        sc = tl.reshape(tl.broadcast_to(sc, (BN, NB, 2, 4, 2, 16)), (BN, NB, 2, 4, 32))
        w = _f16(blk + 208, ok)[:, :, None, None, None] * sc * q
        return tl.reshape(w, (BN, NB * 256))


@triton.jit
def _decode_kernel(
    w_ptr,
    x_ptr,
    y_ptr,
    N,
    K,
    B,
    row_bytes,
    stride_x,
    stride_y,
    QTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Up to ``BLOCK_B`` activation rows (program axis 1) times ``BLOCK_N`` weight rows
    (axis 0). Each weight tile is dequantized once for all the rows; each row's products
    are then summed by the same code in the same order, whichever rows it shares the
    program with, so a row's result never depends on its batch (decode alone and decode
    batched give the same bits, as on the CPU)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * BLOCK_B
    count = tl.minimum(B - first, BLOCK_B)
    row_ok = rows < N
    rows_ptr = w_ptr + rows.to(tl.int64) * row_bytes
    slots = tl.arange(0, BLOCK_B)
    acc = tl.zeros((BLOCK_B, BLOCK_N), tl.float32)
    NB: tl.constexpr = BLOCK_K // BLOCK
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = _dequant_blocks(
            rows_ptr, k0 // BLOCK, K // BLOCK, row_ok, QTYPE, TYPE_SIZE, BLOCK_N, NB
        )
        for j in range(0, count):
            b = (first + j).to(tl.int64)
            x = tl.load(x_ptr + b * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)
            acc = tl.where(slots[:, None] == j, acc + part[None, :], acc)
    out = y_ptr + (first + slots).to(tl.int64)[:, None] * stride_y + rows[None, :]
    tl.store(out, acc, mask=(slots < count)[:, None] & row_ok[None, :])


@triton.jit
def _dequant_kernel(
    w_ptr,
    out_ptr,
    N,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """A ``[BLOCK_N, BLOCK_K]`` tile of the weight into ``out`` (float32 or fp16, or with
    ``BF16_BITS`` bf16 bit patterns in an int16 view, rounded to nearest even here: the
    interpreter's own cast truncates, so the CPU tests would not test what a GPU does)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (k < K)[None, :]
    rows_ptr = w_ptr + rows.to(tl.int64) * row_bytes
    NB: tl.constexpr = BLOCK_K // BLOCK
    w = _dequant_blocks(rows_ptr, k0 // BLOCK, K // BLOCK, rows < N, QTYPE, TYPE_SIZE, BLOCK_N, NB)
    out = out_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    if BF16_BITS:
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def _geometry(data: torch.Tensor, qtype: int, shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """(N, K, block, type_size), the bytes checked against the shape."""
    if int(qtype) not in TRITON_TYPES:
        names = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
        raise ValueError(
            f"no Triton kernel for GGUF type {int(qtype)}; supported: {', '.join(names.values())}"
        )
    block, type_size = TRITON_TYPES[int(qtype)]
    n, k = (int(s) for s in shape)
    if k % block:
        raise ValueError(f"rows of {k} elements are not whole blocks of {block}")
    if data.dtype != torch.uint8 or tuple(data.shape) != (n, k // block * type_size):
        raise ValueError(
            f"weight bytes must be uint8 [{n}, {k // block * type_size}], "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    if not data.is_contiguous():
        raise ValueError("weight bytes must be contiguous")
    return n, k, block, type_size


def _block_k(block: int) -> int:
    return 256 if block == 256 else 128


def triton_quant_matmul(
    x: torch.Tensor, data: torch.Tensor, qtype: int, shape: tuple[int, int]
) -> torch.Tensor:
    """float32 ``[B, N]`` = ``x [B, K] @ W.T``, ``W`` the GGUF blocks ``data`` (uint8
    ``[N, row_bytes]``, on ``x``'s device) of type ``qtype`` and shape ``(N, K)``."""
    n, k, block, type_size = _geometry(data, qtype, shape)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"activations must be [B, {k}], got {tuple(x.shape)}")
    if x.device != data.device:
        raise ValueError(f"activations on {x.device}, weights on {data.device}")
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    if rows == 0:
        return y
    grid = (triton.cdiv(n, DECODE_BLOCK_N), triton.cdiv(rows, DECODE_BLOCK_B))
    _decode_kernel[grid](
        data,
        x,
        y,
        n,
        k,
        rows,
        data.shape[1],
        x.stride(0),
        y.stride(0),
        int(qtype),
        block,
        type_size,
        BLOCK_N=DECODE_BLOCK_N,
        BLOCK_K=_block_k(block),
        BLOCK_B=DECODE_BLOCK_B,
    )
    return y


def triton_dequantize(
    data: torch.Tensor,
    qtype: int,
    shape: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` (bf16 or fp16 for prefill's matmul, each value
    rounded to nearest even; float32 exact), into ``out`` when given (a reused buffer of
    that shape and dtype)."""
    n, k, block, type_size = _geometry(data, qtype, shape)
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=data.device)
    elif tuple(out.shape) != (n, k) or not out.is_contiguous() or out.device != data.device:
        raise ValueError(f"out must be a contiguous [{n}, {k}] tensor on {data.device}")
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dequantize to bfloat16, float16 or float32, not {out.dtype}")
    bf16 = out.dtype == torch.bfloat16
    block_n, block_k = 16, _block_k(block)
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        data,
        out.view(torch.int16) if bf16 else out,
        n,
        k,
        data.shape[1],
        int(qtype),
        block,
        type_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BF16_BITS=bf16,
    )
    return out
