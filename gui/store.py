"""Chats on disk: one SQLite database (WAL) in the user data folder.

Messages form a tree per conversation: editing a message or regenerating a reply adds
a sibling (same parent) instead of overwriting, so every version stays. A
conversation remembers the leaf it shows (`current_leaf`); the path from the root to
that leaf is the transcript sent to the model.

Replies are written while they stream (`update_message` with `complete=False`), so a
killed process loses at most what arrived since the last write. The store knows
nothing of Qt and is used from the UI thread only.

Opening an existing, current database only reads it (the schema is written when it is
missing or old), so a full disk or a read-only file still shows the chats. Every write
is one transaction: a write that fails (disk full, read-only) raises `StoreError`,
whose message names the path and what to do, and leaves what was stored as it was.
"""

from __future__ import annotations

import errno
import json
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from engine import paths

SCHEMA_VERSION = 2  # PRAGMA user_version of a database with the schema below
# What a chat does once it outgrows the model's context (gui/chat/context.py's
# ContextPolicy values); chats stored before the policy existed get it too.
DEFAULT_CONTEXT_POLICY = "truncate_middle"
DATABASE_NAME = "chats.sqlite3"
IN_MEMORY = Path(":memory:")
# Another Folio's write holds the lock for milliseconds; waiting longer means it is stuck.
BUSY_TIMEOUT_S = 5.0

_POLICY_COLUMN = f"context_policy TEXT NOT NULL DEFAULT '{DEFAULT_CONTEXT_POLICY}'"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{{}}',
    {_POLICY_COLUMN},
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
    stats TEXT NOT NULL DEFAULT '{{}}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id);
"""
# Each step brings a database of the version before it up to the next one.
_MIGRATIONS = {
    1: f"ALTER TABLE conversations ADD COLUMN {_POLICY_COLUMN};",
}

_MOVE = f"set {paths.DATA_DIR_VARIABLE} to a folder you can write to"


class StoreProblem(Enum):
    """Why the chat database or its folder cannot be used: the reason, worded to follow
    "Could not save to PATH:", and what the user can do about it."""

    FULL = ("the disk is full", "Free some space on that disk; the chats already saved are kept.")
    READ_ONLY = (
        "it is read-only, or Folio may not write there",
        f"Make it writable for your user, or {_MOVE}.",
    )
    NOT_A_FOLDER = (
        "it is a file, not a folder",
        f"Move or rename that file, or {_MOVE}.",
    )
    CORRUPT = (
        "it is not a readable chat database",
        "Folio leaves the file as it is: restore it from a backup, or move it elsewhere "
        "and Folio starts a new one.",
    )
    LOCKED = (
        "another program is using it",
        "Close the other Folio (or the program that has the file open).",
    )
    NEWER = (
        "a newer version of Folio wrote it",
        "Update Folio to save chats again; this version only reads them.",
    )
    UNAVAILABLE = (
        "it cannot be opened",
        f"Check that the disk is there and the folder exists, or {_MOVE}.",
    )

    @property
    def reason(self) -> str:
        return self.value[0]

    @property
    def advice(self) -> str:
        return self.value[1]


_SQLITE_PROBLEMS = {
    sqlite3.SQLITE_FULL: StoreProblem.FULL,
    sqlite3.SQLITE_READONLY: StoreProblem.READ_ONLY,
    sqlite3.SQLITE_PERM: StoreProblem.READ_ONLY,
    sqlite3.SQLITE_CORRUPT: StoreProblem.CORRUPT,
    sqlite3.SQLITE_NOTADB: StoreProblem.CORRUPT,
    sqlite3.SQLITE_BUSY: StoreProblem.LOCKED,
    sqlite3.SQLITE_LOCKED: StoreProblem.LOCKED,
}
_OS_PROBLEMS = {
    errno.ENOSPC: StoreProblem.FULL,
    getattr(errno, "EDQUOT", errno.ENOSPC): StoreProblem.FULL,
    errno.EROFS: StoreProblem.READ_ONLY,
    errno.EACCES: StoreProblem.READ_ONLY,
    errno.EPERM: StoreProblem.READ_ONLY,
    errno.EEXIST: StoreProblem.NOT_A_FOLDER,
    errno.ENOTDIR: StoreProblem.NOT_A_FOLDER,
}
# SQLite's and the OS's own words add something only where the reason is vague.
_DETAILED = (StoreProblem.CORRUPT, StoreProblem.UNAVAILABLE)


class StoreError(Exception):
    """The chat database or its folder cannot be read or written. `str()` is the whole
    message for the user: the path, what is wrong and what to do."""

    def __init__(
        self, path: str | Path, problem: StoreProblem, detail: str = "", action: str = "save to"
    ):
        self.path = Path(path)
        self.problem = problem
        self.detail = detail
        self.action = action
        super().__init__(str(self))

    @classmethod
    def from_exception(
        cls, path: str | Path, exc: BaseException, action: str = "save to"
    ) -> StoreError:
        if isinstance(exc, StoreError):
            return cls(exc.path, exc.problem, exc.detail, action)
        if isinstance(exc, sqlite3.Error):
            code = (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF  # the primary code
            problem = _SQLITE_PROBLEMS.get(code, StoreProblem.UNAVAILABLE)
        elif isinstance(exc, OSError):
            problem = _OS_PROBLEMS.get(exc.errno or 0, StoreProblem.UNAVAILABLE)
        else:
            problem = StoreProblem.UNAVAILABLE
        words = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return cls(path, problem, words if problem in _DETAILED else "", action)

    @property
    def reason(self) -> str:
        return f"{self.problem.reason} ({self.detail})" if self.detail else self.problem.reason

    def __str__(self) -> str:
        return f"Could not {self.action} {self.path}: {self.reason}. {self.problem.advice}"


class StoreMode(Enum):
    SAVED = "saved"  # the data folder's database, read and written
    READ_ONLY = "read-only"  # the data folder's database, read; every write refused
    TEMPORARY = "temporary"  # a new database that is deleted when Folio closes


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    sampling: dict[str, Any]
    current_leaf: int | None
    created: float
    updated: float
    context_policy: str = DEFAULT_CONTEXT_POLICY


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
    """The chat database. Every write is one transaction, committed at once (WAL keeps
    that cheap).

    `Store(path)` opens (or creates) `path` for reading and writing. With
    `read_only_because` it only reads, and every write raises that error again, so the
    user is told the real reason (a full disk, say) rather than "read-only".
    `Store.temporary()` is a new database in a temporary folder."""

    def __init__(
        self, path: str | Path | None = None, *, read_only_because: StoreError | None = None
    ):
        if path is None:
            path = paths.data_dir() / DATABASE_NAME
        self.path = Path(path)
        self.mode = StoreMode.READ_ONLY if read_only_because else StoreMode.SAVED
        # Why chats are not being saved to the data folder (None: they are).
        self.unsaved_because = read_only_because
        self._temporary_folder: Path | None = None
        if read_only_because is None:
            self._db = self._open(read_only=False)
            return
        try:
            self._db = self._open(read_only=True)
        except StoreError as exc:
            # A read-only open still creates the -shm file, which a full disk or a
            # read-only folder refuses; an immutable open needs none (but misses a -wal
            # a crash left behind, which stays on disk for the next normal open).
            if exc.problem not in (StoreProblem.FULL, StoreProblem.UNAVAILABLE):
                raise
            self._db = self._open(read_only=True, immutable=True)

    def _open(self, read_only: bool, immutable: bool = False) -> sqlite3.Connection:
        if not read_only and self.path != IN_MEMORY:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError.from_exception(self.path.parent, exc, "use") from exc
        try:
            db = _connect(self.path, read_only, immutable)
        except sqlite3.Error as exc:
            raise StoreError.from_exception(self.path, exc, "open") from exc
        try:
            _prepare(db, self.path, read_only)
        except BaseException as exc:
            db.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError.from_exception(self.path, exc, "open") from exc
            raise
        return db

    @classmethod
    def temporary(cls, because: StoreError | None = None) -> Store:
        """A new database in a temporary folder (in memory if even that fails), deleted
        on `close`: where chats go when the data folder cannot be used."""
        folder: Path | None = None
        try:
            folder = Path(tempfile.mkdtemp(prefix="folio-chats-"))
            store = cls(folder / DATABASE_NAME)
        except (OSError, StoreError):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            folder = None
            store = cls(IN_MEMORY)
        store.mode = StoreMode.TEMPORARY
        store.unsaved_because = because
        store._temporary_folder = folder
        return store

    def close(self) -> None:
        self._db.close()
        if self._temporary_folder is not None:
            shutil.rmtree(self._temporary_folder, ignore_errors=True)
            self._temporary_folder = None

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One transaction: every statement of a call is stored, or none is."""
        if self.mode is StoreMode.READ_ONLY:
            assert self.unsaved_because is not None
            raise StoreError.from_exception(self.path, self.unsaved_because)
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except BaseException as exc:
            if db.in_transaction:
                with suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise StoreError.from_exception(self.path, exc) from exc
            raise

    # -- conversations ----------------------------------------------------------------

    def create_conversation(
        self, title: str = "New chat", system_prompt: str = "", sampling: dict | None = None
    ) -> Conversation:
        now = time.time()
        with self._writing() as db:
            cur = db.execute(
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
        with self._writing() as db:
            _update_conversation(db, conversation_id, fields)

    def delete_conversation(self, conversation_id: int) -> None:
        with self._writing() as db:
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

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
        with self._writing() as db:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, parent_id, role, content, complete,"
                " error, stats, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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
                _update_conversation(db, conversation_id, {"current_leaf": message_id})
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
            with self._writing() as db:
                db.execute(
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


def _connect(path: Path, read_only: bool, immutable: bool) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions; `Store._writing` opens and commits
    # each one, so a partial reply is on disk when the call returns.
    options = dict(isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
    if path == IN_MEMORY:
        return sqlite3.connect(":memory:", **options)
    if not read_only:
        return sqlite3.connect(path, **options)
    # mode=ro never writes the file; immutable=1 also skips the -shm file a read-only
    # open would create (which fails on a full disk), at the price of not seeing a
    # -wal left by a crash: the last resort before a temporary store.
    uri = path.resolve().as_uri() + ("?mode=ro&immutable=1" if immutable else "?mode=ro")
    return sqlite3.connect(uri, uri=True, **options)


def _prepare(db: sqlite3.Connection, path: Path, read_only: bool) -> None:
    """Connection settings, then the schema only where it is missing or old: opening a
    current database reads it and writes nothing."""
    db.row_factory = sqlite3.Row
    # synchronous=NORMAL under WAL survives a process kill (not power loss), which is the
    # failure the partial-reply writes guard against.
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")
    version = int(db.execute("PRAGMA user_version").fetchone()[0])  # the first read
    if read_only:
        if version < 1:
            # Nothing to show without the schema, and adding it would be a write. An
            # older schema is read as it is (`_conversation` fills in what it lacks).
            raise StoreError(path, StoreProblem.UNAVAILABLE, "it holds no chats", "open")
        return
    if version > SCHEMA_VERSION:
        raise StoreError(path, StoreProblem.NEWER, action="open")
    if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        db.execute("PRAGMA journal_mode=WAL")
    if version == 0:
        db.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version={SCHEMA_VERSION};COMMIT;")
    elif version < SCHEMA_VERSION:
        steps = "".join(_MIGRATIONS[v] for v in range(version, SCHEMA_VERSION))
        db.executescript(f"BEGIN IMMEDIATE;{steps}PRAGMA user_version={SCHEMA_VERSION};COMMIT;")


def _update_conversation(db: sqlite3.Connection, conversation_id: int, fields: dict) -> None:
    allowed = {"title", "system_prompt", "sampling", "context_policy", "current_leaf"}
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"unknown conversation fields: {sorted(unknown)}")
    fields = dict(fields)
    if "sampling" in fields:
        fields["sampling"] = json.dumps(fields["sampling"])
    fields["updated"] = time.time()
    columns = ", ".join(f"{name} = ?" for name in fields)
    db.execute(
        f"UPDATE conversations SET {columns} WHERE id = ?", (*fields.values(), conversation_id)
    )


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        id=int(row["id"]),
        title=row["title"],
        system_prompt=row["system_prompt"],
        sampling=json.loads(row["sampling"] or "{}"),
        current_leaf=row["current_leaf"],
        created=row["created"],
        updated=row["updated"],
        # absent from a version 1 database opened read-only (nothing may migrate it)
        context_policy=(
            row["context_policy"] if "context_policy" in row.keys() else DEFAULT_CONTEXT_POLICY
        ),
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
