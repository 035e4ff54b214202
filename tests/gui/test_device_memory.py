"""The memory panel on a GPU, without one: a fake `DeviceMemorySource` hands the panel a
GPU's figures, and the panel, page map and legend must show them (and say VRAM and host
RAM); on the CPU none of it shows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.cache.host_tier import HostTierSnapshot
from engine.cache.page import PageState
from engine.cache.snapshot import cache_stats
from engine.device import DeviceMemory
from engine.units import format_bytes
from gui.views.memory_panel import MemoryPanel
from tests.gui.conftest import synthetic_snapshot

GIB, MIB = 1 << 30, 1 << 20


class FakeGpu:
    """A `DeviceMemorySource` with set figures, counting its reads."""

    def __init__(self, memory: DeviceMemory | None | Exception):
        self.memory = memory
        self.reads: list[str] = []

    def __call__(self, device):
        self.reads.append(str(device))
        if isinstance(self.memory, Exception):
            raise self.memory
        return self.memory


def _snapshot(device: str, host_slots: int = 0, **figures):
    snap = synthetic_snapshot(96, page_size=16, chats=4)
    cache = snap.cache
    if host_slots:
        state = np.full(host_slots, PageState.FREE, np.uint8)
        state[: host_slots // 2] = PageState.HOST
        host = HostTierSnapshot(
            state,
            np.arange(host_slots, dtype=np.int64),
            np.arange(1, host_slots + 1, dtype=np.uint64),
        )
        cache = dataclasses.replace(cache, host=host)
    return dataclasses.replace(
        snap, cache=cache, stats=cache_stats(cache, snap.page_size), device=device, **figures
    )


def _size(n: int) -> str:
    return format_bytes(n, binary=True)


@pytest.fixture
def gpu():
    return FakeGpu(
        DeviceMemory(
            total=80 * GIB,
            free=61 * GIB + 300 * MIB,
            allocated=5 * GIB + 700 * MIB,
            reserved=7 * GIB,
            name="NVIDIA Fake 80GB",
        )
    )


def test_the_panel_shows_the_gpus_memory_from_its_source(qtbot, gpu, tmp_path):
    panel = MemoryPanel(device_memory=gpu)
    qtbot.addWidget(panel)
    panel.resize(520, 760)
    weights, kv, host = 3 * GIB + 512 * MIB, 2 * GIB, 1 * GIB
    snap = _snapshot("cuda:0", host_slots=16, weight_bytes=weights, cache_bytes=kv, host_bytes=host)
    panel.refresh(snap)
    assert gpu.reads == ["cuda:0"]
    assert panel.device.isVisibleTo(panel)
    m = gpu.memory
    expected = [
        ("weights", weights),
        ("KV pages", kv),
        ("other", m.allocated - weights - kv),
        ("allocator reserve", m.reserved - m.allocated),
        ("outside torch", m.total - m.free - m.reserved),
        ("free", m.free),
    ]
    assert panel.device.entries() == [f"{name} {_size(n)}" for name, n in expected]
    assert sum(n for _, n in expected) == m.total  # the bar is the whole GPU
    title = panel.device.title()
    assert title.startswith(f"VRAM · cuda:0 {m.name} · {_size(m.total)}")
    assert title.endswith(f"host tier {_size(host)} in pinned RAM")
    # the page map and the legend say where the pages are
    caption = panel.page_map.caption.text()
    assert caption.startswith("VRAM (cuda:0): 96 pages × 16 tokens")
    assert "host tier in host RAM 8/16" in caption
    assert "host tier (RAM) 8" in panel.legend.entries()
    assert panel.page_map.tooltip_text(0).splitlines()[0].endswith(" · in VRAM")
    assert panel.page_map.tooltip_text(96).splitlines()[0].endswith(" · in host RAM")
    panel.show()
    qtbot.waitExposed(panel)
    path = tmp_path / "device_memory.png"
    assert panel.grab().save(str(path))


def test_new_figures_redraw_and_a_failing_source_hides_the_view(qtbot, gpu):
    panel = MemoryPanel(device_memory=gpu)
    qtbot.addWidget(panel)
    snap = _snapshot("cuda:1", weight_bytes=GIB, cache_bytes=GIB)
    panel.refresh(snap)
    before = panel.device.entries()
    gpu.memory = dataclasses.replace(gpu.memory, free=gpu.memory.free - 2 * GIB)
    panel.refresh(dataclasses.replace(snap, version=snap.version + 1))
    assert gpu.reads == ["cuda:1", "cuda:1"]
    assert panel.device.entries()[-1] == f"free {_size(gpu.memory.free)}" != before[-1]
    gpu.memory = RuntimeError("CUDA error: unspecified launch failure")
    panel.refresh(dataclasses.replace(snap, version=snap.version + 2))
    assert not panel.device.isVisibleTo(panel) and panel.device.entries() == []
    gpu.memory = None
    panel.refresh(dataclasses.replace(snap, version=snap.version + 3))
    assert not panel.device.isVisibleTo(panel)


def test_on_the_cpu_the_panel_stays_as_it_was(qtbot, gpu):
    panel = MemoryPanel(device_memory=gpu)
    qtbot.addWidget(panel)
    panel.refresh(_snapshot("cpu", host_slots=16, weight_bytes=GIB, cache_bytes=GIB))
    assert gpu.reads == []  # nothing to read off a GPU
    assert not panel.device.isVisibleTo(panel)
    caption = panel.page_map.caption.text()
    assert caption.startswith("96 pages × 16 tokens") and "VRAM" not in caption
    assert "host tier 8/16" in caption
    assert "host tier 8" in panel.legend.entries()
    assert "VRAM" not in panel.page_map.tooltip_text(0)
    # a remote engine's snapshot names no device: the same
    panel.refresh(_snapshot(""))
    assert gpu.reads == [] and not panel.device.isVisibleTo(panel)
