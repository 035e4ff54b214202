#!/usr/bin/env python3
"""Build Folio's icon set from ``resources/folio.svg``.

    python installer/make_icons.py            # render the PNGs and their record, then the .ico
    python installer/make_icons.py --ico-only # rebuild folio.ico from existing PNGs

Writes ``resources/icons/folio-<N>.png`` for N in 16..512, ``resources/folio.ico``
and ``resources/icons/rendered-from.json``: the SHA-256 of the SVG the PNGs were
rendered from and of each PNG, so a test can tell on any machine whether the shipped
PNGs still belong to the current SVG (a pixel comparison cannot be exact across
machines: Qt's rasterizer rounds differently on different CPUs).

The PNGs are rendered with Qt's SVG renderer (PySide6-Essentials, which Folio depends
on anyway, so run this with the venv's Python); the .ico is assembled with the
standard library only: an ICONDIR header and one directory entry per size, each image
stored as a complete PNG (valid in .ico files since Windows Vista, and far smaller
than BMP entries).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESOURCES = ROOT / "resources"
SVG = RESOURCES / "folio.svg"
ICONS = RESOURCES / "icons"
ICO = RESOURCES / "folio.ico"
RECORD_NAME = "rendered-from.json"  # written beside the PNGs
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)  # .ico entries cannot exceed 256 px
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_path(size: int) -> Path:
    return ICONS / f"folio-{size}.png"


def record_path() -> Path:
    return ICONS / RECORD_NAME


def svg_sha256(svg: Path) -> str:
    """SHA-256 of the SVG text with CRLF read as LF, so a Windows checkout hashes alike."""
    return hashlib.sha256(svg.read_bytes().replace(b"\r\n", b"\n")).hexdigest()


def render_record() -> dict:
    """What the PNGs in ICONS were rendered from: the SVG's hash and each PNG's hash."""
    return {
        "svg": SVG.relative_to(RESOURCES).as_posix(),
        "svg_sha256": svg_sha256(SVG),
        "pngs": {png_path(s).name: hashlib.sha256(png_path(s).read_bytes()).hexdigest()
                 for s in PNG_SIZES},
    }


def write_record() -> None:
    record_path().write_text(json.dumps(render_record(), indent=2) + "\n", encoding="utf-8")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != PNG_MAGIC or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return struct.unpack(">II", data[16:24])


def build_ico(pngs: list[bytes]) -> bytes:
    """An .ico holding ``pngs`` (each at most 256 x 256) as PNG-compressed entries."""
    header = struct.pack("<HHH", 0, 1, len(pngs))  # reserved, type 1 = icon, count
    entries, blobs = [], []
    offset = len(header) + 16 * len(pngs)
    for data in pngs:
        width, height = png_size(data)
        if width > 256 or height > 256:
            raise ValueError(f"an .ico entry cannot be {width} x {height}")
        # Width/height 0 means 256; colour count 0, planes 1, 32 bits per pixel.
        entries.append(struct.pack("<BBBBHHII", width % 256, height % 256, 0, 0, 1, 32,
                                   len(data), offset))
        blobs.append(data)
        offset += len(data)
    return header + b"".join(entries) + b"".join(blobs)


def read_ico(data: bytes) -> list[tuple[int, int, bytes]]:
    """[(width, height, image bytes)] of an .ico (used by the tests)."""
    reserved, kind, count = struct.unpack_from("<HHH", data, 0)
    if reserved != 0 or kind != 1:
        raise ValueError("not an .ico file")
    out = []
    for i in range(count):
        w, h, _, _, _, _, size, offset = struct.unpack_from("<BBBBHHII", data, 6 + 16 * i)
        out.append((w or 256, h or 256, data[offset:offset + size]))
    return out


def render_pngs() -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QRectF, Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication.instance() or QGuiApplication(["make_icons"])  # noqa: F841
    renderer = QSvgRenderer(str(SVG))
    if not renderer.isValid():
        raise SystemExit(f"cannot render {SVG}")
    ICONS.mkdir(parents=True, exist_ok=True)
    for size in PNG_SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
        renderer.render(painter, QRectF(0, 0, size, size))
        painter.end()
        if not image.save(str(png_path(size)), "PNG"):
            raise SystemExit(f"cannot write {png_path(size)}")


def main(argv: list[str]) -> int:
    if "--ico-only" not in argv:
        render_pngs()
        write_record()
    ICO.write_bytes(build_ico([png_path(s).read_bytes() for s in ICO_SIZES]))
    print(f"wrote {len(PNG_SIZES)} PNGs and {RECORD_NAME} in {ICONS}, and {ICO}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
