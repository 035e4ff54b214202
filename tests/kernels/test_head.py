"""The int8 matmul and the rescored output head."""

from __future__ import annotations

import pytest
import torch

from kernels.head import RescoredHead
from kernels.int8 import int8_from_dense, int8_linear


def _weights(n: int = 4096, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def test_int8_linear_close_to_dense():
    w = _weights()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    ref = x @ w.T
    out = int8_linear(x, int8_from_dense(w))
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_rescored_head_is_exact_on_its_leading_logits(bits):
    w = _weights()
    head = RescoredHead(w, bits=bits, rescore=64)
    x = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(2))
    ref = x @ w.T
    out = head(x)
    assert out.shape == ref.shape
    top = ref.topk(16, dim=-1).indices
    # The true leading logits fall inside the rescored 64 and are recomputed from the
    # fp32 weights: exact, not approximate.
    assert torch.allclose(out.gather(-1, top), ref.gather(-1, top), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # Everything else carries the quantized copy's error, bounded.
    assert (out - ref).norm() / ref.norm() < (0.15 if bits == 4 else 0.02)
    assert head.nbytes() < w.numel() * 4 / (3 if bits == 8 else 6)


def test_rescored_head_rejects_other_widths():
    with pytest.raises(ValueError, match="4 or 8"):
        RescoredHead(_weights(64, 64), bits=6)
