"""kernels.kvquant: Hadamard-rotated b-bit KV-cache groups (docs/ENGINE.md §6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.transformer import Rope, apply_rope
from kernels.kvquant import (
    KeyOffset,
    KVFormat,
    allocate_pages,
    decode,
    dequantize,
    dequantize_pages,
    encode,
    pack_codes,
    quantize,
    quantize_asymmetric,
    quantize_into,
    rope_table,
    unpack_codes,
)

BITS = range(2, 9)
KV_HEADS, HEAD_DIM = 3, 64  # SmolLM2

# Measured relative Frobenius error (4096 tokens x 3 x 64, seed 0); bounds leave ~25% margin.
# bits:         2      3      4      5      6      7      8
# gaussian:   0.355  0.178  0.089  0.044  0.022  0.011  0.0056
# outliers:   0.215  0.113  0.057  0.029  0.014  0.0072 0.0036
# outliers without the rotation (same grid, for comparison): 4-bit 0.223, 8-bit 0.012
MAX_REL_ERR = {2: 0.43, 3: 0.22, 4: 0.11, 5: 0.055, 6: 0.027, 7: 0.014, 8: 0.007}


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / x.norm()).item()


def _gaussian(n: int = 4096, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)


def _with_outliers(n: int = 4096, seed: int = 1) -> torch.Tensor:
    """Gaussian plus a few fixed channels 20x larger, as K caches have."""
    x = _gaussian(n, seed)
    x[:, :, [3, 17, 40]] *= 20.0
    return x


def _round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    codes, scales = quantize(x, bits)
    return dequantize(codes, scales, bits)


def _round_trip_asym(x: torch.Tensor, bits: int) -> torch.Tensor:
    codes, steps, zeros = quantize_asymmetric(x, bits)
    return dequantize(codes, steps, bits, zeros)


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_bounds(bits):
    x = _gaussian()
    assert _rel_err(x, _round_trip(x, bits)) < MAX_REL_ERR[bits]
    x = _with_outliers()
    assert _rel_err(x, _round_trip(x, bits)) < MAX_REL_ERR[bits]


def test_error_halves_with_each_bit():
    x = _gaussian()
    errs = [_rel_err(x, _round_trip(x, b)) for b in BITS]
    for lo, hi in zip(errs, errs[1:]):
        assert 0.4 * lo < hi < 0.6 * lo


def test_rotation_tames_outliers():
    """Without the Hadamard rotation the outlier channels would set every group's scale."""
    x = _with_outliers()
    rotated_err = _rel_err(x, _round_trip(x, 4))
    # the same grid on unrotated groups, written out directly
    g = x.reshape(-1, 32)
    s = g.abs().amax(-1, keepdim=True) + 1e-10
    q = torch.floor(g / s * 8 + 8).clamp(0, 15)
    plain_err = _rel_err(g, (q - 8 + 0.5) * s / 8)
    assert rotated_err < 0.4 * plain_err


def _spec_reference(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The §6 formula element by element in float64: (codes, scales, dequantized)."""
    h = np.array([[1.0]])
    while h.shape[0] < 32:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(32)
    flat = x.reshape(x.shape[0], -1)
    n, width = flat.shape
    m = 2 ** (bits - 1)
    codes = np.zeros((n, width), dtype=np.int64)
    scales = np.zeros((n, width // 32))
    out = np.zeros_like(flat, dtype=np.float64)
    for t in range(n):
        for g in range(width // 32):
            y = flat[t, g * 32 : (g + 1) * 32].astype(np.float64) @ h
            s = float(np.float16(np.abs(y).max() + 1e-10))
            scales[t, g] = s
            back = np.zeros(32)
            for i in range(32):
                q = min(max(int(np.floor(y[i] / s * m + m)), 0), 2**bits - 1)
                codes[t, g * 32 + i] = q
                back[i] = (q - m + 0.5) * s / m
            out[t, g * 32 : (g + 1) * 32] = back @ h
    return codes, scales, out.reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_matches_spec_formula(bits):
    x = _gaussian(6, seed=bits)[:, :2]  # 6 tokens x 2 heads x 64 = 4 groups per token
    ref_codes, ref_scales, ref_out = _spec_reference(x.numpy(), bits)
    codes, scales = quantize(x, bits)
    got_codes = unpack_codes(codes, bits).reshape(6, -1).numpy()
    np.testing.assert_allclose(scales.reshape(6, -1).float().numpy(), ref_scales, rtol=0)
    # float32 vs float64 rotation may flip a code sitting exactly on a grid boundary
    diff = np.abs(got_codes - ref_codes)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    if diff.max() == 0:
        np.testing.assert_allclose(dequantize(codes, scales, bits).numpy(), ref_out, atol=1e-5)


@pytest.mark.parametrize("bits", BITS)
def test_packing_is_dense_and_lossless(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (50, 32), generator=g)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (50, bits)
    assert torch.equal(unpack_codes(packed, bits), codes)
    # code i sits at bits [i*b, (i+1)*b) of the group's little-endian bit string
    row = codes[0].tolist()
    stream = sum(c << (i * bits) for i, c in enumerate(row))
    words = [(w + 2**32) % 2**32 for w in packed[0].tolist()]
    assert stream == sum(w << (32 * j) for j, w in enumerate(words))


def test_zero_and_constant_groups():
    """A zero group reads back as zero.  A constant group rotates to a single spike; the
    midpoint grid has no zero level, so its 31 zeros come back as +-s/(2m): relative error
    sqrt(32) / (2m), the worst case of the format (1.41 at 2 bits, 0.022 at 8)."""
    x = torch.zeros(2, 1, 64)
    x[1] = 3.0
    for bits in BITS:
        y = _round_trip(x, bits)
        assert torch.isfinite(y).all()
        assert torch.equal(y[0], x[0])
        m = 2 ** (bits - 1)
        assert _rel_err(x[1], y[1]) == pytest.approx(32**0.5 / (2 * m), rel=1e-3)


# ---- asymmetric (min/max) grid -------------------------------------------------------------

# Measured relative error (same data as MAX_REL_ERR; "offset": gaussian plus a per-channel
# offset from -6 to 6, which the symmetric grid handles worst), bounds with ~25% margin:
# bits:            2      3      4      5      6      7      8
# gaussian:      0.393  0.168  0.078  0.038  0.019  0.0092 0.0046
# outliers:      0.279  0.120  0.055  0.027  0.013  0.0065 0.0032
# offset:        0.475  0.255  0.116  0.056  0.028  0.0137 0.0069  (symmetric: 0.96 .. 0.011)
MAX_REL_ERR_ASYM = {2: 0.60, 3: 0.32, 4: 0.145, 5: 0.07, 6: 0.035, 7: 0.017, 8: 0.0087}


def _with_offset(n: int = 4096, seed: int = 5) -> torch.Tensor:
    return _gaussian(n, seed) + torch.linspace(-6, 6, HEAD_DIM)


@pytest.mark.parametrize("bits", BITS)
def test_asymmetric_round_trip_error_bounds(bits):
    for x in (_gaussian(), _with_outliers(), _with_offset()):
        assert _rel_err(x, _round_trip_asym(x, bits)) < MAX_REL_ERR_ASYM[bits]


@pytest.mark.parametrize("bits", BITS)
def test_asymmetric_grid_beats_midpoint_grid(bits):
    """Every level of the min/max grid lies inside the group's range; the midpoint grid
    spends half its levels on the sign, which an offset group does not use. On centred
    gaussian groups it still wins from 3 bits (measured error ratio 0.94 at 3 bits, 0.83 at
    8); at 2 bits its 4 levels lose to the midpoint grid's (0.39 against 0.35)."""
    x = _with_offset()
    assert _rel_err(x, _round_trip_asym(x, bits)) < 0.7 * _rel_err(x, _round_trip(x, bits))
    if bits >= 3:
        x = _gaussian()
        assert _rel_err(x, _round_trip_asym(x, bits)) < _rel_err(x, _round_trip(x, bits))


def _asym_reference(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The min/max grid element by element in float64: (codes, dequantized)."""
    h = np.array([[1.0]])
    while h.shape[0] < 32:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(32)
    flat = x.reshape(x.shape[0], -1)
    n, width = flat.shape
    levels = 2**bits - 1
    codes = np.zeros((n, width), dtype=np.int64)
    out = np.zeros_like(flat, dtype=np.float64)
    for t in range(n):
        for g in range(width // 32):
            y = flat[t, g * 32 : (g + 1) * 32].astype(np.float64) @ h
            z = float(np.float16(y.min()))
            d = float(np.float16((y.max() - z) / levels))
            q = np.clip(np.round((y - z) / d), 0, levels)
            codes[t, g * 32 : (g + 1) * 32] = q
            out[t, g * 32 : (g + 1) * 32] = (q * d + z) @ h
    return codes, out.reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_asymmetric_matches_formula(bits):
    x = _with_offset(6, seed=bits)[:, :2]
    ref_codes, ref_out = _asym_reference(x.numpy(), bits)
    codes, steps, zeros = quantize_asymmetric(x, bits)
    assert steps.dtype == zeros.dtype == torch.float16 and steps.shape == zeros.shape == (6, 2, 2)
    diff = np.abs(unpack_codes(codes, bits).reshape(6, -1).numpy() - ref_codes)
    # float32 vs float64 may flip a code sitting exactly half way between two levels
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    if diff.max() == 0:
        np.testing.assert_allclose(
            dequantize(codes, steps, bits, zeros).numpy(), ref_out, atol=1e-5
        )


def test_asymmetric_zero_and_constant_groups():
    """A zero group comes back exactly; a constant group rotates to one spike and 31
    zeros, and the zeros are the group minimum, which the grid decodes exactly."""
    x = torch.zeros(2, 1, 64)
    x[1] = 3.0
    for bits in BITS:
        y = _round_trip_asym(x, bits)
        assert torch.equal(y[0], x[0])
        codes, steps, zeros = quantize_asymmetric(x, bits)
        rotated = decode(
            KVFormat(bits, asymmetric=True),
            {"codes": codes, "scales": steps, "zeros": zeros},
            rotated=True,
        )
        # all but the spike of each group (the float32 rotation leaves ~5e-7 for zero)
        assert (rotated[1, 0].abs() < 1e-6).sum() == 62
        assert _rel_err(x[1], y[1]) < 1e-3  # the spike, through the fp16 step


# ---- key offset: keys stored relative to R(p) mu -------------------------------------------


def _key_offset(positions: int = 4096, seed: int = 7) -> tuple[KeyOffset, Rope]:
    rope = Rope(HEAD_DIM, 10000.0)
    mean = torch.randn(KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * 4
    return KeyOffset(mean, rope_table(rope.inv_freq, positions)), rope


def test_key_offset_is_the_models_rope_of_the_mean():
    offset, rope = _key_offset()
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos, sin = rope.tables(positions)
    expected = apply_rope(offset.mean.expand(len(positions), -1, -1), cos, sin)
    assert torch.equal(offset.at(positions), expected)


@pytest.mark.parametrize("n_heads", [3, 9])
def test_key_offset_query_terms_give_the_score_term(n_heads):
    """z . table[p] == q . R(p) mu for every query head (GQA: heads share a KV head's mu)."""
    offset, _ = _key_offset()
    g = torch.Generator().manual_seed(8)
    q = torch.randn(5, n_heads, HEAD_DIM, generator=g)
    positions = torch.tensor([0, 3, 64, 1000, 4095])
    z = offset.query_terms(q)
    got = (z * offset.table[positions][:, None]).sum(-1)
    keys = offset.at(positions).repeat_interleave(n_heads // KV_HEADS, 1)
    want = (q.double() * keys.double()).sum(-1)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_key_offset_shrinks_key_error(bits):
    """Keys with a large constant pre-RoPE offset: quantizing k - R(p) mu and adding
    R(p) mu back leaves only the residual's error. Measured (4-bit): 0.077 of the key
    norm directly, 0.019 through the offset (midpoint grid: 0.089 / 0.022)."""
    offset, _ = _key_offset()
    positions = torch.arange(4096)
    mu_p = offset.at(positions)
    residual = _gaussian()
    k = residual + mu_p
    fmt = KVFormat(bits, asymmetric=True)
    direct = decode(fmt, encode(fmt, k))
    through = decode(fmt, encode(fmt, k - mu_p)) + mu_p
    assert _rel_err(k, through) < 0.3 * _rel_err(k, direct)
    # what is left is the residual's own round-trip error
    assert _rel_err(residual, through - mu_p) < MAX_REL_ERR_ASYM[bits]


@pytest.mark.parametrize(
    "fmt",
    [
        KVFormat(None),
        KVFormat(None, torch.float16),
        KVFormat(8),
        KVFormat(4),
        KVFormat(3),
        KVFormat(4, asymmetric=True),
        KVFormat(5, asymmetric=True),
    ],
    ids=str,
)
def test_writes_touch_only_their_slots(fmt):
    num_pages, page_size = 5, 16
    store = allocate_pages(fmt, num_pages, page_size, KV_HEADS, HEAD_DIM)
    for t in store.values():
        assert t.shape[:2] == (num_pages, page_size)
    first = _gaussian(num_pages * page_size, seed=3)
    pages = torch.arange(num_pages).repeat_interleave(page_size)
    slots = torch.arange(page_size).repeat(num_pages)
    quantize_into(fmt, store, pages, slots, first)
    before = dequantize_pages(fmt, store, torch.arange(num_pages))

    page_idx = torch.tensor([4, 0, 2, 2, 4])
    slot_idx = torch.tensor([15, 0, 7, 3, 1])
    new = _gaussian(5, seed=4) * 3
    quantize_into(fmt, store, page_idx, slot_idx, new)
    after = dequantize_pages(fmt, store, torch.arange(num_pages))

    touched = torch.zeros(num_pages, page_size, dtype=torch.bool)
    touched[page_idx, slot_idx] = True
    assert torch.equal(after[~touched], before[~touched])
    # the written slots read back as a direct round trip of the new values
    if fmt.bits is None:
        expected = new
    elif fmt.asymmetric:
        expected = _round_trip_asym(new, fmt.bits)
    else:
        expected = _round_trip(new, fmt.bits)
    torch.testing.assert_close(
        after[page_idx, slot_idx], expected.to(fmt.dtype).float(), atol=0, rtol=0
    )
    # pages come back in the order asked for
    assert torch.equal(dequantize_pages(fmt, store, torch.tensor([2, 0])), after[[2, 0]])


def test_bytes_per_token():
    assert KVFormat(None).bytes_per_token(3, 64) == 768
    assert KVFormat(None, torch.float16).bytes_per_token(3, 64) == 384
    # 6 groups of (4*b bytes of codes + 2 bytes of fp16 scale)
    expected = {2: 60, 3: 84, 4: 108, 5: 132, 6: 156, 7: 180, 8: 204}
    for bits, nbytes in expected.items():
        fmt = KVFormat(bits)
        assert fmt.bytes_per_token(3, 64) == nbytes
        store = allocate_pages(fmt, 2, 16, 3, 64)
        stored = sum(t.numel() * t.element_size() for t in store.values())
        assert stored == 2 * 16 * nbytes
        # the asymmetric grid adds one fp16 minimum per group
        asym = KVFormat(bits, asymmetric=True)
        assert asym.bytes_per_token(3, 64) == nbytes + 12
        store = allocate_pages(asym, 2, 16, 3, 64)
        assert sum(t.numel() * t.element_size() for t in store.values()) == 2 * 16 * (nbytes + 12)


def test_rejects_bad_formats():
    for bits in (1, 9, 16):
        with pytest.raises(ValueError, match="bits"):
            KVFormat(bits)
    with pytest.raises(ValueError, match="multiple of 32"):
        allocate_pages(KVFormat(4), 1, 16, 4, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(1, 2, 48), 4)
    with pytest.raises(ValueError, match="asymmetric"):
        KVFormat(None, asymmetric=True)


def test_large_host_pages_are_zeroed_writable_and_advised_huge():
    """Unquantized host pages of HUGE_PAGES_FROM bytes or more come in anonymous memory
    marked MADV_HUGEPAGE (the decode kernel's strided reads cross fewer page
    translations): zeroed, writable, shaped like torch.zeros' would be, alive while the
    tensor is."""
    import gc

    from kernels.kvquant import HUGE_PAGES_FROM, allocate_pages, huge_page_zeros
    from tests.smaps import covering

    fmt = KVFormat(dtype=torch.float16)
    pages = HUGE_PAGES_FROM // (256 * 8 * 64 * 2)
    data = allocate_pages(fmt, pages, 256, 8, 64)["data"]
    gc.collect()
    assert data.shape == (pages, 256, 8, 64) and data.dtype == torch.float16
    assert data.is_contiguous() and not data.any()
    data[-1, -1] = 1.5
    assert float(data.float().sum()) == 1.5 * 8 * 64
    held = covering(data.data_ptr(), data.numel() * 2)
    if held is not None and hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        # a mapping of its own, from its first byte (malloc's chunks start past a
        # header), advised huge
        assert held and held[0].start == data.data_ptr() and held[0].path != "[heap]"
        assert all("hg" in m.flags for m in held)
    # a small one is torch.zeros' (its mapping, the heap, may carry other advice)
    small = allocate_pages(fmt, 1, 16, 8, 64)["data"]
    assert small.shape == (1, 16, 8, 64) and not small.any()
    assert huge_page_zeros((0, 4), torch.float32).shape == (0, 4)
