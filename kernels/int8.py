"""Per-output-channel int8 weights on torch's CPU int8 matmul.

Used for the output head (the largest single matrix of small models: SmolLM2's is
49152 x 576), where it reads a quarter of the bytes of fp32 at decode time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    weight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N], in the compute dtype of the kernel (bf16)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * self.scales.element_size()


def int8_from_dense(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
    """Symmetric per-row quantization: q = round(w / s), s = max|w_row| / 127."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.to(dtype))


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype (bf16 activations inside the kernel: the fp32
    variant of torch's kernel is ~9x slower)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features).to(w.scales.dtype).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(x2, w.weight, w.scales)
    return y.reshape(*lead, w.out_features).to(x.dtype)
