"""A data folder that cannot be used (a file in its place, a full disk, a write that
fails, a corrupt or locked database): the app starts anyway, on the chats read-only when
they can be read, else on a temporary store, and says where, why and what to do."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import sys

import pytest
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication

import gui.data_folder
import gui.store
from gui.data_folder import open_store
from gui.main_window import MainWindow
from gui.store import DATABASE_NAME, Store, StoreError, StoreMode, StoreProblem


def a_saved_chat(folder) -> None:
    store = Store(folder / DATABASE_NAME)
    conv = store.create_conversation("Trip")
    q = store.add_message(conv.id, None, "user", "Where to?")
    store.add_message(conv.id, q.id, "assistant", "Lisbon.")
    store.close()


def nearly_full(monkeypatch, free: int = 200_000) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(
        gui.data_folder.shutil, "disk_usage", lambda path: real(path)._replace(free=free)
    )


@pytest.fixture
def close_after():
    stores: list[Store] = []
    yield stores.append
    for store in stores:
        store.close()


def test_a_file_in_place_of_the_folder_gives_a_temporary_store(tmp_path, close_after):
    in_the_way = tmp_path / "folio"
    in_the_way.write_text("I am a file")
    for folder in (in_the_way, in_the_way / "data"):  # the folder, or one above it
        opening = open_store(folder)
        close_after(opening.store)
        assert opening.store.mode is StoreMode.TEMPORARY
        problem = opening.problem
        assert problem is not None and problem.problem is StoreProblem.NOT_A_FOLDER
        assert str(in_the_way) in str(problem) and "FOLIO_DATA_DIR" in str(problem)
        opening.store.create_conversation("works")  # the temporary store takes writes
    assert in_the_way.read_text() == "I am a file"


def test_a_full_disk_opens_the_chats_read_only(tmp_path, monkeypatch, close_after):
    a_saved_chat(tmp_path)
    nearly_full(monkeypatch)
    opening = open_store(tmp_path)
    close_after(opening.store)
    store = opening.store
    assert store.mode is StoreMode.READ_ONLY
    assert [c.title for c in store.conversations()] == ["Trip"]
    assert "disk is full" in str(opening.problem) and str(tmp_path) in str(opening.problem)
    with pytest.raises(StoreError, match="disk is full"):
        store.add_message(1, None, "user", "more")


def test_a_write_that_fails_opens_the_chats_read_only(tmp_path, monkeypatch, close_after):
    """What the permission bits do not show (a read-only disk, a disk's last blocks)
    shows in a small write."""
    a_saved_chat(tmp_path)

    def no_space(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gui.data_folder.os, "fsync", no_space)
    opening = open_store(tmp_path)
    close_after(opening.store)
    assert opening.store.mode is StoreMode.READ_ONLY
    assert opening.problem.problem is StoreProblem.FULL
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".folio-write-check")]


def test_a_corrupt_database_is_left_as_it_is(tmp_path, close_after):
    database = tmp_path / DATABASE_NAME
    database.write_bytes(b"not sqlite " * 500)
    opening = open_store(tmp_path)
    close_after(opening.store)
    assert opening.store.mode is StoreMode.TEMPORARY
    assert opening.problem.problem is StoreProblem.CORRUPT
    assert str(database) in str(opening.problem)
    assert database.read_bytes() == b"not sqlite " * 500


def test_a_locked_database_gives_a_temporary_store(tmp_path, monkeypatch, close_after):
    a_saved_chat(tmp_path)
    monkeypatch.setattr(gui.store, "BUSY_TIMEOUT_S", 0.05)
    holder = sqlite3.connect(tmp_path / DATABASE_NAME, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("UPDATE conversations SET title = 'Held'")  # takes the lock for good
    try:
        opening = open_store(tmp_path)
        close_after(opening.store)
    finally:
        holder.close()
    assert opening.store.mode is StoreMode.TEMPORARY
    assert opening.problem.problem is StoreProblem.LOCKED
    assert "another program" in str(opening.problem)


def window_on(store: Store, tmp_path, qtbot) -> MainWindow:
    settings = QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)
    window = MainWindow(store, settings)
    qtbot.addWidget(window)
    window.resize(1100, 620)
    window.show()
    return window


def test_the_window_on_read_only_chats_says_why_a_message_is_not_saved(
    qtbot, tmp_path, monkeypatch
):
    a_saved_chat(tmp_path)
    before = (tmp_path / DATABASE_NAME).read_bytes()
    nearly_full(monkeypatch)
    opening = open_store(tmp_path)
    window = window_on(opening.store, tmp_path, qtbot)
    box = window.show_data_folder_problem(opening.problem)
    assert box.isVisible()  # opened, not exec'd: the test (and the engine) carry on
    assert str(tmp_path) in box.informativeText() and "disk is full" in box.informativeText()
    assert "read-only" in box.informativeText()
    assert "not being saved" in window.windowTitle()
    assert window.saving_label.isVisible() and "read-only" in window.saving_label.text()
    view = window.chat_view
    assert [b.text for b in view.bubbles.values()] == ["Where to?", "Lisbon."]
    view.input.setPlainText("And after Lisbon?")
    assert view.send() is None
    assert view.notice is not None and "disk is full" in view.notice._segment_widgets[0].text()
    assert view.notice.role_label.text() == "Not saved"
    assert view.input.toPlainText() == "And after Lisbon?"  # nothing typed is lost
    window.new_conversation()
    assert "disk is full" in window.error_dialog.informativeText() + window.error_dialog.text()
    window.error_dialog.close()
    view.settings.temperature.setValue(0.2)  # a change it cannot save either
    view.save_settings()
    window.close()  # closes cleanly: nothing raises on the way out
    opening.store.close()
    assert (tmp_path / DATABASE_NAME).read_bytes() == before


def test_the_window_on_a_temporary_store_says_chats_are_not_saved(qtbot, tmp_path):
    in_the_way = tmp_path / "folio"
    in_the_way.write_text("I am a file")
    opening = open_store(in_the_way)
    window = window_on(opening.store, tmp_path, qtbot)
    window.show_data_folder_problem(opening.problem)
    assert "temporary" in window.windowTitle() and "not being saved" in window.windowTitle()
    assert "lost when Folio closes" in window.data_folder_dialog.informativeText()
    view = window.chat_view
    view.input.setPlainText("Hello")
    assert view.send() is None  # no model: an error bubble that says what to do
    reply = list(view.bubbles.values())[-1]
    assert reply.objectName() == "bubble_error"
    assert "File > Models" in reply._segment_widgets[0].text()
    window.close()
    opening.store.close()


def test_the_app_starts_when_the_data_folder_is_a_file(qtbot, tmp_path, monkeypatch):
    """`folio` with an unusable data folder: a window on a temporary store and a dialog
    naming the path, not a traceback."""
    import gui.app

    in_the_way = tmp_path / "folio"
    in_the_way.write_text("I am a file")
    monkeypatch.setenv("FOLIO_DATA_DIR", str(in_the_way))
    monkeypatch.setattr(MainWindow, "start_engine", lambda self, model=None: None)
    seen: dict[str, str] = {}

    def run_the_loop_once(_app=None) -> int:
        window = next(
            w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()
        )
        seen["title"] = window.windowTitle()
        seen["dialog"] = window.data_folder_dialog.informativeText()
        window.close()
        return 0

    monkeypatch.setattr(QApplication, "exec", run_the_loop_once)
    monkeypatch.setattr(sys, "argv", ["folio"])
    assert gui.app.main([]) == 0
    assert "not being saved" in seen["title"]
    assert str(in_the_way) in seen["dialog"] and "FOLIO_DATA_DIR" in seen["dialog"]
    assert os.path.isfile(in_the_way)


def test_the_window_says_so_while_a_full_disk_refuses_writes(qtbot, tmp_path):
    """A disk that fills up while Folio runs: the status bar and the chat say the
    message was not saved, the text goes back to the input box, and the notice goes
    once a write gets through again."""
    store = Store(tmp_path / DATABASE_NAME)
    window = window_on(store, tmp_path, qtbot)
    view = window.chat_view
    assert window.windowTitle() == "Folio" and not window.saving_label.isVisible()
    store._db.execute("PRAGMA max_page_count = 1")  # SQLite's own "disk is full"
    long_text = "a long question " * 20_000
    view.input.setPlainText(long_text)
    assert view.send() is None
    assert window.saving_label.isVisible() and "disk is full" in window.saving_label.toolTip()
    assert "not being saved" in window.windowTitle()
    assert view.notice is not None and view.input.toPlainText() == long_text.strip()
    store._db.execute("PRAGMA max_page_count = 1000000")
    view.input.setPlainText("short")
    view.send()  # stored (no model: answered by an error bubble)
    assert view.notice is None and not window.saving_label.isVisible()
    assert window.windowTitle() == "Folio"
    window.close()
    store.close()
