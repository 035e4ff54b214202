"""Engine settings: what the user can change, how it is stored, and the dialog.

Cache and generator settings are fixed when an engine is built, so changing them
means a new engine on the same weights (running replies stop, cached prefixes are
dropped); the dialog says which changes do that. CPU threads apply at once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

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

KV_BITS = (None, 8, 6, 5, 4, 3, 2)  # None: full precision (fp32)
PAGE_SIZES = (16, 32, 64, 128, 256, 512, 1024)
MB = 1 << 20


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
            return settings
        except (TypeError, ValueError):
            return cls()


class SettingsDialog(QDialog):
    def __init__(self, current: EngineSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Engine settings")
        self.current = current
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
        layout.addLayout(form)

        self.rebuild_note = QLabel(
            "Applying these changes rebuilds the KV cache: replies in progress stop and "
            "cached prefixes are dropped."
        )
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
        for combo in (self.budget_unit, self.page_size, self.k_bits, self.v_bits):
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
        )

    def needs_rebuild(self) -> bool:
        return self.values().needs_rebuild(self.current)

    def _update_note(self) -> None:
        self.rebuild_note.setVisible(self.needs_rebuild())


def _bits_combo() -> QComboBox:
    combo = QComboBox()
    for bits in KV_BITS:
        combo.addItem("full precision" if bits is None else f"{bits}-bit", bits)
    return combo
