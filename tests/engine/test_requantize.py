"""tests/engine/requantize.py: the super-block quantizers write what the `gguf`
package's dequantizers read back as the values given, within each type's steps."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.engine.requantize import SUPER_BLOCK_TYPES, quantize

# relative error of a Gaussian matrix rounded to each type by its plain quantizer: about
# halved per bit of code
BOUNDS = {Q.Q2_K: 0.45, Q.Q3_K: 0.22, Q.Q4_K: 0.11, Q.Q5_K: 0.055, Q.Q6_K: 0.03}


@pytest.mark.parametrize("qtype", SUPER_BLOCK_TYPES, ids=lambda q: q.name)
def test_super_blocks_read_back_as_the_values_within_their_steps(qtype):
    rng = np.random.default_rng(7)
    x = rng.normal(0, 0.02, size=(48, 1024)).astype(np.float32)
    x[3, 100] = 0.5  # an outlier: its sub-block's scale, not the others'
    x[5, 256:512] = 0.0  # an all-zero super-block
    x[6, :256] = np.abs(x[6, :256])  # no negative value: a zero minimum
    raw = quantize(x, qtype)
    assert raw.shape == (48, 1024 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
    rows = np.ones(48, bool)
    rows[3] = False
    err = np.linalg.norm(back[rows] - x[rows]) / np.linalg.norm(x[rows])
    assert err < BOUNDS[qtype], err
    # one bit less would double it: the codes are laid out where the dequantizer reads them
    assert err > BOUNDS[qtype] / 4, err
    assert np.array_equal(back[5, 256:512], np.zeros(256, np.float32))
    assert abs(back[3, 100] - 0.5) < 0.05
    # every value within a step of its sub-block's levels (no code landed elsewhere)
    sub = 32 if qtype in (Q.Q4_K, Q.Q5_K) else 16
    spans = np.ptp(x.reshape(48, -1, sub), axis=-1, keepdims=True)
    levels = {Q.Q2_K: 3, Q.Q3_K: 7, Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 63}[qtype]
    worst = np.abs(back - x).reshape(48, -1, sub) / np.maximum(spans / levels, 1e-12)
    assert np.quantile(worst, 0.999) < 2.5


def test_rows_of_other_widths_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 576), np.float32), Q.Q4_K)
