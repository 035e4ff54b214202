"""The one place where Qt meets the engine.

`EngineBridge` owns the `Engine` (which runs its own loop thread) and is the only
object in `gui` that calls it. Engine events arrive on the engine thread; the bridge
queues them and wakes the UI thread once per burst, so a burst of tokens from four
chats costs one queued signal, not one per token. Snapshots are read on a QTimer and
re-emitted only when the engine's version moved. Loading a model and rebuilding the
cache run on worker threads; their outcome comes back as signals. Nothing here ever
blocks the UI thread on the engine, except `shutdown`, which the window calls once,
on close.

The bridge also runs the local OpenAI-compatible server (`engine.server.app.Server`) on
the same engine, so API requests share the chats' prefix cache and show in the same
snapshots. The server follows the engine: when the model is switched or the cache
rebuilt, it stops before the old engine does and starts again, same address and key, on
the new one; clients see refused connections for the seconds in between. Starting and
stopping run on their own worker thread, since a graceful stop waits for open requests.

The engine can also be a server elsewhere (`connect_remote`: vLLM, llama-server, another
Folio): `engine.remote.RemoteEngine` has the surface of `Engine` the bridge uses (submit,
cancel, snapshots, listeners, telemetry, shutdown), so the signals, and every widget
behind them, are the same whichever engine runs. A remote engine has no model in this
process (`loaded` is None: no tokenizer, no local server on it).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine.cache.kv_cache import CacheSettings
from engine.engine import Engine, EngineSnapshot, JobHandle
from engine.generator.generator import GeneratorSettings
from engine.generator.job import JobEvent, JobRequest
from engine.model.loader import LoadedModel
from engine.server.settings import ServerSettings

if TYPE_CHECKING:
    from engine.remote.engine import RemoteEngine, RemoteSettings
    from engine.server.app import Server
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
    weight_mode: str = "native"
    # Weights resident in each mode the app offers, estimated from the file's tensor
    # directory (engine.model.weight_modes); empty for a model not read from a GGUF file.
    weight_costs: dict[str, int] = field(default_factory=dict)
    # (layers, KV heads, head size): what prices a token of KV cache (gui.settings_hints)
    kv_shape: tuple[int, int, int] | None = None
    context_length: int | None = None  # the most tokens the model was trained to read
    vocab_size: int | None = None  # sizes the runtime's memory (engine.hub.fit)
    batch_copy_bytes: int = 0  # bf16 copies kept for batched decode (kernels/bf16.py)
    url: str = ""  # a remote engine's server; "" for this computer's
    # Why the model is not on the device the settings ask for (a GPU that is not there);
    # empty when it is (engine.device.resolve_or_cpu)
    device_note: str = ""


def describe_remote(remote: RemoteEngine, seconds: float) -> ModelInfo:
    """The status bar's words for a server elsewhere."""
    kind = {"vllm": "vLLM", "llamacpp": "llama.cpp", "folio": "Folio"}.get(remote.flavour, "")
    return ModelInfo(
        name=remote.model_id or "remote model",
        path=Path(),
        format=f"{kind or 'OpenAI-compatible'} server",
        device=remote.url,
        architecture="",
        weight_bytes=0,
        load_seconds=seconds,
        weight_mode="",
        url=remote.url,
    )


# How far the progress bar is once the file is loaded; the engine's start reports
# ENGINE_START_FRACTION, and the bar is full when it is up (`engine_ready`)
LOADED_FRACTION = 0.95
ENGINE_START_FRACTION = 0.97


def describe_model(loaded: LoadedModel, device_note: str = "") -> ModelInfo:
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
        weight_mode=loaded.weight_mode,
        weight_costs=weight_costs(loaded),
        kv_shape=_kv_shape(loaded.config),
        context_length=getattr(loaded.config, "max_position_embeddings", None),
        vocab_size=getattr(loaded.config, "vocab_size", None),
        batch_copy_bytes=int(loaded.batched_weights_bytes or 0),
        device_note=device_note,
    )


def _kv_shape(config: Any) -> tuple[int, int, int] | None:
    try:
        return (int(config.num_layers), int(config.num_kv_heads), int(config.head_dim))
    except (AttributeError, TypeError, ValueError):
        return None


def weight_costs(loaded: LoadedModel) -> dict[str, int]:
    """Resident weight bytes of `loaded`'s file in each mode the app offers."""
    if loaded.format != "gguf":
        return {}
    from engine.model.gguf_file import GGUFError, GGUFFile
    from engine.model.weight_modes import USER_WEIGHT_MODES, resident_weight_bytes

    try:
        gf = GGUFFile(loaded.path)
    except (GGUFError, OSError):  # moved or deleted since it was loaded
        return {}
    try:
        tensors = [(t.name, t.shape, t.nbytes) for t in gf.tensors.values()]
    finally:
        gf.close()
    return {mode: resident_weight_bytes(tensors, mode) for mode in USER_WEIGHT_MODES}


def _device_name(loaded: LoadedModel) -> str:
    from engine.device import device_label

    return device_label(loaded.device)


@dataclass(frozen=True)
class ServerInfo:
    """The running local server, as the window shows it."""

    base_url: str  # what OpenAI clients take as base_url: "http://127.0.0.1:8080/v1"
    model_id: str  # what clients send as "model" (GET /v1/models lists it)
    settings: ServerSettings  # as started (port 0 asked for any free port; see `port`)
    port: int


def server_error_text(exc: BaseException, settings: ServerSettings) -> str:
    """A failed start in words a user can act on."""
    where = f"{settings.host}:{settings.port}"
    code = getattr(exc, "errno", None)
    if code == errno.EADDRINUSE:
        return (
            f"Port {settings.port} is already in use on {settings.host}: another program "
            "(or another Folio) is listening there. Choose another port, or stop the "
            "other program."
        )
    if code == errno.EACCES:
        return (
            f"Not allowed to listen on {where}: ports below 1024 need administrator "
            "rights. Choose a port from 1024 up, such as 8080."
        )
    # Negative codes are getaddrinfo's: a host name that resolves to nothing.
    if code in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or (code is not None and code < 0):
        return (
            f"Cannot listen on {settings.host}: it is not an address of this computer. "
            "Use 127.0.0.1 (this computer only) or 0.0.0.0 (every network)."
        )
    return f"The local server could not start on {where}: {error_text(exc)}"


def _mark_used(path: str | Path) -> None:
    """The Models window's "Last used" of a model file: loading it is using it."""
    from engine.hub.library import mark_used

    try:
        mark_used(path)
    except OSError:
        log.warning("could not record that %s was used", path, exc_info=True)


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
    # (ServerInfo or None) the local server started, moved to a new engine, or stopped
    server_changed = Signal(object)
    # (message) the local server could not start; it is off
    server_failed = Signal(str)
    # internal: crosses from the engine thread to the UI thread
    _wake = Signal()
    # internal: a worker thread stopped the local server
    _server_gone = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        global _warmed_up
        if not _warmed_up:
            warm_up_thread_pools()
            _warmed_up = True
        self.engine: Engine | RemoteEngine | None = None
        self.loaded: LoadedModel | None = None
        self.model_info: ModelInfo | None = None
        self.cache_settings = CacheSettings()
        self.generator_settings = GeneratorSettings()
        self._pending: deque[JobEvent] = deque()
        self._wake_lock = threading.Lock()
        self._wake_sent = False
        self._last_version = -1
        self._device_note: str | None = None  # the last load's (see `load`)
        # Loads and rebuilds, one at a time, off the UI thread.
        self._worker = TaskRunner(
            self, max_threads=1, describe_error=_start_failure, thread_name="folio-load"
        )
        # The local server: what the user asked for (None: off), and what runs. `_server`
        # is only touched on the server's worker thread, the load worker (which stops it
        # before an engine swap) and in `shutdown`, always under `_server_lock`.
        self.server_settings: ServerSettings | None = None
        self.server: ServerInfo | None = None  # UI thread's view of what runs
        self._server: Server | None = None
        self._server_engine: Engine | None = None
        self._server_lock = threading.Lock()
        self._server_worker = TaskRunner(self, max_threads=1, thread_name="folio-server")
        self._server_gone.connect(lambda: self._on_server_changed(None))
        self._wake.connect(self._drain_events)
        self._timer = QTimer(self)
        self._timer.setInterval(SNAPSHOT_INTERVAL_MS)
        self._timer.timeout.connect(self.poll_snapshot)

    # -- state ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.running

    @property
    def remote(self) -> bool:
        """The engine is a server elsewhere (`connect_remote`)."""
        return self.engine is not None and not isinstance(self.engine, Engine)

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
        weight_mode: str | None = None,
        device: str = "auto",
    ) -> None:
        """Load `path` and start an engine on it, off the UI thread. Ends in
        `engine_ready` or `engine_failed`; `load_progress` reports along the way.
        `weight_mode` (engine.model.weight_modes) applies to GGUF files. `device`
        (engine/device.py): a GPU that is not there means the CPU, and the `ModelInfo`
        carries the note that says so."""
        from engine.device import resolve_or_cpu
        from engine.model.loader import load_model
        from engine.model.weight_modes import DEFAULT_WEIGHT_MODE

        mode = weight_mode or DEFAULT_WEIGHT_MODE

        def work() -> LoadedModel:
            resolved, self._device_note = resolve_or_cpu(device)
            loaded = load_model(
                path,
                weight_mode=mode,
                # the file's part up to LOADED_FRACTION: the engine's start (its warm-up,
                # a minute when the kernels compile, then its cache) is the rest
                progress=lambda f, what: self.load_progress.emit(LOADED_FRACTION * f, what),
                device=resolved,
            )
            _mark_used(path)
            return loaded

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
        self.load_progress.emit(ENGINE_START_FRACTION, "allocating the KV cache")  # and warm-up
        engine = Engine(loaded, cache_settings, generator_settings)
        if self._stop_old_engine():
            # The old cache has written its pages and let go of the disk store's writer
            # lock (KVCache.close). With the same model and cache format the new cache
            # opened that store too, as a reader while the old one held it: it takes
            # the writer's part over now, before its first step.
            if engine.cache.disk is not None:
                engine.cache.disk.refresh()
        engine.add_listener(self._on_engine_event)
        engine.start()
        return engine

    def _stop_old_engine(self) -> bool:
        """Worker thread: stop the running engine (local or remote), if any; True when
        one ran. Before it stops, the local server closes: open requests get the graceful
        stop's seconds to finish, and none reaches an engine that is gone.
        `_on_engine_started` starts the server again on the new engine."""
        old = self.engine
        if old is None:
            return False
        with self._server_lock:
            self._close_server()
        old.shutdown(30.0)
        old.remove_listener(self._on_engine_event)
        return True

    def connect_remote(self, settings: RemoteSettings) -> None:
        """Use the OpenAI-compatible server `settings` names as the engine, off the UI
        thread: checked first (ends in `engine_failed` with what is wrong, the current
        engine still running), then the old engine stops and `engine_ready` follows.
        ValueError at once for settings that cannot work (a URL without http://)."""
        from engine.remote.engine import RemoteEngine

        settings.validate()

        def work() -> RemoteEngine:
            remote = RemoteEngine(settings)
            try:
                remote.connect()
            except Exception:
                remote.shutdown(1.0)
                raise
            self._stop_old_engine()
            remote.add_listener(self._on_engine_event)
            return remote

        self._run_worker(work, lambda remote: remote)

    def _run_worker(
        self, work: Callable[[], Any], then: Callable[[Any], Engine | RemoteEngine]
    ) -> None:
        if self._worker.busy:
            self.engine_failed.emit("the engine is already loading; wait for it to finish")
            return
        self._worker.run(
            "engine", lambda: then(work()), self._on_engine_started, self._on_engine_failed
        )

    def _on_engine_failed(self, error: str) -> None:
        self.engine_failed.emit(error or "loading failed")
        if self.server_settings is not None:
            self._reconcile_server()  # a swap that failed half way may have stopped it

    def _on_engine_started(self, engine: Engine | RemoteEngine) -> None:
        self.engine = engine
        self.loaded = engine.loaded
        if isinstance(engine, Engine):
            self.cache_settings = engine.cache.settings
            self.generator_settings = engine.generator.settings
            self.model_info = describe_model(engine.loaded, self._device_note or "")
        else:
            self.model_info = describe_remote(engine, engine.connected_in)
        self._last_version = -1
        self._timer.start()
        self.engine_ready.emit(self.model_info)
        self.poll_snapshot()
        if self.server_settings is not None:
            self._reconcile_server()

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

    # -- the prompt cache on disk ---------------------------------------------------

    def clear_disk_cache(self, location: Path | str) -> tuple[int, int]:
        """Any thread (the settings dialog calls it on a worker). Delete every store of
        the prompt cache under ``location``: the running engine's own is emptied in place,
        since its tier holds the store's writer lock; the others are deleted unless
        another Folio process writes them. Returns (bytes freed, stores left in use), as
        `engine.cache.disk_tier.delete_stores` does."""
        from engine.cache.disk_tier import delete_stores

        engine = self.engine
        disk = engine.cache.disk if isinstance(engine, Engine) else None
        own = (
            disk is not None
            and disk.writable
            and disk.directory.parent.resolve() == Path(location).resolve()
        )
        freed = disk.clear() if own else 0
        more, busy = delete_stores(location)
        return freed + more, busy - own

    # -- the local server -------------------------------------------------------------

    def start_server(self, settings: ServerSettings) -> None:
        """Serve the OpenAI API on the engine with `settings` (restarting the server if
        it runs with others), off the UI thread. Ends in `server_changed(ServerInfo)` or
        `server_failed(message)`; without an engine yet it starts once one is ready.
        Port 0 takes any free port, anew at each start (an engine swap too). Raises
        ValueError for settings that cannot work (a port out of range)."""
        settings.validate()
        self.server_settings = settings
        if self.engine is not None:
            self._reconcile_server()

    def stop_server(self) -> None:
        """Stop serving (open requests get a few seconds); ends in `server_changed(None)`."""
        self.server_settings = None
        self._reconcile_server()

    def _reconcile_server(self) -> None:
        """Make what runs match what was asked for, on the server's worker thread. Each
        call reads the wish and the engine when it runs, so calls that overtake each
        other still end in the latest wish; only the newest call reports."""

        def work() -> ServerInfo | None:
            with self._server_lock:
                wanted, engine = self.server_settings, self.engine
                server = self._server
                if server is not None and (
                    wanted is None or wanted != server.settings or self._server_engine is not engine
                ):
                    self._close_server()
                if wanted is None or engine is None or not engine.running:
                    return None
                if not isinstance(engine, Engine):
                    raise RuntimeError(
                        f"The local server serves this computer's engine, and the app now "
                        f"uses the server at {engine.url}: its clients can use that one "
                        "directly. Switch Settings > Engine back to this computer to serve."
                    )
                if self._server is None:
                    # The HTTP stack is imported when a server first starts, not at app start.
                    from engine.server.app import Server

                    server = Server(engine, wanted)
                    try:
                        server.start()
                    except (OSError, RuntimeError) as exc:
                        raise RuntimeError(server_error_text(exc, wanted)) from exc
                    self._server, self._server_engine = server, engine
                return self._server_info(self._server)

        self._server_worker.run("server", work, self._on_server_changed, self._on_server_failed)

    def _server_info(self, server: Server) -> ServerInfo:
        assert server.port is not None
        model_id = server.app.state.folio.limits.model_id
        return ServerInfo(server.url + "/v1", model_id, server.settings, server.port)

    def _close_server(self) -> None:
        """Under `_server_lock`, on a worker thread or at shutdown."""
        server, self._server, self._server_engine = self._server, None, None
        if server is None:
            return
        try:
            server.stop()
        except RuntimeError:  # it did not stop in time; its thread is a daemon
            log.exception("local server stop")
        # The window hears of it now, not only once a new server is up (an engine swap).
        self._server_gone.emit()

    def _on_server_changed(self, info: ServerInfo | None) -> None:
        if info != self.server:
            self.server = info
            self.server_changed.emit(info)

    def _on_server_failed(self, message: str) -> None:
        self.server_settings = None  # off, as the window shows it; the user picks again
        self._on_server_changed(None)
        self.server_failed.emit(message)

    # -- shutdown ---------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: jobs end as cancelled, the loop thread joins. The only call
        that waits on the engine (at most one step); used when the window closes."""
        self.server_settings = None
        with self._server_lock:
            self._close_server()
        self._timer.stop()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown(timeout)
            engine.remove_listener(self._on_engine_event)
        self._drain_events()
