"""The icon set in resources/: SVG source, PNGs 16..512, the .ico built from them, and
the record of which SVG the PNGs were rendered from."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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

# How far a fresh rendering may lie from a shipped PNG.  Qt's raster engine picks its
# blend and gradient routines by CPU (SSE2, AVX2, AVX-512), and they round differently,
# so the same SVG gives pixels a level or two apart on different machines.  Rendering
# the SVG through Qt's 16-bit and float pipelines on one machine shows the size of such
# rounding: a mean of 0.18 level (16 px) or less per channel, no pixel more than 2
# levels off; even +-1 level of noise on every pixel stays at a mean of 0.68.  A real
# edit (a cell recoloured, the title line moved 8 px, a gradient stop shifted by about
# 10 levels) puts 1 % or more of the pixels more than 8 levels off: over ten times the
# bound at every size (see test_the_tolerance_catches_a_changed_icon).
MEAN_LIMIT = 1.0  # the worst channel's mean |difference|, in levels of 0..255
LARGE = 8  # a pixel is "off" when some channel differs by more than this many levels
LARGE_LIMIT = 0.001  # the share of pixels that may be off


@dataclass(frozen=True)
class Difference:
    mean: float  # the worst channel's mean |difference| (premultiplied RGBA, 0..255)
    large_share: float  # the share of pixels with some channel off by more than LARGE

    @property
    def ratio(self) -> float:
        """How many times over the tolerance: at most 1 passes."""
        return max(self.mean / MEAN_LIMIT, self.large_share / LARGE_LIMIT)


def _pixels(image) -> np.ndarray:
    """(height, width, 4) premultiplied RGBA as int16.  Premultiplied, so that a pixel
    with almost no coverage cannot show a large colour difference."""
    QImage = pytest.importorskip("PySide6.QtGui").QImage
    if not isinstance(image, QImage):
        image = QImage(str(image))
    assert not image.isNull()
    image = image.convertToFormat(QImage.Format.Format_RGBA8888_Premultiplied)
    h, w = image.height(), image.width()
    rows = np.frombuffer(bytes(image.constBits()), np.uint8).reshape(h, image.bytesPerLine())
    return rows[:, : 4 * w].reshape(h, w, 4).astype(np.int16)


def difference(a: np.ndarray, b: np.ndarray) -> Difference:
    assert a.shape == b.shape
    d = np.abs(a - b)
    return Difference(mean=float(d.mean(axis=(0, 1)).max()),
                      large_share=float((d.max(axis=2) > LARGE).mean()))


def _render(tmp_path: Path, monkeypatch, svg_text: str | None = None) -> Path:
    """Render the icon set as make_icons.py does, into tmp_path; from ``svg_text`` if given."""
    pytest.importorskip("PySide6.QtSvg")
    if svg_text is not None:
        svg = tmp_path / "folio.svg"
        svg.write_text(svg_text, encoding="utf-8")
        monkeypatch.setattr(M, "SVG", svg)
    monkeypatch.setattr(M, "ICONS", tmp_path)
    M.render_pngs()
    return tmp_path


def _shipped(size: int) -> np.ndarray:
    return _pixels(RES / "icons" / f"folio-{size}.png")


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


# --- the record: which SVG the shipped PNGs come from (exact, on every machine) ---

def _record() -> dict:
    return json.loads(M.record_path().read_text(encoding="utf-8"))


def test_the_pngs_were_rendered_from_the_current_svg():
    record = _record()
    assert record["svg"] == "folio.svg"
    assert record["svg_sha256"] == M.svg_sha256(M.SVG), (
        "resources/folio.svg changed since the PNGs were rendered: "
        "run `python installer/make_icons.py` and commit the PNGs, folio.ico and "
        f"{M.RECORD_NAME}")


def test_the_record_names_the_shipped_pngs():
    shipped = {M.png_path(s).name: hashlib.sha256(M.png_path(s).read_bytes()).hexdigest()
               for s in M.PNG_SIZES}
    assert _record()["pngs"] == shipped, "PNGs replaced without `python installer/make_icons.py`"


def test_svg_hash_reads_crlf_as_lf_and_sees_any_edit(tmp_path):
    text = M.SVG.read_bytes().replace(b"\r\n", b"\n")
    lf, crlf, edited = tmp_path / "lf.svg", tmp_path / "crlf.svg", tmp_path / "edited.svg"
    lf.write_bytes(text)
    crlf.write_bytes(text.replace(b"\n", b"\r\n"))
    edited.write_bytes(text.replace(b"#14b8a6", b"#14b8a7", 1))
    assert M.svg_sha256(lf) == M.svg_sha256(crlf) == M.svg_sha256(M.SVG)
    assert M.svg_sha256(edited) != M.svg_sha256(lf)


def test_render_record_matches_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr(M, "ICONS", tmp_path)
    for size in M.PNG_SIZES:
        M.png_path(size).write_bytes(b"png %d" % size)
    M.write_record()
    record = _record()
    assert record["svg_sha256"] == M.svg_sha256(M.SVG)
    assert record["pngs"]["folio-24.png"] == hashlib.sha256(b"png 24").hexdigest()


# --- the pixels: a fresh rendering against the shipped PNGs, within rounding ---

def test_pngs_match_the_svg(tmp_path, monkeypatch):
    """Re-rendering the SVG gives the shipped PNGs, up to the rasterizer's rounding."""
    fresh = _render(tmp_path, monkeypatch)
    for size in M.PNG_SIZES:
        diff = difference(_pixels(fresh / f"folio-{size}.png"), _shipped(size))
        assert diff.ratio <= 1, f"folio-{size}.png is not the SVG's rendering: {diff}"


def _render_through(image_format: str, size: int) -> np.ndarray:
    """The SVG rendered through another of Qt's raster pipelines (other rounding)."""
    pytest.importorskip("PySide6.QtSvg")
    from PySide6.QtCore import QRectF, Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication.instance() or QGuiApplication(["test_icons"])  # noqa: F841
    image = QImage(size, size, getattr(QImage.Format, image_format))
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    QSvgRenderer(str(M.SVG)).render(painter, QRectF(0, 0, size, size))
    painter.end()
    return _pixels(image)


def _one_level_noise(pixels: np.ndarray) -> np.ndarray:
    """Every covered channel moved by -1, 0 or +1 level at random (kept premultiplied)."""
    rng = np.random.default_rng(12)
    noisy = pixels + rng.integers(-1, 2, size=pixels.shape) * (pixels[..., 3:] > 0)
    noisy = np.clip(noisy, 0, 255)
    noisy[..., :3] = np.minimum(noisy[..., :3], noisy[..., 3:])
    return noisy


@pytest.mark.parametrize("size", (16, 256))
@pytest.mark.parametrize("variant", ("Format_RGBA64_Premultiplied",
                                     "Format_RGBA32FPx4_Premultiplied", "noise"))
def test_the_tolerance_accepts_rounding(variant, size):
    if variant == "noise":
        other = _one_level_noise(_shipped(size))
    else:
        other = _render_through(variant, size)
    diff = difference(other, _shipped(size))
    assert diff.mean > 0, "the variant should differ a little from the shipped PNG"
    assert diff.ratio <= 1, diff


EDITS = {
    # (what the SVG says, what the edited SVG says)
    "a cell recoloured": ('<rect x="72"  y="96"  width="32" height="24" rx="5" fill="#14b8a6"/>',
                          '<rect x="72"  y="96"  width="32" height="24" rx="5" fill="#f59e0b"/>'),
    "the title line moved": ('<rect x="72" y="62" width="64"', '<rect x="72" y="70" width="64"'),
    "a gradient stop shifted": ('stop-color="#3b4fd8"', 'stop-color="#3050e0"'),
}


@pytest.mark.parametrize("edit", EDITS)
def test_the_tolerance_catches_a_changed_icon(edit, tmp_path, monkeypatch):
    before, after = EDITS[edit]
    svg = M.SVG.read_text(encoding="utf-8")
    assert svg.count(before) == 1
    fresh = _render(tmp_path, monkeypatch, svg.replace(before, after))
    for size in (16, 256):
        diff = difference(_pixels(fresh / f"folio-{size}.png"), _shipped(size))
        assert diff.ratio >= 10, f"{edit} at {size} px: only {diff}"
