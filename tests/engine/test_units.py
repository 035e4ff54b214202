"""Byte counts in words (engine/units.py)."""

from __future__ import annotations

from engine.units import format_bytes


def test_format_bytes_picks_a_unit():
    assert format_bytes(0) == "0 B"
    assert format_bytes(999) == "999 B"
    assert format_bytes(12_345) == "12 KB"
    assert format_bytes(1_234_567) == "1.2 MB"
    assert format_bytes(2_500_000_000) == "2.50 GB"
    assert format_bytes(4_000_000_000_000) == "4000.00 GB"  # GB is the largest unit
    assert format_bytes(None) == "?" and format_bytes(None, unknown="unknown") == "unknown"


def test_format_bytes_binary_and_fixed_unit():
    assert format_bytes(1023, binary=True) == "1023 B"
    assert format_bytes(3 * 2**20, binary=True) == "3.0 MB"
    assert format_bytes(1_234_567_890, "MB") == "1,235 MB"
    assert format_bytes(300_000, "MB") == "0 MB"
    assert format_bytes(None, "MB", unknown="an unknown amount") == "an unknown amount"
