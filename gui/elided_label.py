"""A one-line label that ends in "…" when it is too narrow for its text."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel, QWidget


class ElidedLabel(QLabel):
    """A label whose minimum width is at most `min_width`: narrower than its text, it
    ends in "…" instead of being cut mid-word, and it never holds a layout wider than
    the window can be (the status bar's model name, a chat's settings summary). Set a
    tooltip with the whole text where it matters."""

    def __init__(self, text: str = "", parent: QWidget | None = None, min_width: int = 160):
        super().__init__(text, parent)
        self.min_width = min_width

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), self.min_width), hint.height())

    def paintEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        painter = QPainter(self)
        self.drawFrame(painter)  # the style sheet's border, as QLabel draws it
        rect = self.contentsRect()
        text = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, rect.width())
        painter.drawText(rect, int(self.alignment()), text)
