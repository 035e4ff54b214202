"""kernels.triton_quant: the CUDA path's GGUF block kernels, in Triton's interpreter on the
CPU, against the ``gguf`` package's dequantizer; and compiled for a Hopper GPU (sm_90) with
the ptxas that ships with triton, so that what the interpreter accepts also lowers.

Tolerances: the kernels multiply float32 activations by the exact dequantized weights and
accumulate in float32, so against the float64 product only float32 rounding separates
them: at most about K u sum |w x| (u = 2^-24) for a sequential sum, well inside
``FP32_REL`` = 1e-5 of sum |w x| at K <= 768. The bf16 tile is the float32 weight rounded
once, (as the fp16 one), so it must equal torch's own rounding exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kernels.quant.bench import random_blocks
from kernels.quant.reference import reference_dequantize
from tests.child_process import run_json

pytest.importorskip("triton")

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FP32_REL = 1e-5
N = 20  # not a multiple of any BLOCK_N: the last row tile is masked


@pytest.fixture(scope="module")
def tq(triton_quant_interpreted):
    return triton_quant_interpreted


def _k(qtype: Q) -> int:
    """Two super-blocks, or three blocks of 32 (a partial 128-element tile)."""
    return 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96


def _weight(qtype: Q, seed: int = 0):
    rng = np.random.default_rng(seed + int(qtype))
    k = _k(qtype)
    raw = random_blocks(qtype, N, k, rng)
    return torch.from_numpy(raw.copy()), reference_dequantize(raw, qtype, (N, k)), k


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(tq, qtype):
    data, ref, k = _weight(qtype)
    exact = tq.triton_dequantize(data, int(qtype), (N, k), torch.float32)
    assert torch.equal(exact, torch.from_numpy(ref))
    for dtype in (torch.bfloat16, torch.float16):
        tile = tq.triton_dequantize(data, int(qtype), (N, k), dtype)
        assert tile.dtype == dtype
        assert torch.equal(tile, torch.from_numpy(ref).to(dtype))


@pytest.mark.parametrize("rows", [1, 3, 17], ids=lambda r: f"B{r}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_equals_gguf_times_activations(tq, qtype, rows):
    """17 rows: two row tiles of the decode kernel."""
    data, ref, k = _weight(qtype, seed=1)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = tq.triton_quant_matmul(x, data, int(qtype), (N, k))
    assert y.shape == (rows, N) and y.dtype == torch.float32
    x64, w64 = x.double().numpy(), ref.astype(np.float64)
    expect = x64 @ w64.T
    bound = FP32_REL * (np.abs(x64) @ np.abs(w64).T)
    err = np.abs(y.numpy() - expect)
    assert (err <= bound).all(), f"worst error {err.max():.2e}, bound {bound.min():.2e}"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_batch(tq, qtype):
    """Bit for bit: row 5 alone, among 7 rows, and as the last of 21 (two row tiles)."""
    data, _, k = _weight(qtype, seed=2)
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(9))
    alone = tq.triton_quant_matmul(x[5:6], data, int(qtype), (N, k))
    assert torch.equal(tq.triton_quant_matmul(x[:7], data, int(qtype), (N, k))[5], alone[0])
    moved = torch.cat([x[:5], x[6:], x[5:6]])
    assert torch.equal(tq.triton_quant_matmul(moved, data, int(qtype), (N, k))[20], alone[0])


def test_strided_activations_and_empty_batch(tq):
    data, ref, k = _weight(Q.Q4_K)
    wide = torch.randn(2, 2 * k)
    x = wide[:, :k]  # rows k apart in memory: not contiguous
    y = tq.triton_quant_matmul(x, data, int(Q.Q4_K), (N, k))
    assert np.allclose(
        y.numpy(), x.double().numpy() @ ref.astype(np.float64).T, rtol=1e-5, atol=1e-6
    )
    assert tq.triton_quant_matmul(x[:0], data, int(Q.Q4_K), (N, k)).shape == (0, N)


def test_dequantize_into_a_buffer(tq):
    data, ref, k = _weight(Q.Q6_K)
    buffer = torch.full((N, k), 7.0, dtype=torch.bfloat16)
    out = tq.triton_dequantize(data, int(Q.Q6_K), (N, k), out=buffer)
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer, torch.from_numpy(ref).to(torch.bfloat16))


def test_bad_input_is_refused_by_name(tq):
    data, _, k = _weight(Q.Q4_0)
    with pytest.raises(ValueError, match="no Triton kernel for GGUF type 6.*Q4_0"):
        tq.triton_quant_matmul(torch.zeros(1, k), data, int(Q.Q5_0), (N, k))
    with pytest.raises(ValueError, match=r"uint8 \[20, 54\]"):
        tq.triton_quant_matmul(torch.zeros(1, k), data[:, :-1], int(Q.Q4_0), (N, k))
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        tq.triton_dequantize(data, int(Q.Q4_0), (N, 100))
    with pytest.raises(ValueError, match=r"activations must be \[B, 96\]"):
        tq.triton_quant_matmul(torch.zeros(1, 64), data, int(Q.Q4_0), (N, k))
    with pytest.raises(ValueError, match="out must be"):
        tq.triton_dequantize(data, int(Q.Q4_0), (N, k), out=torch.empty(N, k + 1))
    with pytest.raises(ValueError, match="not torch.int8"):
        tq.triton_dequantize(data, int(Q.Q4_0), (N, k), torch.int8)


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.triton_quant as tq

target = GPUTarget("cuda", 90, 32)
pointers = {"w_ptr": "*u8", "x_ptr": "*fp32", "y_ptr": "*fp32"}
ints = lambda *names: {n: "i32" for n in names}
kernels = {
    "decode": (tq._decode_kernel, {**pointers, **ints("N", "K", "B", "row_bytes", "stride_x", "stride_y")},
               {"BLOCK_N": tq.DECODE_BLOCK_N, "BLOCK_B": tq.DECODE_BLOCK_B}),
    "dequant": (tq._dequant_kernel, {"w_ptr": "*u8", "out_ptr": "*i16", **ints("N", "K", "row_bytes")},
                {"BLOCK_N": 16, "BF16_BITS": True}),
    "dequant_fp32": (tq._dequant_kernel, {"w_ptr": "*u8", "out_ptr": "*fp32", **ints("N", "K", "row_bytes")},
                     {"BLOCK_N": 16, "BF16_BITS": False}),
    "dequant_fp16": (tq._dequant_kernel, {"w_ptr": "*u8", "out_ptr": "*fp16", **ints("N", "K", "row_bytes")},
                     {"BLOCK_N": 16, "BF16_BITS": False}),
}
done = []
for qtype, (block, type_size) in tq.TRITON_TYPES.items():
    for name, (fn, signature, sizes) in kernels.items():
        if name in ("dequant_fp32", "dequant_fp16") and qtype != tq.Q4_K:
            continue  # the store is all that differs from bf16's: one type shows it lowers
        consts = {"QTYPE": qtype, "BLOCK": block, "TYPE_SIZE": type_size,
                  "BLOCK_K": tq._block_k(block), **sizes}
        src = ASTSource(fn=fn, signature={**signature, **{c: "constexpr" for c in consts}},
                        constexprs=consts)
        compiled = triton.compile(src, target=target)
        done.append([qtype, name, len(compiled.asm["cubin"])])
print(json.dumps({"compiled": done}))
"""


def test_kernels_compile_for_hopper(tmp_path):
    """Every kernel for every type lowers to an sm_90 cubin (no GPU needed: triton ships
    ptxas). The interpreter runs Python and would accept code the compiler refuses."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile, not read an earlier run's cubins
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = run_json(_COMPILE, env=env, timeout=600)
    compiled = result["compiled"]
    assert len(compiled) == 2 * 6 + 2
    assert all(size > 0 for _, _, size in compiled)
