"""A chat written out as Markdown (to read or share) or JSON (to re-read): the branch
on screen, with roles, times, the system prompt, the sampling settings and the model.

The record is built from the store by a pure function, so tests read the file back
and compare it with the chat. Writing is the one step that can fail, and its error
says in words what to do (a full disk, a folder that is missing or not writable).
"""

from __future__ import annotations

import errno
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QFileDialog, QWidget

from gui.chat.controller import DEFAULT_SAMPLING
from gui.store import Store

FORMAT = "folio-chat"
VERSION = 1
MARKDOWN_FILTER = "Markdown (*.md)"
JSON_FILTER = "JSON (*.json)"


class ExportError(Exception):
    """The file could not be written; `str()` is the whole message for the user."""


def chat_record(store: Store, conversation_id: int, model: str | None) -> dict[str, Any]:
    """The chat as plain data. ``model`` is the model loaded at export time: the store
    does not record which model wrote each reply."""
    conv = store.conversation(conversation_id)
    messages = []
    for m in store.transcript(conversation_id):
        item: dict[str, Any] = {
            "role": m.role,
            "content": m.content,
            "created": _iso(m.created),
            "created_unix": m.created,
        }
        if m.error:
            item["error"] = m.error
        if not m.complete:
            item["complete"] = False
        if m.stats:
            item["stats"] = m.stats
        messages.append(item)
    return {
        "format": FORMAT,
        "version": VERSION,
        "title": conv.title,
        "created": _iso(conv.created),
        "model": model,
        "system_prompt": conv.system_prompt,
        "sampling": {**DEFAULT_SAMPLING, **conv.sampling},
        "messages": messages,
    }


def to_json(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, indent=2) + "\n"


def to_markdown(record: dict[str, Any]) -> str:
    """A heading, the settings as a list, then each message under its role and time.
    A reply's own Markdown is kept as it is: it reads as Markdown already."""
    sampling = ", ".join(
        f"{k} {'random' if v is None else v}" for k, v in record["sampling"].items()
    )
    lines = [
        f"# {record['title']}",
        "",
        f"- Model: {record['model'] or 'none loaded'}",
        f"- Started: {record['created']}",
        f"- Sampling: {sampling}",
    ]
    if record["system_prompt"].strip():
        lines += ["", "## System prompt", "", record["system_prompt"].strip()]
    for m in record["messages"]:
        who = "You" if m["role"] == "user" else "Assistant"
        lines += ["", f"## {who} · {m['created']}", ""]
        if m["content"]:
            lines.append(m["content"].strip())
        if m.get("error"):
            lines.append(f"> Error: {m['error']}")
        if m.get("complete") is False:
            lines.append("> (interrupted)")
    return "\n".join(lines) + "\n"


def render(record: dict[str, Any], path: Path) -> str:
    """JSON for a .json file, Markdown otherwise."""
    return to_json(record) if path.suffix.lower() == ".json" else to_markdown(record)


_REASONS = {
    errno.ENOSPC: "the disk is full. Free some space, or choose another disk.",
    getattr(errno, "EDQUOT", errno.ENOSPC): "the disk quota is used up. Free some space first.",
    errno.EACCES: "Folio may not write there. Choose a folder of yours, such as Documents.",
    errno.EPERM: "Folio may not write there. Choose a folder of yours, such as Documents.",
    errno.EROFS: "that disk is read-only. Choose another folder.",
    errno.ENOENT: "that folder does not exist. Choose another folder.",
    errno.ENOTDIR: "part of that path is a file, not a folder. Choose another folder.",
    errno.EISDIR: "that is a folder. Give the file a name.",
}


def write_export(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, or raise ExportError saying why in words. A file this
    call created is removed again on failure; one it was replacing (the dialog asked
    first) is left as far as it got."""
    created = False  # by this call: only then is a failed file removed
    try:
        existed = path.exists()
        with open(path, "w", encoding="utf-8", newline="\n") as fh:
            created = not existed
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())  # a full disk is reported here, not lost at close
    except OSError as exc:
        if created:
            path.unlink(missing_ok=True)
        reason = _REASONS.get(exc.errno or 0, f"{exc.strerror or exc}.")
        raise ExportError(f"Could not export the chat to {path}: {reason}") from exc


def export_chat(store: Store, conversation_id: int, model: str | None, path: Path) -> None:
    write_export(path, render(chat_record(store, conversation_id, model), path))


def ask_export_path(parent: QWidget, title: str) -> Path | None:
    """The save dialog, offering Markdown or JSON; the filter's extension is added
    when the name has none."""
    stem = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip() or "chat"
    name, chosen = QFileDialog.getSaveFileName(
        parent,
        "Export chat",
        str(Path.home() / f"{stem}.md"),
        f"{MARKDOWN_FILTER};;{JSON_FILTER}",
    )
    if not name:
        return None
    path = Path(name)
    if not path.suffix:
        path = path.with_suffix(".json" if chosen == JSON_FILTER else ".md")
    return path


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")
