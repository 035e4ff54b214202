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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine import paths
from engine.cache.disk_tier import default_budget, delete_stores, list_stores
from engine.cache.kv_cache import CacheSettings
from engine.device import DEFAULT_DEVICE, parse_device
from engine.generator.generator import GeneratorSettings
from engine.model.weight_modes import DEFAULT_WEIGHT_MODE, USER_WEIGHT_MODES
from engine.units import format_bytes
from gui.worker import TaskRunner

if TYPE_CHECKING:
    from gui.bridge import ModelInfo

KV_BITS = (None, 8, 6, 5, 4, 3, 2)  # None: full precision (fp32)
PAGE_SIZES = (16, 32, 64, 128, 256, 512, 1024)
MB = 1 << 20
GB = 10**9  # the disk budget is in disk vendors' (and `folio --disk-cache-gb`'s) gigabytes

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
# both modes in one run; README "Measured").
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

REBUILD_NOTE = (
    "Applying these changes rebuilds the KV cache: replies in progress stop and "
    "cached prefixes are dropped."
)
RELOAD_NOTE = (
    "Applying these changes loads the model again: replies in progress stop and "
    "cached prefixes are dropped."
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
    ):
        super().__init__(parent)
        self.setWindowTitle("Engine settings")
        self.current = current
        self.model = model
        self.clear_disk = clear_disk
        self._disk_worker = TaskRunner(self, max_threads=1, thread_name="folio-disk-cache")
        layout = QVBoxLayout(self)
        form = QFormLayout()

        budget_row = QHBoxLayout()
        self.budget = QSpinBox()
        self.budget.setRange(16, 10_000_000)
        self.budget_unit = QComboBox()
        self.budget_unit.addItems(["tokens", "MB"])
        budget_row.addWidget(self.budget, 1)
        budget_row.addWidget(self.budget_unit)
        form.addRow("KV cache budget", budget_row)
        self.page_size = QComboBox()
        for size in PAGE_SIZES:
            self.page_size.addItem(f"{size} tokens", size)
        form.addRow("Page size", self.page_size)
        self.k_bits = _bits_combo()
        self.v_bits = _bits_combo()
        form.addRow("K cache bits", self.k_bits)
        form.addRow("V cache bits", self.v_bits)
        self.host_mb = QSpinBox()
        self.host_mb.setRange(0, 1_000_000)
        self.host_mb.setSuffix(" MB")
        self.host_mb.setSpecialValueText("off")
        self.host_mb.setToolTip("Host-memory tier for evicted pages (0 = off)")
        form.addRow("Host tier", self.host_mb)
        self.max_batch = QSpinBox()
        self.max_batch.setRange(1, 256)
        form.addRow("Max batch size", self.max_batch)
        self.chunk = QSpinBox()
        self.chunk.setRange(16, 65536)
        self.chunk.setSuffix(" tokens")
        self.chunk.setToolTip("Prompt tokens one job prefills per step (rounded to whole pages)")
        form.addRow("Prefill chunk", self.chunk)
        self.threads = QSpinBox()
        self.threads.setRange(0, os.cpu_count() or 64)
        self.threads.setSpecialValueText("automatic")
        form.addRow("CPU threads", self.threads)
        self.device = _device_combo()
        self.device.setToolTip(
            "Where the model runs; changing it loads the model again. A GPU that is not "
            "there means the CPU, and the status bar says so."
        )
        form.addRow("Device", self.device)
        self.weights = QComboBox()
        for mode in USER_WEIGHT_MODES:
            self.weights.addItem(WEIGHT_CHOICES[mode], mode)
        self.weights.setToolTip(
            "How the model's weights are kept in memory; changing it loads the model again"
        )
        self.weights.setEnabled(model is None or bool(model.weight_costs))
        form.addRow("Weights in memory", self.weights)
        self.weights_note = QLabel()
        self.weights_note.setWordWrap(True)
        layout.addLayout(form)
        # Outside the form: a form row clips a word-wrapped label's later lines.
        layout.addWidget(self.weights_note)
        layout.addWidget(self._disk_box())

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
        self._update_note()
        self._show_disk_usage()

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
        )

    def needs_rebuild(self) -> bool:
        return self.values().needs_rebuild(self.current)

    def needs_reload(self) -> bool:
        return self.values().needs_reload(self.current)

    def _update_note(self) -> None:
        self.weights_note.setText(weights_note(self.weights.currentData(), self.model))
        if self.needs_reload():
            self.rebuild_note.setText(RELOAD_NOTE)
        else:
            self.rebuild_note.setText(REBUILD_NOTE)
        self.rebuild_note.setVisible(self.needs_rebuild() or self.needs_reload())
        self.disk_gb.setEnabled(self.disk_on.isChecked())


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
        combo.addItem("full precision" if bits is None else f"{bits}-bit", bits)
    return combo
