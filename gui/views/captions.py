"""Small layout pieces the views share."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget


def fixed_caption(parent: QWidget) -> QLabel:
    """A two-line caption of fixed height: a caption whose height followed its text would
    re-lay out the panel and repaint every view whenever a figure gains a digit."""
    caption = QLabel(parent)
    caption.setTextFormat(Qt.TextFormat.PlainText)
    caption.setWordWrap(True)
    caption.setFixedHeight(2 * QFontMetrics(caption.font()).lineSpacing() + 2)
    caption.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
    return caption


def plot_with_caption(widget: QWidget, plot: QWidget, caption: QLabel) -> None:
    layout = QVBoxLayout(widget)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.setSpacing(2)
    layout.addWidget(plot, 1)
    layout.addWidget(caption)
