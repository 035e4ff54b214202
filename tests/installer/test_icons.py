"""The icon set in resources/: SVG source, PNGs 16..512, and the .ico built from them."""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RES = ROOT / "resources"


def _make_icons():
    spec = importlib.util.spec_from_file_location("folio_make_icons", ROOT / "installer" / "make_icons.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


M = _make_icons()


def test_svg_is_square_and_parses():
    root = ET.parse(RES / "folio.svg").getroot()
    assert root.tag.endswith("svg") and root.get("viewBox") == "0 0 256 256"


@pytest.mark.parametrize("size", M.PNG_SIZES)
def test_png_sizes(size):
    assert M.png_size(M.png_path(size).read_bytes()) == (size, size)


def test_ico_holds_png_entries_up_to_256():
    entries = M.read_ico((RES / "folio.ico").read_bytes())
    assert [(w, h) for w, h, _ in entries] == [(s, s) for s in M.ICO_SIZES]
    for size, (_, _, data) in zip(M.ICO_SIZES, entries):
        assert data == M.png_path(size).read_bytes()


def test_build_ico_round_trip_and_limits():
    small = M.png_path(16).read_bytes()
    assert M.read_ico(M.build_ico([small])) == [(16, 16, small)]
    with pytest.raises(ValueError, match="cannot be 512"):
        M.build_ico([M.png_path(512).read_bytes()])
    with pytest.raises(ValueError, match="not a PNG"):
        M.build_ico([b"GIF89a" + b"\0" * 30])


def test_pngs_match_the_svg(tmp_path, monkeypatch):
    """Re-rendering the SVG gives the shipped PNGs (so they were not edited apart)."""
    pytest.importorskip("PySide6.QtSvg")
    monkeypatch.setattr(M, "ICONS", tmp_path)
    M.render_pngs()
    from PySide6.QtGui import QImage

    for size in (16, 256):
        fresh = QImage(str(tmp_path / f"folio-{size}.png"))
        shipped = QImage(str(RES / "icons" / f"folio-{size}.png"))
        assert fresh.size() == shipped.size()
        assert fresh.convertToFormat(QImage.Format.Format_ARGB32) == shipped.convertToFormat(
            QImage.Format.Format_ARGB32)
