"""kernels.int4: GGUF Q4 weights through torch's CPU int4 matmul."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from kernels import int4 as int4mod
from kernels.int4 import Int4Weight, int4_from_gguf, int4_linear, int4_supported, quantize_int4

Q = GGMLQuantizationType

# bf16 activations/scales and a bf16 output: ~2^-9 relative rounding per value.
BF16_REL_TOL = 1e-2
# fp32 compute: only fp32 rounding of the scale/zero arithmetic and accumulation order.
FP32_REL_TOL = 1e-5


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _gguf_bytes(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes for an [n, k] tensor of a Q4 type."""
    if qtype in (Q.Q4_0, Q.Q4_1):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return np.ascontiguousarray(gq.quantize(w, qtype)).reshape(-1)
    # Q4_K: numpy cannot quantize it -> random bytes with sane fp16 d / dmin
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    nb = n * k // block_size
    blocks = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    d = (np.abs(rng.standard_normal(nb)) * 2e-4 + 1e-5).astype(np.float16)
    dmin = (np.abs(rng.standard_normal(nb)) * 2e-4).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(-1)


def _ref_weight(raw_np: np.ndarray, qtype, n: int, k: int) -> torch.Tensor:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw_np.reshape(n, k // block_size * type_size)
    return torch.from_numpy(gq.dequantize(rows, qtype).reshape(n, k).copy())


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


Q4_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K]
# (N out_features, K in_features): SmolLM2-like projections plus small/odd ones.
# Q4_K rows must be a multiple of 256, so K=576 only exists for Q4_0/Q4_1.
SHAPES = {
    Q.Q4_0: [(1536, 576), (576, 1536), (192, 576), (64, 256), (48, 512)],
    Q.Q4_1: [(1536, 576), (576, 1536), (192, 576), (64, 256), (48, 512)],
    Q.Q4_K: [(576, 1536), (1536, 512), (192, 768), (64, 256), (48, 512)],
}


def _type_shape_cases():
    for qt in Q4_TYPES:
        for n, k in SHAPES[qt]:
            yield pytest.param(qt, n, k, id=f"{qt.name}-{n}x{k}")


@pytest.mark.parametrize("qtype,n,k", list(_type_shape_cases()))
@pytest.mark.parametrize("m", [1, 4, 33])
def test_int4_linear_matches_gguf_dequant_bf16(qtype, n, k, m):
    rng = np.random.default_rng(_seed(qtype.name, n, k, m))
    raw_np = _gguf_bytes(qtype, n, k, rng)
    w_ref = _ref_weight(raw_np, qtype, n, k)
    w = int4_from_gguf(torch.from_numpy(raw_np), qtype, (n, k))
    assert w.out_features == n and w.in_features == k and w.group_size == 32
    assert w.scales_and_zeros.dtype == torch.bfloat16
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = int4_linear(x, w)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = x.double() @ w_ref.double().T
    assert _rel_err(y, ref) < BF16_REL_TOL


@pytest.mark.parametrize("qtype,n,k", list(_type_shape_cases()))
def test_int4_mapping_is_exact_in_fp32(qtype, n, k):
    """With fp32 scales/zeros the repacking must reproduce gguf's dequant to fp32 rounding."""
    rng = np.random.default_rng(_seed("fp32", qtype.name, n, k))
    raw_np = _gguf_bytes(qtype, n, k, rng)
    w_ref = _ref_weight(raw_np, qtype, n, k)
    w = int4_from_gguf(torch.from_numpy(raw_np), qtype, (n, k), dtype=torch.float32)
    # one-hot inputs recover columns of the dequantized weight itself
    cols = torch.cat((torch.arange(40), torch.randperm(k - 80)[:48] + 40, torch.arange(k - 40, k)))
    w_cols = int4_linear(torch.eye(k)[cols], w).T
    torch.testing.assert_close(w_cols, w_ref[:, cols], rtol=FP32_REL_TOL, atol=1e-6)
    x = torch.from_numpy(rng.standard_normal((7, k)).astype(np.float32))
    assert _rel_err(int4_linear(x, w), x.double() @ w_ref.double().T) < FP32_REL_TOL


def test_bf16_activations_and_batched_leading_dims():
    rng = np.random.default_rng(7)
    n, k = 192, 768
    raw_np = _gguf_bytes(Q.Q4_K, n, k, rng)
    w_ref = _ref_weight(raw_np, Q.Q4_K, n, k)
    w = int4_from_gguf(torch.from_numpy(raw_np), Q.Q4_K, (n, k))
    x = torch.from_numpy(rng.standard_normal((2, 5, k)).astype(np.float32))
    y32 = int4_linear(x, w)
    assert y32.shape == (2, 5, n) and y32.dtype == torch.float32
    y16 = int4_linear(x.bfloat16(), w)
    assert y16.dtype == torch.bfloat16
    ref = x.double() @ w_ref.double().T
    assert _rel_err(y32, ref) < BF16_REL_TOL
    assert _rel_err(y16, ref) < BF16_REL_TOL
    # non-contiguous input is fine
    xt = torch.from_numpy(rng.standard_normal((k, 3)).astype(np.float32)).T
    assert _rel_err(int4_linear(xt, w), xt.double() @ w_ref.double().T) < BF16_REL_TOL


@pytest.mark.parametrize("n", [1, 8, 24, 200])
def test_out_features_not_multiple_of_16_are_padded(n):
    rng = np.random.default_rng(n)
    k = 256
    raw_np = _gguf_bytes(Q.Q4_1, n, k, rng)
    w_ref = _ref_weight(raw_np, Q.Q4_1, n, k)
    w = int4_from_gguf(torch.from_numpy(raw_np), Q.Q4_1, (n, k), dtype=torch.float32)
    assert w.packed.shape[0] % 16 == 0 and w.packed.shape[0] >= n
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    y = int4_linear(x, w)
    assert y.shape == (3, n) and y.is_contiguous()
    assert _rel_err(y, x.double() @ w_ref.double().T) < FP32_REL_TOL


def test_row_chunked_packing_matches_single_call(monkeypatch):
    rng = np.random.default_rng(11)
    n, k = 208, 128  # 3 full 64-row blocks + a 16-row tail
    raw = torch.from_numpy(_gguf_bytes(Q.Q4_0, n, k, rng))
    whole = int4_from_gguf(raw, Q.Q4_0, (n, k))
    monkeypatch.setattr(int4mod, "_PACK_CHUNK_ROWS", 64)
    chunked = int4_from_gguf(raw, Q.Q4_0, (n, k))
    assert torch.equal(whole.packed, chunked.packed)
    assert torch.equal(whole.scales_and_zeros, chunked.scales_and_zeros)


def test_nbytes_and_layout():
    rng = np.random.default_rng(3)
    n, k = 1536, 512
    w = int4_from_gguf(torch.from_numpy(_gguf_bytes(Q.Q4_K, n, k, rng)), Q.Q4_K, (n, k))
    assert w.packed.dtype == torch.uint8 and w.packed.shape == (n, k // 2)
    assert w.scales_and_zeros.shape == (k // 32, n, 2)
    assert w.nbytes() == n * k // 2 + (k // 32) * n * 2 * 2
    assert w.nbytes() < n * k * 2 / 3  # well under bf16 dense
    assert w.dtype == torch.bfloat16 and w.shape == (n, k)


def test_int4_supported():
    assert int4_supported(Q.Q4_0) and int4_supported(Q.Q4_1) and int4_supported(Q.Q4_K)
    assert int4_supported(int(Q.Q4_K))
    for qt in (Q.F32, Q.F16, Q.Q8_0, Q.Q5_K, Q.Q6_K, Q.Q5_0):
        assert not int4_supported(qt)
    assert not int4_supported(12345)


def test_int4_from_gguf_rejects_bad_input():
    with pytest.raises(ValueError, match="Q6_K"):
        int4_from_gguf(torch.zeros(210, dtype=torch.uint8), Q.Q6_K, (1, 256))
    with pytest.raises(ValueError, match="2-D"):
        int4_from_gguf(torch.zeros(18 * 4, dtype=torch.uint8), Q.Q4_0, (2, 2, 32))
    with pytest.raises(ValueError, match="bytes"):
        int4_from_gguf(torch.zeros(17, dtype=torch.uint8), Q.Q4_0, (1, 32))
    with pytest.raises(ValueError, match="multiple"):
        int4_from_gguf(torch.zeros(144, dtype=torch.uint8), Q.Q4_K, (2, 128))
    with pytest.raises(ValueError, match="dtype"):
        int4_from_gguf(torch.zeros(18, dtype=torch.uint8), Q.Q4_0, (1, 32), dtype=torch.int8)


def test_int4_linear_rejects_wrong_width():
    w = quantize_int4(torch.randn(32, 64))
    with pytest.raises(ValueError, match="features"):
        int4_linear(torch.randn(2, 32), w)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_int4_roundtrip(group_size, dtype):
    torch.manual_seed(0)
    n, k = 96, 512
    w = torch.randn(n, k) * 0.02
    q = quantize_int4(w, group_size=group_size, dtype=dtype)
    assert isinstance(q, Int4Weight) and q.group_size == group_size
    w_back = int4_linear(torch.eye(k), q).T
    # per element the error is at most half a step, plus the rounding of scale, zero and
    # output to the compute dtype (bf16: 2^-9 relative each)
    g = w.reshape(n, k // group_size, group_size)
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(group_size, dim=1)
    eps = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    bound = 0.5 * step + eps * (
        8 * step + 2 * w.abs() + 2 * g.abs().amax(-1).repeat_interleave(group_size, dim=1)
    )
    assert ((w_back - w).abs() <= bound).all()
    x = torch.randn(4, k)
    # 4-bit quantization noise on Gaussian weights is ~9% relative
    assert _rel_err(int4_linear(x, q), x @ w.T) < 0.15


def test_quantize_int4_constant_groups():
    w = torch.zeros(16, 64)
    w[:, 32:] = 0.5
    q = quantize_int4(w, dtype=torch.float32)
    torch.testing.assert_close(int4_linear(torch.eye(64), q).T, w)
