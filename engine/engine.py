"""The engine a program talks to: a model, its paged cache and the generator, run by
one background thread.

Every other thread talks to it through `submit`, `cancel`, `snapshot` and events.
Requests and cancellations go into an inbox the loop drains before each step; events
come back through each job's `JobHandle` and through listeners (called on the engine
thread: a GUI turns them into queued signals). The cache is only touched by the loop
thread, which publishes an `EngineSnapshot` after its steps, so a reader never waits
for a forward pass.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.cache.page_table import CacheEvent
from engine.cache.snapshot import CacheSnapshot, CacheStats, cache_stats
from engine.generator.generator import Generator, GeneratorSettings
from engine.generator.job import EventKind, Job, JobEvent, JobRequest, JobResult, JobState
from engine.generator.stops import StopReason
from engine.model.calibration import calibration_for
from engine.model.loader import LoadedModel
from engine.published import Published
from engine.telemetry import Telemetry

log = logging.getLogger(__name__)

Listener = Callable[[JobEvent], None]

# Snapshot versions are unique in the process, not per engine: a reader that skips a
# version it has drawn must not skip a new engine's first snapshots (after a settings
# change rebuilt the cache, the memory panel kept the old cache's figures).
_SNAPSHOT_VERSIONS = itertools.count(1)

# While the engine is idle and the disk tier's writer is still storing finished chats'
# pages, a snapshot is published this often, so readers see the tier fill.
DISK_PUBLISH_S = 0.25


@dataclass(frozen=True)
class JobInfo:
    """A job as a snapshot shows it."""

    job_id: int
    tag: Any
    state: str
    prompt_tokens: int
    new_tokens: int
    cached_tokens: int
    skips: int
    wait_reason: str
    sequences: tuple[int, ...]  # page-table ids of its live sequences
    pages: int  # distinct pages held
    disk_pages: int = 0  # context pages read back from the disk tier on admission
    disk_bytes: int = 0
    disk_seconds: float = 0.0
    wait_kind: str = ""  # `WaitKind`: why a pending job waits, as a word to branch on
    # Prefill progress: tokens of the sequence in the cache now, of how many, and where
    # and when this round's prefill began (so a reader measures the rate it runs at).
    prefill_done: int = 0
    prefill_total: int = 0
    prefill_from: int = 0
    prefill_since: float | None = None

    def prefill_rate(self, now: float) -> float | None:
        """Prompt tokens per second this prefill has computed, from its start to `now`
        (the snapshot's time); None before any chunk has finished."""
        if self.prefill_since is None or self.prefill_done <= self.prefill_from:
            return None
        seconds = now - self.prefill_since
        return (self.prefill_done - self.prefill_from) / seconds if seconds > 0 else None

    def prefill_eta(self, now: float) -> float | None:
        """Seconds until the prompt is in the cache at the measured rate (None: no rate yet)."""
        rate = self.prefill_rate(now)
        if rate is None:
            return None
        return max(0, self.prefill_total - self.prefill_done) / rate


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine's memory looks like after a step; safe to keep and read anywhere."""

    version: int  # unique in the process, growing; unchanged means nothing to redraw
    time: float
    cache: CacheSnapshot
    stats: CacheStats
    page_size: int
    num_pages: int
    page_tokens: list[list[int]]  # token ids each page holds (shared, never mutated)
    eviction_next: list[int]  # unreferenced pages in the order they would be reused
    jobs: list[JobInfo]  # active first, then pending in queue order
    seq_jobs: dict[int, int]  # page-table id -> job id
    job_tags: dict[int, Any]  # job id -> the caller's tag
    cache_bytes: int
    host_bytes: int
    # Where the KV pages (and the weights, `weight_bytes` of them) live: "cpu", "cuda:0";
    # "" when not known (a remote engine). On a GPU the memory panel adds the device's
    # memory to these figures (gui/views/device_memory.py).
    device: str = ""
    weight_bytes: int = 0
    # What a reader should know of this snapshot's limits: "" for a local engine; for a
    # remote one, what its source (KV events, metrics) cannot say (engine/remote/).
    note: str = ""


class JobHandle:
    """A submitted job as the caller sees it: its events, then its result."""

    def __init__(self, job_id: int, engine: Engine):
        self.job_id = job_id
        self._engine = engine
        self._events: queue.Queue[JobEvent] = queue.Queue()
        self._done = threading.Event()
        self.result: JobResult | None = None

    def _deliver(self, event: JobEvent) -> None:
        if event.eos:
            self.result = event.result
        self._events.put(event)
        if event.eos:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def events(self, timeout: float | None = None) -> Iterator[JobEvent]:
        """Events as they come, ending with the last one (eos=True)."""
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if event.eos:
                return

    def wait(self, timeout: float | None = None) -> JobResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.job_id} still running after {timeout} s")
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        self._engine.cancel(self.job_id)


def _warm_up(loaded: LoadedModel, settings: CacheSettings, calibration) -> str:
    """`engine.model.runner.warm_up`; "" when it ran, else what went wrong (logged: the
    first job meets the same fault and reports it as its own error)."""
    from engine.model.runner import warm_up

    try:
        warm_up(loaded, settings, calibration)
    except Exception as exc:  # noqa: BLE001 - the engine starts; each job reports its own fault
        log.warning("warming the kernels up failed: %s", exc)
        return f"{type(exc).__name__}: {exc}"
    return ""


class Engine:
    """Owns model, cache and generator; `start()` runs the loop thread (a context
    manager does start and shutdown)."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_settings: CacheSettings | None = None,
        settings: GeneratorSettings | None = None,
        telemetry_history: int = 600,
        snapshot_interval: float = 0.05,
    ):
        self.loaded = loaded
        cache_settings = cache_settings or CacheSettings()
        calibration = calibration_for(loaded, cache_settings)
        # warmed before the cache is allocated: the warm-up drops the libraries' code
        # from the resident set (what only loading ran stays out), and the peak RSS
        # would otherwise hold that code and the cache's pages together
        self.warm_up_error = _warm_up(loaded, cache_settings, calibration)
        self.cache = KVCache.for_model(loaded, cache_settings, calibration)
        self._weight_bytes = loaded.weight_bytes  # summed once: the snapshots repeat it
        self.telemetry = Telemetry(history=telemetry_history)
        self.generator = Generator(loaded, self.cache, settings, self.telemetry)
        self.snapshot_interval = snapshot_interval
        self._cv = threading.Condition()
        self._inbox: list[tuple[JobRequest, list[int], frozenset[int], JobHandle]] = []
        self._cancels: list[int] = []
        self._handles: dict[int, JobHandle] = {}
        self._listeners: list[Listener] = []
        self._cache_listeners: list[Callable[[list[CacheEvent]], None]] = []
        self._cache_events: deque[CacheEvent] = deque(maxlen=4096)  # for the next snapshot
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._snapshot: Published[EngineSnapshot] = Published()
        self._last_publish = 0.0
        self._published_disk_changes = 0  # the disk tier's `changes` the last one showed
        self.loop_error: str = ""

    @classmethod
    def load(
        cls,
        path: str | Path,
        cache_settings: CacheSettings | None = None,
        settings: GeneratorSettings | None = None,
        **load_options: Any,
    ) -> Engine:
        from engine.model.loader import load_model

        return cls(load_model(path, **load_options), cache_settings, settings)

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._publish_snapshot()
            self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel every job (their handles get their last event) and stop the thread.
        A `submit` from then on raises RuntimeError."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")
            self._thread = None
        # No loop drains the inbox now (it never started, or it has returned): end what
        # is still queued here, so that every handle `submit` returned finishes.
        with self._cv:
            inbox, self._inbox = self._inbox, []
        events: list[JobEvent] = []
        for job in self._jobs_from(inbox):
            events.extend(self.generator.cancel(job.job_id))
        self._dispatch(events)
        self.cache.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- any thread --------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Called on the engine thread with every event of every job."""
        with self._cv:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._cv:
            self._listeners.remove(listener)

    def add_cache_listener(self, listener: Callable[[list[CacheEvent]], None]) -> None:
        """Called on the engine thread after every step with that step's page-table
        events, in order (the KV-events feed, docs/ENGINE.md §11). It must not block."""
        with self._cv:
            self._cache_listeners.append(listener)

    def remove_cache_listener(self, listener: Callable[[list[CacheEvent]], None]) -> None:
        with self._cv:
            self._cache_listeners.remove(listener)

    def submit(self, request: JobRequest) -> JobHandle:
        """Queue a job. Bad requests raise ValueError here, in the caller's thread, with
        a message that says what to change; nothing is queued then. After `shutdown`
        it raises RuntimeError."""
        prompt, stop_ids = self.generator.prepare(request)
        # Checked and queued under the lock `shutdown` takes: a job is either refused
        # here or in the inbox before the loop (or `shutdown`) drains it for the last time.
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shut down: start a new one to submit jobs")
            handle = JobHandle(self.generator.new_job_id(), self)
            self._handles[handle.job_id] = handle
            self._inbox.append((request, prompt, stop_ids, handle))
            self._cv.notify_all()
        return handle

    def cancel(self, job_id: int) -> None:
        with self._cv:
            self._cancels.append(job_id)
            self._cv.notify_all()

    def generate(self, request: JobRequest, timeout: float | None = None) -> JobResult:
        """Submit and wait (the loop must be running)."""
        return self.submit(request).wait(timeout)

    def snapshot(self) -> EngineSnapshot:
        """The latest published snapshot. It never waits for a step; a thread polling
        in a tight loop is paced (see `engine.published`) so it cannot starve the loop."""
        snapshot = self._snapshot.read()
        if snapshot is None:
            raise RuntimeError("the engine has not started")
        return snapshot

    # -- the loop thread ---------------------------------------------------------------

    def _run(self) -> None:
        gen = self.generator
        while True:
            disk_moved = False
            with self._cv:
                while not (self._inbox or self._cancels or self._stopping or not gen.idle):
                    if not self._disk_unpublished():
                        self._cv.wait()
                    elif not self._cv.wait(DISK_PUBLISH_S):
                        disk_moved = True
                        break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                stopping = self._stopping
            if disk_moved and not (inbox or cancels or stopping):
                self._publish_snapshot()
                continue
            events: list[JobEvent] = []
            self._jobs_from(inbox)
            for job_id in cancels:
                events.extend(gen.cancel(job_id))
            if stopping:
                for job in list(gen.active) + list(gen.pending):
                    events.extend(gen.cancel(job.job_id))
                self._dispatch(events)
                self._publish_snapshot()
                return
            try:
                started = gen.admit()
                if started:
                    # Shown before the step's forward passes run: a long prompt's first
                    # chunk takes seconds, and until now the job looked merely queued.
                    # No more often than the loop publishes anyway: a snapshot costs the
                    # other threads GIL time (the server's request threads, say).
                    self._drain_cache_events()
                    self._dispatch(started)
                    if time.monotonic() - self._last_publish >= self.snapshot_interval:
                        self._publish_snapshot()
                events.extend(gen.advance())
            except Exception as exc:  # noqa: BLE001 - the thread must survive
                self.loop_error = traceback.format_exc()
                log.error("engine step failed:\n%s", self.loop_error)
                events.extend(gen.fail_all(f"the engine failed: {exc}"))
                self._recover()
            self._drain_cache_events()  # before the jobs' events: a job done has its pages
            self._dispatch(events)
            now = time.monotonic()
            if gen.idle or now - self._last_publish >= self.snapshot_interval:
                self._publish_snapshot()

    def _disk_unpublished(self) -> bool:
        """The disk tier's writer thread is busy, or changed it since the last snapshot."""
        disk = self.cache.disk
        return disk is not None and (disk.writing or disk.changes != self._published_disk_changes)

    def _jobs_from(
        self, inbox: list[tuple[JobRequest, list[int], frozenset[int], JobHandle]]
    ) -> list[Job]:
        """Queue the submitted jobs on the generator (the loop thread, or `shutdown`
        once no loop runs)."""
        jobs = []
        for request, prompt, stop_ids, handle in inbox:
            job = Job(handle.job_id, request, prompt, stop_ids, time.monotonic())
            self.generator.enqueue(job)
            jobs.append(job)
        return jobs

    def _recover(self) -> None:
        """After a failed step every job has ended; drop whatever they still hold."""
        pages = self.cache.pages
        for job_id in list(pages.allocations):
            pages.release(job_id)

    def _dispatch(self, events: list[JobEvent]) -> None:
        if not events:
            return
        with self._cv:
            listeners = list(self._listeners)
        for event in events:
            if event.kind in (EventKind.STARTED, EventKind.DONE):
                self._log_job_event(event)
            handle = self._handles.get(event.job_id)
            if handle is not None:
                handle._deliver(event)
                if event.eos:
                    del self._handles[event.job_id]
            for listener in listeners:
                try:
                    listener(event)
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
                    log.exception("engine event listener failed")

    def _log_job_event(self, event: JobEvent) -> None:
        fields: dict[str, Any] = {"job": event.job_id, "tag": event.tag}
        if event.result is not None:
            r = event.result
            fields.update(
                eos_reason=r.eos_reason,
                prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens,
                disk_pages=r.disk_pages,
                disk_bytes=r.disk_bytes,
                disk_seconds=r.disk_seconds,
                new_tokens=r.new_tokens,
                time_prefill=r.time_prefill,
                time_generate=r.time_generate,
            )
        else:
            fields["cached_tokens"] = event.prefill_done
        self.telemetry.log(f"job_{event.kind}", **fields)

    def _drain_cache_events(self) -> None:
        """Hand the page table's new events to the cache listeners, and keep them for
        the next snapshot's telemetry."""
        pages = self.cache.pages
        if not pages.events:
            return
        events = list(pages.events)
        pages.events.clear()
        self._cache_events.extend(events)
        with self._cv:
            listeners = list(self._cache_listeners)
        for listener in listeners:
            try:
                listener(events)
            except Exception:  # noqa: BLE001 - a listener never stops the engine
                log.exception("cache listener %r failed", listener)

    def _publish_snapshot(self) -> None:
        gen = self.generator
        pages = self.cache.pages
        self._drain_cache_events()
        # The page table's events move to the telemetry log, where readers on other
        # threads follow them by sequence number (`Telemetry.events(since)`).
        while self._cache_events:
            ev = self._cache_events.popleft()
            self.telemetry.log(
                f"page_{ev.kind}",
                page=ev.page,
                hash=ev.hash.hex() if ev.hash else None,
                parent=ev.parent_hash.hex() if ev.parent_hash else None,
                detail=ev.detail,
            )
        snap = pages.snapshot()
        if snap.disk_records is not None:
            self._published_disk_changes = snap.disk_records.changes
        jobs = [_job_info(job) for job in list(gen.active) + list(gen.pending)]
        host = pages.host_tier
        snapshot = EngineSnapshot(
            version=next(_SNAPSHOT_VERSIONS),
            time=time.monotonic(),
            cache=snap,
            stats=cache_stats(snap, self.cache.page_size),
            page_size=self.cache.page_size,
            num_pages=self.cache.num_pages,
            page_tokens=[rec.tokens for rec in pages.pages],
            eviction_next=pages.next_victims(64),
            jobs=jobs,
            seq_jobs=dict(gen.seq_jobs),
            job_tags={info.job_id: info.tag for info in jobs},
            cache_bytes=self.cache.nbytes(),
            host_bytes=host.nbytes() if host is not None else 0,
            device=str(self.cache.device),
            weight_bytes=self._weight_bytes,
        )
        self._snapshot.publish(snapshot)
        self._last_publish = snapshot.time


def _job_info(job: Job) -> JobInfo:
    seq = job.sequences[0] if job.sequences else None
    return JobInfo(
        job_id=job.job_id,
        tag=job.tag,
        state=str(job.state),
        prompt_tokens=len(job.prompt_ids),
        new_tokens=sum(len(s.generated) for s in job.sequences),
        cached_tokens=job.cached_tokens,
        skips=job.skips,
        wait_reason=job.wait_reason,
        sequences=tuple(s.seq_id for s in job.sequences if s.alloc is not None),
        pages=len(job.held_pages()),
        disk_pages=job.disk_pages,
        disk_bytes=job.disk_bytes,
        disk_seconds=job.disk_seconds,
        wait_kind=str(job.wait_kind),
        prefill_done=seq.stored if seq is not None else 0,
        prefill_total=len(seq.tokens) if seq is not None else len(job.prompt_ids),
        prefill_from=job.prefill_start,
        prefill_since=job.prefill_since if job.state == JobState.PREFILL else None,
    )


__all__ = [
    "Engine",
    "EngineSnapshot",
    "EventKind",
    "JobHandle",
    "JobInfo",
    "JobState",
    "StopReason",
]
