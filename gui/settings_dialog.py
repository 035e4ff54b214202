"""Engine settings: what the user can change, how it is stored, and the dialog.

Cache and generator settings are fixed when an engine is built, so changing them
means a new engine on the same weights (running replies stop, cached prefixes are
dropped); the dialog says which changes do that. CPU threads apply at once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.cache.kv_cache import CacheSettings
from engine.generator.generator import GeneratorSettings
from engine.model.weight_modes import DEFAULT_WEIGHT_MODE, USER_WEIGHT_MODES
from engine.units import format_bytes

if TYPE_CHECKING:
    from gui.bridge import ModelInfo

KV_BITS = (None, 8, 6, 5, 4, 3, 2)  # None: full precision (fp32)
PAGE_SIZES = (16, 32, 64, 128, 256, 512, 1024)
MB = 1 << 20

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

    REBUILD_FIELDS = (
        "page_size",
        "budget_unit",
        "budget",
        "k_bits",
        "v_bits",
        "host_mb",
        "max_batch_size",
        "max_chunk_size",
    )

    def cache_settings(self) -> CacheSettings:
        by_bytes = self.budget_unit == "MB"
        return CacheSettings(
            page_size=self.page_size,
            token_budget=None if by_bytes else self.budget,
            byte_budget=self.budget * MB if by_bytes else None,
            k_bits=self.k_bits,
            v_bits=self.v_bits,
            host_bytes=self.host_mb * MB,
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
        """The weights are kept another way: the model is read again."""
        return self.weights != other.weights

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
            return settings
        except (TypeError, ValueError):
            return cls()


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
    def __init__(
        self,
        current: EngineSettings,
        parent: QWidget | None = None,
        model: ModelInfo | None = None,
    ):
        super().__init__(parent)
        self.setWindowTitle("Engine settings")
        self.current = current
        self.model = model
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
        for combo in (self.budget_unit, self.page_size, self.k_bits, self.v_bits, self.weights):
            combo.currentIndexChanged.connect(self._update_note)
        for spin in (self.budget, self.host_mb, self.max_batch, self.chunk, self.threads):
            spin.valueChanged.connect(self._update_note)
        self._update_note()

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


def _bits_combo() -> QComboBox:
    combo = QComboBox()
    for bits in KV_BITS:
        combo.addItem("full precision" if bits is None else f"{bits}-bit", bits)
    return combo
