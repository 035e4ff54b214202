"""The engine bridge: events as batched signals on the UI thread, snapshots on a timer
only when the engine moved, errors from loading as signals, clean shutdown. Also the
engine settings the settings dialog edits."""

from __future__ import annotations

import threading

import pytest

from engine.cache.kv_cache import CacheSettings
from engine.generator.generator import GeneratorSettings
from engine.generator.job import EventKind, JobRequest
from engine.generator.sampler import SamplingSettings
from gui.bridge import EngineBridge, ModelInfo
from gui.settings_dialog import EngineSettings, SettingsDialog, weights_note


@pytest.fixture
def bridge(qtbot, smollm2_int4):
    b = EngineBridge()
    with qtbot.waitSignal(b.engine_ready, timeout=30_000):
        b.use_loaded(
            smollm2_int4,
            CacheSettings(page_size=16, token_budget=512),
            GeneratorSettings(max_chunk_size=64),
        )
    yield b
    b.shutdown()


@pytest.mark.slow
def test_events_arrive_batched_on_the_ui_thread(qtbot, bridge):
    batches: list[list] = []
    threads: set[str] = set()

    def on_events(events: list) -> None:
        batches.append(events)
        threads.add(threading.current_thread().name)

    bridge.job_events.connect(on_events)
    handle = bridge.submit(
        JobRequest(
            messages=[{"role": "user", "content": "Count to five."}],
            max_new_tokens=12,
            sampling=SamplingSettings(temperature=0),
            tag="chat-a",
        )
    )
    qtbot.waitUntil(lambda: any(e.eos for b in batches for e in b), timeout=30_000)
    events = [e for b in batches for e in b]
    assert threads == {threading.main_thread().name}
    assert events[0].kind == EventKind.STARTED and events[-1].eos
    assert all(e.job_id == handle.job_id and e.tag == "chat-a" for e in events)
    streamed = "".join(e.text for e in events if e.kind == EventKind.STREAMING)
    assert streamed and streamed == events[-1].result.text


@pytest.mark.slow
def test_snapshots_only_when_the_engine_moved(qtbot, bridge):
    seen: list = []
    bridge.snapshot_ready.connect(seen.append)
    qtbot.wait(350)  # idle engine: at most the first tick's snapshot
    assert len(seen) <= 1
    assert bridge.poll_snapshot() is None  # same version: skipped
    assert bridge.poll_snapshot(force=True) is not None


@pytest.mark.slow
def test_bad_requests_raise_in_the_caller(bridge):
    with pytest.raises(ValueError, match="pages"):
        bridge.submit(JobRequest(messages=[{"role": "user", "content": "word " * 2000}]))
    with pytest.raises(ValueError):
        bridge.submit(JobRequest(messages=[]))


def test_load_failure_is_a_signal(qtbot, tmp_path):
    b = EngineBridge()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 40)
    with qtbot.waitSignal(b.engine_failed, timeout=30_000) as blocker:
        b.load(bad)
    assert "broken.gguf" in blocker.args[0]
    assert not b.ready and not b.busy
    with pytest.raises(RuntimeError, match="no model"):
        b.submit(JobRequest(messages=[{"role": "user", "content": "hi"}]))


def test_engine_settings_round_trip_and_rebuild_rules(qtbot):
    s = EngineSettings(page_size=64, budget=256, budget_unit="MB", k_bits=8, v_bits=4)
    assert EngineSettings.from_dict(s.as_dict()) == s
    cache = s.cache_settings()
    assert cache.byte_budget == 256 << 20 and cache.token_budget is None
    assert EngineSettings.from_dict({"page_size": 7, "junk": 1}) == EngineSettings()
    assert EngineSettings.from_dict("nonsense") == EngineSettings()  # type: ignore[arg-type]
    assert not s.needs_rebuild(EngineSettings(**{**s.as_dict(), "cpu_threads": 2}))
    assert s.needs_rebuild(EngineSettings(**{**s.as_dict(), "page_size": 32}))
    dialog = SettingsDialog(s)
    qtbot.addWidget(dialog)
    assert dialog.values() == s and dialog.rebuild_note.isHidden()
    dialog.threads.setValue(1)
    assert not dialog.needs_rebuild()
    dialog.page_size.setCurrentIndex(dialog.page_size.findData(128))
    assert dialog.needs_rebuild() and not dialog.rebuild_note.isHidden()


def test_weights_setting_says_what_each_mode_costs(qtbot, tmp_path):
    s = EngineSettings()
    bf16 = EngineSettings(weights="bf16")
    assert EngineSettings.from_dict(bf16.as_dict()) == bf16
    assert EngineSettings.from_dict({"weights": "fp64"}) == EngineSettings()
    assert bf16.needs_reload(s) and not bf16.needs_rebuild(s) and not s.needs_reload(s)
    info = ModelInfo(
        name="m", path=tmp_path / "m.gguf", format="GGUF Q4_K", device="CPU",
        architecture="llama", weight_bytes=800 << 20, load_seconds=0.5,
        weight_costs={"native": 800 << 20, "bf16": 3000 << 20, "dequant": 6000 << 20},
    )  # fmt: skip
    dialog = SettingsDialog(s, model=info)
    qtbot.addWidget(dialog)
    assert "800.0 MB of weights" in dialog.weights_note.text() and dialog.rebuild_note.isHidden()
    dialog.weights.setCurrentIndex(dialog.weights.findData("bf16"))
    assert dialog.values() == bf16 and dialog.needs_reload()
    note = dialog.weights_note.text()
    assert "2.93 GB of weights" in note and "2.15 GB more" in note
    assert (
        not dialog.rebuild_note.isHidden() and "loads the model again" in dialog.rebuild_note.text()
    )
    # a model that is not a GGUF file has one way to keep its weights
    folder = ModelInfo(**{**info.__dict__, "weight_costs": {}})
    assert "not a GGUF" in weights_note("native", folder)
    other = SettingsDialog(s, model=folder)
    qtbot.addWidget(other)
    assert not other.weights.isEnabled()


def test_device_setting_round_trip_and_reload(qtbot):
    s = EngineSettings()
    assert s.device == "auto"
    gpu = EngineSettings(device="cuda:1")
    assert EngineSettings.from_dict(gpu.as_dict()) == gpu
    assert EngineSettings.from_dict({"device": "CUDA"}).device == "cuda"
    assert EngineSettings.from_dict({"device": "tpu"}) == EngineSettings()
    assert gpu.needs_reload(s) and not gpu.needs_rebuild(s)
    dialog = SettingsDialog(gpu)
    qtbot.addWidget(dialog)
    assert dialog.values() == gpu  # kept even where this machine has no second GPU
    dialog.device.setCurrentIndex(dialog.device.findData("cpu"))
    assert dialog.values().device == "cpu" and dialog.needs_reload()
    assert "loads the model again" in dialog.rebuild_note.text()


@pytest.fixture
def no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_cuda_without_a_gpu_loads_on_the_cpu_with_a_note(qtbot, tmp_path, no_gpu, monkeypatch):
    """The app asked for CUDA on a machine without a GPU: the model runs on the CPU and
    the status bar says so in the device's place, the reason in its tooltip."""
    import json

    from PySide6.QtCore import QSettings

    from gui.main_window import MainWindow
    from gui.settings_dialog import device_choices
    from gui.store import Store
    from tests.engine.tiny_models import write_chat_model

    assert ("CUDA GPU (none found)", "cuda") in device_choices()
    model = write_chat_model(tmp_path / "tiny")
    qsettings = QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)
    qsettings.setValue("engine/settings", json.dumps(EngineSettings(device="cuda").as_dict()))
    window = MainWindow(Store(tmp_path / "chats.sqlite3"), qsettings)
    qtbot.addWidget(window)
    window.show()
    window.load_model(model)
    qtbot.waitUntil(lambda: window.bridge.ready, timeout=30_000)
    info = window.model_info
    assert info.device == "CPU" and window.bridge.loaded.device.type == "cpu"
    assert info.device_note.startswith("device cuda: no CUDA GPU is available")
    assert window.device_label.text() == "CPU: no CUDA GPU found"
    assert window.device_label.isVisible()
    assert window.device_label.toolTip() == info.device_note
    assert "VRAM" not in window.memory_label.text()
    # on a GPU the memory label adds what the device holds (engine.device.DeviceMemory)
    from engine.device import DeviceMemory

    vram = DeviceMemory(total=8 << 30, free=6 << 30, allocated=1 << 30, reserved=2 << 30)
    monkeypatch.setattr("gui.main_window.device_memory", lambda device: vram)
    window.update_status(window.bridge.engine.snapshot())
    assert window.memory_label.text().endswith(
        vram.describe(
            window.bridge.loaded.weight_bytes, window.bridge.engine.snapshot().cache_bytes
        )
    )
    window.close()
