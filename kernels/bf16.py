"""bf16 copies of weights, pre-packed for oneDNN's AMX matmul, for batched decode.

torch's CPU int4 kernel (kernels/int4.py) reads a quarter of the bytes of bf16 and wins
for one or two rows, but its cost grows linearly with the rows: on this machine's Xeon
(AMX), SmolLM2's fused gate/up projection at 16 rows takes 0.40 ms through the int4
kernel and 0.19 ms as a bf16 matmul on a weight packed once for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``, the op torch.compile's CPU backend uses);
the 49152-row head, 6.2 ms against 1.8 ms. A plain bf16 ``F.linear`` repacks the weight
at every call and gains less than half of that.

Precision: the packed copy is the fp32 weight (dequantized exactly from the GGUF codes)
rounded once to bf16, multiplied with bf16 activations and fp32 accumulation, which is
the same class of error as the int4 kernel's (bf16 activations, bf16 scales and zeros).
Each output row depends only on its own input row (oneDNN handles up to 32 rows a call
that way; larger inputs go in 32-row pieces), so sequences sharing a batch of this path
do not perturb each other.

Kept only where measured to win (CPUs with AMX bf16 tiles; `Transformer.add_batched_weights`),
and read by decode batches of at least `BATCHED_FROM_ROWS` sequences and by prefill chunks
(`Transformer.forward` decides).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "BATCHED_FROM_ROWS",
    "PackedBF16",
    "bf16_linear",
    "pack_bf16",
    "packed_bf16_available",
    "packed_bf16_supported",
]

# Decode batches of this many sequences and more use the packed copy. Alone, one matrix
# hot in cache, the crossover is 8 rows (gate/up: int4 0.20 ms, bf16 0.14 ms), but whole
# decode steps read 4x the weight bytes from memory; `folio bench batched`, SmolLM2, S_TG
# with the copies over without: B=8 0.90-1.03x, B=10 1.03-1.12x, B=12 1.07-1.25x,
# B=16 1.12-1.24x.
BATCHED_FROM_ROWS = 12
# Rows per oneDNN call: up to here each row's result is independent of the others.
_ROW_BLOCK = 32
# The packed layout is chosen for this many rows; any row count runs on it.
_PACK_FOR_ROWS = 16


@dataclass
class PackedBF16:
    """A linear weight ``[out_features, in_features]`` in bf16, packed for oneDNN."""

    packed: torch.Tensor  # opaque oneDNN layout; only _linear_pointwise reads it
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2


def _cpu_flags() -> set[str]:
    """The host CPU's feature names, lower case with '-' and '_' dropped ('amxbf16')."""
    try:
        import llvmlite.binding as llvm  # installed with numba; portable (Windows, macOS)

        return {k.replace("-", "").lower() for k, on in llvm.get_host_cpu_features().items() if on}
    except Exception:  # noqa: BLE001 - llvmlite missing or unable to query the host
        pass
    cpuinfo = Path("/proc/cpuinfo")
    if sys.platform.startswith("linux") and cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return {f.replace("_", "").lower() for f in line.split(":", 1)[1].split()}
    return set()


@functools.cache
def packed_bf16_supported() -> bool:
    """Whether this PyTorch build and CPU can run :func:`bf16_linear` at all."""
    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def packed_bf16_available() -> bool:
    """Whether this machine runs packed bf16 matmuls faster than the int4 kernel at
    batch sizes, as measured: supported, on a CPU with AMX bf16 tiles."""
    return packed_bf16_supported() and "amxbf16" in _cpu_flags()


def pack_bf16(weight: torch.Tensor) -> PackedBF16:
    """Round a dense weight ``[N, K]`` to bf16 once and pack it for :func:`bf16_linear`."""
    if weight.dim() != 2:
        raise ValueError(f"pack_bf16 expects a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.bfloat16).contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_FOR_ROWS)
    return PackedBF16(packed, w.shape[0], w.shape[1])


def bf16_linear(x: torch.Tensor, w: PackedBF16) -> torch.Tensor:
    """``x @ W.T`` for ``x [..., K]``: bf16 inputs, fp32 accumulation, result in ``x.dtype``."""
    if x.shape[-1] != w.in_features:
        raise ValueError(
            f"bf16_linear: input has {x.shape[-1]} features, weight expects {w.in_features}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features).to(torch.bfloat16).contiguous()
    # oneDNN computes each row alone up to 32 rows and blocks rows together above (seen on
    # torch 2.13: 33-63 rows give other roundings); 32-row pieces keep every row's result
    # independent of the batch it came in
    parts = [
        torch.ops.mkldnn._linear_pointwise(x2[i : i + _ROW_BLOCK], w.packed, None, "none", [], "")
        for i in range(0, max(x2.shape[0], 1), _ROW_BLOCK)
    ]
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(*lead, w.out_features).to(x.dtype)
