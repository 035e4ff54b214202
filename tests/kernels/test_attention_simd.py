"""The decode attention kernel's SIMD steps (kernels/quant/simd.py) keep the bits of the
code they replaced, so the kernel's output did not move: `key_scores` (16 slots' scores
a call) those of the one-slot-at-a-time dot products (`float_dots4`, `float_dot`),
`shifted_exps` (the softmax's exponentials and their sum in one vector pass) those of
`exp_into` and the scalar partial sums; and both agree with float64."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from kernels.paged_attention import CPU_HALF_PAGES, _score_keys
from kernels.quant.fastexp import exp_into
from kernels.quant.simd import float_dot, float_dots4, shifted_exps


@numba.njit
def _scores_in_runs(q, keys, n, out, scratch, half):
    """``out[r, s]`` for the first ``n`` keys and every row of ``q``, as the kernel makes
    them (`_score_keys`: `key_scores` four rows a call, then the rest)."""
    _score_keys(q, 0, q.shape[0], keys.ctypes.data, keys.strides[0], n, out, 0, scratch, half)


@numba.njit
def _scores_slot_by_slot(q, keys, n, out):
    """The same scores as the kernel made them before, a slot at a time: four rows by
    `float_dots4`, the rest by `float_dot`."""
    four = np.empty(4, np.float32)
    rows, width = q.shape
    for s in range(n):
        r = 0
        while r + 4 <= rows:
            float_dots4(
                q[r].ctypes.data, q.strides[0], keys[s].ctypes.data, width, four.ctypes.data
            )
            for j in range(4):
                out[r + j, s] = four[j]
            r += 4
        for j in range(r, rows):
            out[j, s] = float_dot(q[j].ctypes.data, keys[s].ctypes.data, width)


@pytest.mark.parametrize("width", [16, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 7, 16])
def test_key_scores_keep_the_bits_of_slot_by_slot_dots(width, rows, n):
    rng = np.random.default_rng(width * 100 + rows * 10 + n)
    q = rng.standard_normal((rows, width)).astype(np.float32)
    # keys 16 slots apart in a wider pool (a page's rows are kv_heads heads apart)
    pool = rng.standard_normal((16, 3, width)).astype(np.float32)
    keys = pool[:, 1]
    scratch = np.zeros(4 * 16 * 16, np.float32)
    got = np.full((rows, 20), np.float32(7.0))
    want = np.full((rows, 20), np.float32(7.0))
    _scores_in_runs(q, keys, n, got, scratch, False)
    _scores_slot_by_slot(q, np.ascontiguousarray(keys), n, want)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    # lanes past n are left as they were
    assert (got[:, n:] == 7.0).all()
    exact = q.astype(np.float64) @ keys[:n].astype(np.float64).T
    np.testing.assert_allclose(got[:, :n], exact, rtol=1e-5, atol=1e-4 * np.sqrt(width))


@pytest.mark.skipif(not CPU_HALF_PAGES, reason="fp16 keys are widened by F16C")
@pytest.mark.parametrize("n", [5, 16])
def test_key_scores_widen_fp16_keys_exactly(n):
    rng = np.random.default_rng(n)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    keys = rng.standard_normal((16, 64)).astype(np.float16)
    scratch = np.zeros(4 * 16 * 16, np.float32)
    got = np.zeros((4, 16), np.float32)
    want = np.zeros((4, 16), np.float32)
    _scores_in_runs(q, keys.view(np.uint16), n, got, scratch, True)
    _scores_in_runs(q, keys.astype(np.float32), n, want, scratch, False)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@numba.njit
def _exps_then_sum(a, n, shift):
    """exp(a - shift) in place as the kernel made it before `shifted_exps`: shifted
    copies, `exp_into`, then four partial sums by ``i % 4`` (the ``n % 4`` left into the
    first) and ``(s0 + s1) + (s2 + s3)``."""
    shifted = np.empty(n, np.float32)
    bits = np.empty(n, np.int32)
    for i in range(n):
        shifted[i] = a[i] - shift
    exp_into(shifted, a, bits, n)
    s = np.zeros(4, np.float32)
    quads = n - n % 4
    for i in range(0, quads, 4):
        for j in range(4):
            s[j] += a[i + j]
    for i in range(quads, n):
        s[0] += a[i]
    return (s[0] + s[1]) + (s[2] + s[3])


@numba.njit
def _shifted_exps(a, n, shift):
    return shifted_exps(a.ctypes.data, n, shift)


@pytest.mark.parametrize("n", [1, 3, 4, 15, 16, 17, 64, 100])
@pytest.mark.parametrize("spread", [1.0, 30.0, 300.0])
def test_shifted_exps_keep_the_bits_of_exp_into_and_the_partial_sums(n, spread):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n + 5) * spread).astype(np.float32)
    shift = np.float32(x[:n].max())
    got, want = x.copy(), x.copy()
    total = _shifted_exps(got, n, shift)
    expected_total = _exps_then_sum(want, n, shift)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))  # past n untouched too
    assert np.float32(total).view(np.int32) == np.float32(expected_total).view(np.int32)
    # and they are exponentials: near float64's (fastexp's error grows to about 2e-6 for
    # arguments near -60; below -87 it gives exp(-87) for what is smaller still)
    exact = np.exp(x[:n].astype(np.float64) - np.float64(shift))
    np.testing.assert_allclose(got[:n], exact, rtol=4e-6, atol=2e-38)
    np.testing.assert_allclose(total, exact.sum(), rtol=1e-5)
