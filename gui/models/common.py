"""What the Models window's tabs share: errors and byte counts in words, chips, tables.

Every Hub call (search, a repository's listing, a header peek) and every disk scan can
block for seconds, so none runs on the UI thread: the tabs run them with
`gui.worker.TaskRunner`, which reports failures with :func:`plain_error`.
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QLabel,
    QProgressBar,
    QTableWidget,
    QTableWidgetItem,
    QWidget,
)

from gui.palette import OKABE_ITO, label_color_on

ERROR_COLOR = "#B3261E"  # readable red on light and dark window backgrounds alike
WARNING_COLOR = "#8A5A00"


def plain_error(exc: BaseException) -> str:
    """The words to show for a failed call: a HubError's own text, else explain()'s."""
    from engine.hub.errors import HubError, explain

    if isinstance(exc, HubError | ValueError):
        return str(exc) or type(exc).__name__
    try:
        return str(explain(exc))
    except Exception:  # noqa: BLE001 - the message itself must never crash the window
        return f"{type(exc).__name__}: {exc}"


def fmt_count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}".replace(".0", "")
    return str(n)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def fmt_when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch)) if epoch else "never"


# Okabe-Ito hues (gui/palette.py), so "fits" / "tight" / "won't fit" stay apart for
# colour-blind users; the chip's words carry the meaning in any case.
CHIP_COLORS = {
    "Fits": OKABE_ITO["bluish_green"],
    "Tight": OKABE_ITO["yellow"],
    "Won't fit": OKABE_ITO["vermillion"],
    "Unknown": "#8C959F",
    "Can't run": "#8C959F",
}


def chip(text: str, tooltip: str = "") -> QLabel:
    """A small rounded label coloured by its text (Fits / Tight / Won't fit / ...)."""
    color = CHIP_COLORS.get(text, "#8C959F")
    label = QLabel(text)
    label.setObjectName("fit_chip")
    label.setAlignment(Qt.AlignmentFlag.AlignCenter)
    label.setStyleSheet(
        f"QLabel {{ background: {color}; color: {label_color_on(color)}; border-radius: 8px;"
        f" padding: 1px 8px; margin: 3px 6px; font-weight: 600; }}"
    )
    label.setToolTip(tooltip)
    return label


def busy_bar() -> QProgressBar:
    """A thin indeterminate bar shown while a TaskRunner works."""
    bar = QProgressBar()
    bar.setRange(0, 0)
    bar.setTextVisible(False)
    bar.setFixedHeight(4)
    bar.setVisible(False)
    return bar


def set_message(label: QLabel, text: str, kind: str = "info") -> None:
    """An inline status line: errors in red, warnings in amber, the rest in the text colour."""
    color = {"error": ERROR_COLOR, "warning": WARNING_COLOR}.get(kind)
    label.setStyleSheet(f"color: {color};" if color else "")
    label.setText(text)
    label.setProperty("kind", kind)
    label.setVisible(bool(text))


def message_label(parent: QWidget | None = None) -> QLabel:
    label = QLabel(parent)
    label.setWordWrap(True)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    label.setVisible(False)
    return label


def table_item(text: str, align_right: bool = False, tooltip: str = "") -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    item.setFlags(Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsEnabled)
    if align_right:
        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
    if tooltip:
        item.setToolTip(tooltip)
    return item


def make_table(headers: list[str]) -> QTableWidget:
    table = QTableWidget(0, len(headers))
    table.setHorizontalHeaderLabels(headers)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.verticalHeader().setVisible(False)
    table.setShowGrid(False)
    table.setAlternatingRowColors(True)
    table.setWordWrap(False)
    table.horizontalHeader().setHighlightSections(False)
    return table
