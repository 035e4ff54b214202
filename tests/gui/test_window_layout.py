"""The main window's layout at 1024x700 and up: every panel open, no widget below its
minimum size, spin boxes wide enough to show their values, the memory dock toggled
without the window changing width, and a squeezed layout not brought back by a restart.

No model: the layout is the widgets', and the status bar's model figures are elided."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import QAbstractScrollArea, QAbstractSpinBox, QApplication, QWidget

from gui.main_window import CHAT_MIN_WIDTH, MainWindow
from gui.store import Store

SIZES = [(1024, 700), (1400, 860)]


def make_window(qtbot, folder: Path) -> MainWindow:
    settings = QSettings(str(folder / "folio.ini"), QSettings.Format.IniFormat)
    window = MainWindow(Store(folder / "chats.sqlite3"), settings)
    qtbot.addWidget(window)
    return window


def open_every_panel(qtbot, window: MainWindow, size: tuple[int, int]) -> None:
    window.resize(*size)
    window.show()
    window.chat_view.settings.toggle.setChecked(True)
    window.memory_dock.show()
    settle(qtbot)


def settle(qtbot) -> None:
    for _ in range(3):
        QApplication.processEvents()
        qtbot.wait(20)


def owned_by_a_composite(widget: QWidget) -> bool:
    """A spin box's editor and a table's header and scroll bars: their owner sizes them
    inside its own frame (a table scrolls), so its own size is the one to judge."""
    parent = widget.parentWidget()
    while parent is not None:
        if isinstance(parent, QAbstractSpinBox | QAbstractScrollArea):
            return True
        parent = parent.parentWidget()
    return False


def squeezed(window: MainWindow) -> list[str]:
    """Visible widgets smaller than their minimum size hint, named for the message."""
    out = []
    for widget in [window, *window.findChildren(QWidget)]:
        if not widget.isVisible() or owned_by_a_composite(widget):
            continue
        need = widget.minimumSizeHint().expandedTo(widget.minimumSize())
        if not need.isValid():
            continue
        if widget.width() < need.width() or widget.height() < need.height():
            name = f"{type(widget).__name__} {widget.objectName()}".strip()
            out.append(f"{name}: {widget.size().toTuple()} < {need.toTuple()}")
    return out


@pytest.mark.parametrize("size", SIZES)
def test_every_panel_open_fits(qtbot, tmp_path, size):
    window = make_window(qtbot, tmp_path)
    open_every_panel(qtbot, window, size)
    assert window.size().toTuple() == size, "the window grew past the size it was given"
    assert squeezed(window) == []
    # Opening the chat's settings leaves the chat list its room.
    assert window.chats.width() >= window.chats.minimumSizeHint().width() > 0
    # A narrow window takes its width from the dock and the list before the chat.
    if window.chat_view.width() < CHAT_MIN_WIDTH:
        assert window.memory_dock.width() == window.memory_dock.minimumSizeHint().width()
        assert window.chats.width() == window.chats.minimumSizeHint().width()
    # Each spin box is wide enough for the text of its value, and for its widest value.
    spins = window.chat_view.settings.findChildren(QAbstractSpinBox)
    assert len(spins) == 5
    for spin in spins:
        editor = spin.lineEdit()
        metrics = editor.fontMetrics()
        spin.setValue(spin.maximum())
        assert editor.width() >= metrics.horizontalAdvance(spin.text()), spin.toolTip()
    window.close()


def test_the_graphs_are_never_cut(qtbot, tmp_path):
    """The graphs' scene does not shrink below its plots' titles and axes: the widget's
    minimum is that width, and the dock honours it."""
    window = make_window(qtbot, tmp_path)
    open_every_panel(qtbot, window, (1024, 700))
    graphs = window.memory_panel.graphs
    layout_min = graphs.view.ci.minimumWidth()
    assert graphs.minimumWidth() >= layout_min
    assert graphs.view.width() >= layout_min
    window.close()


@pytest.mark.parametrize("size", SIZES)
def test_hiding_and_showing_the_memory_dock_keeps_the_window_size(qtbot, tmp_path, size):
    window = make_window(qtbot, tmp_path)
    open_every_panel(qtbot, window, size)
    toggle = window.memory_dock.toggleViewAction()
    for _ in range(2):
        toggle.trigger()
        settle(qtbot)
        assert not window.memory_dock.isVisible()
        assert window.size().toTuple() == size
        toggle.trigger()
        settle(qtbot)
        assert window.memory_dock.isVisible()
        assert window.size().toTuple() == size
    assert squeezed(window) == []
    window.close()


def test_a_squeezed_layout_is_not_restored(qtbot, tmp_path):
    """A dock dragged as wide as it goes and a chat list dragged shut, saved on close,
    come back inside every widget's minimum at 1024x700."""
    window = make_window(qtbot, tmp_path)
    open_every_panel(qtbot, window, (1400, 860))
    window.resizeDocks([window.memory_dock], [1200], Qt.Orientation.Horizontal)
    window.splitter.setSizes([0, 2000])
    settle(qtbot)
    window.close()
    again = make_window(qtbot, tmp_path)
    open_every_panel(qtbot, again, (1024, 700))
    assert again.size().toTuple() == (1024, 700)
    assert squeezed(again) == []
    assert again.chats.width() >= again.chats.minimumSizeHint().width()
    again.close()
