"""kernels.rope: a step's q/k heads rotated in place and its K/V rows stored, the same
bits as the model's torch RoPE and the cache's indexed write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.transformer import Rope, apply_rope
from kernels.rope import rope_and_store


def _host(pages: torch.Tensor) -> np.ndarray:
    """Pages as the cache hands them to the kernel: fp16 as uint16 bit patterns."""
    if pages.dtype == torch.float16:
        return pages.view(torch.int16).numpy().view(np.uint16)
    return pages.numpy()


# fp16 pages: the rows rounded to nearest (ties to even) by F16C, as torch's .half() rounds
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (5, 1, 40)])
def test_rope_and_store_equal_torch_rope_and_indexed_write(heads, kv_heads, head_dim, dtype):
    torch.manual_seed(0)
    tokens = 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim) * 3
    positions = torch.tensor([0, 7, 300, 301, 4095])
    cos, sin = Rope(head_dim, 10000.0).tables(positions)
    pages, slots = torch.tensor([2, 0, 1, 1, 3]), torch.tensor([0, 5, 15, 14, 9])
    k_pages = torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype)
    v_pages = torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype)

    want_qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    want_k, want_v = k_pages.clone(), v_pages.clone()
    want_k[pages, slots] = want_qk[:, heads:].to(dtype)
    want_v[pages, slots] = qkv[:, heads + kv_heads :].to(dtype)

    got = qkv.clone()
    stores = (_host(k_pages), _host(v_pages))
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
    wide = np.zeros((2, 16, 1, 64), np.float64)
    with pytest.raises(ValueError, match="float32 or fp16 bits, not float64"):
        rope_and_store(qkv, table, table, 4, (wide, wide), index, index)


def test_half_conversions_round_as_torch_on_every_kind_of_value():
    """floats_to_halves (the store of fp16 pages) rounds as torch's .half() on ties,
    subnormals, overflow, infinities and NaN; halves_to_floats widens every one of the
    65,536 bit patterns exactly (NaNs stay NaN)."""
    import numba

    from kernels.paged_attention import CPU_HALF_PAGES
    from kernels.quant.simd import floats_to_halves, halves_to_floats

    if not CPU_HALF_PAGES:
        pytest.skip("this CPU has no F16C: its caches keep fp32 pages")

    @numba.njit
    def narrow(x, out):
        floats_to_halves(x.ctypes.data, out.ctypes.data, x.shape[0])

    @numba.njit
    def widen(h, out):
        halves_to_floats(h.ctypes.data, out.ctypes.data, h.shape[0])

    every = np.arange(1 << 16, dtype=np.uint16)
    wide = np.empty(every.shape, np.float32)
    widen(every, wide)
    want = torch.from_numpy(every.view(np.int16)).view(torch.float16).float().numpy()
    assert np.array_equal(wide, want, equal_nan=True)
    assert np.array_equal(np.isnan(wide), np.isnan(want))

    rng = np.random.default_rng(3)
    # halfway between neighbouring halves (ties to even), around the subnormal range,
    # past the largest half, and a random spread of magnitudes; 16 at a time and a tail
    mid = (want[:-1:7].astype(np.float64) + want[1::7]) / 2
    edge = [65504.0, 65519.0, 65520.0, 1e6, -1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-9]
    spread = rng.standard_normal(5001) * np.exp(rng.uniform(-30, 12, 5001))
    x = np.concatenate([mid, edge, [np.inf, -np.inf, np.nan, -0.0], spread]).astype(np.float32)
    got = np.empty(x.shape, np.uint16)
    narrow(x, got)
    ref = torch.from_numpy(x).half().view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], ref[~nan])
    assert np.all(np.isnan(got[nan].view(np.float16)))
