"""kernels.dequant against the numpy reference in gguf.quants."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from kernels import dequant as dq
from kernels.dequant import SUPPORTED_TYPES, UnsupportedTensorType, block_geometry, dequantize

Q = GGMLQuantizationType

QUANT_TYPES = [
    Q.Q8_0,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
]
# types that gguf.quants can quantize in numpy
NUMPY_QUANTIZABLE = {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}

# byte offsets of the fp16 scale fields inside one block, per type
FP16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}

SHAPES_32 = [(32,), (4, 64), (3, 5, 96), (17, 160)]
SHAPES_256 = [(256,), (3, 512), (2, 2, 768), (5, 1536)]


def _random_blocks(qtype: GGMLQuantizationType, shape, rng: np.random.Generator) -> np.ndarray:
    """Random raw bytes with every fp16 scale field set to a finite random value."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        vals = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, off : off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def _make(qtype, shape, rng, mode):
    if mode == "quantize":
        data = rng.standard_normal(shape).astype(np.float32)
        return np.ascontiguousarray(gq.quantize(data, qtype)).reshape(-1).view(np.uint8)
    return _random_blocks(qtype, shape, rng)


def _reference(raw_np: np.ndarray, qtype, shape) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw_np.reshape(-1, shape[-1] // block_size * type_size)
    return gq.dequantize(rows, qtype).reshape(shape)


def _cases():
    for qt in QUANT_TYPES:
        shapes = SHAPES_256 if GGML_QUANT_SIZES[qt][0] == 256 else SHAPES_32
        modes = ["random"] + (["quantize"] if qt in NUMPY_QUANTIZABLE else [])
        for shape in shapes:
            for mode in modes:
                yield pytest.param(
                    qt, shape, mode, id=f"{qt.name}-{'x'.join(map(str, shape))}-{mode}"
                )


@pytest.mark.parametrize("qtype,shape,mode", list(_cases()))
def test_quant_types_match_reference(qtype, shape, mode):
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}{shape}{mode}".encode()))
    raw_np = _make(qtype, shape, rng, mode)
    expected = _reference(raw_np, qtype, shape)
    got = dequantize(torch.from_numpy(raw_np.copy()), qtype, shape)
    assert got.dtype == torch.float32
    assert tuple(got.shape) == tuple(shape)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_chunked_path_matches_reference(qtype, monkeypatch):
    """Force several chunks (with a ragged tail) through the chunked output loop."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    monkeypatch.setattr(dq, "_CHUNK_ELEMS", block_size * 7)
    shape = (9, block_size * 5)  # 45 blocks -> chunks of 7 blocks + a tail of 3
    rng = np.random.default_rng(int(qtype))
    raw_np = _random_blocks(qtype, shape, rng)
    expected = _reference(raw_np, qtype, shape)
    got = dequantize(torch.from_numpy(raw_np), qtype, shape)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-30)
    got_bf16 = dequantize(torch.from_numpy(raw_np), qtype, shape, dtype=torch.bfloat16)
    assert got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_bf16, torch.from_numpy(expected).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(7,), (3, 64), (2, 3, 10)])
def test_float_types_bit_exact(qtype, shape):
    rng = np.random.default_rng(1)
    data = (rng.standard_normal(shape) * 10).astype(np.float32)
    if qtype == Q.F32:
        stored = data
    elif qtype == Q.F16:
        stored = data.astype(np.float16)
    else:
        stored = gq.quantize(data, Q.BF16)
    raw_np = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
    expected = gq.dequantize(raw_np.copy(), qtype).reshape(shape)
    got = dequantize(torch.from_numpy(raw_np.copy()), qtype, shape)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


def test_float_types_accept_typed_tensors_and_do_not_alias():
    t = torch.randn(4, 8)
    out = dequantize(t, Q.F32, (4, 8))
    assert torch.equal(out, t)
    out.add_(1)
    assert not torch.equal(out, t)
    h = torch.randn(4, 8).half()
    assert torch.equal(dequantize(h, Q.F16, (4, 8)), h.float())
    assert torch.equal(dequantize(h, Q.F16, (4, 8), dtype=torch.float16), h)
    b = torch.randn(2, 16).bfloat16()
    assert torch.equal(dequantize(b, Q.BF16, (2, 16)), b.float())


def test_accepts_int_qtype_and_output_dtype():
    rng = np.random.default_rng(3)
    raw_np = _random_blocks(Q.Q4_K, (2, 256), rng)
    ref = _reference(raw_np, Q.Q4_K, (2, 256))
    got = dequantize(torch.from_numpy(raw_np), int(Q.Q4_K), (2, 256), dtype=torch.float16)
    assert got.dtype == torch.float16
    assert torch.equal(got, torch.from_numpy(ref).half())


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q8_1, Q.TQ1_0, Q.IQ4_NL], ids=lambda t: t.name)
def test_unsupported_types_raise_clear_error(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.zeros(type_size, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorType) as exc:
        dequantize(raw, qtype, (block_size,))
    msg = str(exc.value)
    assert qtype.name in msg
    assert "Q4_K" in msg and "Q8_0" in msg  # lists what *is* supported
    assert isinstance(exc.value, ValueError)


def test_unknown_type_id_raises():
    with pytest.raises(UnsupportedTensorType, match="unknown"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 9999, (1,))


def test_wrong_byte_count_and_bad_row_size():
    with pytest.raises(ValueError, match="bytes"):
        dequantize(torch.zeros(17, dtype=torch.uint8), Q.Q4_0, (32,))
    with pytest.raises(ValueError, match="block size"):
        dequantize(torch.zeros(18, dtype=torch.uint8), Q.Q4_0, (2, 16))


def test_supported_types_and_block_geometry():
    assert set(SUPPORTED_TYPES) == {Q.F32, Q.F16, Q.BF16, *QUANT_TYPES}
    assert all(isinstance(t, GGMLQuantizationType) for t in SUPPORTED_TYPES)
    assert block_geometry(Q.Q4_0) == (32, 18)
    assert block_geometry(Q.Q4_K) == (256, 144)
    assert block_geometry(int(Q.Q6_K)) == (256, 210)
    assert block_geometry(Q.F32) == (1, 4)
    for qt in SUPPORTED_TYPES:
        assert block_geometry(qt) == GGML_QUANT_SIZES[qt]


def test_misaligned_and_empty_inputs():
    t = torch.randn(5)
    buf = torch.zeros(21, dtype=torch.uint8)
    buf[1:21] = t.view(torch.uint8)
    assert torch.equal(dequantize(buf[1:21], Q.F32, (5,)), t)  # storage offset not 4-aligned
    assert dequantize(torch.zeros(0, dtype=torch.uint8), Q.Q4_K, (0, 256)).shape == (0, 256)
    assert dequantize(torch.zeros(0, dtype=torch.uint8), Q.Q8_0, (3, 0)).shape == (3, 0)
