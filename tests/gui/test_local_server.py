"""File > Local server: the OpenAI-compatible server on the app's own engine. API jobs in
their own colour in every memory view; the dialog's switch, warning, key and URL; with
SmolLM2, a request served next to a chat, sharing its cached prefix and shown as "API";
a port in use said in words; the server following a cache rebuild and stopping on close.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from PySide6.QtCore import QSettings
from PySide6.QtGui import QGuiApplication

from engine.cache.page import PageState
from engine.server.tag import ApiTag
from gui.main_window import MainWindow
from gui.palette import API_COLOR, CHAT_COLORS, ChatColors
from gui.server_dialog import LocalServerSettings, ServerDialog, base_url
from gui.settings_dialog import EngineSettings
from gui.store import Store
from gui.views.memory_panel import MemoryPanel
from tests.gui.conftest import synthetic_snapshot

SMALL = EngineSettings(page_size=16, budget=1024, max_chunk_size=64, max_batch_size=8)
SYSTEM = "You are Folio's test assistant. Answer in one short sentence, plainly and politely."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_api_jobs(snapshot, job_ids: set[int]):
    """`snapshot` with the jobs `job_ids` turned into API requests."""
    tags = {j: (ApiTag(f"req-{j}") if j in job_ids else t) for j, t in snapshot.job_tags.items()}
    jobs = [dataclasses.replace(j, tag=tags[j.job_id]) for j in snapshot.jobs]
    return dataclasses.replace(snapshot, job_tags=tags, jobs=jobs)


# -- the API's colour (no model) -------------------------------------------------------


def test_api_jobs_have_one_fixed_colour_that_no_chat_takes(qtbot):
    chats = ChatColors()
    assert chats.color("a") == CHAT_COLORS[0]
    assert chats.color(ApiTag("req-1")) == API_COLOR
    assert chats.index_of(ApiTag("req-2")) == chats.index_of(ApiTag("req-1"))
    assert chats.color("b") == CHAT_COLORS[1]  # the API took no chat colour
    assert chats.name(ApiTag("req-3")) == "API"
    assert API_COLOR not in CHAT_COLORS
    table = chats.color_table(5)
    assert [tuple(r[:3]) for r in table[:3]] == [
        (0xE6, 0x9F, 0x00),
        (0x8C, 0x5A, 0x2B),
        (0x00, 0x9E, 0x73),
    ]
    # Slots beyond those given continue the chats' cycle, as before.
    assert tuple(table[3][:3]) == (0xCC, 0x79, 0xA7)


def test_views_label_api_pages_and_rows(qtbot, fake_tokenizer):
    snap = with_api_jobs(synthetic_snapshot(64, chats=4), {3, 4})
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.resize(700, 900)
    panel.refresh(snap, None, fake_tokenizer)
    pm = panel.page_map
    api_pages = pm.model.pages_of_chat(ApiTag())
    assert api_pages
    for page in api_pages:
        assert pm.cell_color(page) == API_COLOR
        assert pm.page_info(page)["chats"] == ["API"]
        assert "API" in pm.hover_page(page)
    chat_pages = pm.model.pages_of_chat("chat 1")
    assert chat_pages and pm.cell_color(chat_pages[0]) == CHAT_COLORS[0]
    rows = panel.queue.rows()
    assert [r["chat"] for r in rows] == ["chat 1", "chat 2", "API", "API"]
    assert panel.legend.entries().count("API") == 1  # two API jobs, one entry
    nodes = [n for n in panel.tree.model.nodes().values() if ApiTag() in n.owners]
    assert nodes and all(
        panel.tree._node_color(n) == API_COLOR
        for n in nodes
        if n.state == PageState.REFERENCED and n.owners[0] == ApiTag()
    )


# -- the dialog (no model) -------------------------------------------------------------


def test_settings_round_trip_and_bad_files():
    s = LocalServerSettings(enabled=True, host="0.0.0.0", port=9000, api_key="k")
    assert LocalServerSettings.from_dict(s.as_dict()) == s
    assert s.server_settings().api_key == "k" and s.server_settings().port == 9000
    assert LocalServerSettings().server_settings().api_key is None
    for bad in ({"port": 70000}, {"port": 0}, {"port": "80"}, {"enabled": "yes"}, "nonsense"):
        assert LocalServerSettings.from_dict(bad) == LocalServerSettings()
    assert base_url("0.0.0.0", 8080) == "http://127.0.0.1:8080/v1"
    assert base_url("::1", 8080) == "http://[::1]:8080/v1"


def test_dialog_warns_generates_and_copies(qtbot):
    from gui.bridge import EngineBridge

    bridge = EngineBridge()
    dialog = ServerDialog(bridge, LocalServerSettings())
    qtbot.addWidget(dialog)
    dialog.show()
    assert not dialog.enabled.isChecked() and dialog.status.text() == "Off."
    assert dialog.url.text() == "http://127.0.0.1:8080/v1"
    assert dialog.warning.isHidden()
    dialog.host.setCurrentIndex(dialog.host.findData("0.0.0.0"))
    assert dialog.values().host == "0.0.0.0" and dialog.values().exposed
    assert not dialog.warning.isHidden()  # every network, no key
    dialog.generate.click()
    key = dialog.key.text()
    assert len(key) >= 32 and dialog.warning.isHidden()
    dialog.generate.click()
    assert dialog.key.text() != key
    dialog.port.setValue(9123)
    dialog.copy_url.click()
    assert QGuiApplication.clipboard().text() == "http://127.0.0.1:9123/v1"
    assert dialog.copy_url.text() == "Copied"
    dialog.host.setEditText("192.168.1.7")
    assert dialog.values().host == "192.168.1.7"
    requested: list = []
    dialog.apply_requested.connect(requested.append)
    dialog.enabled.setChecked(True)
    assert requested[-1].enabled and requested[-1].port == 9123
    # No engine yet: the bridge waits for one, and the dialog says so.
    bridge.start_server(requested[-1].server_settings())
    dialog._refresh()
    assert "as soon as a model is loaded" in dialog.status.text()


# -- with SmolLM2 -----------------------------------------------------------------------


def make_window(
    qtbot, tmp_path: Path, loaded, server: LocalServerSettings | None = None
) -> MainWindow:
    qsettings = QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)
    qsettings.setValue("engine/settings", json.dumps(SMALL.as_dict()))
    if server is not None:
        qsettings.setValue("server/settings", json.dumps(server.as_dict()))
    window = MainWindow(Store(tmp_path / "chats.sqlite3"), qsettings)
    qtbot.addWidget(window)
    window.show()
    window.use_loaded(loaded)
    qtbot.waitUntil(lambda: window.bridge.ready, timeout=30_000)
    window.chat_view.settings.load(SYSTEM, {"temperature": 0.0, "max_new_tokens": 8})
    window.chat_view.save_settings()
    return window


def switch_on(qtbot, window: MainWindow, port: int, host: str = "127.0.0.1") -> ServerDialog:
    dialog = window.open_server_dialog()
    dialog.host.setCurrentIndex(dialog.host.findData(host))
    dialog.port.setValue(port)
    dialog.enabled.setChecked(True)
    return dialog


def chat_body(model: str, user: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


@pytest.mark.slow
def test_api_request_beside_a_chat_shows_as_api(qtbot, tmp_path, smollm2_int4):
    window = make_window(qtbot, tmp_path, smollm2_int4)
    view = window.chat_view
    # A chat first: its reply leaves the system prompt's pages in the cache.
    view.input.setPlainText("Name a colour.")
    view.send()
    qtbot.waitUntil(lambda: not window.controller.generations, timeout=60_000)

    port = free_port()
    dialog = switch_on(qtbot, window, port)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=10_000)
    url = f"http://127.0.0.1:{port}/v1"
    assert window.bridge.server.base_url == url
    assert window.server_button.isVisible()
    assert window.server_button.text() == f"API server: {url}"
    assert dialog.status.text().startswith("● Running at " + url)
    assert dialog.url.text() == url
    assert smollm2_int4.name in dialog.usage.text()
    saved = json.loads(window.settings.value("server/settings"))
    assert saved == {"enabled": True, "host": "127.0.0.1", "port": port, "api_key": ""}

    models = httpx.get(url + "/models", timeout=10).json()
    model = window.bridge.server.model_id
    assert models["data"][0]["id"] == model and model.startswith(smollm2_int4.name)

    reply: dict = {}

    def ask() -> None:
        r = httpx.post(url + "/chat/completions", json=chat_body(model, "Count.", 40), timeout=60)
        reply["status"], reply["body"] = r.status_code, r.json()

    asker = threading.Thread(target=ask)
    asker.start()
    pm, panel = window.memory_panel.page_map, window.memory_panel
    # While it runs the views show its pages in the API colour (the panel redraws on its
    # own timer, one view per tick).
    qtbot.waitUntil(lambda: bool(pm.model.pages_of_chat(ApiTag())), timeout=30_000)
    page = pm.model.pages_of_chat(ApiTag())[0]
    assert pm.cell_color(page) == API_COLOR and pm.page_info(page)["chats"] == ["API"]
    qtbot.waitUntil(lambda: "API" in [r["chat"] for r in panel.queue.rows()], timeout=10_000)
    qtbot.waitUntil(lambda: "API" in panel.legend.entries(), timeout=10_000)
    qtbot.waitUntil(
        lambda: any(ApiTag() in n.owners for n in panel.tree.model.nodes().values()),
        timeout=10_000,
    )
    asker.join(60)
    assert reply["status"] == 200, reply
    body = reply["body"]
    assert body["usage"]["completion_tokens"] == 40 and body["choices"][0]["message"]["content"]
    # Same engine, same cache: the chat's system prompt was not computed again.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert not window.controller.generations  # the chat controller ignored the API job
    window.close()


@pytest.mark.slow
def test_port_in_use_is_said_in_words(qtbot, tmp_path, smollm2_int4):
    window = make_window(qtbot, tmp_path, smollm2_int4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dialog = switch_on(qtbot, window, port)
        with qtbot.waitSignal(window.bridge.server_failed, timeout=10_000) as failed:
            pass
    message = failed.args[0]
    assert f"Port {port} is already in use" in message and "another port" in message
    assert "File > Local server" not in message  # said where the box is shown, below
    assert dialog.status.text() == message
    assert not dialog.enabled.isChecked() and window.bridge.server is None
    assert not window.server_button.isVisible()
    assert json.loads(window.settings.value("server/settings"))["enabled"] is False
    assert window.error_dialog is None  # the open dialog says it; no second box
    dialog.close()
    # Without the dialog open, the window says it in a box.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        prefs = LocalServerSettings(enabled=True, port=taken.getsockname()[1])
        window.apply_server_settings(prefs)
        qtbot.waitUntil(lambda: window.error_dialog is not None, timeout=10_000)
    assert "already in use" in window.error_dialog.text()
    assert "File > Local server" in window.error_dialog.informativeText()
    assert window.bridge.ready  # the chats' engine is untouched
    window.close()


@pytest.mark.slow
def test_server_follows_a_rebuild_and_stops_on_close(qtbot, tmp_path, smollm2_int4):
    # On when the app last closed, with a key: it starts with the engine.
    port = free_port()
    prefs = LocalServerSettings(enabled=True, port=port, api_key="s3cret")
    window = make_window(qtbot, tmp_path, smollm2_int4, server=prefs)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=10_000)
    url = window.bridge.server.base_url
    assert url == f"http://127.0.0.1:{port}/v1"
    assert "key required" in window.server_button.toolTip()
    auth = {"Authorization": "Bearer s3cret"}
    assert httpx.get(url + "/models", timeout=10).status_code == 401
    old = window.bridge.engine

    # New cache settings: a new engine; the server moves to it, same address.
    window.apply_settings(dataclasses.replace(SMALL, budget=512), confirm=False)
    qtbot.waitUntil(
        lambda: window.bridge.engine is not old and window.bridge.server is not None,
        timeout=30_000,
    )
    assert window.bridge.server.base_url == url and not old.running
    r = httpx.post(
        url + "/chat/completions",
        json=chat_body(window.bridge.server.model_id, "Hi.", 4),
        headers=auth,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert window.bridge.engine.snapshot().num_pages == 512 // 16  # served by the new one

    start = time.monotonic()
    window.close()
    assert time.monotonic() - start < 10
    assert window.bridge.server is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", headers=auth, timeout=2)
    # Still on in the saved settings: the next start serves again.
    assert json.loads(window.settings.value("server/settings"))["enabled"] is True
