"""The download queue: requests run one at a time on a worker thread, with progress for any thread.

Each job runs :func:`engine.hub.transfer.download_model`; the manager owns the jobs'
states and hands subscribers immutable :class:`DownloadProgress` snapshots.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from engine import paths
from engine.hub.errors import DownloadCancelled, HubError, explain
from engine.hub.remote import ModelCandidate
from engine.hub.transfer import (
    CancelToken,
    DownloadProgress,
    DownloadRequest,
    DownloadState,
    ProgressCallback,
    discard_partial,
    download_model,
    pending_downloads,
)

__all__ = ["DownloadManager"]


@dataclass
class _Job:
    id: int
    request: DownloadRequest
    cancel: CancelToken
    last: DownloadProgress
    done: threading.Event


class DownloadManager:
    """A queue of downloads run one at a time on a worker thread.

    Thread model: every public method may be called from any thread (the GUI's);
    callbacks registered with :meth:`subscribe` run on the worker thread (and on the
    caller's thread for a job cancelled while still queued), so a Qt bridge should
    re-emit them as signals. Callbacks receive immutable :class:`DownloadProgress`
    snapshots and must not block.
    """

    def __init__(
        self,
        models_dir: Path | str | None = None,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        retries: int = 5,
        progress_interval_s: float = 0.1,
    ):
        self.models_dir = paths.models_dir(models_dir)
        self.endpoint = endpoint
        self.token = token
        self.retries = retries
        self.progress_interval_s = progress_interval_s
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._subscribers: list[ProgressCallback] = []
        self._worker: threading.Thread | None = None
        self._closed = False

    # -- subscriptions ---------------------------------------------------------------
    def subscribe(self, callback: ProgressCallback) -> Callable[[], None]:
        """Call ``callback(progress)`` on every change; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def _publish(self, job: _Job, progress: DownloadProgress) -> None:
        with self._lock:
            job.last = progress
            subscribers = list(self._subscribers)
        for cb in subscribers:
            with contextlib.suppress(Exception):  # a broken view must not kill the download
                cb(progress)

    # -- queue -----------------------------------------------------------------------
    def enqueue(self, item: ModelCandidate | DownloadRequest) -> int:
        """Queue a download (or return the id of the same one already queued or running)."""
        request = DownloadRequest.from_candidate(item) if isinstance(item, ModelCandidate) else item
        with self._lock:
            if self._closed:
                raise RuntimeError("the download manager is closed")
            for job in self._jobs.values():
                if job.request.key == request.key and not job.last.state.finished:
                    return job.id
            job_id = next(self._ids)
            job = _Job(
                job_id, request, CancelToken(), self._initial(job_id, request), threading.Event()
            )
            self._jobs[job_id] = job
        self._publish(job, job.last)
        self._queue.put(job_id)
        self._ensure_worker()
        return job_id

    def _initial(self, job_id: int, request: DownloadRequest) -> DownloadProgress:
        return DownloadProgress(
            job_id,
            DownloadState.QUEUED,
            request.repo_id,
            request.name,
            total_bytes=request.total_bytes,
            message="queued",
        )

    def resume(self, job_id: int) -> None:
        """Queue a cancelled or failed job again; it continues from the bytes on disk."""
        with self._lock:
            job = self._jobs[job_id]
            if not job.last.state.finished or job.last.state == DownloadState.DONE:
                return
            job.cancel = CancelToken()
            job.done = threading.Event()
            job.last = self._initial(job_id, job.request)
        self._publish(job, job.last)
        self._queue.put(job_id)
        self._ensure_worker()

    def cancel(self, job_id: int) -> None:
        """Stop a job (queued or running); its partial file stays for :meth:`resume`."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.last.state.finished:
                return
            job.cancel.cancel()
            queued = job.last.state == DownloadState.QUEUED
        if queued:  # never started: report it now rather than when the worker reaches it
            self._finish(job, DownloadState.CANCELLED, "cancelled before it started")

    def discard(self, job_id: int) -> int:
        """Forget a finished, failed or cancelled job and delete its partial files; bytes freed."""
        with self._lock:
            job = self._jobs[job_id]
            if not job.last.state.finished:
                raise RuntimeError("cancel the download before discarding it")
            del self._jobs[job_id]
        if job.last.state == DownloadState.DONE:
            return 0
        return discard_partial(job.request, self.models_dir)

    def status(self, job_id: int) -> DownloadProgress:
        with self._lock:
            return self._jobs[job_id].last

    def jobs(self) -> list[DownloadProgress]:
        with self._lock:
            return [j.last for j in self._jobs.values()]

    def wait(self, job_id: int, timeout: float | None = None) -> DownloadProgress:
        """Block until the job is done, failed or cancelled (for scripts and tests)."""
        with self._lock:
            done = self._jobs[job_id].done
        if not done.wait(timeout):
            raise TimeoutError(f"download {job_id} still running after {timeout} s")
        return self.status(job_id)

    def resume_pending(self) -> list[int]:
        """Queue every download left unfinished by an earlier session; their ids."""
        return [self.enqueue(r) for r in pending_downloads(self.models_dir)]

    def close(self, timeout: float | None = 5.0) -> None:
        """Cancel everything and stop the worker (partial files stay for next time)."""
        with self._lock:
            self._closed = True
            jobs = [j.id for j in self._jobs.values() if not j.last.state.finished]
        for job_id in jobs:
            self.cancel(job_id)
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout)

    # -- worker ----------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(
                    target=self._run, name="folio-downloads", daemon=True
                )
                self._worker.start()

    def _finish(
        self,
        job: _Job,
        state: DownloadState,
        message: str,
        error: HubError | None = None,
        path: Path | None = None,
    ) -> None:
        last = self.status(job.id)
        self._publish(
            job,
            replace(
                last,
                state=state,
                message=message,
                error=error,
                path=path,
                bytes_per_s=None,
                eta_s=None,
            ),
        )
        job.done.set()

    def _run(self) -> None:
        while True:
            job_id = self._queue.get()
            if job_id is None:
                return
            with self._lock:
                job = self._jobs.get(job_id)
                if job is None or job.last.state != DownloadState.QUEUED or job.cancel.cancelled:
                    continue
                # Claimed under the lock: a cancel from now on goes through the token.
                job.last = replace(job.last, state=DownloadState.DOWNLOADING, message="starting")
            self._run_job(job)

    def _run_job(self, job: _Job) -> None:
        def progress(p: DownloadProgress) -> None:
            if p.state != DownloadState.DONE:
                self._publish(job, p)

        try:
            path = download_model(
                job.request,
                models_dir=self.models_dir,
                endpoint=self.endpoint,
                token=self.token,
                progress=progress,
                cancel=job.cancel,
                retries=self.retries,
                job_id=job.id,
                progress_interval_s=self.progress_interval_s,
            )
        except DownloadCancelled as exc:
            self._finish(job, DownloadState.CANCELLED, str(exc), exc)
        except HubError as exc:
            self._finish(job, DownloadState.FAILED, str(exc), exc)
        except Exception as exc:  # anything unexpected still ends the job in words
            err = explain(exc, job.request.repo_id, job.request.name)
            self._finish(job, DownloadState.FAILED, str(err), err)
        else:
            last = self.status(job.id)
            done = last.total_bytes if last.total_bytes is not None else last.done_bytes
            self._publish(job, replace(last, done_bytes=done))
            self._finish(job, DownloadState.DONE, f"downloaded and verified: {path}", path=path)
