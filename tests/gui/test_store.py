"""The chat database: message trees (versions), transcripts, search, crash-safe writes."""

from __future__ import annotations

import sqlite3

from engine.paths import data_dir
from gui.store import Store


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
