"""Engine settings: what the user can change, how it is stored, and the dialog.

Cache and generator settings are fixed when an engine is built, so changing them
means a new engine on the same weights (running replies stop, cached prefixes are
dropped); the dialog says which changes do that. CPU threads apply at once.

The prompt cache on disk (docs/ENGINE.md §10) is on by default at the location `folio
generate` uses, so the app and the command line find each other's pages. The dialog
shows what its stores hold and clears them; the listing and the clearing run off the
UI thread.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QTimer
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine import paths
from engine.cache.disk_tier import default_budget, delete_stores, list_stores
from engine.cache.formats import width_name
from engine.cache.kv_cache import CacheSettings
from engine.device import DEFAULT_DEVICE, parse_device
from engine.generator.generator import GeneratorSettings
from engine.model.weight_modes import DEFAULT_WEIGHT_MODE, USER_WEIGHT_MODES
from engine.units import format_bytes
from gui.settings_hints import (
    BATCH_TIP,
    BUDGET_TIP,
    CHUNK_TIP,
    HOST_TIP,
    KV_BITS_TIP,
    PAGE_TIP,
    THREADS_TIP,
    Hint,
    LostWork,
    budget_hint,
    kv_quality_hint,
    page_size_hint,
    suggest_page_size,
    work_lost,
)
from gui.worker import TaskRunner

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot
    from engine.remote.engine import RemoteSettings
    from gui.bridge import ModelInfo

KV_BITS = (None, 32, 8, 6, 5, 4, 3, 2)  # None: unquantized, fp16 (engine.cache.formats)
PAGE_SIZES = (16, 32, 64, 128, 256, 512, 1024)
MB = 1 << 20
GB = 10**9
HINT_WIDTH = 440  # the fields' column at least: a hint wraps to two or three lines  # the disk budget is in disk vendors' (and `folio --disk-cache-gb`'s) gigabytes

DISK_TIP = (
    "Keeps the pages of finished chats on disk, so that reopening a long chat after a "
    "restart (or switching back to a model) costs no prefill: its pages are read back "
    "in a fraction of a second instead of being computed again. It costs disk space, "
    "up to the budget below for each model."
)
DISK_BUDGET_TIP = (
    "The most disk space the prompt cache of one model may take; past it the oldest "
    "chats' last pages go first. 0: automatic (4 GiB, or a tenth of the free disk if that "
    "is less)."
)
DISK_DIR_TIP = (
    "The folder of the prompt cache on disk (a store per model and cache format). "
    "Empty: the default, which `folio generate` and `folio chat` use too."
)
CLEAR_TIP = (
    "Deletes every model's prompt cache in this folder and frees the space. Chats are "
    "not touched; their next replies prefill the whole conversation again. Pages the "
    "loaded model holds in memory now are written again as it runs."
)

# The choices of "Weights in memory", in plain words, and what each was measured to
# cost and buy (`folio bench forward --shape llama-3.2-1b --quant q4_k_m --weights M`,
# both modes in one run; README "Run it").
WEIGHT_CHOICES = {
    "native": "As the file stores them (least memory)",
    "bf16": "bf16 copy: faster prompts, slower replies",
    "dequant": "fp32 copy: exact arithmetic, most memory",
}
WEIGHT_TRADES = {
    "native": "Reads the model file in place: the least memory, and the fastest replies.",
    "bf16": (
        "A bf16 copy of every weight: prompts are read about 2.8x faster, replies are "
        "written about 2.3x slower, the weights take about 3.7x the memory and loading "
        "takes seconds longer (measured on a 1B Q4_K_M model, 2-core Xeon). For long "
        "prompts with short answers."
    ),
    "dequant": (
        "Exact fp32 arithmetic, as the reference implementations compute: for checking "
        "results, not for chatting (the most memory and the slowest replies)."
    ),
}

REBUILD_NOTE = "Applying these changes rebuilds the KV cache."
RELOAD_NOTE = "Applying these changes loads the model again."
SWITCH_NOTE = "Applying these changes switches the engine: replies in progress stop."
REMOTE_TIP = (
    "Chats stream from the server's /v1/chat/completions (vLLM, llama.cpp's llama-server, "
    "another Folio's folio serve). The memory views draw what it publishes: graphs from "
    "its /metrics; the page map and prefix tree from its KV-cache events when you give "
    "their endpoint (vLLM: --kv-events-config, Folio: --kv-events), or from a Folio "
    "server's own snapshot."
)


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings a user sees; defaults suit a small model on a laptop CPU."""

    page_size: int = 32
    budget_unit: str = "tokens"  # or "MB"
    budget: int = 4096  # tokens or MB of KV cache
    k_bits: int | None = None
    v_bits: int | None = None
    host_mb: int = 0
    max_batch_size: int = 16
    max_chunk_size: int = 256
    cpu_threads: int = 0  # 0: torch's default
    weights: str = DEFAULT_WEIGHT_MODE  # how a GGUF file's weights are kept (reloads)
    device: str = DEFAULT_DEVICE  # auto, cpu, cuda or cuda:N (engine/device.py; reloads)
    disk_cache: bool = True  # the prompt cache on disk (docs/ENGINE.md §10)
    disk_gb: float = 0.0  # its budget per model; 0: the engine's default
    disk_dir: str = ""  # its location; "": engine.paths.kv_cache_dir()
    # Which engine runs the chats: "local" (this computer's) or "remote" (a server at
    # remote_url, with its API key and, optionally, its KV-event endpoints).
    backend: str = "local"
    remote_url: str = ""
    remote_key: str = ""
    remote_events: str = ""
    remote_replay: str = ""

    REBUILD_FIELDS = (
        "page_size",
        "budget_unit",
        "budget",
        "k_bits",
        "v_bits",
        "host_mb",
        "max_batch_size",
        "max_chunk_size",
        "disk_cache",
        "disk_gb",
        "disk_dir",
    )

    REMOTE_FIELDS = ("backend", "remote_url", "remote_key", "remote_events", "remote_replay")

    @property
    def remote(self) -> bool:
        return self.backend == "remote"

    def remote_settings(self) -> RemoteSettings:
        from engine.remote.engine import RemoteSettings

        return RemoteSettings(
            url=self.remote_url,
            api_key=self.remote_key or None,
            kv_events=self.remote_events or None,
            kv_events_replay=self.remote_replay or None,
        )

    def needs_switch(self, other: EngineSettings) -> bool:
        """Another engine: local to remote, back, or another server."""
        if self.backend != other.backend:
            return True
        return self.remote and any(
            getattr(self, f) != getattr(other, f) for f in self.REMOTE_FIELDS
        )

    def disk_location(self) -> Path:
        """Where the prompt cache on disk goes (whether or not it is on)."""
        return Path(self.disk_dir).expanduser() if self.disk_dir else paths.kv_cache_dir()

    def cache_settings(self) -> CacheSettings:
        by_bytes = self.budget_unit == "MB"
        return CacheSettings(
            page_size=self.page_size,
            token_budget=None if by_bytes else self.budget,
            byte_budget=self.budget * MB if by_bytes else None,
            k_bits=self.k_bits,
            v_bits=self.v_bits,
            host_bytes=self.host_mb * MB,
            disk_dir=str(self.disk_location()) if self.disk_cache else None,
            disk_bytes=round(self.disk_gb * GB) if self.disk_gb > 0 else None,
        )

    def generator_settings(self) -> GeneratorSettings:
        # A chunk is whole pages and at least one page.
        chunk = max(self.page_size, self.max_chunk_size // self.page_size * self.page_size)
        return GeneratorSettings(
            max_batch_size=self.max_batch_size,
            max_chunk_size=chunk,
            max_prefill_tokens=max(chunk, 1024),
        )

    def needs_rebuild(self, other: EngineSettings) -> bool:
        return any(getattr(self, f) != getattr(other, f) for f in self.REBUILD_FIELDS)

    def needs_reload(self, other: EngineSettings) -> bool:
        """The weights are kept another way or elsewhere: the model is read again."""
        return self.weights != other.weights or self.device != other.device

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> EngineSettings:
        """Unknown keys are dropped and bad values fall back to defaults, so an old or
        hand-edited settings file never stops the app from starting."""
        if not isinstance(data, dict):
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            settings = cls(**{k: v for k, v in data.items() if k in known})
            settings.cache_settings()
            settings.generator_settings().validate(settings.page_size)
            if settings.weights not in USER_WEIGHT_MODES:
                raise ValueError(f"unknown weight mode {settings.weights!r}")
            settings = dataclasses.replace(settings, device=str(parse_device(settings.device)))
            _check_disk_fields(settings)
            if settings.backend not in ("local", "remote") or not all(
                isinstance(getattr(settings, f), str) for f in cls.REMOTE_FIELDS
            ):
                raise ValueError("engine: local or remote, and the server's fields as text")
            return settings
        except (TypeError, ValueError):
            return cls()


def _check_disk_fields(s: EngineSettings) -> None:
    gb = s.disk_gb
    if not isinstance(s.disk_cache, bool) or not isinstance(s.disk_dir, str):
        raise ValueError("disk cache: on/off must be a bool and the location a string")
    if isinstance(gb, bool) or not isinstance(gb, int | float) or not math.isfinite(gb) or gb < 0:
        raise ValueError(f"disk cache budget {gb!r} GB")


def cleared_text(freed: int, in_use: int) -> str:
    """What clearing the stores did (`delete_stores`' result)."""
    text = f"Freed {format_bytes(freed, 'MB')}."
    if in_use:
        stores = "store is" if in_use == 1 else "stores are"
        text += (
            f" {in_use} {stores} in use by another Folio process and stayed;"
            " quit it and clear again."
        )
    return text


def disk_usage_text(location: Path) -> str:
    """What the prompt cache holds at ``location`` now (a short disk scan)."""
    stores = list_stores(location)
    if not stores:
        return f"Nothing cached in {location} yet."
    total = sum(st.bytes for st in stores)
    models = len(stores)
    return (
        f"{format_bytes(total, 'MB')} cached in {location} "
        f"({models} store{'s' if models != 1 else ''}: one per model and cache format)."
    )


def default_budget_text(location: Path) -> str:
    return f"automatic: {format_bytes(default_budget(location))} here"


def weights_note(mode: str, model: ModelInfo | None) -> str:
    """What keeping the weights in `mode` costs for `model` and what it buys."""
    costs = model.weight_costs if model is not None else {}
    if model is not None and not costs:
        return "This model is not a GGUF file: its weights are kept as fp32."
    text = WEIGHT_TRADES[mode]
    if costs:
        here = format_bytes(costs[mode], binary=True)
        base = costs[DEFAULT_WEIGHT_MODE]
        if mode == DEFAULT_WEIGHT_MODE:
            text = f"{model.name}: {here} of weights. {text}"
        else:
            extra = format_bytes(costs[mode] - base, binary=True)
            text = f"{model.name}: {here} of weights ({extra} more than as stored). {text}"
    return text


class SettingsDialog(QDialog):
    """The engine settings. ``clear_disk`` deletes the prompt cache's stores under a
    location and returns (bytes freed, stores left in use), on a worker thread; the main
    window passes the bridge's, which also empties the running engine's own store (without
    an engine, `delete_stores` is all there is to do)."""

    def __init__(
        self,
        current: EngineSettings,
        parent: QWidget | None = None,
        model: ModelInfo | None = None,
        clear_disk: Callable[[Path], tuple[int, int]] = delete_stores,
        prompt_lengths: Sequence[int] = (),
        snapshot: EngineSnapshot | None = None,
        shared_prefix: int | None = None,
    ):
        """``prompt_lengths``: the prompts this install has seen, and ``shared_prefix``:
        the tokens chats with the open chat's system prompt begin with (the page-size
        hint); ``snapshot``: the engine's latest, for what applying would lose."""
        super().__init__(parent)
        self.setWindowTitle("Engine settings")
        self.current = current
        self.model = model
        self.clear_disk = clear_disk
        self._disk_worker = TaskRunner(self, max_threads=1, thread_name="folio-disk-cache")
        self.prompt_lengths = tuple(prompt_lengths)
        self.shared_prefix = shared_prefix
        self.snapshot = snapshot
        layout = QVBoxLayout(self)
        layout.addWidget(self._engine_box())
        # This computer's engine: greyed out while a server elsewhere is the engine.
        self.local_part = QWidget()
        local = QVBoxLayout(self.local_part)
        local.setContentsMargins(0, 0, 0, 0)
        # A grid, not a form: each field's hint is a word-wrapped label in its own row,
        # and a form row clips a wrapped label's later lines.
        self.grid = QGridLayout()
        self.grid.setColumnStretch(1, 1)
        self.grid.setColumnMinimumWidth(1, HINT_WIDTH)  # hints of two lines, not five

        budget_row = QHBoxLayout()
        self.budget = QSpinBox()
        self.budget.setRange(16, 10_000_000)
        self.budget_unit = QComboBox()
        self.budget_unit.addItems(["tokens", "MB"])
        budget_row.addWidget(self.budget, 1)
        budget_row.addWidget(self.budget_unit)
        self.budget_hint = self._add_row("KV cache budget", budget_row, BUDGET_TIP, hint=True)
        page_row = QHBoxLayout()
        self.page_size = QComboBox()
        for size in PAGE_SIZES:
            self.page_size.addItem(f"{size} tokens", size)
        self.use_suggested = QPushButton()
        self.use_suggested.setAutoDefault(False)
        self.use_suggested.setToolTip("Set the page size your prompts suggest")
        self.use_suggested.clicked.connect(self._use_suggested_page_size)
        page_row.addWidget(self.page_size, 1)
        page_row.addWidget(self.use_suggested)
        self.page_hint = self._add_row("Page size", page_row, PAGE_TIP, hint=True)
        self.k_bits = _bits_combo()
        self.v_bits = _bits_combo()
        self._add_row("K cache bits", self.k_bits, KV_BITS_TIP)
        self.kv_hint = self._add_row("V cache bits", self.v_bits, KV_BITS_TIP, hint=True)
        self.host_mb = QSpinBox()
        self.host_mb.setRange(0, 1_000_000)
        self.host_mb.setSuffix(" MB")
        self.host_mb.setSpecialValueText("off")
        self._add_row("Host tier", self.host_mb, HOST_TIP)
        self.max_batch = QSpinBox()
        self.max_batch.setRange(1, 256)
        self._add_row("Max batch size", self.max_batch, BATCH_TIP)
        self.chunk = QSpinBox()
        self.chunk.setRange(16, 65536)
        self.chunk.setSuffix(" tokens")
        self._add_row("Prefill chunk", self.chunk, CHUNK_TIP)
        self.threads = QSpinBox()
        self.threads.setRange(0, os.cpu_count() or 64)
        self.threads.setSpecialValueText("automatic")
        self._add_row("CPU threads", self.threads, THREADS_TIP)
        self.device = _device_combo()
        self._add_row(
            "Device",
            self.device,
            "Where the model runs; changing it loads the model again. A GPU that is not "
            "there means the CPU, and the status bar says so.",
        )
        self.weights = QComboBox()
        for mode in USER_WEIGHT_MODES:
            self.weights.addItem(WEIGHT_CHOICES[mode], mode)
        self.weights.setEnabled(model is None or bool(model.weight_costs))
        self.weights_note = self._add_row(
            "Weights in memory",
            self.weights,
            "How the model's weights are kept in memory; changing it loads the model again",
            hint=True,
        )
        local.addLayout(self.grid)
        local.addWidget(self._disk_box())
        layout.addWidget(self.local_part)

        self.rebuild_note = QLabel(REBUILD_NOTE)
        self.rebuild_note.setWordWrap(True)
        self.rebuild_note.setStyleSheet("color: #a15c00;")
        layout.addWidget(self.rebuild_note)
        self.buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        layout.addWidget(self.buttons)

        self.set_values(current)
        combos = (self.budget_unit, self.page_size, self.k_bits, self.v_bits, self.weights)
        for combo in (*combos, self.device):
            combo.currentIndexChanged.connect(self._update_note)
        for spin in (self.budget, self.host_mb, self.max_batch, self.chunk, self.threads):
            spin.valueChanged.connect(self._update_note)
        self.disk_on.toggled.connect(self._update_note)
        self.disk_gb.valueChanged.connect(self._update_note)
        self.disk_dir.textChanged.connect(self._update_note)
        self.disk_dir.editingFinished.connect(self._show_disk_usage)
        self.use_remote.toggled.connect(self._update_note)
        for edit in (self.remote_url, self.remote_key, self.remote_events, self.remote_replay):
            edit.textChanged.connect(self._update_note)
        self._update_note()
        self._show_disk_usage()

    def _engine_box(self) -> QGroupBox:
        box = QGroupBox("Engine")
        box.setToolTip(REMOTE_TIP)
        form = self.engine_form = QFormLayout(box)
        self.use_local = QRadioButton("This computer")
        self.use_local.setToolTip("Run the model here, on Folio's own engine")
        self.use_remote = QRadioButton("A server at")
        self.use_remote.setToolTip(REMOTE_TIP)
        self.remote_url = QLineEdit()
        self.remote_url.setPlaceholderText("http://192.168.1.20:8000")
        self.remote_url.setToolTip(
            "The server's address with http:// or https:// (its OpenAI API under /v1)"
        )
        row = QHBoxLayout()
        row.addWidget(self.use_remote)
        row.addWidget(self.remote_url, 1)
        form.addRow(self.use_local)
        form.addRow(row)
        self.remote_key = QLineEdit()
        self.remote_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.remote_key.setPlaceholderText("none")
        self.remote_key.setToolTip("The server's API key, sent as 'Authorization: Bearer KEY'")
        form.addRow("API key", self.remote_key)
        self.remote_events = QLineEdit()
        self.remote_events.setPlaceholderText("optional: tcp://host:5557")
        self.remote_events.setToolTip("The server's KV-cache event endpoint (ZMQ PUB)")
        form.addRow("KV events", self.remote_events)
        self.remote_replay = QLineEdit()
        self.remote_replay.setPlaceholderText("optional: tcp://host:5558")
        self.remote_replay.setToolTip("Its replay endpoint, for events sent before the app joined")
        form.addRow("Event replay", self.remote_replay)
        self.remote_error = QLabel()
        self.remote_error.setWordWrap(True)
        self.remote_error.setStyleSheet("color: #B3261E;")
        form.addRow(self.remote_error)
        return box

    def _disk_box(self) -> QGroupBox:
        box = QGroupBox("Prompt cache on disk")
        box.setToolTip(DISK_TIP)
        outer = QVBoxLayout(box)
        form = QFormLayout()
        outer.addLayout(form)
        self.disk_on = QCheckBox("Keep finished chats' pages on disk")
        self.disk_on.setToolTip(DISK_TIP)
        form.addRow(self.disk_on)
        self.disk_gb = QDoubleSpinBox()
        self.disk_gb.setRange(0.0, 100_000.0)
        self.disk_gb.setDecimals(1)
        self.disk_gb.setSuffix(" GB")
        self.disk_gb.setToolTip(DISK_BUDGET_TIP)
        form.addRow("Budget per model", self.disk_gb)
        row = QHBoxLayout()
        self.disk_dir = QLineEdit()
        self.disk_dir.setPlaceholderText(str(paths.kv_cache_dir()))
        self.disk_dir.setToolTip(DISK_DIR_TIP)
        self.disk_browse = QPushButton("Browse…")
        self.disk_browse.setAutoDefault(False)
        self.disk_browse.clicked.connect(self._browse_disk_dir)
        row.addWidget(self.disk_dir, 1)
        row.addWidget(self.disk_browse)
        form.addRow("Location", row)
        clear_row = QHBoxLayout()
        self.disk_clear = QPushButton("Clear disk cache")
        self.disk_clear.setAutoDefault(False)
        self.disk_clear.setToolTip(CLEAR_TIP)
        self.disk_clear.clicked.connect(self.clear_disk_cache)
        clear_row.addWidget(self.disk_clear)
        clear_row.addStretch(1)
        form.addRow(clear_row)
        # Below the form, as the weights note: a form row clips a wrapped label.
        self.disk_note = QLabel()
        self.disk_note.setWordWrap(True)
        outer.addWidget(self.disk_note)
        return box

    def _add_row(
        self, label: str, field: QWidget | QHBoxLayout, tip: str, hint: bool = False
    ) -> QLabel | None:
        """A labelled field with its one-line explanation as a tooltip, and below it (when
        ``hint``) a label for what the value chosen costs, updated as it changes."""
        row = self.grid.rowCount()
        name = QLabel(label)
        name.setToolTip(tip)
        self.grid.addWidget(name, row, 0)
        if isinstance(field, QHBoxLayout):
            self.grid.addLayout(field, row, 1)
            for i in range(field.count()):
                widget = field.itemAt(i).widget()
                if widget is not None and not widget.toolTip():
                    widget.setToolTip(tip)
        else:
            field.setToolTip(tip)
            self.grid.addWidget(field, row, 1)
        if not hint:
            return None
        note = HintLabel()
        self.grid.addWidget(note, row + 1, 1)
        return note

    def suggested_page_size(self) -> int | None:
        return suggest_page_size(self.prompt_lengths)

    def _use_suggested_page_size(self) -> None:
        size = self.suggested_page_size()
        if size is not None:
            self.page_size.setCurrentIndex(max(0, self.page_size.findData(size)))

    def disk_location(self) -> Path:
        """The location the dialog shows now (the default when the field is empty)."""
        return dataclasses.replace(self.current, disk_dir=self._disk_dir_value()).disk_location()

    def _disk_dir_value(self) -> str:
        """The field's folder, "" when it names the default (so moving the default with
        FOLIO_KV_CACHE_DIR still moves the app's cache)."""
        text = self.disk_dir.text().strip()
        if text and Path(text).expanduser() == paths.kv_cache_dir():
            return ""
        return text

    def _browse_disk_dir(self) -> None:
        folder = QFileDialog.getExistingDirectory(
            self, "Prompt cache location", str(self.disk_location())
        )
        if folder:
            self.disk_dir.setText(folder)
            self._show_disk_usage()

    def _show_disk_usage(self) -> None:
        location = self.disk_location()
        self.disk_gb.setSpecialValueText(default_budget_text(location))
        self._disk_worker.run(
            "disk", lambda: disk_usage_text(location), self._disk_done, self._disk_failed
        )

    def clear_disk_cache(self) -> None:
        """Delete the stores at the location shown; the note says how much was freed."""
        location = self.disk_location()
        self.disk_clear.setEnabled(False)
        self.disk_note.setText(f"Clearing {location}…")
        self._disk_worker.run(
            "disk",
            lambda: cleared_text(*self.clear_disk(location)),
            self._disk_done,
            self._disk_failed,
        )

    def _disk_done(self, text: str) -> None:
        # A listing that overtook a clear reports for both (the clear still ran).
        self.disk_clear.setEnabled(True)
        self.disk_note.setText(text)

    def _disk_failed(self, message: str) -> None:
        self._disk_done(f"The disk cache could not be read or cleared: {message}")

    def done(self, result: int) -> None:
        """A clear still running finishes first: its report would find no dialog."""
        self._disk_worker.wait(10_000)
        super().done(result)

    def set_values(self, s: EngineSettings) -> None:
        self.budget.setValue(s.budget)
        self.budget_unit.setCurrentText(s.budget_unit)
        self.page_size.setCurrentIndex(max(0, self.page_size.findData(s.page_size)))
        self.k_bits.setCurrentIndex(KV_BITS.index(s.k_bits) if s.k_bits in KV_BITS else 0)
        self.v_bits.setCurrentIndex(KV_BITS.index(s.v_bits) if s.v_bits in KV_BITS else 0)
        self.host_mb.setValue(s.host_mb)
        self.max_batch.setValue(s.max_batch_size)
        self.chunk.setValue(s.max_chunk_size)
        self.threads.setValue(s.cpu_threads)
        self.weights.setCurrentIndex(max(0, self.weights.findData(s.weights)))
        if self.device.findData(s.device) < 0:  # cuda:3 saved on a machine with one GPU
            self.device.addItem(s.device, s.device)
        self.device.setCurrentIndex(self.device.findData(s.device))
        self.disk_on.setChecked(s.disk_cache)
        self.disk_gb.setValue(s.disk_gb)
        self.disk_dir.setText(s.disk_dir)
        (self.use_remote if s.remote else self.use_local).setChecked(True)
        self.remote_url.setText(s.remote_url)
        self.remote_key.setText(s.remote_key)
        self.remote_events.setText(s.remote_events)
        self.remote_replay.setText(s.remote_replay)

    def values(self) -> EngineSettings:
        return EngineSettings(
            page_size=int(self.page_size.currentData()),
            budget_unit=self.budget_unit.currentText(),
            budget=self.budget.value(),
            k_bits=self.k_bits.currentData(),
            v_bits=self.v_bits.currentData(),
            host_mb=self.host_mb.value(),
            max_batch_size=self.max_batch.value(),
            max_chunk_size=self.chunk.value(),
            cpu_threads=self.threads.value(),
            weights=self.weights.currentData(),
            device=self.device.currentData(),
            disk_cache=self.disk_on.isChecked(),
            disk_gb=self.disk_gb.value(),
            disk_dir=self._disk_dir_value(),
            backend="remote" if self.use_remote.isChecked() else "local",
            remote_url=self.remote_url.text().strip(),
            remote_key=self.remote_key.text().strip(),
            remote_events=self.remote_events.text().strip(),
            remote_replay=self.remote_replay.text().strip(),
        )

    def needs_rebuild(self) -> bool:
        return self.values().needs_rebuild(self.current)

    def needs_reload(self) -> bool:
        return self.values().needs_reload(self.current)

    def lost_work(self) -> LostWork:
        """What applying the values shown would throw away."""
        return work_lost(self.snapshot, self.current, self.values())

    def remote_problem(self) -> str:
        """What is wrong with the server's fields, "" when nothing (or not remote)."""
        values = self.values()
        if not values.remote:
            return ""
        try:
            values.remote_settings().validate()
        except ValueError as exc:
            return str(exc)[:1].upper() + str(exc)[1:] + "."
        return ""

    def accept(self) -> None:
        """A server's fields that cannot work keep the dialog open, saying why."""
        if self.remote_problem():
            self._update_note()
            return
        super().accept()

    def _update_note(self) -> None:
        values = self.values()
        model = self.model
        _show_hint(
            self.budget_hint,
            budget_hint(
                values,
                model.kv_shape if model is not None else None,
                model.name if model is not None else "",
                model.context_length if model is not None else None,
            ),
        )
        _show_hint(
            self.page_hint,
            page_size_hint(values.page_size, self.prompt_lengths, self.shared_prefix),
        )
        suggested = self.suggested_page_size()
        self.use_suggested.setText(f"Use {suggested}" if suggested else "Use suggested")
        self.use_suggested.setEnabled(suggested is not None and suggested != values.page_size)
        _show_hint(self.kv_hint, kv_quality_hint(values.k_bits, values.v_bits))
        _show_hint(self.weights_note, Hint(weights_note(self.weights.currentData(), self.model)))
        switch = values.needs_switch(self.current)
        if switch:
            self.rebuild_note.setText(SWITCH_NOTE)
        else:
            note = RELOAD_NOTE if self.needs_reload() else REBUILD_NOTE
            self.rebuild_note.setText(f"{note} {self.lost_work().text()}")
        local_change = not values.remote and (self.needs_rebuild() or self.needs_reload())
        self.rebuild_note.setVisible(switch or local_change)
        self.disk_gb.setEnabled(self.disk_on.isChecked())
        self.local_part.setEnabled(not values.remote)
        for edit in (self.remote_url, self.remote_key, self.remote_events, self.remote_replay):
            edit.setEnabled(values.remote)
        problem = self.remote_problem() if values.remote_url or values.remote_events else ""
        self.remote_error.setText(problem)
        self.remote_error.setVisible(bool(problem))
        # This computer's settings while its engine is chosen, the server's key and event
        # endpoints while a server is: the dialog keeps to a 700-pixel screen and takes
        # the height of what it shows.
        for edit in (self.remote_key, self.remote_events, self.remote_replay):
            self.engine_form.setRowVisible(edit, values.remote)
        if self.local_part.isVisibleTo(self) == values.remote:
            self.local_part.setVisible(not values.remote)
            # once the layout has taken in the rows shown and hidden
            QTimer.singleShot(0, self._fit_height)
        self._grow_to_fit()

    def _fit_height(self) -> None:
        for layout in (self.engine_form, self.local_part.layout(), self.layout()):
            layout.invalidate()
            layout.activate()
        if self.isVisible():
            self.resize(self.width(), self.sizeHint().height())

    def _grow_to_fit(self) -> None:
        """A hint that wrapped to another line, or the note appearing, makes the dialog
        taller: its minimum does not follow word-wrapped labels by itself."""
        need = self.sizeHint().height()
        if self.isVisible() and self.height() < need:
            self.resize(self.width(), need)


class HintLabel(QLabel):
    """A word-wrapped note under a field, smaller and quieter than the field's label,
    that asks for the height its wrapped lines need (a grid row does not ask it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setWordWrap(True)
        font = self.font()
        font.setPointSizeF(font.pointSizeF() * 0.9)
        self.setFont(font)
        self.setForegroundRole(QPalette.ColorRole.PlaceholderText)

    def fit(self) -> None:
        """Ask for the height the text needs at the column's least width (wider, it
        needs no more): a grid row does not ask a wrapped label's height itself."""
        self.setMinimumHeight(self.heightForWidth(HINT_WIDTH))


def _show_hint(label: HintLabel, hint: Hint) -> None:
    label.setText(hint.line)
    label.setToolTip(hint.tooltip)
    label.fit()


def device_choices() -> list[tuple[str, str]]:
    """(label, choice) of the device menu: automatic, the CPU, and CUDA (each GPU by name
    when torch sees more than one; "cuda" is offered without one too, and then runs on
    the CPU with a note)."""
    import torch

    choices = [
        ("Automatic (a CUDA GPU when there is one)", DEFAULT_DEVICE),
        ("CPU", "cpu"),
    ]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return [*choices, ("CUDA GPU (none found)", "cuda")]
    if count == 1:
        return [*choices, (f"CUDA: {torch.cuda.get_device_name(0)}", "cuda")]
    return choices + [
        (f"cuda:{i}: {torch.cuda.get_device_name(i)}", f"cuda:{i}") for i in range(count)
    ]


def _device_combo() -> QComboBox:
    combo = QComboBox()
    for label, choice in device_choices():
        combo.addItem(label, choice)
    return combo


def _bits_combo() -> QComboBox:
    combo = QComboBox()
    for bits in KV_BITS:
        name = width_name(bits)
        text = {"fp16": "16-bit float (default)", "fp32": "32-bit float (exact)"}.get(name, name)
        combo.addItem(text, bits)
    return combo
