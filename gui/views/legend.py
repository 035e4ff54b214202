"""The legend: what every colour and mark of the memory views means, always visible.

It is drawn from the same `Palette` and `ChatColors` as the views, so it cannot
disagree with them; the chat swatches list the chats that hold pages right now, and the
tiers' swatches say how many pages each holds (`set_counts`, from the snapshot the page
map draws).

The whole legend is one widget that paints itself. An earlier version was a row of
labels and swatch widgets, rebuilt (and re-styled with style sheets) whenever a chat
came or went; each rebuild cost 10-40 ms of UI time and re-laid out the window. Now a
change is a list of entries and one `update()`, and the height is fixed (two rows), so
nothing around the legend moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QEvent, QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPen, QPolygonF
from PySide6.QtWidgets import QSizePolicy

from gui.palette import Palette, blend, is_api
from gui.views.base import ChatColoredView, show_region_tooltip

_SWATCH = 12  # px, a page cell as the map draws it
_GAP = 4  # swatch to word
_SPACING = 10  # one entry to the next
_MAX_CHATS = 6  # chat swatches listed; the rest are counted


@dataclass(frozen=True)
class LegendEntry:
    """One swatch and its word; the swatch is drawn the way the page map draws a cell."""

    text: str
    color: str | None  # None: words only ("+3 chats")
    tip: str = ""
    fill: float = 1.0
    dot: bool = False
    frame: bool = False
    corner: bool = False  # the mark of a page read back from disk


def draw_swatch(p: QPainter, x: float, y: float, e: LegendEntry, pal: Palette) -> None:
    r = QRectF(x, y, _SWATCH, _SWATCH)
    p.fillRect(r, QColor(blend(e.color or pal.free, pal.background, 0.65)))
    h = _SWATCH * e.fill
    p.fillRect(QRectF(x, y + _SWATCH - h, _SWATCH, h), QColor(e.color or pal.free))
    if e.frame:
        p.setPen(QPen(QColor(pal.evict), 2))
        p.drawRect(QRectF(x + 1, y + 1, _SWATCH - 2, _SWATCH - 2))
    if e.dot:
        p.fillRect(QRectF(x + 4, y + 4, 4, 4), QColor(pal.shared_mark))
    if e.corner:
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(QColor(pal.disk))
        p.drawPolygon(QPolygonF([QPointF(x, y), QPointF(x + 6, y), QPointF(x, y + 6)]))


class LegendBar(ChatColoredView):
    """Swatches and words in up to two rows (wrapping when narrow); hover for what
    each means."""

    def _build(self) -> None:
        self._active: list[Any] = []
        self._counts: dict[str, int] = {}
        self._gpu = False
        self._entries: list[LegendEntry] = []
        self._hit: list[tuple[QRectF, str]] = []  # where each entry was drawn, for tooltips
        self._font = QFont(self.font())
        self._font.setPointSizeF(8.0)
        self.setFont(self._font)
        line = QFontMetrics(self._font).height()
        self._row_h = max(line, _SWATCH) + 4
        self.setFixedHeight(2 * self._row_h + 4)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setToolTip("Page map and prefix tree use these colours; hover a page for details.")
        self.chats.changed.connect(self._rebuild)
        self._rebuild()

    def entries(self) -> list[str]:
        """The legend's words, in order (what a test or a screen reader sees)."""
        return [e.text for e in self._entries]

    def set_palette(self, palette: Palette) -> None:
        self.palette_ = palette
        self._rebuild()

    def set_active_chats(self, tags: list[Any]) -> None:
        """The chats to list (those holding pages now); colours come from ChatColors.
        A chat with several jobs (every API request is one "API" chat) is listed once."""
        tags = _each_once(tags)
        if tags != self._active:
            self._active = tags
            self._rebuild()

    def set_counts(self, counts: dict[str, int]) -> None:
        """Pages per state ("free", "cached", "host tier", "disk tier"); a tier the
        engine does not have is left out of ``counts`` and shows no number."""
        if counts != self._counts:
            self._counts = dict(counts)
            self._rebuild()

    def set_on_gpu(self, gpu: bool) -> None:
        """Pages on a GPU: the tips say VRAM, and the host tier is named as host RAM."""
        if gpu != self._gpu:
            self._gpu = gpu
            self._rebuild()

    def _counted(self, word: str, shown: str | None = None) -> str:
        """``shown`` (default ``word``) with the count of ``word``'s pages, if any."""
        shown = shown or word
        n = self._counts.get(word)
        return shown if n is None else f"{shown} {n:,}"

    def _rebuild(self) -> None:
        pal = self.palette_
        vram = " (in VRAM)" if self._gpu else ""
        host = "host tier (RAM)" if self._gpu else "host tier"
        host_tip = (
            "evicted from VRAM to pinned host RAM, copied back on a prefix hit"
            if self._gpu
            else "evicted to host memory, restorable"
        )
        out = [
            LegendEntry(self._counted("free"), pal.free, f"an empty page{vram}, ready for any job"),
            LegendEntry(
                self._counted("cached"),
                pal.cached,
                f"no job holds it{vram}; kept for prefix-cache hits",
            ),
            LegendEntry(self._counted("host tier", host), pal.host, host_tip),
            LegendEntry(
                self._counted("disk tier"),
                pal.disk,
                "kept on disk: survives a restart, read back instead of prefilled",
            ),
        ]
        if self._active:
            for tag in self._active[:_MAX_CHATS]:
                tip = "held by requests to the local server" if is_api(tag) else "held by this chat"
                out.append(LegendEntry(self.chats.name(tag), self.chats.color(tag), tip))
            if len(self._active) > _MAX_CHATS:
                out.append(LegendEntry(f"+{len(self._active) - _MAX_CHATS} chats", None))
        else:
            out.append(LegendEntry("in use", pal.in_use, "held by a job (coloured by its chat)"))
        out += [
            LegendEntry("fill", pal.cached, "solid part = tokens written", fill=0.4),
            LegendEntry("shared", pal.in_use, "ref count > 1: several jobs read it", dot=True),
            LegendEntry(
                "evicted next", pal.cached, "reused first when pages run out", frame=True
            ),  # fmt: skip
            LegendEntry(
                "from disk", pal.cached, "read back from the disk tier a moment ago", corner=True
            ),
        ]
        if out != self._entries:
            self._entries = out
            self.update()

    def paintEvent(self, _event: Any) -> None:  # noqa: N802 - Qt's name
        pal = self.palette_
        p = QPainter(self)
        p.fillRect(self.rect(), QColor(pal.background))
        p.setFont(self._font)
        fm = QFontMetrics(self._font)
        x, y, right = 4.0, 2.0, self.width() - 4
        self._hit = []
        for e in self._entries:
            text = fm.elidedText(e.text, Qt.TextElideMode.ElideRight, 110)
            w = (_SWATCH + _GAP if e.color else 0) + fm.horizontalAdvance(text)
            if x + w > right and x > 4:
                x, y = 4.0, y + self._row_h
                if y + self._row_h > self.height():
                    break  # a third row would not show; the tooltip lists everything
            top = y + (self._row_h - _SWATCH) / 2
            if e.color:
                draw_swatch(p, x, top, e, pal)
                tx = x + _SWATCH + _GAP
            else:
                tx = x
            p.setPen(QColor(pal.foreground))
            p.drawText(QRectF(tx, y, w, self._row_h), Qt.AlignmentFlag.AlignVCenter, text)
            self._hit.append((QRectF(x, y, w, self._row_h), e.tip or e.text))
            x += w + _SPACING
        p.end()

    def event(self, ev: QEvent) -> bool:
        return show_region_tooltip(self, ev, self._hit) or super().event(ev)


def _each_once(tags: list[Any]) -> list[Any]:
    """``tags`` without repeats, in order (a server under load lists hundreds of jobs)."""
    seen: set[Any] = set()
    out: list[Any] = []
    for tag in tags:
        try:
            if tag in seen:
                continue
            seen.add(tag)
        except TypeError:  # an unhashable tag: compare it the slow way
            if tag in out:
                continue
        out.append(tag)
    return out
