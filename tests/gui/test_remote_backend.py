"""The app as a client of a server elsewhere: a `folio serve` subprocess (KV events with
replay, metrics, an API key) on a tiny chat model. Chats stream from it and cancel by
closing the stream; the page map and prefix tree rebuilt from its events equal the
server's own snapshot (GET /folio/v1/cache); the graphs' hit rate is the server's; an
unreachable address, a wrong or missing key and a server that is not OpenAI's are said
in words, in the engine and in the window, and nothing crashes."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QSettings

from engine.cache.page import PageState
from engine.generator.job import EventKind, JobRequest
from engine.generator.sampler import SamplingSettings
from engine.remote.engine import RemoteEngine, RemoteError, RemoteSettings
from gui.main_window import MainWindow
from gui.palette import ChatColors
from gui.settings_dialog import EngineSettings
from gui.store import Store
from gui.views.page_map_model import PageMapModel
from gui.views.prefix_tree_model import PrefixTreeModel
from tests.engine.server.conftest import wait_idle
from tests.engine.tiny_models import write_chat_model
from tests.gui.test_local_server import free_port

KEY = "remote-test-key"
PS = 16
SYSTEM = {"role": "system", "content": "You are a test assistant on another machine. " * 3}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`folio serve` in its own process: (url, events endpoint, replay endpoint)."""
    tmp = tmp_path_factory.mktemp("remote")
    folder = write_chat_model(tmp / "tiny-chat", context=512, seed=11)
    env = {**os.environ, "FOLIO_DATA_DIR": str(tmp / "data"), "FOLIO_CONFIG_DIR": str(tmp)}
    cmd = [sys.executable, "-m", "folio", "serve", "--model", str(folder), "--port", "0",
           "--api-key", KEY, "--page-size", str(PS), "--cache-tokens", "512",
           "--no-disk-cache", "--kv-events", "tcp://127.0.0.1:*",
           "--kv-events-replay", "tcp://127.0.0.1:*", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    url = events = replay = None
    said = []
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        said.append(line)
        if m := re.search(r"KV-cache events on (\S+), replays on (\S+)", line):
            events, replay = m.groups()
        if m := re.search(r"serving (http://\S+)/v1", line):
            url = m.group(1)
    if url is None:
        proc.kill()
        pytest.fail("folio serve did not start:\n" + "".join(said))
    # Keep reading its output, or a full pipe would stall the server.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield url, events, replay
    proc.terminate()
    proc.wait(30)


@pytest.fixture
def remote(served):
    url, events, replay = served
    engine = RemoteEngine(RemoteSettings(url, KEY, events, replay)).connect()
    yield engine
    engine.shutdown()


def chat(user: str, tag, new: int = 12) -> JobRequest:
    return JobRequest(
        messages=[SYSTEM, {"role": "user", "content": user}],
        sampling=SamplingSettings(temperature=0),
        max_new_tokens=new,
        tag=tag,
    )


def server_idle(remote: RemoteEngine):
    return wait_idle(remote.server_snapshot)


def hashed_cells(snap) -> dict[int, tuple]:
    """Per hashed page: (parent's hash or 0, state, ref count, fill, tokens)."""
    pm = PageMapModel.from_snapshot(snap, ChatColors())
    out = {}
    for cell in np.flatnonzero(pm.hash_prefix[: pm.num_pages] != 0).tolist():
        parent = int(pm.parent[cell])
        up = int(pm.hash_prefix[parent]) if parent >= 0 else 0
        fill = int(pm.fill[cell])
        out[int(pm.hash_prefix[cell])] = (
            up, int(pm.state[cell]), int(pm.ref_count[cell]), fill,
            list(snap.page_tokens[cell][:fill]),
        )  # fmt: skip
    return out


def hashed_nodes(snap) -> dict:
    tree = PrefixTreeModel()
    tree.set_snapshot(snap)
    nodes = tree.nodes()
    return {
        k: (n.parent if n.parent in nodes else None, n.state, n.ref_count, n.fill,
            list(n.tokens[: n.fill]), n.owners)
        for k, n in nodes.items()
        if k[0] == "h"
    }  # fmt: skip


def test_views_from_events_equal_the_servers_own_snapshot(remote):
    assert remote.model_id == "tiny-chat" and remote.flavour == "folio"
    assert remote.has_metrics and remote.has_folio_cache and remote.subscriber is not None
    # Three chats sharing a system prompt at once, then a second turn of one of them.
    handles = [remote.submit(chat(f"question {i}", tag=i)) for i in range(3)]
    results = [h.wait(60) for h in handles]
    assert all(r.eos_reason in ("stop", "length") and not r.error for r in results)
    follow_up = chat("question 0", tag=0)
    follow_up.messages.extend(
        [{"role": "assistant", "content": results[0].text}, {"role": "user", "content": "more"}]
    )
    again = remote.submit(follow_up).wait(60)
    assert again.cached_tokens >= PS  # the server's own count, streamed back in usage

    server = server_idle(remote)
    # The events arrive on their own socket: wait for the pool to catch up, then compare.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mine = remote.snapshot()
        server = remote.server_snapshot()
        if hashed_cells(mine) == hashed_cells(server):
            break
        time.sleep(0.1)
    assert mine.num_pages == server.num_pages and mine.page_size == server.page_size == PS
    cells = hashed_cells(server)
    assert len(cells) >= 6 and all(c[1] == PageState.CACHED for c in cells.values())
    assert hashed_cells(mine) == cells  # page map: same pages, chains, fills, tokens
    assert hashed_nodes(mine) == hashed_nodes(server)  # prefix tree: same nodes and edges
    # The shared system prompt is one chain that the chats fork from.
    tree = PrefixTreeModel()
    tree.set_snapshot(mine)
    assert tree.branch_points()
    assert "no physical page index" in mine.note


def test_chats_stream_and_a_cancel_closes_the_stream(remote):
    seen: list = []
    remote.add_listener(seen.append)
    handle = remote.submit(chat("tell a long story", tag="story", new=300))
    first = next(e for e in handle.events(timeout=60) if e.kind is EventKind.STREAMING)
    assert first.text and first.tag == "story"
    handle.cancel()
    result = handle.wait(30)
    assert result.eos_reason == "cancelled" and result.new_tokens < 300
    # The server saw its client go: the job is cancelled and its pages freed.
    server_idle(remote)
    kinds = [e.kind for e in seen if e.job_id == handle.job_id]
    assert kinds[0] is EventKind.STARTED and kinds[-1] is EventKind.DONE


def test_graphs_follow_the_servers_metrics(remote):
    remote.submit(chat("one", tag=1)).wait(60)
    remote.submit(chat("two", tag=2)).wait(60)
    server_idle(remote)
    # The scrapes run every second: wait for one that follows the server's last step.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counters = remote.server_snapshot().cache.counters
        expected = counters["prefix_hit_tokens"] / counters["prefix_query_tokens"]
        rates = remote.telemetry.series("prefix_hit_rate")[1]
        if len(rates) and abs(rates[-1] - expected) < 1e-9:
            break
        time.sleep(0.2)
    assert rates[-1] == pytest.approx(expected) and expected > 0
    assert remote.snapshot().stats.prefix_hit_rate == pytest.approx(expected)
    decoded = remote.telemetry.series("decode_tokens")[1]
    assert decoded.sum() > 0  # tokens generated between scrapes, from the counters
    done = [e for e in remote.telemetry.events() if e["kind"] == "job_done"]
    assert {e["tag"] for e in done} >= {1, 2}


# -- what cannot work, said in words ---------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    """A web server that is not an OpenAI one: 404 on /v1/*, an HTML page elsewhere."""

    def do_GET(self):  # noqa: N802 - http.server's name
        html = self.path == "/page/v1/models"
        self.send_response(200 if html else 404)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html><body>hello</body></html>")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def refusal(settings: RemoteSettings) -> str:
    with pytest.raises(RemoteError) as err:
        RemoteEngine(settings, timeout=5).connect()
    return str(err.value)


def test_what_cannot_work_is_said_in_words(served, web_server):
    url = served[0]
    port = free_port()  # nobody listens there
    gone = refusal(RemoteSettings(f"http://127.0.0.1:{port}"))
    assert f"Cannot reach http://127.0.0.1:{port}" in gone and "server is running" in gone
    wrong = refusal(RemoteSettings(url + "/v1", "not-the-key"))
    assert "refused the API key (HTTP 401" in wrong and "the key the server was started" in wrong
    assert "It needs an API key" in refusal(RemoteSettings(url))
    assert "does not look like an OpenAI-compatible server" in refusal(RemoteSettings(web_server))
    html = refusal(RemoteSettings(web_server + "/page"))
    assert "something other than JSON (text/html)" in html
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        RemoteSettings("192.168.1.20:8000").validate()
    with pytest.raises(ValueError, match="must look like tcp://HOST:PORT"):
        RemoteSettings("http://h:1", kv_events="h:5557").validate()


def test_a_refused_request_ends_as_an_error_the_chat_shows(remote):
    # Longer than the server's whole cache: refused with its own words, not a crash.
    result = remote.submit(chat("word " * 2000, tag="long")).wait(60)
    assert result.eos_reason == "error" and "HTTP 4" in result.error


# -- the window ---------------------------------------------------------------------------


def remote_window(qtbot, tmp_path: Path, settings: EngineSettings) -> MainWindow:
    qsettings = QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)
    qsettings.setValue("engine/settings", json.dumps(settings.as_dict()))
    window = MainWindow(Store(tmp_path / "chats.sqlite3"), qsettings)
    qtbot.addWidget(window)
    window.show()
    window.start_engine()
    return window


def test_the_window_chats_with_a_remote_server(qtbot, tmp_path, served):
    url, events, replay = served
    settings = EngineSettings(
        backend="remote", remote_url=url, remote_key=KEY, remote_events=events,
        remote_replay=replay,
    )  # fmt: skip
    window = remote_window(qtbot, tmp_path, settings)
    qtbot.waitUntil(lambda: window.bridge.ready, timeout=30_000)
    assert window.bridge.remote and window.bridge.tokenizer is None
    assert window.model_label.text() == "tiny-chat · Folio server"
    view = window.chat_view
    view.settings.load("", {"temperature": 0.0, "max_new_tokens": 8})
    view.save_settings()
    view.input.setPlainText("Hello there")
    view.send()
    qtbot.waitUntil(lambda: not window.controller.generations, timeout=60_000)
    cid = view.conversation_id
    reply = window.store.transcript(cid, window.store.conversation(cid).current_leaf)[-1]
    assert reply.role == "assistant" and reply.complete and not reply.error
    assert reply.content and reply.stats["new_tokens"] > 0
    # The gauge recounts on a debounce timer: it may lag the reply under load.
    qtbot.waitUntil(
        lambda: "The server counts this chat's tokens" in view.gauge.label.text(), timeout=10_000
    )
    panel = window.memory_panel
    qtbot.waitUntil(lambda: panel.note.isVisible(), timeout=10_000)
    assert "KV-cache events" in panel.note.text()
    qtbot.waitUntil(lambda: panel.page_map.model.num_pages == 512 // PS, timeout=10_000)
    # The local server cannot serve a remote engine: said, and switched off.
    from gui.server_dialog import LocalServerSettings

    with qtbot.waitSignal(window.bridge.server_failed, timeout=10_000) as failed:
        window.apply_server_settings(LocalServerSettings(enabled=True, port=free_port()))
    assert "serves this computer's engine" in failed.args[0]
    window.close()


def test_the_window_says_a_wrong_key_and_keeps_going(qtbot, tmp_path, served):
    settings = EngineSettings(backend="remote", remote_url=served[0], remote_key="wrong")
    window = remote_window(qtbot, tmp_path, settings)
    qtbot.waitUntil(lambda: window.error_dialog is not None, timeout=30_000)
    assert window.error_dialog.windowTitle() == "Could not use the server"
    assert "refused the API key (HTTP 401" in window.error_dialog.text()
    assert not window.bridge.ready and window.model_label.text() == "no model"
    # A send without an engine is an error bubble, not a crash.
    window.chat_view.input.setPlainText("anyone?")
    window.chat_view.send()
    cid = window.chat_view.conversation_id
    reply = window.store.transcript(cid, window.store.conversation(cid).current_leaf)[-1]
    assert reply.error
    window.close()


def test_without_events_a_folio_server_is_drawn_from_its_own_snapshot(served):
    url = served[0]
    remote = RemoteEngine(RemoteSettings(url, KEY)).connect()
    try:
        assert remote.subscriber is None and remote.has_folio_cache
        handle = remote.submit(chat("a long answer please", tag="mine", new=300))
        next(e for e in handle.events(timeout=60) if e.kind is EventKind.STREAMING)
        # While it runs (300 tokens: a second or so), the server's job is this app's chat
        # (matched by request id), holding pages the page map colours as the chat's.
        snap = remote.server_snapshot()
        job = next(j for j in snap.jobs if j.tag == "mine")
        assert job.pages > 0
        pm = PageMapModel.from_snapshot(snap, ChatColors())
        assert len(pm.pages_of_chat("mine")) == job.pages
        handle.cancel()
        handle.wait(30)
        server = server_idle(remote)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and hashed_cells(remote.snapshot()) != hashed_cells(
            server
        ):
            time.sleep(0.1)
        mine = remote.snapshot()
        assert mine.note.startswith("Drawn from the Folio server's own page-table snapshot")
        assert hashed_cells(mine) == hashed_cells(server)
        # An idle server sends nothing when asked for what is newer than a copy.
        latest = remote.server_snapshot()
        assert remote.server_snapshot(after=latest.version) is None
        assert remote.server_snapshot(after=latest.version - 1).version == latest.version
    finally:
        remote.shutdown()


def test_the_engine_settings_say_what_a_server_needs(qtbot):
    from gui.settings_dialog import SWITCH_NOTE, SettingsDialog

    local = EngineSettings()
    dialog = SettingsDialog(local)
    qtbot.addWidget(dialog)
    assert dialog.use_local.isChecked() and not dialog.remote_url.isEnabled()
    dialog.use_remote.setChecked(True)
    dialog.remote_url.setText("gpu-box:8000")
    assert not dialog.local_part.isEnabled()
    assert "must start with http:// or https://" in dialog.remote_error.text()
    accepted: list = []
    dialog.accepted.connect(lambda: accepted.append(True))
    dialog.accept()
    assert not accepted  # refused: the dialog stays open, saying why
    dialog.remote_url.setText("http://gpu-box:8000/v1")
    dialog.remote_key.setText("k")
    dialog.remote_events.setText("tcp://gpu-box:5557")
    assert not dialog.remote_error.isVisible() and dialog.rebuild_note.text() == SWITCH_NOTE
    values = dialog.values()
    assert values.remote and values.needs_switch(local)
    dialog.accept()
    assert accepted
    saved = EngineSettings.from_dict(values.as_dict())
    assert saved == values
    assert saved.remote_settings().base_url == "http://gpu-box:8000"
    assert EngineSettings.from_dict({**values.as_dict(), "backend": "cloud"}) == EngineSettings()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    from engine.model.loader import load_model

    return load_model(
        write_chat_model(tmp_path_factory.mktemp("local") / "tiny-chat", 512, seed=11)
    )


def test_the_window_switches_to_a_server_and_back(qtbot, tmp_path, served, tiny_chat):
    qsettings = QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)
    window = MainWindow(Store(tmp_path / "chats.sqlite3"), qsettings)
    qtbot.addWidget(window)
    window.use_loaded(tiny_chat)
    qtbot.waitUntil(lambda: window.bridge.ready, timeout=30_000)
    assert not window.bridge.remote
    local = window.engine_settings
    remote = dataclasses.replace(local, backend="remote", remote_url=served[0], remote_key=KEY)
    assert window.apply_settings(remote, confirm=False)
    qtbot.waitUntil(lambda: window.bridge.remote and window.bridge.ready, timeout=30_000)
    assert window.model_label.text() == "tiny-chat · Folio server"
    assert json.loads(qsettings.value("engine/settings"))["backend"] == "remote"
    # Back to this computer: the model it ran before is loaded again.
    assert window.apply_settings(dataclasses.replace(remote, backend="local"), confirm=False)
    qtbot.waitUntil(lambda: window.bridge.ready and not window.bridge.remote, timeout=60_000)
    assert window.bridge.loaded is not None and window.bridge.loaded.name == tiny_chat.name
    window.close()
