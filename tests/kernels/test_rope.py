"""kernels.rope: a step's q/k heads rotated in place and its K/V rows stored, the same
bits as the model's torch RoPE and the cache's indexed write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.transformer import Rope, apply_rope
from kernels.rope import rope_and_store


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256)])
def test_rope_and_store_equal_torch_rope_and_indexed_write(heads, kv_heads, head_dim):
    torch.manual_seed(0)
    tokens = 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim) * 3
    positions = torch.tensor([0, 7, 300, 301, 4095])
    cos, sin = Rope(head_dim, 10000.0).tables(positions)
    pages, slots = torch.tensor([2, 0, 1, 1, 3]), torch.tensor([0, 5, 15, 14, 9])
    k_pages = torch.zeros(4, 16, kv_heads, head_dim)
    v_pages = torch.zeros(4, 16, kv_heads, head_dim)

    want_qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    want_k, want_v = k_pages.clone(), v_pages.clone()
    want_k[pages, slots] = want_qk[:, heads:]
    want_v[pages, slots] = qkv[:, heads + kv_heads :]

    got = qkv.clone()
    stores = (k_pages.numpy(), v_pages.numpy())
    rope_and_store(
        got.numpy(),
        cos.numpy(),
        sin.numpy(),
        heads + kv_heads,
        stores,
        pages.numpy(),
        slots.numpy(),
    )
    assert torch.equal(got[:, : heads + kv_heads], want_qk)
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])
    assert torch.equal(k_pages, want_k) and torch.equal(v_pages, want_v)

    alone = qkv[3:4].clone()
    rope_and_store(alone.numpy(), cos[3:4].numpy(), sin[3:4].numpy(), heads + kv_heads)
    assert torch.equal(alone[0], got[3])


def test_head_norms_before_the_rotation():
    """Models with q/k norms (Gemma 3, Qwen3): each rotated head RMS-normed by its weight
    first, within float32 rounding of torch's norm."""
    import torch.nn.functional as F

    torch.manual_seed(1)
    heads, kv_heads, head_dim = 4, 1, 256
    qkv = torch.randn(3, heads + 2 * kv_heads, head_dim) * 5
    q_norm, k_norm = 1 + 0.1 * torch.randn(head_dim), 1 + 0.1 * torch.randn(head_dim)
    cos, sin = Rope(head_dim, 1e6).tables(torch.tensor([1, 50, 9000]))
    normed = torch.cat(
        (
            F.rms_norm(qkv[:, :heads], (head_dim,), q_norm, 1e-6),
            F.rms_norm(qkv[:, heads : heads + kv_heads], (head_dim,), k_norm, 1e-6),
        ),
        dim=1,
    )
    want = apply_rope(normed, cos, sin)
    got = qkv.clone()
    norms = (heads, q_norm.numpy(), k_norm.numpy(), 1e-6)
    rope_and_store(got.numpy(), cos.numpy(), sin.numpy(), heads + kv_heads, head_norms=norms)
    assert torch.allclose(got[:, : heads + kv_heads], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])


def test_rope_and_store_refuses_what_it_cannot_write():
    qkv = np.zeros((1, 5, 64), np.float32)
    table = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        rope_and_store(qkv[:, ::2], table, table, 3)
    pages = np.zeros((2, 16, 2, 64), np.float32)  # two kv heads; qkv has one
    index = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="do not hold 1 heads"):
        rope_and_store(qkv, table, table, 4, (pages, pages), index, index)
