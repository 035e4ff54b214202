"""What the memory views share: the chat colours and the palette they draw with, one
constructor, and the bare plot with a caption under it that the page map and the
prefix tree draw in."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QPointF, QRectF, Qt
from PySide6.QtGui import QFontMetrics, QHelpEvent
from PySide6.QtWidgets import QLabel, QToolTip, QVBoxLayout, QWidget

from gui.palette import ChatColors, Palette, palette_for


class ChatColoredView(QWidget):
    """A view drawn in per-chat colours and a light or dark palette. The panel passes
    its own so every view agrees; a view built alone makes its own.

    Views do not override `__init__`: they build their widgets in `_build`, which runs
    once `chats` and `palette_` are set."""

    def __init__(
        self,
        chats: ChatColors | None = None,
        palette: Palette | None = None,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        self.chats = chats if chats is not None else ChatColors(parent=self)
        self.palette_ = palette if palette is not None else palette_for()
        self._build()

    def _build(self) -> None:
        """Make the view's widgets and state (the end of `__init__`)."""


class PlotView(ChatColoredView):
    """A pyqtgraph plot without axes, menu or buttons, y pointing down (the first page
    or prompt at the top, as one reads), over a caption of fixed height. Subclasses add
    their items to `plot` and draw in `_redraw`, which `set_palette` calls."""

    def _build(self) -> None:
        self.plot = pg.PlotWidget(parent=self)
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.getViewBox().invertY(True)
        self.caption = _fixed_caption(self)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.caption)
        self.setMinimumSize(160, 120)

    def set_palette(self, palette: Palette) -> None:
        self.palette_ = palette
        self.plot.setBackground(palette.background)
        self.caption.setStyleSheet(f"color: {palette.muted_text};")
        self._redraw()

    def _redraw(self) -> None:
        """Draw the view from its model in the current palette."""


def _fixed_caption(parent: QWidget) -> QLabel:
    """A two-line caption of fixed height: a caption whose height followed its text would
    re-lay out the panel and repaint every view whenever a figure gains a digit."""
    caption = QLabel(parent)
    caption.setTextFormat(Qt.TextFormat.PlainText)
    caption.setWordWrap(True)
    caption.setFixedHeight(2 * QFontMetrics(caption.font()).lineSpacing() + 2)
    caption.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
    return caption


def show_region_tooltip(widget: QWidget, ev: QEvent, regions: list[tuple[QRectF, str]]) -> bool:
    """For a widget that paints itself: on a tooltip event, show the tip of the region
    under the pointer. True when one was shown (the event is handled)."""
    if ev.type() == QEvent.Type.ToolTip and isinstance(ev, QHelpEvent):
        for rect, tip in regions:
            if rect.contains(QPointF(ev.pos())):
                QToolTip.showText(ev.globalPos(), tip, widget)
                return True
    return False
