"""The perplexity change of each KV-cache format, as `folio bench kv-quant` measured it.

A recorded run, kept as data so the app can say what a format costs in quality without
running the bench: the table of docs/KV_QUANT.md ("What the engine does now") and the
README, in the bench's own record fields. `tests/engine/test_kv_quant_measured.py` holds
these records to that table and their bytes per token to the cache's formats, so they
cannot drift apart. Re-measure with `folio bench kv-quant` and update all three together.
"""

from __future__ import annotations

from dataclasses import dataclass

MEASURED_ON = (
    "measured by `folio bench kv-quant` on SmolLM2-135M-Instruct Q4_1, "
    "the first 4,096 tokens of Python's pydoc_data.topics"
)
MODEL_SHAPE = (30, 3, 64)  # SmolLM2-135M's layers, KV heads and head size


@dataclass(frozen=True)
class KVQuantRecord:
    """One line of `folio bench kv-quant`: bits 32 / 16 stand for unquantized fp32 / fp16."""

    k_bits: int
    v_bits: int
    perplexity: float
    vs_fp32: float  # perplexity / fp32's - 1, as the bench rounds it
    kv_bytes_per_token: int
    fp32_bytes_per_token: int


# (k_bits, v_bits, perplexity, vs_fp32, KV bytes per token), docs/KV_QUANT.md
_RECORDS = (
    (32, 32, 10.8342, 0.0, 46_080),
    (16, 16, 10.8342, 0.0, 23_040),
    (8, 8, 10.8383, 0.00038, 12_960),
    (6, 6, 10.8685, 0.00317, 10_080),
    (4, 4, 11.0411, 0.0191, 7_200),
    (2, 2, 24.417, 1.2537, 4_320),
    (8, 4, 10.8763, 0.00389, 10_080),
)


def measured_formats() -> dict[tuple[int, int], KVQuantRecord]:
    """The recorded formats by (K bits, V bits), 32 / 16 for unquantized fp32 / fp16."""
    fp32 = _RECORDS[0][4]
    return {
        (k, v): KVQuantRecord(k, v, ppl, change, per_token, fp32)
        for k, v, ppl, change, per_token in _RECORDS
    }
