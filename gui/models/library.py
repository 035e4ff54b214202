"""The My models tab: every model on disk, and Load / Delete / Reveal / Import.

Listing reads GGUF and safetensors headers of every model (and scans the Hugging Face
cache), which can take a moment on a slow disk, so it runs on a pool thread.

Deleting a model deletes its prompt cache on disk too: `engine.hub.library.delete_model`
does at the default location and says how much it freed; where the app keeps the cache
elsewhere (Engine settings), the model's stores there go as well.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QMenu,
    QMessageBox,
    QPushButton,
    QTableWidgetItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine import paths
from engine.cache.disk_tier import delete_stores, list_stores
from engine.hub.errors import HubError
from engine.hub.library import (
    LocalModel,
    delete_model,
    import_model,
    list_local_models,
    reveal_in_file_manager,
)
from engine.units import format_bytes
from gui.models.common import (
    busy_bar,
    fmt_when,
    make_table,
    message_label,
    plain_error,
    set_message,
)
from gui.worker import TaskRunner

COLUMNS = ["Name", "Format", "Quant", "Architecture", "Size", "Last used", "Source"]
SOURCES = {"folio": "Folio", "hf-cache": "HF cache", "imported": "Imported"}


class LibraryTab(QWidget):
    load_requested = Signal(object)  # Path of the model to load

    def __init__(
        self,
        loaded_path: Callable[[], Path | None] = lambda: None,
        parent: QWidget | None = None,
        prompt_cache_dir: Callable[[], str | None] = lambda: None,
    ):
        """``prompt_cache_dir``: where the app keeps the prompt cache on disk (None: off,
        or the default location)."""
        super().__init__(parent)
        self.loaded_path = loaded_path
        self.prompt_cache_dir = prompt_cache_dir
        self.models: list[LocalModel] = []
        self.runner = TaskRunner(
            self, max_threads=1, describe_error=plain_error, thread_name="folio-disk"
        )

        layout = QVBoxLayout(self)
        self.busy = busy_bar()
        layout.addWidget(self.busy)
        self.table = make_table(COLUMNS)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in range(1, len(COLUMNS)):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        layout.addWidget(self.table, 1)
        self.message = message_label()
        layout.addWidget(self.message)

        buttons = QHBoxLayout()
        self.load_button = QPushButton("Load")
        self.load_button.setToolTip("Load this model in the chat window")
        self.delete_button = QPushButton("Delete…")
        self.reveal_button = QPushButton("Reveal in file manager")
        self.import_button = QToolButton()
        self.import_button.setText("Import…")
        self.import_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QMenu(self.import_button)
        menu.addAction("A .gguf file…", self._choose_file)
        menu.addAction("A model folder (config.json + safetensors)…", self._choose_folder)
        self.import_button.setMenu(menu)
        self.refresh_button = QPushButton("Refresh")
        for b in (self.load_button, self.delete_button, self.reveal_button):
            b.setAutoDefault(False)
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.import_button)
        self.refresh_button.setAutoDefault(False)
        buttons.addWidget(self.refresh_button)
        layout.addLayout(buttons)

        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.cellDoubleClicked.connect(lambda *_: self.load_selected())
        self.load_button.clicked.connect(self.load_selected)
        self.delete_button.clicked.connect(lambda: self.delete_selected())
        self.reveal_button.clicked.connect(self.reveal_selected)
        self.refresh_button.clicked.connect(self.refresh)
        self.runner.busy_changed.connect(self.busy.setVisible)
        self._update_buttons()

    # -- listing ----------------------------------------------------------------------

    def refresh(self) -> None:
        self.runner.run("list", list_local_models, self._show, self._list_failed)

    def _list_failed(self, message: str) -> None:
        set_message(self.message, f"Could not list the models: {message}", "error")

    def _show(self, models: list[LocalModel]) -> None:
        selected = self.selected_model()
        self.models = models
        loaded = self.loaded_path()
        table = self.table
        table.blockSignals(True)
        table.setRowCount(0)
        bold = QFont(table.font())
        bold.setBold(True)
        for m in models:
            row = table.rowCount()
            table.insertRow(row)
            is_loaded = loaded is not None and Path(loaded).absolute() == m.path.absolute()
            name = m.name + ("  (loaded)" if is_loaded else "")
            cells = [
                name,
                "GGUF" if m.format == "gguf" else m.format,
                m.quant or "?",
                m.architecture or "?",
                format_bytes(m.size_bytes),
                fmt_when(m.last_used),
                SOURCES.get(m.source, m.source),
            ]
            tip = f"{m.path}" + (f"\nCannot load: {m.problem}" if m.problem else "")
            if m.repo_id:
                tip += f"\nfrom {m.repo_id}" + (" (verified)" if m.verified else "")
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setFlags(Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsEnabled)
                item.setToolTip(tip)
                if col == 4:
                    item.setTextAlignment(
                        Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
                    )
                if is_loaded:
                    item.setFont(bold)
                if m.problem:
                    item.setForeground(QBrush(QColor("#8C959F")))
                table.setItem(row, col, item)
        table.blockSignals(False)
        if selected is not None:
            self.select_path(selected.path)
        if not models:
            set_message(
                self.message,
                "No models on this machine yet: find one in Discover, or Import a .gguf file.",
            )
        self._update_buttons()

    # -- selection --------------------------------------------------------------------

    def selected_model(self) -> LocalModel | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or rows[0].row() >= len(self.models):
            return None
        return self.models[rows[0].row()]

    def select_path(self, path: Path | str) -> bool:
        for i, m in enumerate(self.models):
            if m.path.absolute() == Path(path).absolute():
                self.table.selectRow(i)
                return True
        return False

    def _update_buttons(self) -> None:
        m = self.selected_model()
        self.load_button.setEnabled(m is not None and m.loadable)
        self.load_button.setToolTip(
            f"Cannot load: {m.problem}" if m is not None and m.problem else "Load this model"
        )
        self.delete_button.setEnabled(m is not None)
        self.delete_button.setText(
            "Remove from list…" if m is not None and m.source == "imported" else "Delete…"
        )
        self.reveal_button.setEnabled(m is not None)

    # -- actions ----------------------------------------------------------------------

    def load_selected(self) -> None:
        m = self.selected_model()
        if m is None or not m.loadable:
            return
        set_message(self.message, f"Loading {m.name}…")
        self.load_requested.emit(m.path)

    def delete_selected(self, confirm: bool = True) -> None:
        m = self.selected_model()
        if m is None:
            return
        if confirm:
            loaded = self.loaded_path()
            if m.source == "imported":
                text = f"Remove {m.name} from the list? Its files stay in {m.path.parent}."
            else:
                text = f"Delete {m.name} for good? This frees {format_bytes(m.size_bytes)}."
                if m.source == "hf-cache":
                    text += "\nIt is in the Hugging Face cache, which other programs may share."
            if loaded is not None and Path(loaded).absolute() == m.path.absolute():
                text += "\nIt is loaded now; the chat keeps working until another model loads."
            answer = QMessageBox.question(self, "Delete model", text)
            if answer != QMessageBox.StandardButton.Yes:
                return
        resolved = m.path.resolve()  # before the files go: a Hugging Face link stops resolving
        try:
            result = delete_model(m)
        except (HubError, OSError) as exc:
            set_message(self.message, f"Could not delete {m.name}: {exc}", "error")
            return
        text = result.message[:1].upper() + result.message[1:]
        set_message(self.message, text + self._delete_prompt_cache(resolved) + ".")
        self.refresh()

    def _delete_prompt_cache(self, model_path: Path) -> str:
        """Delete the model's stores at the app's own prompt-cache location, where that is
        not the default one `delete_model` cleared; the words to add to its message."""
        text = ""
        default = paths.kv_cache_dir()
        locations = [default]
        custom = self.prompt_cache_dir()
        if custom and Path(custom).resolve() != default.resolve():
            locations.append(Path(custom))
            try:
                freed, _busy = delete_stores(custom, model_path)
            except OSError:
                freed = 0
            if freed:
                text += f"; also {format_bytes(freed, 'MB')} of its prompt cache in {custom}"
        kept = sum(
            st.bytes
            for where in locations
            for st in list_stores(where)
            if st.in_use and st.model_path == str(model_path)
        )
        if kept:
            text += (
                f"; its prompt cache in use ({format_bytes(kept, 'MB')}) stays while the model"
                " is loaded: Engine settings ▸ Clear disk cache frees it once another model runs"
            )
        return text

    def reveal_selected(self) -> None:
        m = self.selected_model()
        if m is None:
            return
        try:
            reveal_in_file_manager(m.path)
        except HubError as exc:
            set_message(self.message, str(exc), "error")

    def _choose_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Import a model file", "", "GGUF models (*.gguf);;All files (*)"
        )
        if path:
            self.import_path(path)

    def _choose_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Import a model folder")
        if path:
            self.import_path(path)

    def import_path(self, path: Path | str) -> LocalModel | None:
        """Validate and list a local model (not copied); a validation error is shown inline."""
        try:
            model = import_model(path)
        except (HubError, OSError) as exc:
            set_message(self.message, f"Cannot import: {exc}", "error")
            return None
        facts = ", ".join(filter(None, (model.format, model.architecture, model.quant)))
        set_message(self.message, f"Imported {model.name} ({facts}); it stays at {model.path}.")
        self.refresh()
        return model
