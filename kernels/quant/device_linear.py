"""Projections and embeddings on GGUF block bytes held on a torch device (issue 18).

:class:`DeviceBlockLinear` is :class:`~kernels.quant.linear.BlockLinear` with each part's
bytes uploaded, as the file has them, to the device (a uint8 tensor ``[N, row_bytes]``)
and multiplied by the Triton kernels of :mod:`kernels.triton_quant`: up to
:data:`DECODE_MAX_ROWS` rows (decode, small batches) the fused dequantize-and-multiply
kernel in float32, above (prefill chunks) the weight dequantized to a reused fp16 buffer
and torch's matmul (:func:`split_half_matmul`). F32 / F16 / BF16 parts are plain tensors and torch's matmul.

Nothing here assumes CUDA: on the CPU under ``TRITON_INTERPRET=1`` the same code runs
through Triton's interpreter, which is how the CPU tests exercise the CUDA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.quant.linear import BlockEmbedding, BlockLinear, PartsLinear
from kernels.quant.weight import QuantWeight

DECODE_MAX_ROWS = 64  # beyond, dequantizing once to fp16 reads fewer bytes than 16-row tiles


@dataclass(frozen=True)
class DeviceWeight:
    """One weight on the device: the file's bytes (block types) or the float tensor."""

    data: torch.Tensor  # uint8 [N, row_bytes], or the float weight [N, K]
    qtype: int
    shape: tuple[int, int]
    is_float: bool

    @classmethod
    def upload(cls, w: QuantWeight, device: torch.device | str) -> DeviceWeight:
        """ValueError for a block type the Triton kernels do not read (before any byte is
        copied, so loading fails rather than the first reply)."""
        if not w.is_float:
            from kernels.triton_quant import TRITON_TYPES

            if int(w.qtype) not in TRITON_TYPES:
                raise ValueError(
                    f"{w.qtype.name} weights have no GPU kernel (the GPU reads Q4_0, Q4_1, "
                    "Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16 and F32); run this file on the CPU"
                )
        if w.is_float:
            data = w.float_tensor()
        else:
            data = torch.from_numpy(np.ascontiguousarray(w.data))  # a copy: the map is read-only
        return cls(data.to(device), int(w.qtype), w.shape, w.is_float)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class Uploads:
    """Each :class:`QuantWeight` uploaded once (a tied head shares the embedding's bytes)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._done: dict[int, tuple[QuantWeight, DeviceWeight]] = {}

    def __call__(self, w: QuantWeight) -> DeviceWeight:
        hit = self._done.get(id(w))
        if hit is None:
            hit = self._done[id(w)] = (w, DeviceWeight.upload(w, self.device))
        return hit[1]


class DeviceBlockLinear(PartsLinear):
    """``y = x W^T (+ b)`` over device parts fused along the output dim; ``perm`` as in
    :class:`~kernels.quant.linear.BlockLinear` (llama's q/k rows, undone on the outputs)."""

    __slots__ = ("parts", "bias", "perm", "in_features", "out_features", "batched", "_buffer")

    def __init__(
        self,
        parts: list[DeviceWeight],
        bias: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
    ):
        self.parts = list(parts)
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = bias
        self.perm = perm
        self.batched = None
        self._buffer: torch.Tensor | None = None  # the bf16 prefill tile, reused

    @classmethod
    def of(cls, linear: BlockLinear, uploads: Uploads) -> DeviceBlockLinear:
        device = uploads.device
        return cls(
            [uploads(p) for p in linear.parts],
            linear.bias.to(device) if linear.bias is not None else None,
            linear.perm.to(device) if linear.perm is not None else None,
        )

    def __call__(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        """``x [..., K]`` -> float32 ``[..., N]`` (``bf16``: ``Linear``'s signature, unused)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        decode = x2.shape[0] <= DECODE_MAX_ROWS
        outs = [self._part(x2, p, decode) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.perm is not None:
            y = y.index_select(1, self.perm)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _part(self, x: torch.Tensor, p: DeviceWeight, decode: bool) -> torch.Tensor:
        from kernels.triton_quant import triton_dequantize, triton_quant_matmul

        if p.is_float:
            return F.linear(x.to(p.data.dtype), p.data).float()
        if decode:
            return triton_quant_matmul(x, p.data, p.qtype, p.shape)
        n, k = p.shape
        if self._buffer is None or self._buffer.numel() < n * k:
            widest = max(q.shape[0] * q.shape[1] for q in self.parts)
            self._buffer = torch.empty(widest, dtype=torch.float16, device=x.device)
        w = triton_dequantize(p.data, p.qtype, p.shape, out=self._buffer[: n * k].view(n, k))
        return split_half_matmul(x, w)


def split_half_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``x [B, K]`` times the fp16 weight ``w [N, K]``, on fp16 tensor cores with
    float32 accumulation: each row scaled by a power of two into fp16's range, then split
    into a high and a low fp16 part (two products), so the activations keep about 22 bits
    and the weight's rounding to fp16 (11 bits) is what remains (with, on CUDA, the high
    product's output rounded to fp16 once: cuBLAS returns the inputs' dtype).

    Measured on the tiny Q4_K_M test model, 70-token prefill, relative error of the logits
    against exact weights: 0.109 with bf16 weights and activations, 0.0087 this way
    (tests/engine/test_device_path.py)."""
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(1, keepdim=True).clamp_min(1e-30))))
    x = x / scale
    high = x.to(torch.float16)
    low = (x - high.float()).to(torch.float16)
    y = F.linear(high, w, None).float() + F.linear(low, w, None).float()
    return y * scale


class DeviceBlockEmbedding:
    """Token rows of the table on the device, dequantized (float32) when looked up."""

    __slots__ = ("weight",)

    def __init__(self, weight: DeviceWeight):
        self.weight = weight

    @classmethod
    def of(cls, table: BlockEmbedding, uploads: Uploads) -> DeviceBlockEmbedding:
        return cls(uploads(table.weight))

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        from kernels.triton_quant import triton_dequantize

        w = self.weight
        index = tokens.reshape(-1).to(w.data.device)
        checkable = not (index.is_cuda and torch.cuda.is_current_stream_capturing())
        if checkable and index.numel() and (int(index.min()) < 0 or int(index.max()) >= w.shape[0]):
            raise IndexError(f"token id outside the vocabulary of {w.shape[0]:,}")
        picked = w.data.index_select(0, index)
        if w.is_float:
            rows = picked.float()
        elif index.numel() == 0:
            rows = torch.empty((0, w.shape[1]), device=w.data.device)
        else:
            rows = triton_dequantize(picked, w.qtype, (index.numel(), w.shape[1]), torch.float32)
        return rows.reshape(*tokens.shape, w.shape[1])

    def nbytes(self) -> int:
        return self.weight.nbytes
