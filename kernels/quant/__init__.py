"""Matrix products on weights kept in their GGUF block format (issue 14).

The weight is a view of the memory-mapped file (:class:`QuantWeight`); each type's kernels
and facts live in one table (:mod:`kernels.quant.registry`); :func:`quant_matmul` is the
entry point. Layout of the package:

* ``simd.py``: the LLVM-IR primitives (the int8 scaled dot product, byte unpacking).
* ``rows.py``: the decode and dequantize loops every type shares.
* ``legacy.py`` / ``kquants.py``: per type, an unpacker and its kernels.
* ``superblock.py``: Q4_K and Q6_K decode kernels that unpack in registers and sum each
  256-element super-block in integers (the bulk of a Q4_K_M file).
* ``block32.py``: the decode kernels of the blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
  unpacked in registers two blocks to a vector.
* ``activations.py``: activations to int8 once per matmul: per 32 (most types) or per 256
  with integer sums (the super-block kernels).
* ``reference.py``: the plain reference the kernels are tested against.
* ``registry.py``, ``weight.py``, ``matmul.py``: the table, the weight, the entry point.
* ``bench.py``: GB/s of each kernel against the machine's read bandwidth.
"""

from kernels.quant import _cache

_cache.install()  # before any kernel of the package is decorated

from kernels.quant.activations import Q8Activations, quantize_activations  # noqa: E402
from kernels.quant.matmul import (  # noqa: E402
    COMMON_TYPES,
    DECODE_MAX_ROWS,
    decode_matmul,
    dequantize_weight,
    prefill_matmul,
    quant_matmul,
    warm_up,
)
from kernels.quant.registry import FLOAT_TYPES, QUANT_TYPES, ActivationFormat, QuantType, quant_type  # noqa: E402
from kernels.quant.simd import HOST_ISA  # noqa: E402
from kernels.quant.weight import QuantWeight  # noqa: E402

__all__ = [
    "COMMON_TYPES",
    "DECODE_MAX_ROWS",
    "FLOAT_TYPES",
    "HOST_ISA",
    "QUANT_TYPES",
    "ActivationFormat",
    "Q8Activations",
    "QuantType",
    "QuantWeight",
    "decode_matmul",
    "dequantize_weight",
    "prefill_matmul",
    "quant_matmul",
    "quantize_activations",
    "quant_type",
    "warm_up",
]
