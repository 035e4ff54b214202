"""Blocking work off the UI thread, with the outcome delivered back on it.

Loading a model, rebuilding the cache, fetching the default model, every Hub call and
every disk scan can take seconds; none may run on the UI thread. `TaskRunner` runs
such a call on a daemon thread (closing the window never waits for one) and hands the
result or the error back to the UI thread through a queued signal.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal, Slot


def error_text(exc: BaseException) -> str:
    """The exception's own words, or its type's name when it has none."""
    return str(exc) or type(exc).__name__


class TaskRunner(QObject):
    """Runs blocking calls on at most ``max_threads`` threads at once; results come
    back on the UI thread.

    Calls share a *channel* ("search", "listing", ...): only the newest call of a
    channel reports, so a slow answer to an old search never overwrites a newer one.
    ``describe_error`` turns a failure into the words handed to ``on_error``; it runs
    on the worker thread, inside the ``except`` block.
    """

    busy_changed = Signal(bool)
    # internal: (ticket, result, error text or None), emitted on a worker thread
    _finished = Signal(int, object, object)

    def __init__(
        self,
        parent: QObject | None = None,
        max_threads: int = 2,
        describe_error: Callable[[BaseException], str] = error_text,
        thread_name: str = "folio-task",
    ):
        super().__init__(parent)
        self._describe_error = describe_error
        self._thread_name = thread_name
        self._slots = threading.BoundedSemaphore(max_threads)
        self._running = 0  # threads started and not yet finished
        self._idle = threading.Condition()
        self._tickets = itertools.count(1)
        self._pending: dict[int, tuple[str, Callable[[Any], None], Callable[[str], None]]] = {}
        self._latest: dict[str, int] = {}
        self._finished.connect(self._on_finished, Qt.ConnectionType.QueuedConnection)

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def run(
        self,
        channel: str,
        work: Callable[[], Any],
        on_done: Callable[[Any], None],
        on_error: Callable[[str], None],
    ) -> int:
        ticket = next(self._tickets)
        was_busy = self.busy
        self._pending[ticket] = (channel, on_done, on_error)
        self._latest[channel] = ticket

        def call() -> None:  # on a worker thread
            try:
                with self._slots:
                    try:
                        result = work()
                    except Exception as exc:  # noqa: BLE001 - reported in words, never raised
                        self._finished.emit(ticket, None, self._describe_error(exc))
                        return
                    self._finished.emit(ticket, result, None)
            finally:
                with self._idle:
                    self._running -= 1
                    self._idle.notify_all()

        with self._idle:
            self._running += 1
        threading.Thread(target=call, name=self._thread_name, daemon=True).start()
        if not was_busy:
            self.busy_changed.emit(True)
        return ticket

    @Slot(int, object, object)
    def _on_finished(self, ticket: int, result: Any, error: str | None) -> None:
        channel, on_done, on_error = self._pending.pop(ticket)
        if not self.busy:
            self.busy_changed.emit(False)
        if self._latest.get(channel) != ticket:
            return  # superseded by a newer call on the same channel
        if error is not None:
            on_error(error)
        else:
            on_done(result)

    def wait(self, timeout_ms: int = 5000) -> bool:
        """Wait until no call is running (True) or ``timeout_ms`` passed (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout_ms / 1000)
