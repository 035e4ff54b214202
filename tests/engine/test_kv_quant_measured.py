"""The recorded `folio bench kv-quant` run the settings dialog quotes: the same figures
as docs/KV_QUANT.md's table, and bytes per token the cache's formats still charge."""

from __future__ import annotations

import re
from pathlib import Path

from engine.bench.kv_quant import KV_QUANT_FORMATS
from engine.bench.kv_quant_measured import MODEL_SHAPE, measured_formats
from engine.cache import formats

DOC = Path(__file__).resolve().parents[2] / "docs" / "KV_QUANT.md"
ROW = re.compile(r"^\| (fp32|fp16|K(\d)/V(\d)) \| ([\d,]+) \| ([\d.]+) \|([^|]*)\|")


def doc_table() -> dict[tuple[int, int], tuple[int, float, str]]:
    """(K bits, V bits) -> (bytes per token, perplexity, change) of "What the engine does now"."""
    section = DOC.read_text(encoding="utf-8").split("## How the fix was found")[0]
    rows = {}
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            dense = {"fp32": (32, 32), "fp16": (16, 16)}
            key = dense[m[1]] if m[1] in dense else (int(m[2]), int(m[3]))
            rows[key] = (int(m[4].replace(",", "")), float(m[5]), m[6].strip().strip("*"))
    return rows


def test_records_are_the_documented_run():
    records = measured_formats()
    table = doc_table()
    assert set(records) == set(table)
    assert set(records) == set(KV_QUANT_FORMATS)
    for key, record in records.items():
        per_token, ppl, change = table[key]
        assert record.kv_bytes_per_token == per_token
        assert record.perplexity == ppl
        if key != (32, 32):
            value = record.vs_fp32 * 100
            assert change == (f"{value:+.2f}%" if abs(value) < 10 else f"{value:+.0f}%")
            # the bench's change is its perplexity against fp32's, to the rounding shown
            assert abs(ppl / table[(32, 32)][1] - 1 - record.vs_fp32) < 0.0006 + 0.005 * abs(
                record.vs_fp32
            )


def test_recorded_bytes_are_what_the_formats_charge():
    for (k, v), record in measured_formats().items():
        kv = formats.kv_formats(k, v)
        assert record.kv_bytes_per_token == formats.kv_bytes_per_token(*MODEL_SHAPE, kv)
