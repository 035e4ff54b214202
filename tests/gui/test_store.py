"""The chat database: message trees (versions), transcripts, search, crash-safe writes,
and a database that cannot be written (full disk, read-only, corrupt, newer)."""

from __future__ import annotations

import os
import sqlite3

import pytest

from engine.paths import data_dir
from gui.store import (
    DEFAULT_CONTEXT_POLICY,
    SCHEMA_VERSION,
    Store,
    StoreError,
    StoreMode,
    StoreProblem,
)


def test_versions_and_transcripts(tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    conv = store.create_conversation("Trip", system_prompt="Be brief.")
    q1 = store.add_message(conv.id, None, "user", "Where to?")
    a1 = store.add_message(conv.id, q1.id, "assistant", "Lisbon.")
    # editing q1 adds a sibling; the old branch stays
    q1b = store.add_message(conv.id, None, "user", "Where to in May?")
    a1b = store.add_message(conv.id, q1b.id, "assistant", "Porto.")
    assert [m.id for m in store.transcript(conv.id)] == [q1b.id, a1b.id]
    assert [m.id for m in store.siblings(q1)] == [q1.id, q1b.id]
    assert store.deepest_leaf(q1.id) == a1.id
    store.update_conversation(conv.id, current_leaf=store.deepest_leaf(q1.id))
    assert [m.content for m in store.transcript(conv.id)] == ["Where to?", "Lisbon."]
    regen = store.add_message(conv.id, q1.id, "assistant", "Rome.")
    assert [m.id for m in store.siblings(a1)] == [a1.id, regen.id]


def test_partial_writes_are_visible_to_another_connection(tmp_path):
    """What a killed process left is what a new one reads (autocommit, WAL)."""
    path = tmp_path / "chats.sqlite3"
    store = Store(path)
    conv = store.create_conversation()
    q = store.add_message(conv.id, None, "user", "Hi")
    a = store.add_message(conv.id, q.id, "assistant", "", complete=False)
    store.update_message(a.id, content="Hel", complete=False)
    other = Store(path)
    got = other.message(a.id)
    assert (got.content, got.complete) == ("Hel", False)
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_search_rename_delete(tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    a = store.create_conversation("Poems")
    b = store.create_conversation("Code help")
    store.add_message(b.id, None, "user", "a sorting algorithm please")
    assert [c.id for c in store.conversations("poem")] == [a.id]
    assert [c.id for c in store.conversations("sorting")] == [b.id]
    store.update_conversation(a.id, title="Haiku", sampling={"temperature": 0.2})
    assert store.conversation(a.id).sampling == {"temperature": 0.2}
    store.delete_conversation(b.id)
    assert [c.id for c in store.conversations()] == [a.id]
    assert store.messages(b.id) == []


def test_data_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("FOLIO_DATA_DIR", str(tmp_path / "x"))
    assert data_dir() == tmp_path / "x"


# -- a data folder that cannot be written ---------------------------------------------

# Statements that change the file; an authorizer that refuses them stands in for a full
# disk or a read-only file, and works when the tests run as root (where chmod does not).
_WRITES = {
    sqlite3.SQLITE_INSERT,
    sqlite3.SQLITE_UPDATE,
    sqlite3.SQLITE_DELETE,
    sqlite3.SQLITE_CREATE_TABLE,
    sqlite3.SQLITE_CREATE_INDEX,
    sqlite3.SQLITE_DROP_TABLE,
    sqlite3.SQLITE_ALTER_TABLE,
}
_FILE_PRAGMAS = {"user_version", "journal_mode", "application_id", "page_size", "auto_vacuum"}


def _refuse_writes(action, arg1, arg2, _db, _trigger):
    if action in _WRITES or (
        action == sqlite3.SQLITE_PRAGMA and arg1 in _FILE_PRAGMAS and arg2 is not None
    ):
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def chats_in(path) -> list[tuple]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT c.title, m.content FROM conversations c JOIN messages m"
                          " ON m.conversation_id = c.id ORDER BY m.id").fetchall()  # fmt: skip
    finally:
        db.close()


def a_saved_chat(path) -> None:
    store = Store(path)
    conv = store.create_conversation("Trip")
    q = store.add_message(conv.id, None, "user", "Where to?")
    store.add_message(conv.id, q.id, "assistant", "Lisbon.")
    store.close()


def test_opening_a_current_database_writes_nothing(tmp_path, monkeypatch):
    """A full disk or a read-only file still opens the chats: the schema is written only
    when it is missing or old, never on every open."""
    path = tmp_path / "chats.sqlite3"
    a_saved_chat(path)
    real_connect = sqlite3.connect

    def connect_refusing_writes(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        db.set_authorizer(_refuse_writes)
        return db

    monkeypatch.setattr(sqlite3, "connect", connect_refusing_writes)
    store = Store(path)
    conv = store.conversations()[0]
    assert [m.content for m in store.transcript(conv.id)] == ["Where to?", "Lisbon."]
    with pytest.raises(StoreError) as refused:
        store.add_message(conv.id, conv.current_leaf, "user", "And then?")
    assert str(path) in str(refused.value)
    store.close()
    monkeypatch.undo()
    assert chats_in(path) == [("Trip", "Where to?"), ("Trip", "Lisbon.")]


def test_a_new_database_gets_the_schema_and_its_version(tmp_path):
    path = tmp_path / "new" / "chats.sqlite3"
    Store(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def fill_the_disk(store: Store) -> None:
    """SQLite's own SQLITE_FULL: the database may not grow by another page."""
    store._db.execute("PRAGMA max_page_count = 1")  # clamped to the pages it has now


def test_a_full_disk_refuses_the_write_and_keeps_what_was_stored(tmp_path):
    path = tmp_path / "chats.sqlite3"
    a_saved_chat(path)
    store = Store(path)
    conv = store.conversations()[0]
    fill_the_disk(store)
    with pytest.raises(StoreError) as full:
        store.add_message(conv.id, conv.current_leaf, "user", "x" * 200_000)
    assert full.value.problem is StoreProblem.FULL
    message = str(full.value)
    assert str(path) in message and "disk is full" in message and "Free some space" in message
    # the failed call left nothing half-done: no new message, the current leaf as it was
    assert store.conversation(conv.id).current_leaf == conv.current_leaf
    assert [m.content for m in store.messages(conv.id)] == ["Where to?", "Lisbon."]
    store._db.execute("PRAGMA max_page_count = 1000000")  # space again
    store.add_message(conv.id, conv.current_leaf, "user", "x" * 200_000)
    store.close()
    assert len(chats_in(path)) == 3


def test_a_read_only_store_reads_and_refuses_writes_with_the_reason(tmp_path):
    path = tmp_path / "chats.sqlite3"
    a_saved_chat(path)
    before = path.read_bytes()
    why = StoreError(tmp_path, StoreProblem.FULL, "12 KiB free")
    store = Store(path, read_only_because=why)
    assert store.mode is StoreMode.READ_ONLY and store.unsaved_because is why
    conv = store.conversations()[0]
    assert [m.content for m in store.transcript(conv.id)] == ["Where to?", "Lisbon."]
    for write in (
        lambda: store.create_conversation("New"),
        lambda: store.add_message(conv.id, None, "user", "Hi"),
        lambda: store.update_conversation(conv.id, title="Renamed"),
        lambda: store.delete_conversation(conv.id),
    ):
        with pytest.raises(StoreError) as refused:
            write()
        # the real reason, not "read-only"
        assert "the disk is full (12 KiB free)" in str(refused.value)
    store.close()
    assert path.read_bytes() == before
    wal = tmp_path / "chats.sqlite3-wal"  # SQLite may leave an empty one behind
    assert not wal.exists() or wal.stat().st_size == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_read_only_store_opens_when_its_shared_memory_cannot_be_written(tmp_path):
    """On a full disk even a read-only open can fail, creating the -shm file; the chats
    are then read without it."""
    path = tmp_path / "chats.sqlite3"
    a_saved_chat(path)
    (tmp_path / "chats.sqlite3-shm").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(StoreError):
        Store(path)
    store = Store(path, read_only_because=StoreError(path, StoreProblem.FULL))
    assert [c.title for c in store.conversations()] == ["Trip"]
    store.close()


def test_a_database_from_a_newer_folio_is_not_written(tmp_path):
    path = tmp_path / "chats.sqlite3"
    a_saved_chat(path)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError) as newer:
        Store(path)
    assert newer.value.problem is StoreProblem.NEWER and "Update Folio" in str(newer.value)
    store = Store(path, read_only_because=newer.value)
    assert [c.title for c in store.conversations()] == ["Trip"]
    store.close()


def test_unusable_paths_raise_store_errors_that_name_them(tmp_path):
    in_the_way = tmp_path / "folio"
    in_the_way.write_text("not a folder")
    with pytest.raises(StoreError) as not_a_folder:
        Store(in_the_way / "chats.sqlite3")
    assert not_a_folder.value.problem is StoreProblem.NOT_A_FOLDER
    assert str(in_the_way) in str(not_a_folder.value)
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"this is no database " * 100)
    with pytest.raises(StoreError) as unreadable:
        Store(corrupt)
    assert unreadable.value.problem is StoreProblem.CORRUPT
    assert str(corrupt) in str(unreadable.value) and "backup" in str(unreadable.value)
    assert corrupt.read_bytes() == b"this is no database " * 100


def test_a_temporary_store_is_gone_after_close():
    store = Store.temporary()
    assert store.mode is StoreMode.TEMPORARY
    conv = store.create_conversation("Scratch")
    store.add_message(conv.id, None, "user", "Hi")
    folder = store.path.parent
    assert folder.is_dir()
    store.close()
    assert not folder.exists()


# -- the context policy column (schema version 2) -------------------------------------

_VERSION_1 = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '', sampling TEXT NOT NULL DEFAULT '{}',
    current_leaf INTEGER, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE, role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '', complete INTEGER NOT NULL DEFAULT 1,
    error TEXT NOT NULL DEFAULT '', stats TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
INSERT INTO conversations VALUES (1, 'Trip', 'Be brief.', '{}', 2, 0, 0);
INSERT INTO messages VALUES (1, 1, NULL, 'user', 'Where to?', 1, '', '{}', 0);
INSERT INTO messages VALUES (2, 1, 1, 'assistant', 'Lisbon.', 1, '', '{}', 0);
PRAGMA user_version = 1;
"""


def a_version_1_database(path) -> None:
    """A chat database as Folio wrote it before chats had a context policy."""
    db = sqlite3.connect(path)
    db.executescript(_VERSION_1)
    db.close()


def test_a_version_1_database_gets_the_policy_column_and_keeps_its_chats(tmp_path):
    path = tmp_path / "chats.sqlite3"
    a_version_1_database(path)
    store = Store(path)
    conv = store.conversation(1)
    assert conv.context_policy == DEFAULT_CONTEXT_POLICY == "truncate_middle"
    assert [m.content for m in store.transcript(1)] == ["Where to?", "Lisbon."]
    store.update_conversation(1, context_policy="stop")
    assert store.conversation(1).context_policy == "stop"
    new = store.create_conversation("New")
    assert new.context_policy == DEFAULT_CONTEXT_POLICY
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    db.close()
    assert Store(path).conversation(1).context_policy == "stop"  # and it stays


def test_a_version_1_database_opened_read_only_shows_the_default_policy(tmp_path):
    """Read-only, nothing may migrate it: its chats read with the default policy."""
    path = tmp_path / "chats.sqlite3"
    a_version_1_database(path)
    before = path.read_bytes()
    why = StoreError(tmp_path, StoreProblem.READ_ONLY)
    store = Store(path, read_only_because=why)
    assert store.conversation(1).context_policy == DEFAULT_CONTEXT_POLICY
    assert [m.content for m in store.transcript(1)] == ["Where to?", "Lisbon."]
    store.close()
    assert path.read_bytes() == before
