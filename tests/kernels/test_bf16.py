"""Packed bf16 copies for batched rows (kernels/bf16.py): their error is bf16 rounding and
nothing more, each row is computed independently of the others, and `Linear` and the
rescored head take int4, bf16 or dense fp32 as the forward asks and the rows allow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.transformer import Linear
from kernels.bf16 import BATCHED_FROM_ROWS, bf16_linear, pack_bf16, packed_bf16_supported
from kernels.head import BF16_RESCORE, RescoredHead
from kernels.int4 import int4_linear, quantize_int4

pytestmark = pytest.mark.skipif(
    not packed_bf16_supported(), reason="this PyTorch build or CPU has no oneDNN bf16 matmul"
)

# round-to-nearest bf16 keeps 8 significant bits: relative error at most 2^-9 per value
BF16_UNIT = 2.0**-9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_error_is_bf16_rounding_of_inputs_and_weights():
    w = torch.randn(300, 256, generator=_gen(0)) * 0.05
    x = torch.randn(12, 256, generator=_gen(1))
    out = bf16_linear(x, pack_bf16(w))
    ref = (x.double() @ w.double().T).float()
    # |x w - bf16(x) bf16(w)| <= (2u + u^2) |x| |w| per product; fp32 sums add far less
    bound = (2 * BF16_UNIT + BF16_UNIT**2) * (x.abs() @ w.abs().T) * 1.01 + 1e-6
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert bool(((out - ref).abs() <= bound).all())
    assert (out - ref).abs().max() > 0  # it is bf16, not an fp32 matmul in disguise


def test_each_row_is_independent_of_the_batch():
    w = pack_bf16(torch.randn(3072, 576, generator=_gen(2)))
    x = torch.randn(64, 576, generator=_gen(3))
    alone = torch.cat([bf16_linear(x[i : i + 1], w) for i in range(64)])
    # oneDNN alone would round rows 33-63 differently: bf16_linear splits at 32 rows
    for rows in (2, 8, 13, 16, 32, 33, 40, 63, 64):
        assert torch.equal(bf16_linear(x[:rows], w), alone[:rows]), rows


def test_leading_dimensions_and_width_check():
    w = pack_bf16(torch.randn(64, 96, generator=_gen(4)))
    x = torch.randn(2, 5, 96, generator=_gen(5))
    assert bf16_linear(x, w).shape == (2, 5, 64)
    with pytest.raises(ValueError, match="96"):
        bf16_linear(torch.randn(3, 95), w)
    with pytest.raises(ValueError, match="2-D"):
        pack_bf16(torch.randn(4, 4, 4))


def test_linear_picks_its_path_by_rows():
    dense = torch.randn(256, 128, generator=_gen(6)) * 0.1
    q = quantize_int4(dense)
    lin = Linear(q, source=lambda: dense)
    assert lin.batched_bytes() == 256 * 128 * 2
    before = lin.nbytes()
    assert lin.add_batched() == 256 * 128 * 2 and lin.nbytes() == before + 256 * 128 * 2
    assert lin.add_batched() == 0  # kept once
    x = torch.randn(Linear.DENSE_FROM_ROWS, 128, generator=_gen(7))
    rows = x[:BATCHED_FROM_ROWS]
    assert torch.equal(lin(rows), int4_linear(rows, q))  # the forward did not ask for bf16
    assert torch.equal(lin(rows, bf16=True), bf16_linear(rows, lin.batched))
    assert torch.equal(lin(x[:1], bf16=True), bf16_linear(x[:1], lin.batched))
    assert not torch.equal(lin(rows, bf16=True), lin(rows))
    # from DENSE_FROM_ROWS rows: the exact fp32 path, whatever was asked
    assert torch.equal(lin(x, bf16=True), F.linear(x, dense))
    assert torch.equal(lin(x), F.linear(x, dense))


def test_dense_linears_get_no_copy():
    lin = Linear(torch.randn(32, 32))
    assert lin.batched_bytes() == 0 and lin.add_batched() == 0 and lin.batched is None


def test_rescored_head_with_bf16_copy_is_exact_on_its_leading_logits():
    w = torch.randn(4096, 256, generator=_gen(8)) * 0.05
    head = RescoredHead(w, bits=4, rescore=256)
    plain = head(torch.randn(4, 256, generator=_gen(9)))
    head.add_batched()
    x = torch.randn(2, BATCHED_FROM_ROWS, 256, generator=_gen(10))
    ref = x @ w.T
    out = head(x, bf16=True)
    top = ref.topk(16, dim=-1).indices
    assert torch.allclose(out.gather(-1, top), ref.gather(-1, top), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # past the BF16_RESCORE leading candidates the values are bf16 scores
    rest = ref.topk(BF16_RESCORE + 200, dim=-1).indices[..., BF16_RESCORE + 100 :]
    tail_err = (out.gather(-1, rest) - ref.gather(-1, rest)).abs()
    assert tail_err.max() > 0 and tail_err.max() < 0.01
    # not asked for bf16: the int4 copy scores, as before the copy was added
    assert torch.equal(head(torch.randn(4, 256, generator=_gen(9))), plain)
