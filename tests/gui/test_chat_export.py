"""Chat > Export chat…: the chat on screen as JSON that reads back as the same chat,
or Markdown with every message; a file that cannot be written says why, in words, and
leaves nothing half-written behind."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from gui.chat.export import ExportError, chat_record, export_chat, to_markdown, write_export
from gui.store import Store

REPLY = "Use a list:\n\n```python\nxs = [1, 2]\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |"


@pytest.fixture
def chat(tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    conv = store.create_conversation("Lists & tables", "Be brief.", {"temperature": 0.2, "seed": 7})
    user = store.add_message(conv.id, None, "user", "How do I make a list?")
    reply = store.add_message(conv.id, user.id, "assistant", REPLY, stats={"new_tokens": 30})
    user2 = store.add_message(conv.id, reply.id, "user", "And a failing one?")
    store.add_message(conv.id, user2.id, "assistant", "", error="the engine failed")
    yield store, conv.id
    store.close()


def test_json_reads_back_as_the_chat(chat, tmp_path):
    store, cid = chat
    path = tmp_path / "chat.json"
    export_chat(store, cid, "SmolLM2-360M-Instruct", path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data == chat_record(store, cid, "SmolLM2-360M-Instruct")
    conv = store.conversation(cid)
    assert (data["title"], data["system_prompt"], data["model"]) == (
        "Lists & tables",
        "Be brief.",
        "SmolLM2-360M-Instruct",
    )
    assert data["sampling"]["temperature"] == 0.2 and data["sampling"]["seed"] == 7
    assert data["sampling"]["max_new_tokens"] == 512  # the defaults the chat runs with
    transcript = store.transcript(cid)
    assert [(m["role"], m["content"], m["created_unix"]) for m in data["messages"]] == [
        (m.role, m.content, m.created) for m in transcript
    ]
    assert data["messages"][1]["stats"] == {"new_tokens": 30}
    assert data["messages"][3]["error"] == "the engine failed"
    assert datetime.fromisoformat(data["created"]).timestamp() == pytest.approx(conv.created, abs=1)


def test_markdown_has_every_message(chat, tmp_path):
    store, cid = chat
    path = tmp_path / "chat.md"
    export_chat(store, cid, None, path)
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# Lists & tables\n")
    assert "- Model: none loaded" in text and "temperature 0.2" in text and "seed 7" in text
    assert "## System prompt\n\nBe brief." in text
    for m in store.transcript(cid):
        assert m.content.strip() in text
    assert text.count("## You ·") == 2 and text.count("## Assistant ·") == 2
    assert "```python\nxs = [1, 2]\n```" in text  # the reply's Markdown kept as it is
    assert "> Error: the engine failed" in text


@pytest.mark.parametrize(
    ("where", "words"),
    [
        (lambda tmp: tmp / "no such folder" / "chat.md", "that folder does not exist"),
        (lambda tmp: tmp / "a file" / "chat.md", "part of that path is a file"),
        (lambda tmp: tmp, "that is a folder"),
    ],
)
def test_a_path_that_cannot_be_written_says_why(chat, tmp_path, where, words):
    store, cid = chat
    (tmp_path / "a file").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    path = where(tmp_path)
    with pytest.raises(ExportError) as caught:
        export_chat(store, cid, None, path)
    message = str(caught.value)
    assert message.startswith(f"Could not export the chat to {path}: ") and words in message
    assert sorted(tmp_path.rglob("*")) == before  # nothing left behind


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/full is Linux's")
def test_a_full_disk_says_so():
    with pytest.raises(ExportError, match="the disk is full. Free some space"):
        write_export(Path("/dev/full"), to_markdown(_record()))


def _record() -> dict:
    return {
        "title": "t",
        "created": "2026-01-01T00:00:00+00:00",
        "model": None,
        "system_prompt": "",
        "sampling": {},
        "messages": [{"role": "user", "content": "hi " * 3000, "created": "x"}],
    }


def test_the_chat_menu_exports_and_shows_a_failure(qtbot, tmp_path):
    from gui.main_window import MainWindow

    store = Store(tmp_path / "chats.sqlite3")
    window = MainWindow(store, QSettings(str(tmp_path / "f.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(window)
    cid = window.chat_view.conversation_id
    store.add_message(cid, None, "user", "Hello there")
    chat_menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Chat")
    assert "&Export chat…" in [a.text() for a in chat_menu.actions()]
    assert window.chat_view.settings.presets.store.settings is window.settings  # presets kept
    window.export_chat(tmp_path / "out.json")
    assert (
        json.loads((tmp_path / "out.json").read_text())["messages"][0]["content"] == "Hello there"
    )
    window.export_chat(tmp_path / "missing" / "out.md")
    assert window.error_dialog is not None and window.error_dialog.isVisible()
    assert "that folder does not exist" in window.error_dialog.text()
    window.close()
    store.close()


@pytest.mark.parametrize(
    ("typed", "chosen", "expected"),
    [
        ("notes/chat", "JSON (*.json)", "notes/chat.json"),
        ("notes/chat", "Markdown (*.md)", "notes/chat.md"),
        ("notes/chat.json", "Markdown (*.md)", "notes/chat.json"),  # the name the user typed
        ("", "Markdown (*.md)", None),  # cancelled
    ],
)
def test_the_dialog_adds_the_chosen_extension(monkeypatch, tmp_path, typed, chosen, expected):
    from PySide6.QtWidgets import QFileDialog

    from gui.chat.export import ask_export_path

    asked = {}

    def fake_dialog(parent, caption, start, filters):
        asked.update(start=start, filters=filters)
        return (str(tmp_path / typed) if typed else "", chosen)

    monkeypatch.setattr(QFileDialog, "getSaveFileName", fake_dialog)
    path = ask_export_path(None, "Lists: tables/rows?")
    assert path == (tmp_path / expected if expected else None)
    assert Path(asked["start"]).name == "Lists_ tables_rows_.md"
    assert asked["filters"] == "Markdown (*.md);;JSON (*.json)"
