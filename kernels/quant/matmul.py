"""``quant_matmul``: activations times a weight kept in its GGUF block format.

Two paths, picked by the number of activation rows ``B``:

* decode (``B <= DECODE_MAX_ROWS``): the activations are quantized once to int8, per 32 or
  per 256 as the type's kernel wants (:mod:`kernels.quant.activations`), then the decode
  kernel reads each weight row once and dots it with every activation row in integers
  (``vpdpbusd`` where the CPU has VNNI): Q4_K and Q6_K unpacked in registers
  (:mod:`kernels.quant.superblock`), as are the blocks of 32 (:mod:`kernels.quant.block32`),
  the other k-quants into a cache-resident buffer. Row ``b`` of the result depends only
  on row ``b`` of ``x``: the same bits for any batch.
* prefill (larger ``B``): tiles of weight rows (:data:`PREFILL_TILE_BYTES`) are dequantized
  into a reused buffer (bf16 where the CPU has native bf16 dot products, else float32) and
  multiplied by torch's GEMM; the activations stay in float.

The float types (F32, F16, BF16) are multiplied by torch directly on a view of their bytes.
"""

from __future__ import annotations

import functools

import llvmlite.binding as llvm
import numba
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from kernels.quant.activations import (
    Q8Activations,
    Q8KActivations,
    quantize_activations,
    quantize_super_blocks,
    two_level_activations,
)
from kernels.quant.block32 import BLOCK32_CODES, WIDE32
from kernels.quant.lanes import lanes_supported
from kernels.quant.registry import ActivationFormat, QuantType
from kernels.quant.superblock import FEW_TOKENS, KBLOCK_CODES, KBLOCK_KINDS, wide_levels
from kernels.quant.weight import QuantWeight

__all__ = [
    "COMMON_TYPES",
    "DECODE_MAX_ROWS",
    "PREFILL_TILE_BYTES",
    "decode_matmul",
    "dequantize_weight",
    "prefill_matmul",
    "quant_matmul",
    "warm_up",
]

# Up to here every activation row is dotted with each unpacked weight row (issue 14: batch
# 1-32 reads each block once); beyond it a GEMM on dequantized tiles wins (bench.py).
DECODE_MAX_ROWS = 32
# Bytes of dequantized weight per tile. Each GEMM call repacks its activations for oneDNN,
# so tiles must not be small: 4096 x 4096 Q4_K, B = 512, 2 threads (bench.py): 128-row
# tiles 4x, 256 2x, 1024 1.2x the time of one call on the whole dequantized matrix.
PREFILL_TILE_BYTES = 8 << 20
TASKS_PER_THREAD = 4


# Row ranges per kernel call: a few per thread numba may run (fixed at import, since
# numba.get_num_threads() costs microseconds per call; fewer active threads just take
# more ranges each).
_TASKS = numba.config.NUMBA_NUM_THREADS * TASKS_PER_THREAD


def decode_tasks() -> int:
    return _TASKS


@functools.cache
def prefill_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies it natively (AVX512-BF16 / AMX), else float32."""
    f = {name for name, on in llvm.get_host_cpu_features().items() if on}
    return torch.bfloat16 if f & {"avx512bf16", "amx-bf16"} else torch.float32


def decode_matmul(
    act: Q8Activations | Q8KActivations, w: QuantWeight, out: np.ndarray | None = None
) -> np.ndarray:
    """float32 ``[B, N]`` from activations already quantized (share one ``act`` between
    the weights that read the same input). ``Q8KActivations`` serve only the types whose
    kernels read super-blocks (``ActivationFormat.Q8_256``)."""
    kind = w.kind
    b, k = act.shape
    if k != w.in_features:
        raise ValueError(f"activations have {k} features, weight {w.shape} expects {w.in_features}")
    if out is None:
        out = np.empty((b, w.out_features), np.float32)
    if isinstance(act, Q8KActivations) and kind.activation is not ActivationFormat.Q8_256:
        raise ValueError(f"{kind.name} reads activations per 32, not super-blocks")
    if kind.activation is ActivationFormat.Q8_256:
        ka = act if isinstance(act, Q8KActivations) else act.super_blocks()
        kind.decode(
            w.data, *ka.kernel_args(kind.activation_order, kind.sub_block), out, decode_tasks()
        )
        return out
    xsum = act.sum16 if kind.sub_block == 16 else act.sum32
    kind.decode(w.data, act.q, act.scale, xsum, out, decode_tasks())
    return out


def parts_kernel_args(
    kind: QuantType, act: Q8Activations | Q8KActivations, tokens: int
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(levels, codes, scales, sums) of ``tokens`` rows of two-level activations as
    ``kind.decode_parts`` reads them: for the blocks of 32 (:mod:`kernels.quant.block32`)
    the two levels as one int16 per element with the sums of both (``levels`` WIDE32);
    for the other per-32 readers (Q2_K, Q3_K, Q5_K) the levels as rows of their own with
    their float sums (``levels`` 2); in super-blocks with the paired integer sums, the
    codes as int16 where :func:`~kernels.quant.superblock.wide_levels` says so (``levels``
    WIDE or WALKED, else 2)."""
    if kind.activation is not ActivationFormat.Q8_256:
        if isinstance(act, Q8KActivations) or act.levels != 2:
            raise ValueError(f"{kind.name} reads two levels of activations per 32")
        if kind.name in BLOCK32_CODES:  # both levels as one int16, their sums per 32
            return WIDE32, act.widened(), act.scale, act.pair32
        return 2, act.q, act.scale, act.sum16 if kind.sub_block == 16 else act.sum32
    ka = act if isinstance(act, Q8KActivations) else act.super_blocks()
    q, d, bsum = ka.kernel_args(kind.activation_order, kind.sub_block, paired=True)
    levels = wide_levels(kind.name, tokens)
    if levels != 2:
        return levels, ka.widened(kind.activation_order), d, bsum
    return 2, q, d, bsum


def prompt_kernel_args(
    kind: QuantType, ka: Q8KActivations
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int16 activations, scales, scaled sums) of two-level super-block activations as
    ``kind.prompt_parts`` reads them (:func:`~kernels.quant.lanes.lane_rows`): the tokens'
    int16 codes in the kind's order, their second level's scale per 256, and for a kind
    with offsets (Q4_K) their paired sums per 32 times that scale (float32, the paired sums
    exact: |sum| < 2^24)."""
    tokens = ka.q.shape[0] // 2
    xd = ka.d[tokens:]
    if not KBLOCK_KINDS[KBLOCK_CODES[kind.name]][4]:  # offsets per 32 (no zero point)
        bx = ka.pair32.astype(np.float32) * np.repeat(xd, 8, axis=1)
    else:  # a zero point (Q6_K): no offsets to sum
        bx = np.zeros((tokens, 1), np.float32)
    return ka.widened(kind.activation_order), xd, bx


def dequantize_weight(
    w: QuantWeight,
    first: int = 0,
    rows: int | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``first .. first + rows`` of the weight as ``dtype`` (float32 or bf16)."""
    n, k = w.shape
    rows = n - first if rows is None else rows
    if out is None:
        out = torch.empty((rows, k), dtype=dtype)
    if w.is_float:
        out.copy_(w.float_tensor()[first : first + rows])
        return out
    if out.dtype == torch.bfloat16:
        w.kind.dequant(
            w.data,
            first,
            np.empty((0, k), np.float32),
            out.view(torch.int16).numpy().view(np.uint16),
            decode_tasks(),
        )
    elif out.dtype == torch.float32:
        w.kind.dequant(w.data, first, out.numpy(), np.empty((0, k), np.uint16), decode_tasks())
    else:
        raise ValueError(f"dequantize_weight: dtype must be float32 or bfloat16, got {out.dtype}")
    return out


def prefill_tile_rows(k: int, dtype: torch.dtype) -> int:
    """Rows per tile for in_features ``k``: :data:`PREFILL_TILE_BYTES`, a multiple of 64."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(64, PREFILL_TILE_BYTES // (k * itemsize) // 64 * 64)


def prefill_matmul(
    x: torch.Tensor,
    w: QuantWeight,
    tile_rows: int | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``[B, N]`` through dequantized weight tiles and torch's GEMM; into ``out``
    (float32 ``[B, N]``, a view of a wider output) when given."""
    dtype = dtype or prefill_dtype()
    n, k = w.shape
    tile_rows = tile_rows or prefill_tile_rows(k, dtype)
    xd = x.to(dtype)
    out = torch.empty((x.shape[0], n), dtype=torch.float32) if out is None else out
    buf = torch.empty((min(tile_rows, n), k), dtype=dtype)
    for first in range(0, n, tile_rows):
        rows = min(tile_rows, n - first)
        tile = dequantize_weight(w, first, rows, dtype, buf[:rows])
        # F.linear, not mm(tile, x.t()): a transposed operand made oneDNN 3.6x slower here
        out[:, first : first + rows] = F.linear(xd, tile)
    return out


def _float_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    wt = w.float_tensor()
    if w.qtype == GGMLQuantizationType.F32:
        return F.linear(x, wt)
    return F.linear(x.to(wt.dtype), wt).float()


def quant_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """``x @ W.T`` for float32 ``x [B, K]``: float32 ``[B, N]`` (see the module docstring)."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"quant_matmul: x must be [B, {w.in_features}], got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError("quant_matmul runs on CPU tensors")
    if w.is_float:
        return _float_matmul(x.float(), w)
    if x.shape[0] > DECODE_MAX_ROWS:
        return prefill_matmul(x, w)
    act = quantize_activations(x.detach().float().numpy())
    return torch.from_numpy(decode_matmul(act, w))


# The block types of the common K-quant mixes (Q4_K_M, Q5_K_M: Q4_K/Q5_K with Q6_K, Q8_0
# and Q5_0 tensors): what an installer would compile ahead.
COMMON_TYPES = (
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_K,
)


def warm_up(qtypes=COMMON_TYPES) -> None:
    """Compile (or load from numba's cache) the decode and dequantize kernels of
    ``qtypes``: a few seconds per type the first time on a 2-core machine, then a fraction
    of a second from the cache."""
    from kernels.quant.amx import AMX_TOKENS, amx_ready
    from kernels.quant.registry import quant_type
    from kernels.quant.superblock import KBLOCK_CODES
    from kernels.quant.tiles import repack_parts, tile_rows, tiles_supported
    from kernels.quant.tiles32 import CODES as TILES32
    from kernels.quant.tiles32 import tile_rows32

    for qtype in qtypes:
        kind = quant_type(qtype)
        k = 256
        raw = np.zeros((1, kind.row_bytes(k)), np.uint8)
        w = QuantWeight.from_raw(raw, qtype, (1, k))
        decode_matmul(quantize_activations(np.zeros((1, k), np.float32)), w)
        if kind.decode_parts is not None:  # the fused-parts kernel, two levels summed
            table = np.array([[w.data.ctypes.data, 1]], np.int64)
            # one token, a few, and more: each signature taken (int8 or int16 activations)
            seen = set()
            for tokens in (1, 2, FEW_TOKENS + 1):
                act = two_level_activations(np.zeros((tokens, k), np.float32))
                levels, *args = parts_kernel_args(kind, act, tokens)
                if args[0].dtype in seen:
                    continue
                seen.add(args[0].dtype)
                # into a whole output, and into some columns of one (a projection of
                # mixed types: numba compiles each memory layout apart)
                for out in (
                    np.empty((tokens, 1), np.float32),
                    np.empty((tokens, 2), np.float32)[:, :1],
                ):
                    kind.decode_parts(table, w.data.shape[1], levels, *args, out, decode_tasks())
        if kind.prompt_parts is not None and lanes_supported(kind.name):
            tokens = DECODE_MAX_ROWS + 1  # a prompt's rows (kernels/quant/lanes.py)
            args = prompt_kernel_args(
                kind, quantize_super_blocks(np.zeros((tokens, k), np.float32), levels=2)
            )
            for out in (
                np.empty((tokens, 1), np.float32),
                np.empty((tokens, 2), np.float32)[:, :1],
            ):
                kind.prompt_parts(table, w.data.shape[1], *args, out, decode_tasks())
        if tiles_supported(kind.name):  # kernels/quant/tiles.py
            tiles = repack_parts([w.data], kind.name)
            # one token and a few (Q6_K's float steps: a kernel each), and (on AMX:
            # kernels/quant/amx.py) 16, where taken
            per32 = kind.name in TILES32  # kernels/quant/tiles32.py
            for tokens in (1, 2, AMX_TOKENS) if amx_ready() and not per32 else (1, 2):
                zeros = np.zeros((tokens, k), np.float32)
                act = two_level_activations(zeros) if per32 else quantize_super_blocks(zeros, 2)
                for out in (
                    np.empty((tokens, 1), np.float32),
                    np.empty((tokens, 2), np.float32)[:, :1],
                ):
                    if per32:
                        tile_rows32(kind.name, tiles, 1, act, out, decode_tasks())
                    else:
                        tile_rows(KBLOCK_CODES[kind.name], tiles, 1, act, out, decode_tasks())
        dequantize_weight(w, dtype=torch.bfloat16)
        dequantize_weight(w, dtype=torch.float32)
