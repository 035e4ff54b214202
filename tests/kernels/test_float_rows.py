"""kernels.quant.float_rows: F16 / BF16 weights at decode sizes, read as the file has them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kernels.quant.float_rows import float_rows, float_rows_supported
from tests.child_process import run_json


def _weight(qtype, n: int, k: int, seed: int):
    """The 16-bit patterns of a random ``[n, k]`` weight, and its values as float64."""
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k))).float() * 0.05
    if qtype == Q.F16:
        w16 = w.half()
        return w16.numpy(), w16.double()
    w16 = w.bfloat16()
    return w16.view(torch.int16).numpy().view(np.uint16), w16.double()


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(37, 576), (64, 1000), (5, 7)])
def test_float_rows_equal_the_exact_product_and_ignore_the_batch(qtype, shape):
    """Within float32 rounding of the float64 product (rows not a multiple of four, widths
    with a tail past the 16-lane chunks), each token's row the same bits alone as in any
    batch, written into a view of a wider output and nowhere else."""
    if not float_rows_supported(qtype):
        pytest.skip(f"{qtype.name} needs F16C, which this CPU lacks")
    n, k = shape
    bits, exact_w = _weight(qtype, n, k, seed=n)
    x = np.random.default_rng(k).standard_normal((9, k)).astype(np.float32)
    wide = np.full((9, n + 6), -7.0, np.float32)
    out = float_rows([bits], qtype, x, wide[:, 3 : 3 + n], tasks=2)
    exact = torch.from_numpy(x).double() @ exact_w.T
    scale = torch.from_numpy(np.abs(x)).double() @ exact_w.abs().T
    assert ((torch.from_numpy(out).double() - exact).abs() / scale).max() < 1e-6
    assert np.all(wide[:, :3] == -7.0) and np.all(wide[:, 3 + n :] == -7.0)
    for b in (1, 2, 4):
        alone = np.empty((b, n), np.float32)
        float_rows([bits], qtype, x[:b], alone, tasks=1)
        assert np.array_equal(alone, out[:b])


def test_float_rows_refuse_what_they_do_not_take():
    bits, _ = _weight(Q.F16, 8, 32, seed=0)
    with pytest.raises(ValueError, match="Q8_0"):
        float_rows([bits], Q.Q8_0, np.zeros((1, 32), np.float32), np.empty((1, 8), np.float32), 1)
    if float_rows_supported(Q.F16):
        with pytest.raises(ValueError, match="weights of"):
            float_rows(
                [bits], Q.F16, np.zeros((1, 31), np.float32), np.empty((1, 8), np.float32), 1
            )
        other, _ = _weight(Q.F16, 8, 48, seed=1)
        with pytest.raises(ValueError, match="one width"):
            float_rows(
                [bits, other],
                Q.F16,
                np.zeros((1, 32), np.float32),
                np.empty((1, 16), np.float32),
                1,
            )


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_parts_in_one_call_give_each_parts_own_bits(qtype):
    """A fused q/k/v's parts (row counts not multiples of four) in one call: each part's
    columns in turn, the bits of a call of that part alone."""
    if not float_rows_supported(qtype):
        pytest.skip(f"{qtype.name} needs F16C, which this CPU lacks")
    parts = [_weight(qtype, n, 96, seed=n)[0] for n in (13, 6, 6)]
    x = np.random.default_rng(2).standard_normal((3, 96)).astype(np.float32)
    for tokens in (1, 3):
        together = float_rows(parts, qtype, x[:tokens], np.empty((tokens, 25), np.float32), 2)
        alone = [
            float_rows([p], qtype, x[:tokens], np.empty((tokens, len(p)), np.float32), 1)
            for p in parts
        ]
        assert np.array_equal(together, np.concatenate(alone, axis=1))


_ISA_SCRIPT = """
import json, numpy as np
from gguf import GGMLQuantizationType as Q
from kernels.quant.float_rows import float_rows, float_rows_supported
from kernels.quant.simd import HOST_ISA
rng = np.random.default_rng(3)
x = rng.standard_normal((7, 1100)).astype(np.float32)
out = {"isa": HOST_ISA}
for q in (Q.F16, Q.BF16):
    if float_rows_supported(q):
        w = rng.standard_normal((10, 1100)).astype(np.float32) * 0.05
        bits = w.astype(np.float16) if q == Q.F16 else (w.view(np.uint32) >> 16).astype(np.uint16)
        y = float_rows([bits, bits[:3]], q, x, np.empty((7, 13), np.float32), 2)
        out[q.name] = y.view(np.uint32).tolist()
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_every_isa_compiles_the_kernel_and_gives_its_bits(isa):
    """On CPUs without AVX-512 the kernel takes fewer tokens a call (its accumulators in
    16 registers), and compiles there too: the same bits as on this CPU, token blocks of
    another size and all."""
    from kernels.quant.simd import HOST_ISA, ISA_CODES

    if ISA_CODES[isa] > ISA_CODES[HOST_ISA]:
        pytest.skip(f"this CPU has no {isa}")
    here = run_json(
        _ISA_SCRIPT, env={k: v for k, v in os.environ.items() if k != "FOLIO_QUANT_ISA"}
    )
    there = run_json(_ISA_SCRIPT, env=dict(os.environ, FOLIO_QUANT_ISA=isa))
    assert there["isa"] == isa
    assert there == {**here, "isa": isa}
