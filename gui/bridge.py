"""The one place where Qt meets the engine.

`EngineBridge` owns the `Engine` (which runs its own loop thread) and is the only
object in `gui` that calls it. Engine events arrive on the engine thread; the bridge
queues them and wakes the UI thread once per burst, so a burst of tokens from four
chats costs one queued signal, not one per token. Snapshots are read on a QTimer and
re-emitted only when the engine's version moved. Loading a model and rebuilding the
cache run on worker threads; their outcome comes back as signals. Nothing here ever
blocks the UI thread on the engine, except `shutdown`, which the window calls once,
on close.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine.cache.kv_cache import CacheSettings
from engine.engine import Engine, EngineSnapshot, JobHandle
from engine.generator.generator import GeneratorSettings
from engine.generator.job import JobEvent, JobRequest
from engine.model.loader import LoadedModel
from gui.worker import TaskRunner, error_text

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_MS = 100  # ~10 Hz: smooth enough for the views, cheap for the UI thread


@dataclass(frozen=True)
class ModelInfo:
    """What the status bar shows about the loaded model; plain data, safe to keep."""

    name: str
    path: Path
    format: str  # "GGUF int4", "safetensors", ...
    device: str
    architecture: str
    weight_bytes: int
    load_seconds: float


def describe_model(loaded: LoadedModel) -> ModelInfo:
    # The quant type most tensors use names the file ("Q4_1"); norms stay F32.
    quantized = {k: v for k, v in loaded.quant_types.items() if k not in ("F32", "F16", "BF16")}
    quant = max(quantized, key=quantized.__getitem__) if quantized else ""
    fmt = loaded.format.upper() if loaded.format == "gguf" else loaded.format
    fmt = f"{fmt} {quant}" if quant else fmt
    fmt += f" · {loaded.weight_mode} weights"
    if loaded.batched_weights_bytes:
        fmt += " + bf16 for batches"  # kernels/bf16.py
    return ModelInfo(
        name=loaded.name,
        path=Path(loaded.path),
        format=fmt,
        device=_device_name(loaded),
        architecture=str(getattr(loaded.config, "arch", "")),
        weight_bytes=_safe_weight_bytes(loaded),
        load_seconds=loaded.load_seconds,
    )


def _device_name(loaded: LoadedModel) -> str:
    # The engine keeps weights wherever the loader put them; find one tensor to ask.
    import torch

    model = loaded.model
    for value in vars(model).values():
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                return torch.cuda.get_device_name(value.device)
            return "CPU"
    return "CPU"


def _safe_weight_bytes(loaded: LoadedModel) -> int:
    try:
        return int(loaded.weight_bytes)
    except Exception:  # noqa: BLE001 - a figure for display only
        return 0


def warm_up_thread_pools() -> None:
    """Run one parallel torch op on the calling (main) thread.

    Measured on the 2-core dev machine: when the first OpenMP parallel region of the
    process runs on a worker thread (loading the model off the UI thread) and the
    engine is then built on another thread, decoding runs 10-20x slower (about 2
    tok/s instead of 30) for the life of the process. torch and numba share libgomp,
    whose thread team belongs to the thread that first used it; making that the main
    thread, before any worker exists, avoids the slow path. Costs a millisecond.
    """
    import torch

    a = torch.ones(256, 256)
    (a @ a).add_(1.0).sum()
    torch.ones(1 << 17).mul_(2.0).sum()


_warmed_up = False


def _start_failure(exc: BaseException) -> str:
    """Worker thread: log a failed load or rebuild with its traceback; the user gets
    the words."""
    log.error("engine start failed", exc_info=exc)
    return error_text(exc)


class EngineBridge(QObject):
    """Owns the engine; turns its events into signals and its snapshots into a tick."""

    # a list of JobEvent, in engine order, drained in one go on the UI thread
    job_events = Signal(list)
    # (EngineSnapshot) when the engine changed since the last tick
    snapshot_ready = Signal(object)
    load_progress = Signal(float, str)
    # (ModelInfo) once an engine is running on the model
    engine_ready = Signal(object)
    # (message) loading or rebuilding failed; the old engine (if any) keeps running
    engine_failed = Signal(str)
    # internal: crosses from the engine thread to the UI thread
    _wake = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        global _warmed_up
        if not _warmed_up:
            warm_up_thread_pools()
            _warmed_up = True
        self.engine: Engine | None = None
        self.loaded: LoadedModel | None = None
        self.model_info: ModelInfo | None = None
        self.cache_settings = CacheSettings()
        self.generator_settings = GeneratorSettings()
        self._pending: deque[JobEvent] = deque()
        self._wake_lock = threading.Lock()
        self._wake_sent = False
        self._last_version = -1
        # Loads and rebuilds, one at a time, off the UI thread.
        self._worker = TaskRunner(
            self, max_threads=1, describe_error=_start_failure, thread_name="folio-load"
        )
        self._wake.connect(self._drain_events)
        self._timer = QTimer(self)
        self._timer.setInterval(SNAPSHOT_INTERVAL_MS)
        self._timer.timeout.connect(self.poll_snapshot)

    # -- state ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.running

    @property
    def busy(self) -> bool:
        """A load or rebuild is running on the worker thread."""
        return self._worker.busy

    @property
    def telemetry(self):
        return self.engine.telemetry if self.engine is not None else None

    @property
    def tokenizer(self):
        return self.loaded.tokenizer if self.loaded is not None else None

    # -- loading (worker threads) -----------------------------------------------------

    def load(
        self,
        path: str | Path,
        cache_settings: CacheSettings | None = None,
        generator_settings: GeneratorSettings | None = None,
    ) -> None:
        """Load `path` and start an engine on it, off the UI thread. Ends in
        `engine_ready` or `engine_failed`; `load_progress` reports along the way."""
        from engine.model.loader import load_model

        def work() -> LoadedModel:
            return load_model(path, progress=lambda f, what: self.load_progress.emit(f, what))

        self._run_worker(
            work, lambda loaded: self._start_engine(loaded, cache_settings, generator_settings)
        )

    def use_loaded(
        self,
        loaded: LoadedModel,
        cache_settings: CacheSettings | None = None,
        generator_settings: GeneratorSettings | None = None,
    ) -> None:
        """Start an engine on a model already in memory (tests, a cache rebuild)."""
        self._run_worker(
            lambda: loaded, lambda m: self._start_engine(m, cache_settings, generator_settings)
        )

    def rebuild(self, cache_settings: CacheSettings, generator_settings: GeneratorSettings) -> None:
        """New cache and generator settings: a new engine on the same weights. Running
        jobs end as cancelled (their final events still arrive)."""
        if self.loaded is None:
            self.cache_settings, self.generator_settings = cache_settings, generator_settings
            return
        self.use_loaded(self.loaded, cache_settings, generator_settings)

    def _start_engine(
        self,
        loaded: LoadedModel,
        cache_settings: CacheSettings | None,
        generator_settings: GeneratorSettings | None,
    ) -> Engine:
        """Runs on the worker thread: the old engine stops, the new one allocates its
        cache (which can take a while for a big budget) and starts."""
        cache_settings = cache_settings or self.cache_settings
        generator_settings = generator_settings or self.generator_settings
        generator_settings.validate(cache_settings.page_size)
        self.load_progress.emit(0.97, "allocating the KV cache")
        engine = Engine(loaded, cache_settings, generator_settings)
        old = self.engine
        if old is not None:
            old.shutdown(30.0)
        engine.add_listener(self._on_engine_event)
        engine.start()
        return engine

    def _run_worker(self, work: Callable[[], Any], then: Callable[[Any], Engine]) -> None:
        if self._worker.busy:
            self.engine_failed.emit("the engine is already loading; wait for it to finish")
            return
        self._worker.run(
            "engine", lambda: then(work()), self._on_engine_started, self._on_engine_failed
        )

    def _on_engine_failed(self, error: str) -> None:
        self.engine_failed.emit(error or "loading failed")

    def _on_engine_started(self, engine: Engine) -> None:
        self.engine = engine
        self.loaded = engine.loaded
        self.cache_settings = engine.cache.settings
        self.generator_settings = engine.generator.settings
        self.model_info = describe_model(engine.loaded)
        self._last_version = -1
        self._timer.start()
        self.engine_ready.emit(self.model_info)
        self.poll_snapshot()

    # -- jobs -------------------------------------------------------------------------

    def submit(self, request: JobRequest) -> JobHandle:
        """Queue a job. Raises ValueError (bad input, prompt too long for the cache) or
        RuntimeError (no engine) in the caller, with a message for the user."""
        if self.engine is None or not self.engine.running:
            raise RuntimeError("no model is loaded yet")
        return self.engine.submit(request)

    def cancel(self, job_id: int) -> None:
        if self.engine is not None:
            self.engine.cancel(job_id)

    # -- engine thread -> UI thread ---------------------------------------------------

    def _on_engine_event(self, event: JobEvent) -> None:
        """Engine thread. Only the first event of a burst emits a (queued) signal."""
        self._pending.append(event)
        with self._wake_lock:
            if self._wake_sent:
                return
            self._wake_sent = True
        self._wake.emit()

    @Slot()
    def _drain_events(self) -> None:
        with self._wake_lock:
            self._wake_sent = False
        events: list[JobEvent] = []
        while self._pending:
            events.append(self._pending.popleft())
        if events:
            self.job_events.emit(events)

    # -- snapshots --------------------------------------------------------------------

    @Slot()
    def poll_snapshot(self, force: bool = False) -> EngineSnapshot | None:
        """Emit the engine's latest snapshot if it changed (reading it never waits)."""
        if self.engine is None:
            return None
        try:
            snapshot = self.engine.snapshot()
        except RuntimeError:
            return None
        if snapshot.version == self._last_version and not force:
            return None
        self._last_version = snapshot.version
        self.snapshot_ready.emit(snapshot)
        return snapshot

    # -- shutdown ---------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: jobs end as cancelled, the loop thread joins. The only call
        that waits on the engine (at most one step); used when the window closes."""
        self._timer.stop()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown(timeout)
            engine.remove_listener(self._on_engine_event)
        self._drain_events()
