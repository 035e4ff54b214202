"""Projections and embeddings on weights kept in their GGUF block format (issue 14).

:class:`BlockLinear` is the model's ``Linear`` for weights read in place from the mapped
file: one or several parts fused along the output dimension (q/k/v, gate/up), each a
:class:`~kernels.quant.weight.QuantWeight` of its own type (a Q4_K_M file mixes Q4_K and
Q6_K within a layer). The input is quantized to int8 once for all parts.
:class:`BlockEmbedding` dequantizes the rows a step looks up, never the table.

Which kernel runs depends on the number of rows only (never on what else is in the
batch): up to :data:`~kernels.quant.matmul.DECODE_MAX_ROWS` rows, the integer decode
kernel on two levels of int8 activations (:func:`two_level_activations`; per 256 for
the k-quant super-block kernels), whose row ``b``
depends on input row ``b`` alone; above, float32 tiles dequantized into a reused buffer
and torch's GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F

from kernels.quant.activations import (
    ACT_BLOCK,
    Q8Activations,
    Q8KActivations,
    quantize_super_blocks,
)
from kernels.quant.blocks import JIT
from kernels.quant.matmul import (
    DECODE_MAX_ROWS,
    decode_matmul,
    decode_tasks,
    dequantize_weight,
    prefill_matmul,
)
from kernels.quant.registry import ActivationFormat
from kernels.quant.simd import quantize32
from kernels.quant.weight import QuantWeight


class PartsLinear:
    """What the projections over file blocks share (here and on a device,
    kernels/quant/device_linear.py): ``parts`` with ``nbytes``, a bias, and no batch copies
    (the point is to keep only the file's bytes)."""

    __slots__ = ()

    def nbytes(self) -> int:
        n = sum(p.nbytes for p in self.parts)
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def add_batched(self) -> int:
        return 0

    def batched_bytes(self) -> int:
        return 0


class BlockLinear(PartsLinear):
    """``y = x W^T (+ b)``, ``W`` the concatenation of ``parts`` along the output dim.

    ``perm`` (optional, int64 ``[N]``) reorders the output columns after the product:
    llama.cpp stores the q/k rows of ``llama`` models permuted per head, and permuting the
    outputs leaves the file's bytes untouched (no copy at load).
    """

    __slots__ = (
        "parts",
        "bias",
        "perm",
        "batched",
        "in_features",
        "out_features",
        "_per32",
        "_groups",
    )

    def __init__(
        self,
        parts: list[QuantWeight],
        bias: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
    ):
        if not parts:
            raise ValueError("BlockLinear needs at least one weight")
        k = parts[0].in_features
        if any(p.in_features != k for p in parts):
            raise ValueError(f"fused weights disagree on in_features: {[p.shape for p in parts]}")
        self.parts = list(parts)
        self.in_features = k
        self.out_features = sum(p.out_features for p in parts)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        if perm is not None and perm.shape != (self.out_features,):
            raise ValueError(f"perm of shape {tuple(perm.shape)} for {self.out_features} outputs")
        self.bias = bias
        self.perm = perm
        # whether any part's kernel reads activations per 32 (else only super-blocks are made)
        self._per32 = any(
            not p.is_float and p.kind.activation is ActivationFormat.Q8_32 for p in parts
        )
        self._groups = _decode_groups(self.parts)
        self.batched = None  # no bf16 copies: the point is to keep only the file's bytes

    def __call__(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        """``x [..., K]`` -> float32 ``[..., N]``; ``bf16`` is ignored (``Linear``'s
        signature: only int4 weights keep batch copies)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = self._matmul(x2.contiguous())
        if self.perm is not None:
            y = y.index_select(1, self.perm)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= DECODE_MAX_ROWS:
            return self._decode(x)
        # float32 tiles: exact products of the dequantized weights (bf16 tiles round
        # every output to 8 bits of mantissa: SmolLM2's argmax then moved at 2% of
        # the positions of a 512-token text, against none in float32). Each part into
        # its columns of one output, not concatenated after (at a 512-token prefill of
        # the Qwen2-7B shape, gate and up are 78 MB, which a copy would double).
        if len(self.parts) == 1 and self.parts[0].is_float:
            return _float_part(x, self.parts[0])
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        first = 0
        for p in self.parts:
            cols = out[:, first : first + p.shape[0]]
            if p.is_float:
                cols.copy_(_float_part(x, p))
            else:
                prefill_matmul(x, p, dtype=torch.float32, out=cols)
            first += p.shape[0]
        return out

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """Two levels of int8 activations; each group of parts in one kernel call that
        writes its columns of the output (the levels summed in the kernel), the other
        parts one call each."""
        rows = x.shape[0]
        out = np.empty((rows, self.out_features), np.float32)
        act = (
            two_level_activations(x.numpy())
            if self._per32
            else quantize_super_blocks(x.numpy(), levels=2)
        )
        for group in self._groups:
            cols = out[:, group.first : group.first + group.columns]
            if group.table is not None:
                ka = act if isinstance(act, Q8KActivations) else act.super_blocks()
                kind = group.parts[0].kind
                q, d, bsum = ka.kernel_args(kind.activation_order, kind.sub_block, paired=True)
                kind.decode_parts(group.table, group.row_bytes, 2, q, d, bsum, cols, decode_tasks())
                continue
            (part,) = group.parts
            if part.is_float:
                cols[:] = _float_part(x, part).numpy()
            else:
                y = decode_matmul(act, part)
                np.add(y[:rows], y[rows:], out=cols)
        return torch.from_numpy(out)


@dataclass(frozen=True)
class _Group:
    """Output columns ``first .. first + columns`` of a :class:`BlockLinear`: consecutive
    parts of one super-block type, multiplied in one call through their row table
    (``table``: int64 ``[P, 2]``, each part's first-row address and row count), or a
    single part of any other type (``table`` None)."""

    parts: tuple[QuantWeight, ...]
    first: int
    columns: int
    row_bytes: int = 0
    table: np.ndarray | None = None


def _decode_groups(parts: list[QuantWeight]) -> list[_Group]:
    groups: list[_Group] = []
    run: list[QuantWeight] = []
    first = 0

    def fusable(p: QuantWeight) -> bool:
        return not p.is_float and p.kind.decode_parts is not None and p.data.flags.c_contiguous

    def close_run():
        nonlocal first, run
        if run:
            table = np.array([[p.data.ctypes.data, p.out_features] for p in run], np.int64)
            columns = sum(p.out_features for p in run)
            groups.append(_Group(tuple(run), first, columns, run[0].data.shape[1], table))
            first += columns
            run = []

    for p in parts:
        if fusable(p) and (not run or run[0].qtype == p.qtype):
            run.append(p)
            continue
        close_run()
        if fusable(p):
            run.append(p)
            continue
        groups.append(_Group((p,), first, p.out_features))
        first += p.out_features
    close_run()
    return groups


def two_level_activations(x: np.ndarray) -> Q8Activations:
    """``x [B, K]`` as int8 activations of ``2B`` rows: ``x`` itself, then what its int8
    rounding left (``x`` minus the dequantized first rows), so that rows ``b`` and
    ``B + b`` of a product sum to ``W x_b`` within about 1/127 of the int8 error.

    One level of int8 per 32 is what llama.cpp multiplies by; on SmolLM2 it moved the
    argmax against exact weights at 4% of the positions of a 512-token text (relative
    error of the leading logit 0.7%); two levels at none (3e-5). The kernel unpacks each
    weight row once for all activation rows, so the second level costs dot products, not
    weight reads. One numba call (three numpy calls and two quantizations took 21 us).
    The super-block format of the same two levels (Q4_K / Q6_K kernels) is made from
    ``x`` on first use; a projection of those types alone makes only that one
    (:func:`~kernels.quant.activations.quantize_super_blocks`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b, k = x.shape
    if k % ACT_BLOCK:
        raise ValueError(f"activations must be [B, K] with K a multiple of 32, got {x.shape}")
    act = Q8Activations(
        np.empty((2 * b, k), np.int8),
        np.empty((2 * b, k // 32), np.float32),
        np.empty((2 * b, k // 16), np.float32),
        np.empty((2 * b, k // 32), np.float32),
    )
    _two_level(x, act.q, act.scale, act.sum16, act.sum32)
    act.source, act.levels = x, 2
    return act


@numba.njit(**JIT)
def _two_level(x, q, scale, sum16, sum32):
    batch, k = x.shape
    four = np.empty(4, np.float32)
    rest = np.empty(32, np.float32)
    for b in range(batch):
        x_at = x[b].ctypes.data
        for level in range(2):
            row = b + level * batch
            q_at = q[row].ctypes.data
            for blk in range(k // 32):
                if level == 0:
                    src = x_at + 128 * blk
                else:
                    d = scale[b, blk]
                    for i in range(32):
                        rest[i] = x[b, 32 * blk + i] - np.float32(q[b, 32 * blk + i]) * d
                    src = rest.ctypes.data
                quantize32(src, q_at + 32 * blk, four.ctypes.data)
                scale[row, blk] = four[0]
                sum16[row, 2 * blk] = four[1]
                sum16[row, 2 * blk + 1] = four[2]
                sum32[row, blk] = four[3]


def _float_part(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """F32 as it is; F16 / BF16 through float32 tiles (exact: computing in half
    precision rounds the activations and every output)."""
    wt = w.float_tensor()
    if wt.dtype == torch.float32:
        return F.linear(x, wt)
    return prefill_matmul(x, w, dtype=torch.float32)


class BlockEmbedding:
    """Token rows of a ``[vocab, hidden]`` table in its file format, dequantized (float32)
    when looked up."""

    __slots__ = ("weight",)

    def __init__(self, weight: QuantWeight):
        self.weight = weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weight
        index = tokens.reshape(-1).numpy()
        if index.size == 0:
            return torch.empty((*tokens.shape, w.in_features))
        if int(index.min()) < 0 or int(index.max()) >= w.out_features:
            raise IndexError(f"token id outside the vocabulary of {w.out_features:,}")
        if w.is_float:
            rows = F.embedding(torch.from_numpy(index), w.float_tensor()).float()
        else:
            picked = np.ascontiguousarray(w.data[index])
            rows = dequantize_weight(
                QuantWeight.from_raw(picked, w.qtype, (index.size, w.in_features))
            )
        return rows.reshape(*tokens.shape, w.in_features)

    def nbytes(self) -> int:
        return self.weight.nbytes
