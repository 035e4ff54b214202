"""The vectorised float32 exp (kernels/quant/fastexp.py) against float64's, and the gated
activations built on it at the ends of float32's range."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.quant.activations import GELU_TANH_GATE, SILU_GATE, prepared_activations
from kernels.quant.fastexp import HIGH, LOW, exp_into


def _run(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    exp_into(x, out, np.empty(x.shape, np.int32), x.shape[0])
    return out


def test_exp_is_within_3e_7_over_the_normal_range_and_clamped_outside():
    x = np.concatenate(
        [np.linspace(LOW, HIGH, 400_001), np.logspace(-8, 1, 1001), -np.logspace(-8, 1, 1001)]
    ).astype(np.float32)
    got = _run(x)
    assert np.max(np.abs(got / np.exp(x.astype(np.float64)) - 1)) < 3e-7
    assert _run(np.zeros(1, np.float32))[0] == 1.0
    ends = _run(np.array([-1e4, LOW - 1, HIGH + 1, 1e4], np.float32))
    assert np.allclose(ends, np.exp([LOW, LOW, HIGH, HIGH]), rtol=3e-7)
    assert np.isfinite(ends).all()


def test_gates_at_the_ends_of_the_range_match_float64():
    """Gate values far past where exp over- or underflows: SiLU and tanh-GELU go to the
    identity or to zero as float64's do (within 1e-20 absolute where they vanish: below
    exp's clamp the gate gives g / (1 + e^88), and float64's tanh is -1 from z < -19 on,
    where the true tanh-GELU is still about 1e-23 for these gates)."""
    k = 256
    g = np.linspace(-300, 300, k).astype(np.float32)
    g[:6] = [-1e4, -200, -88.5, 88.5, 200, 1e4]
    gate_up = np.concatenate([g, np.linspace(-2, 2, k, dtype=np.float32)])[None, :]
    g64, u64 = torch.from_numpy(gate_up).double().split(k, dim=-1)
    for op, want in (
        (SILU_GATE, F.silu(g64) * u64),
        (GELU_TANH_GATE, F.gelu(g64, approximate="tanh") * u64),
    ):
        got = prepared_activations(gate_up, op, per32=False).source
        assert np.isfinite(got).all()
        assert np.allclose(got, want.numpy(), rtol=1e-6, atol=1e-20), op
