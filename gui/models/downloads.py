"""The Downloads tab: one row per DownloadManager job, with Cancel / Resume / Discard.

The manager calls its subscribers on its own worker thread; this tab re-emits each
snapshot as a Qt signal with a queued connection, so rows are only ever touched on
the UI thread. Snapshots are immutable, so passing them across is safe.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.hub.downloads import DownloadManager
from engine.hub.errors import HubError
from engine.hub.remote import ModelCandidate
from engine.hub.transfer import DownloadProgress, DownloadState
from engine.units import format_bytes
from gui.models.common import (
    ERROR_COLOR,
    fmt_duration,
    message_label,
    set_message,
)

COLUMNS = ["Model", "Progress", "Speed", "ETA", "State", ""]
BAR_STEPS = 1000  # QProgressBar holds an int: per mille, since files pass 2 GB
STATE_WORDS = {
    DownloadState.QUEUED: "Queued",
    DownloadState.DOWNLOADING: "Downloading",
    DownloadState.VERIFYING: "Verifying",
    DownloadState.DONE: "Done",
    DownloadState.FAILED: "Failed",
    DownloadState.CANCELLED: "Cancelled",
}


class JobRow:
    """The widgets of one job's row; kept so updates never rebuild them."""

    def __init__(self, tab: DownloadsTab, job_id: int):
        self.job_id = job_id
        self.bar = QProgressBar()
        self.bar.setRange(0, BAR_STEPS)
        self.bar.setTextVisible(True)
        self.cancel = QPushButton("Cancel")
        self.resume = QPushButton("Resume")
        self.discard = QPushButton("Discard")
        self.discard.setToolTip("Forget this download and delete its partial file")
        self.actions = QWidget()
        box = QHBoxLayout(self.actions)
        box.setContentsMargins(2, 0, 2, 0)
        box.setSpacing(4)
        for button in (self.cancel, self.resume, self.discard):
            button.setAutoDefault(False)
            box.addWidget(button)
        self.cancel.clicked.connect(lambda: tab.cancel(job_id))
        self.resume.clicked.connect(lambda: tab.resume(job_id))
        self.discard.clicked.connect(lambda: tab.discard(job_id))


class DownloadsTab(QWidget):
    # A DownloadProgress from the manager's worker thread (queued to the UI thread).
    progress = Signal(object)
    # A job reached DONE: its DownloadProgress (path set); the library should refresh.
    completed = Signal(object)
    # How many jobs are queued or running, for the tab's title.
    active_changed = Signal(int)

    def __init__(self, manager: DownloadManager, parent: QWidget | None = None):
        super().__init__(parent)
        self.manager = manager
        self.rows: dict[int, JobRow] = {}
        self.order: list[int] = []  # job ids in table order
        self.last: dict[int, DownloadProgress] = {}
        self.discarded: set[int] = set()
        self._resumed_pending = False

        layout = QVBoxLayout(self)
        self.hint = QLabel(
            "Downloads continue while this window is closed. Partial files are kept, so a "
            "cancelled or interrupted download resumes where it stopped."
        )
        self.hint.setWordWrap(True)
        layout.addWidget(self.hint)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setShowGrid(False)
        self.table.setWordWrap(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Interactive)
        self.table.setColumnWidth(1, 230)
        for col in (2, 3):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.Interactive)
        self.table.setColumnWidth(4, 130)
        header.setSectionResizeMode(5, QHeaderView.ResizeMode.ResizeToContents)
        self.table.verticalHeader().setDefaultSectionSize(34)
        layout.addWidget(self.table, 1)
        # Failures stay on screen until resumed or discarded, whatever happens meanwhile.
        self.errors = message_label()
        layout.addWidget(self.errors)
        self.message = message_label()
        layout.addWidget(self.message)

        self.progress.connect(self._on_progress, Qt.ConnectionType.QueuedConnection)
        self._unsubscribe = manager.subscribe(self.progress.emit)

    # -- actions ----------------------------------------------------------------------

    def enqueue(self, candidate: ModelCandidate) -> int:
        return self.manager.enqueue(candidate)

    def resume_pending(self) -> list[int]:
        """Once per session: downloads left unfinished by an earlier run continue."""
        if self._resumed_pending:
            return []
        self._resumed_pending = True
        ids = self.manager.resume_pending()
        if ids:
            n = len(ids)
            set_message(
                self.message,
                f"Resuming {n} download{'s' if n != 1 else ''} left unfinished last time.",
            )
        return ids

    def cancel(self, job_id: int) -> None:
        self.manager.cancel(job_id)

    def resume(self, job_id: int) -> None:
        self.manager.resume(job_id)

    def discard(self, job_id: int) -> None:
        last = self.last.get(job_id)
        try:
            freed = self.manager.discard(job_id)
        except (RuntimeError, HubError, OSError) as exc:
            set_message(self.message, str(exc), "error")
            return
        self.discarded.add(job_id)
        self._remove_row(job_id)
        if last is not None and last.state != DownloadState.DONE:
            set_message(
                self.message,
                f"Discarded {last.name}: {format_bytes(freed)} of partial download deleted.",
            )

    def shutdown(self) -> None:
        self._unsubscribe()

    # -- rows -------------------------------------------------------------------------

    @Slot(object)
    def _on_progress(self, p: DownloadProgress) -> None:
        if p.job_id in self.discarded:
            return  # a late snapshot of a job the user already removed
        if p.job_id not in self.rows:
            self._add_row(p.job_id)
        previous = self.last.get(p.job_id)
        self.last[p.job_id] = p
        self._update_row(p)
        if p.state == DownloadState.DONE and (previous is None or previous.state != p.state):
            set_message(self.message, f"{p.name} downloaded and verified.")
            self.completed.emit(p)
        if previous is None or previous.state != p.state:
            self._show_failures()
        self.active_changed.emit(self.active_count())

    def _show_failures(self) -> None:
        failed = [p for p in self.last.values() if p.state == DownloadState.FAILED]
        text = "\n".join(f"{p.name} failed: {p.message}" for p in failed)
        set_message(self.errors, text, "error")

    def active_count(self) -> int:
        return sum(1 for p in self.last.values() if not p.state.finished)

    def _add_row(self, job_id: int) -> None:
        row = self.table.rowCount()
        self.table.insertRow(row)
        widgets = JobRow(self, job_id)
        self.rows[job_id] = widgets
        self.order.append(job_id)
        for col in (0, 2, 3, 4):
            item = QTableWidgetItem()
            item.setFlags(Qt.ItemFlag.ItemIsEnabled)
            self.table.setItem(row, col, item)
        self.table.setCellWidget(row, 1, widgets.bar)
        self.table.setCellWidget(row, 5, widgets.actions)

    def _remove_row(self, job_id: int) -> None:
        if job_id not in self.rows:
            return
        row = self.order.index(job_id)
        self.table.removeRow(row)
        self.order.remove(job_id)
        del self.rows[job_id]
        self.last.pop(job_id, None)
        self._show_failures()
        self.active_changed.emit(self.active_count())

    def row_of(self, job_id: int) -> int:
        return self.order.index(job_id)

    def _update_row(self, p: DownloadProgress) -> None:
        row = self.row_of(p.job_id)
        widgets = self.rows[p.job_id]
        name = self.table.item(row, 0)
        name.setText(p.name)
        where = f"\n{p.path}" if p.path else ""
        name.setToolTip(f"{p.repo_id}/{p.name}{where}")

        bar = widgets.bar
        done = format_bytes(p.done_bytes)
        if p.fraction is None:
            # Size unknown: a busy bar while it moves, an empty one once it stopped.
            bar.setRange(0, 0 if not p.state.finished else BAR_STEPS)
            bar.setFormat(done)
        else:
            bar.setRange(0, BAR_STEPS)
            bar.setValue(round(p.fraction * BAR_STEPS))
            bar.setFormat(f"%p% · {done} of {format_bytes(p.total_bytes)}")
        active = p.state in (DownloadState.DOWNLOADING, DownloadState.VERIFYING)
        speed = f"{p.bytes_per_s / 1e6:.1f} MB/s" if p.bytes_per_s and active else ""
        eta = fmt_duration(p.eta_s) if p.state == DownloadState.DOWNLOADING else ""
        self.table.item(row, 2).setText(speed)
        self.table.item(row, 3).setText(eta)

        state = self.table.item(row, 4)
        words = STATE_WORDS[p.state]
        if p.state == DownloadState.VERIFYING:
            words = "Verifying (SHA-256)"
        if p.resumed_bytes and p.state == DownloadState.DOWNLOADING:
            words = f"Resumed at {format_bytes(p.resumed_bytes)}"
        state.setText(words)
        state.setToolTip(p.message or words)
        failed = p.state == DownloadState.FAILED
        state.setForeground(QBrush(QColor(ERROR_COLOR)) if failed else self.palette().text())

        widgets.cancel.setEnabled(not p.state.finished)
        widgets.resume.setEnabled(p.state in (DownloadState.CANCELLED, DownloadState.FAILED))
        widgets.discard.setEnabled(p.state.finished)
        widgets.discard.setText("Clear" if p.state == DownloadState.DONE else "Discard")
        widgets.discard.setToolTip(
            "Remove from this list (the model stays in My models)"
            if p.state == DownloadState.DONE
            else "Forget this download and delete its partial file"
        )
