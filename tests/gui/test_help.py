"""The window's keys and Help menu, without a model: Ctrl+F, Ctrl+, and the memory
panel's key reach their targets from the message box, the shortcuts dialog lists every
key the window has, and the memory help names every legend entry."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QAction

from gui.main_window import MainWindow
from gui.settings_dialog import SettingsDialog
from gui.store import Store


@pytest.fixture
def window(qtbot, tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    win = MainWindow(store, QSettings(str(tmp_path / "f.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    win.activateWindow()
    yield win
    win.close()
    store.close()


def test_ctrl_f_moves_focus_from_the_composer_to_the_search(qtbot, window):
    composer = window.chat_view.input
    composer.setFocus()
    qtbot.waitUntil(composer.hasFocus)
    qtbot.keyClick(composer, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert window.chats.search.hasFocus()
    assert composer.toPlainText() == ""


def test_ctrl_comma_opens_the_engine_settings(qtbot, window, monkeypatch):
    opened = []
    monkeypatch.setattr(SettingsDialog, "exec", lambda self: opened.append(self) or 0)
    qtbot.keyClick(window.chat_view.input, Qt.Key.Key_Comma, Qt.KeyboardModifier.ControlModifier)
    assert len(opened) == 1


def test_the_memory_key_hides_and_shows_the_dock(qtbot, window):
    assert window.memory_dock.isVisible()
    mods = Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier
    qtbot.keyClick(window.chat_view.input, Qt.Key.Key_M, mods)
    assert not window.memory_dock.isVisible()
    qtbot.keyClick(window.chat_view.input, Qt.Key.Key_M, mods)
    assert window.memory_dock.isVisible()


def test_no_two_actions_share_a_key(window):
    keys = [a.shortcut().toString() for a in window.findChildren(QAction)]
    keys = [k for k in keys if k]
    assert len(keys) == len(set(keys))


def test_the_shortcuts_dialog_lists_every_key_of_the_window(window):
    dialog = window.open_shortcuts()
    listed = dialog.rows()
    shown_keys = {keys for _, keys in listed}
    for action in window.findChildren(QAction):
        if not action.shortcut().isEmpty():
            assert action.shortcut().toString() in shown_keys, action.text()
    assert ("Chat › Search chats", "Ctrl+F") in listed
    assert ("File › Engine settings", "Ctrl+,") in listed
    assert any("Delete the selected chat" in what for what, _ in listed)  # a QShortcut
    dialog.close()


def test_the_memory_help_names_every_legend_entry(window):
    dialog = window.open_memory_help()
    assert dialog.isVisible()
    text = dialog.text.toPlainText()
    entries = window.memory_panel.legend.entries()
    assert "free" in entries and "evicted next" in entries
    for entry in entries:
        assert entry in text, entry
    assert f"{window.engine_settings.page_size} tokens" in text
    assert window.open_memory_help() is dialog  # one for the window
