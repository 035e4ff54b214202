"""Where the chats live when Folio starts, and what it says when the data folder cannot
be used.

`open_store` checks the data folder the way the store will use it (a folder, room on
the disk, writable), then opens the chat database. When something is wrong the app
still starts: on the existing chats, read-only, when they can be read, else on a
temporary store; the window names the path, the reason and what to do.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox, QWidget

from engine.units import format_bytes
from gui.store import DATABASE_NAME, Store, StoreError, StoreMode, StoreProblem

log = logging.getLogger(__name__)

# Below this the next few replies may not fit (the WAL alone grows to about 4 MB
# between checkpoints): treated as a full disk rather than failing mid-reply.
MIN_FREE_BYTES = 1 << 20
PROBE_BYTES = 4096  # one block: a full disk refuses it, an almost-full one does not


@dataclass(frozen=True)
class StoreOpening:
    """The store the app runs on and, when it is not the data folder's database opened
    for writing, why not."""

    store: Store
    problem: StoreError | None = None


def open_store(folder: Path) -> StoreOpening:
    """The chat database in `folder`; on any problem a fallback and the reason. Never
    raises for a folder or database that cannot be used."""
    database = folder / DATABASE_NAME
    try:
        check_folder(folder)
        if database.exists() and not os.access(database, os.W_OK):
            raise StoreError(database, StoreProblem.READ_ONLY, action="write to")
        return StoreOpening(Store(database))
    except StoreError as problem:
        log.warning("the data folder cannot be used: %s", problem)
        return StoreOpening(fallback_store(database, problem), problem)


def check_folder(folder: Path) -> None:
    """Raise `StoreError` unless `folder` is a folder on a disk with room, that Folio can
    write to."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError.from_exception(_file_in_the_way(folder), exc, "use") from exc
    free = shutil.disk_usage(folder).free
    if free < MIN_FREE_BYTES:
        detail = f"{format_bytes(free, binary=True)} free"
        raise StoreError(folder, StoreProblem.FULL, detail, "write to")
    # Permission bits cannot tell a read-only disk, an administrator's policy or a full
    # disk's reserve apart from a writable folder; a small write can.
    probe = folder / f".folio-write-check-{os.getpid()}"
    try:
        with open(probe, "wb") as file:
            file.write(b"\0" * PROBE_BYTES)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        raise StoreError.from_exception(folder, exc, "write to") from exc
    finally:
        with suppress(OSError):
            probe.unlink()


def _file_in_the_way(folder: Path) -> Path:
    """The file that stands where `folder` or one of its parents should be, if any: the
    path the user has to move."""
    for path in (folder, *folder.parents):
        if path.exists() and not path.is_dir():
            return path
    return folder


def fallback_store(database: Path, problem: StoreError) -> Store:
    """The existing chats, read-only, when they can be read; else a temporary store."""
    # A corrupt or locked file fails the same way when opened read-only.
    if database.is_file() and problem.problem not in (StoreProblem.CORRUPT, StoreProblem.LOCKED):
        try:
            return Store(database, read_only_because=problem)
        except StoreError as exc:
            log.warning("the chats cannot be read either: %s", exc)
    return Store.temporary(because=problem)


def what_happens_now(store: Store) -> str:
    """One sentence on what the fallback means for the user's chats."""
    if store.mode is StoreMode.READ_ONLY:
        return (
            f"For now Folio shows the chats saved in {store.path} read-only: you can read "
            "them, but new messages are not saved."
        )
    if store.mode is StoreMode.TEMPORARY:
        return (
            "For now new chats go to a temporary store and are lost when Folio closes; "
            "no file in the data folder is changed."
        )
    return "Chats are saved as usual."


def problem_dialog(problem: StoreError, store: Store, parent: QWidget | None) -> QMessageBox:
    """The dialog shown once at start-up: what is wrong and where, what to do, what
    happens meanwhile. The caller opens it (non-blocking, so tests and the engine's
    loading carry on)."""
    box = QMessageBox(
        QMessageBox.Icon.Warning,
        "Chats are not being saved",
        "Folio cannot save chats in its data folder.",
        QMessageBox.StandardButton.Ok,
        parent,
    )
    box.setInformativeText(
        f"{problem}\n\n{what_happens_now(store)} Restart Folio once this is fixed."
    )
    # The path is there to be copied into a file manager or a terminal, and wide
    # enough that it is not broken over two lines.
    box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    box.setStyleSheet("QLabel#qt_msgbox_informativelabel { min-width: 520px; }")
    return box
