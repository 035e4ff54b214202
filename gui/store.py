"""Chats on disk: one SQLite database (WAL) in the user data folder.

Messages form a tree per conversation: editing a message or regenerating a reply adds
a sibling (same parent) instead of overwriting, so every version stays. A
conversation remembers the leaf it shows (`current_leaf`); the path from the root to
that leaf is the transcript sent to the model.

Replies are written while they stream (`update_message` with `complete=False`), so a
killed process loses at most what arrived since the last write. The store knows
nothing of Qt and is used from the UI thread only.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import paths

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',
    current_leaf INTEGER,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    complete INTEGER NOT NULL DEFAULT 1,
    error TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id);
"""


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    sampling: dict[str, Any]
    current_leaf: int | None
    created: float
    updated: float


@dataclass
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str  # "user" or "assistant"
    content: str
    complete: bool
    error: str
    stats: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0


class Store:
    """The chat database. Every write commits at once (WAL keeps that cheap)."""

    def __init__(self, path: str | Path | None = None):
        if path is None:
            path = paths.data_dir() / "chats.sqlite3"
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: autocommit, so a partial reply is on disk when the call
        # returns; synchronous=NORMAL under WAL survives a process kill (not power loss),
        # which is the failure the partial-reply writes guard against.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    # -- conversations ----------------------------------------------------------------

    def create_conversation(
        self, title: str = "New chat", system_prompt: str = "", sampling: dict | None = None
    ) -> Conversation:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, system_prompt, sampling, created, updated)"
            " VALUES (?, ?, ?, ?, ?)",
            (title, system_prompt, json.dumps(sampling or {}), now, now),
        )
        return self.conversation(int(cur.lastrowid))

    def conversation(self, conversation_id: int) -> Conversation:
        row = self._db.execute(
            "SELECT * FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return _conversation(row)

    def conversations(self, search: str = "") -> list[Conversation]:
        """Most recently updated first; `search` matches titles and message text."""
        if search:
            like = f"%{search}%"
            rows = self._db.execute(
                "SELECT * FROM conversations WHERE title LIKE ? OR id IN"
                " (SELECT conversation_id FROM messages WHERE content LIKE ?)"
                " ORDER BY updated DESC, id DESC",
                (like, like),
            ).fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM conversations ORDER BY updated DESC, id DESC"
            ).fetchall()
        return [_conversation(r) for r in rows]

    def update_conversation(self, conversation_id: int, **fields: Any) -> None:
        allowed = {"title", "system_prompt", "sampling", "current_leaf"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown conversation fields: {sorted(unknown)}")
        if "sampling" in fields:
            fields["sampling"] = json.dumps(fields["sampling"])
        fields["updated"] = time.time()
        columns = ", ".join(f"{name} = ?" for name in fields)
        self._db.execute(
            f"UPDATE conversations SET {columns} WHERE id = ?",
            (*fields.values(), conversation_id),
        )

    def delete_conversation(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages ---------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        parent_id: int | None,
        role: str,
        content: str = "",
        complete: bool = True,
        error: str = "",
        stats: dict | None = None,
        make_current: bool = True,
    ) -> Message:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO messages (conversation_id, parent_id, role, content, complete, error,"
            " stats, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                conversation_id,
                parent_id,
                role,
                content,
                int(complete),
                error,
                json.dumps(stats or {}),
                now,
            ),
        )
        message_id = int(cur.lastrowid)
        if make_current:
            self.update_conversation(conversation_id, current_leaf=message_id)
        return self.message(message_id)

    def update_message(
        self,
        message_id: int,
        content: str | None = None,
        complete: bool | None = None,
        error: str | None = None,
        stats: dict | None = None,
    ) -> None:
        sets: list[str] = []
        values: list[Any] = []
        for name, value in (("content", content), ("complete", complete), ("error", error)):
            if value is not None:
                sets.append(f"{name} = ?")
                values.append(int(value) if name == "complete" else value)
        if stats is not None:
            sets.append("stats = ?")
            values.append(json.dumps(stats))
        if sets:
            self._db.execute(
                f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*values, message_id)
            )

    def message(self, message_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return _message(row)

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [_message(r) for r in rows]

    def siblings(self, message: Message) -> list[Message]:
        """The versions of `message`: every message with its parent and role, oldest first."""
        if message.parent_id is None:
            rows = self._db.execute(
                "SELECT * FROM messages WHERE conversation_id = ? AND parent_id IS NULL"
                " AND role = ? ORDER BY id",
                (message.conversation_id, message.role),
            ).fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM messages WHERE parent_id = ? AND role = ? ORDER BY id",
                (message.parent_id, message.role),
            ).fetchall()
        return [_message(r) for r in rows]

    def transcript(self, conversation_id: int, leaf: int | None = None) -> list[Message]:
        """Root-to-leaf transcript ending at `leaf` (default: the conversation's current)."""
        if leaf is None:
            leaf = self.conversation(conversation_id).current_leaf
        by_id = {m.id: m for m in self.messages(conversation_id)}
        out: list[Message] = []
        while leaf is not None and leaf in by_id:
            out.append(by_id[leaf])
            leaf = by_id[leaf].parent_id
        out.reverse()
        return out

    def deepest_leaf(self, message_id: int) -> int:
        """The newest leaf below `message_id`: where switching to a version lands."""
        current = message_id
        while True:
            row = self._db.execute(
                "SELECT id FROM messages WHERE parent_id = ? ORDER BY id DESC LIMIT 1", (current,)
            ).fetchone()
            if row is None:
                return current
            current = int(row["id"])


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        id=int(row["id"]),
        title=row["title"],
        system_prompt=row["system_prompt"],
        sampling=json.loads(row["sampling"] or "{}"),
        current_leaf=row["current_leaf"],
        created=row["created"],
        updated=row["updated"],
    )


def _message(row: sqlite3.Row) -> Message:
    return Message(
        id=int(row["id"]),
        conversation_id=int(row["conversation_id"]),
        parent_id=row["parent_id"],
        role=row["role"],
        content=row["content"],
        complete=bool(row["complete"]),
        error=row["error"],
        stats=json.loads(row["stats"] or "{}"),
        created=row["created"],
    )
