"""The table of GGUF weight types: what every kernel and the loader read about a type.

One :class:`QuantType` per supported GGUF type: its block geometry, how its unpacker
splits a weight into codes and scales (sub-block width, signed codes), the activation
format its decode kernel wants, its kernels, and its reference dequantizer. Code that
handles weights looks a type up here (:func:`quant_type`) instead of branching on it.

The kernels are numba dispatchers compiled on first use (then cached on disk), so listing
a type costs nothing until a model has it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.quant import kquants, legacy
from kernels.quant.reference import reference_dequantize

Q = GGMLQuantizationType


class ActivationFormat(enum.Enum):
    """How a decode kernel wants its activations."""

    Q8_32 = "int8 per 32, float32 scale"  # kernels.quant.activations.Q8Activations
    Q8_256 = "int8 per 256, float32 scale, integer sums"  # Q8KActivations (superblock.py)


@dataclass(frozen=True)
class QuantType:
    ggml: GGMLQuantizationType
    block_size: int  # elements per block
    type_size: int  # bytes per block
    sub_block: int  # elements per scale (16 or 32): the unpacker's ``fw`` / ``fo`` granularity
    signed: bool  # codes are int8 with no offset (Q8_0) rather than uint8 plus an offset
    activation: ActivationFormat
    # (w, xq, xs, xsum, out, tasks): the matrix-vector / small-batch kernel; for Q8_32 the
    # scales and float sums per sub_block, for Q8_256 the scales per 256 and integer sums
    decode: Callable
    dequant: Callable  # (w, first, out32, out16, tasks): rows first.. as float32 or bf16 bits
    # Q8_256 kernels only: (parts, row_bytes, levels, xq, xs, xsum, out, tasks), the rows
    # of several matrices of this type in one call, the two levels of int8 summed (levels
    # 2) into out [T, N] (superblock.kblock_rows)
    decode_parts: Callable | None = None
    # the order of the int8 codes a Q8_256 kernel reads (Q8KActivations.kernel_args)
    activation_order: str = "natural"
    # (parts, row_bytes, xw, xd, bx, out, tasks): the prompt kernel with weight rows in
    # vector lanes (kernels/quant/lanes.py, matmul.prompt_kernel_args), where the type
    # has one; it runs where lanes.lanes_supported says
    prompt_parts: Callable | None = None

    @property
    def name(self) -> str:
        return self.ggml.name

    def row_bytes(self, k: int) -> int:
        if k % self.block_size:
            raise ValueError(f"{self.name}: row length {k} is not a multiple of {self.block_size}")
        return k // self.block_size * self.type_size

    def reference(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """float32 ``[N, K]`` through the ``gguf`` package's dequantizer."""
        return reference_dequantize(raw, self.ggml, shape)


def _entry(
    qtype: GGMLQuantizationType,
    family,
    sub_block: int,
    signed: bool = False,
    activation: ActivationFormat = ActivationFormat.Q8_32,
    activation_order: str = "natural",
) -> QuantType:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    suffix = qtype.name.lower()
    return QuantType(
        ggml=qtype,
        block_size=block_size,
        type_size=type_size,
        sub_block=sub_block,
        signed=signed,
        activation=activation,
        decode=getattr(family, f"decode_{suffix}"),
        dequant=getattr(family, f"dequant_{suffix}"),
        decode_parts=getattr(family, f"decode_parts_{suffix}", None),
        activation_order=activation_order,
        prompt_parts=getattr(family, f"prompt_parts_{suffix}", None),
    )


QUANT_TYPES: dict[GGMLQuantizationType, QuantType] = {
    t.ggml: t
    for t in (
        _entry(Q.Q8_0, legacy, 32, signed=True),
        _entry(Q.Q4_0, legacy, 32),
        _entry(Q.Q4_1, legacy, 32),
        _entry(Q.Q5_0, legacy, 32),
        _entry(Q.Q5_1, legacy, 32),
        _entry(Q.Q2_K, kquants, 16),
        _entry(Q.Q3_K, kquants, 16),
        _entry(Q.Q4_K, kquants, 32, activation=ActivationFormat.Q8_256, activation_order="q4_k"),
        _entry(Q.Q5_K, kquants, 32),
        _entry(Q.Q6_K, kquants, 16, activation=ActivationFormat.Q8_256),
    )
}

# Kept as the file has them and multiplied by torch (no block structure).
FLOAT_TYPES: dict[GGMLQuantizationType, np.dtype] = {
    Q.F32: np.dtype(np.float32),
    Q.F16: np.dtype(np.float16),
    Q.BF16: np.dtype(np.uint16),  # bf16 bit patterns; viewed as torch.bfloat16
}


def quant_type(qtype: int | GGMLQuantizationType) -> QuantType:
    """The registry entry of a block type; ``KeyError`` naming the supported ones if none."""
    try:
        return QUANT_TYPES[GGMLQuantizationType(int(qtype))]
    except (KeyError, ValueError):
        names = ", ".join(t.name for t in QUANT_TYPES)
        raise KeyError(
            f"no block-quantized kernel for GGUF type {qtype!r}; supported: {names}"
        ) from None
