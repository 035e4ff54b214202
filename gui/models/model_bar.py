"""The main window's model bar: pick a local model, and watch it load.

`ModelPicker` lists the models on disk (`engine.hub.library`), each with the fit label and
the memory it would need for the cache the user has chosen (`gui.models.loading`); choosing
one asks the window to load it. Listing reads every model's header, so it runs on a worker
thread. `LoadStatus` is the line and bar of a load in progress (`LoadProgress`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QStandardItemModel
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QProgressBar, QWidget

from engine.cache.kv_cache import CacheSettings
from engine.hub.fit import free_memory
from engine.hub.library import list_local_models
from gui.models.common import plain_error
from gui.models.discover import fit_arithmetic
from gui.models.loading import LoadProgress, PickerEntry, picker_entries
from gui.worker import TaskRunner

MANAGE = "manage"  # the item data of "Manage models…"
PICKER_TIP = (
    "The models on this computer, with whether each fits in the memory free now (with "
    "the loaded model's memory counted as free, since switching gives it back) and "
    "what it needs: weights + KV cache + runtime. Choosing one loads it."
)


class ModelPicker(QComboBox):
    load_requested = Signal(object)  # Path of the model chosen
    manage_requested = Signal()  # "Manage models…": the Models window

    def __init__(
        self,
        cache_settings: Callable[[], CacheSettings],
        weight_mode: Callable[[], str],
        loaded_path: Callable[[], Path | None],
        released_bytes: Callable[[], int] = lambda: 0,
        parent: QWidget | None = None,
    ):
        """``released_bytes``: what the loaded model holds (weights and cache), free
        again once another model replaces it."""
        super().__init__(parent)
        self.cache_settings = cache_settings
        self.weight_mode = weight_mode
        self.loaded_path = loaded_path
        self.released_bytes = released_bytes
        self.free_memory: Callable[[], int | None] = free_memory  # tests fix it
        self.entries: list[PickerEntry] = []
        self.runner = TaskRunner(
            self, max_threads=1, describe_error=plain_error, thread_name="folio-picker"
        )
        # As wide as the longest entry, so its fit and memory are never cut off.
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.setMinimumContentsLength(24)
        self.setToolTip(PICKER_TIP)
        self.addItem("no model loaded")
        self.activated.connect(self._on_activated)

    def refresh(self) -> None:
        """List the models again (off the UI thread) and price them for the settings now."""
        cache, mode = self.cache_settings(), self.weight_mode()
        free = self.free_memory()
        if free is not None:
            free += self.released_bytes()

        def work() -> list[PickerEntry]:
            return picker_entries(list_local_models(), cache, mode, free)

        self.runner.run("list", work, self._show, self._failed)

    def _failed(self, message: str) -> None:
        self._show([])
        self.setItemText(self.count() - 1, "Manage models…")
        self.setToolTip(f"Could not list the models: {message}")

    def _show(self, entries: list[PickerEntry]) -> None:
        self.entries = entries
        loaded = self.loaded_path()
        self.blockSignals(True)
        self.clear()
        current = -1
        for entry in entries:
            self.addItem(entry.text, str(entry.model.path))
            row = self.count() - 1
            tip = str(entry.model.path)
            if entry.fit is not None and entry.plan is not None:
                tip += "\n" + fit_arithmetic(entry.fit, entry.plan, entry.note)
            elif entry.note:
                tip += "\n" + entry.note
            self.setItemData(row, tip, Qt.ItemDataRole.ToolTipRole)
            if not entry.model.loadable:
                self._disable(row)
            if loaded is not None and Path(loaded).absolute() == entry.model.path.absolute():
                current = row
        if loaded is not None and current < 0:  # loaded from a file the library does not list
            self.insertItem(0, f"{Path(loaded).name} (loaded)", str(loaded))
            current = 0
        if self.count():
            self.insertSeparator(self.count())
        self.addItem("Manage models…", MANAGE)
        self.setCurrentIndex(max(current, 0) if loaded is not None else -1)
        if loaded is None:
            self.setPlaceholderText("choose a model")
        self.blockSignals(False)

    def _disable(self, row: int) -> None:
        model = self.model()
        if isinstance(model, QStandardItemModel):
            model.item(row).setEnabled(False)

    def select_loaded(self) -> None:
        """Show the loaded model as the choice (after a load, or a failed one)."""
        loaded = self.loaded_path()
        index = self.findData(str(loaded)) if loaded is not None else -1
        self.setCurrentIndex(index)

    def _on_activated(self, index: int) -> None:
        data = self.itemData(index)
        if data == MANAGE:
            self.select_loaded()
            self.manage_requested.emit()
            return
        loaded = self.loaded_path()
        if data and (loaded is None or Path(data).absolute() != Path(loaded).absolute()):
            self.load_requested.emit(Path(data))


class LoadStatus(QWidget):
    """'Loading SmolLM2: layer 12 of 30 · 40% · about 3 s left' with a bar; hidden when
    no load runs."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 0, 0, 0)
        self.label = QLabel()
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setTextVisible(False)
        self.bar.setFixedWidth(120)
        layout.addWidget(self.bar)
        layout.addWidget(self.label)
        self.progress: LoadProgress | None = None
        # In a tool bar, the bar's action shows and hides the widget (QToolBar.addWidget).
        self.action: QAction | None = None
        self.setVisible(False)

    def _set_shown(self, shown: bool) -> None:
        if self.action is not None:
            self.action.setVisible(shown)
        else:
            self.setVisible(shown)

    @property
    def shown(self) -> bool:
        return self.action.isVisible() if self.action is not None else self.isVisible()

    def start(self, name: str, verb: str = "Loading") -> None:
        self.progress = LoadProgress(name, verb)
        self._show(0.0, "opening the file" if verb == "Loading" else "stopping the engine")

    def update_progress(self, fraction: float, what: str) -> None:
        """A report of the load `start` announced; one that arrives after `finish` (the
        worker's last reports can trail the engine's start) is dropped."""
        if self.progress is not None:
            self._show(fraction, what)

    def _show(self, fraction: float, what: str) -> None:
        self.label.setText(self.progress.update(fraction, what))
        self.bar.setValue(round(self.progress.fraction * 1000))
        self._set_shown(True)

    def finish(self) -> None:
        self.progress = None
        self._set_shown(False)
