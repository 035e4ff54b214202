"""The GPU's memory in the memory panel: one bar split into what holds it.

When the engine runs on a CUDA GPU the panel shows, above the page map, the device's
memory as `engine.device.DeviceMemory.parts` splits it: the weights, the KV pages, other
torch tensors, the caching allocator's reserve (reserved, in no tensor), what lies
outside torch (the CUDA context, other processes) and what is free; a line over the bar
names the GPU and its size and, with a host tier, the pinned host RAM that tier holds.
On the CPU the view is hidden.

The figures come from the panel's `DeviceMemorySource` (`engine.device.device_memory`
on a real GPU; a test passes its own). Like the legend the view paints itself at a fixed
height, so a figure gaining a digit never re-lays out the panel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QEvent, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from engine.device import DeviceMemory
from engine.units import format_bytes
from gui.palette import Palette, blend
from gui.views.base import show_region_tooltip

_BAR_H = 12
_SWATCH = 10
_GAP = 4
_SPACING = 10


def _size(n: int) -> str:
    return format_bytes(n, binary=True)


@dataclass(frozen=True)
class DeviceFigures:
    """What the view draws: the device, its memory, and the engine's own shares."""

    device: str  # "cuda:0"
    memory: DeviceMemory
    weights: int
    kv: int
    host_tier: int  # bytes of the host tier (in pinned host RAM, not on the device)

    def title(self) -> str:
        """'VRAM · cuda:0 NVIDIA H200 · 140.0 GiB · host tier 2.0 GiB in pinned RAM'."""
        name = f"{self.device} {self.memory.name}".strip()
        text = f"VRAM · {name} · {_size(self.memory.total)}"
        if self.host_tier:
            text += f" · host tier {_size(self.host_tier)} in pinned RAM"
        return text

    def entries(self) -> list[tuple[str, int, str]]:
        """(words, bytes, tooltip) per share, in drawing order."""
        return [
            (f"{p.name} {_size(p.size)}", p.size, p.what)
            for p in self.memory.parts(self.weights, self.kv)
        ]


def _part_colors(pal: Palette) -> list[str]:
    """weights, KV pages, other, allocator reserve, outside torch, free."""
    # outside torch: a grey between the weights' dark one and free's pale one
    outside = blend(pal.in_use, pal.background, 0.5)
    return [pal.in_use, pal.cached, pal.decode, pal.hit_rate, outside, pal.free]


class DeviceMemoryView(QWidget):
    """A title line, a stacked bar and its words (up to two rows); hover for sources."""

    def __init__(self, palette: Palette, parent: QWidget | None = None):
        super().__init__(parent)
        self.palette_ = palette
        self.figures: DeviceFigures | None = None
        self._hit: list[tuple[QRectF, str]] = []
        self._font = QFont(self.font())
        self._font.setPointSizeF(8.0)
        self.setFont(self._font)
        line = QFontMetrics(self._font).height()
        self._row_h = max(line, _SWATCH) + 2
        self.setFixedHeight(line + 2 + _BAR_H + 2 + 2 * self._row_h)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setVisible(False)

    def set_figures(self, figures: DeviceFigures | None) -> None:
        """Draw these figures; None (the engine is on the CPU, or remote) hides the view."""
        if figures != self.figures:
            self.figures = figures
            self.setVisible(figures is not None)
            self.update()

    def set_palette(self, palette: Palette) -> None:
        self.palette_ = palette
        self.update()

    def title(self) -> str:
        return "" if self.figures is None else self.figures.title()

    def entries(self) -> list[str]:
        """The bar's words, in order (what a test or a screen reader sees)."""
        return [] if self.figures is None else [words for words, _, _ in self.figures.entries()]

    def paintEvent(self, _event: Any) -> None:  # noqa: N802 - Qt's name
        pal, figures = self.palette_, self.figures
        p = QPainter(self)
        p.fillRect(self.rect(), QColor(pal.background))
        self._hit = []
        if figures is None:
            p.end()
            return
        p.setFont(self._font)
        fm = QFontMetrics(self._font)
        left, right = 4.0, self.width() - 4.0
        p.setPen(QColor(pal.foreground))
        title = fm.elidedText(figures.title(), Qt.TextElideMode.ElideRight, int(right - left))
        p.drawText(QRectF(left, 0, right - left, fm.height()), Qt.AlignmentFlag.AlignVCenter, title)
        entries = figures.entries()
        colors = _part_colors(pal)
        # the bar spans the total, or the shares' sum when inconsistent figures exceed it
        whole = max(figures.memory.total, sum(size for _, size, _ in entries), 1)
        y, x = fm.height() + 2.0, left
        for (words, size, tip), color in zip(entries, colors):
            w = (right - left) * size / whole
            if w > 0:
                p.fillRect(QRectF(x, y, w, _BAR_H), QColor(color))
                self._hit.append((QRectF(x, y, w, _BAR_H), f"{words}: {tip}"))
            x += w
        x, y = left, y + _BAR_H + 2
        for (words, _, tip), color in zip(entries, colors):
            w = _SWATCH + _GAP + fm.horizontalAdvance(words)
            if x + w > right and x > left:
                x, y = left, y + self._row_h
                if y + self._row_h > self.height():
                    break  # a third row would not show; the bar's tooltips say it all
            top = y + (self._row_h - _SWATCH) / 2
            p.fillRect(QRectF(x, top, _SWATCH, _SWATCH), QColor(color))
            p.setPen(QColor(pal.foreground))
            p.drawText(
                QRectF(x + _SWATCH + _GAP, y, w, self._row_h), Qt.AlignmentFlag.AlignVCenter, words
            )
            self._hit.append((QRectF(x, y, w, self._row_h), f"{words}: {tip}"))
            x += w + _SPACING
        p.end()

    def event(self, ev: QEvent) -> bool:
        return show_region_tooltip(self, ev, self._hit) or super().event(ev)
