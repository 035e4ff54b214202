"""`RemoteEngine`: an OpenAI-compatible server elsewhere, with the surface of `Engine` that
the app uses (`submit`, `cancel`, `snapshot`, listeners, `telemetry`, `shutdown`), so the
GUI's bridge drives it as it drives the local engine and the views draw it unchanged.

- Chats: each job is one streamed `POST /v1/chat/completions` on a thread of its own
  (httpx); its server-sent chunks become the same `JobEvent`s a local job sends, and
  `cancel` closes the stream (the server cancels the request when the client goes).
- Graphs and figures: `/metrics` scraped every second (vLLM's, llama.cpp's or Folio's
  names: `engine.remote.metrics`) into a `Telemetry` of the same records.
- Page map and prefix tree: from the server's KV-cache events when the user gives their
  endpoint (`engine.remote.block_pool`), else from Folio's own page-table snapshot
  (`GET /folio/v1/cache`) when the server is a Folio. Each snapshot carries a note on
  what its source cannot show.

`connect()` checks the server before anything is shown as connected, and every failure
(unreachable, a refused key, not an OpenAI server) is a `RemoteError` in words a user can
act on.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

from engine.engine import EngineSnapshot, JobHandle, JobInfo
from engine.generator.job import EventKind, JobEvent, JobRequest, JobResult
from engine.published import Published
from engine.remote.block_pool import LIMITS, BlockPool
from engine.remote.metrics import ServerFigures, step_record
from engine.remote.wire import snapshot_from_json
from engine.server.tag import ApiTag
from engine.telemetry import Telemetry

log = logging.getLogger(__name__)

POLL_S = 0.5  # snapshots at 2 Hz: the events arrive as they come, the views catch up
METRICS_S = 1.0  # one scrape a second: the graphs' rates are per second anyway
CACHE_PATH = "/folio/v1/cache"

FOLIO_NOTE = (
    "Drawn from the Folio server's own page-table snapshot: pages, sharing and owners as "
    "the server sees them; its host and disk tiers are not drawn. Other clients' requests "
    "show as API."
)
NO_EVENTS_NOTE = (
    "This server publishes no KV-cache events the app was told of: the page map and prefix "
    "tree stay empty. Give its event endpoint (vLLM: --kv-events-config; Folio: "
    "--kv-events) in Settings > Engine to draw them."
)
NO_METRICS = " It has no /metrics either (llama-server needs --metrics): no graphs."


class RemoteError(Exception):
    """A remote server that cannot be used, in words for the user."""


@dataclass(frozen=True)
class RemoteSettings:
    url: str  # the server's address, with or without /v1
    api_key: str | None = None
    kv_events: str | None = None  # its KV-event endpoint, e.g. tcp://host:5557
    kv_events_replay: str | None = None  # its replay endpoint, e.g. tcp://host:5558
    kv_events_topic: str = ""

    @property
    def base_url(self) -> str:
        url = self.url.strip().rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def validate(self) -> None:
        """ValueError naming what to change."""
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"the server's URL must start with http:// or https://, got {self.url!r:.80}"
                " (for example http://192.168.1.20:8000)"
            )
        for name, endpoint in (("events", self.kv_events), ("replay", self.kv_events_replay)):
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(
                    f"the KV {name} endpoint must look like tcp://HOST:PORT, got {endpoint!r:.80}"
                )
        if self.kv_events_replay and not self.kv_events:
            raise ValueError("a replay endpoint needs the events endpoint too")


@dataclass
class _RemoteJob:
    job_id: int
    request: JobRequest
    handle: JobHandle
    texts: list[str]
    reasons: list[str]
    submitted: float
    state: str = "pending"
    request_id: str = ""  # the server's id for it (its chunks' "id")
    first_token: float = 0.0
    new_tokens: int = 0
    usage: dict[str, Any] = field(default_factory=dict)
    cancelled: bool = False
    response: httpx.Response | None = None


class RemoteEngine:
    """A server elsewhere, driven like `Engine`. `connect()` (blocking: call it off the UI
    thread) checks it and starts following it; `shutdown()` stops."""

    loaded = None  # no model in this process: no tokenizer, no weights

    def __init__(self, settings: RemoteSettings, timeout: float = 10.0):
        settings.validate()
        self.settings = settings
        self.url = settings.base_url
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._client = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, read=300.0),
            follow_redirects=True,
        )
        self.model_id = ""
        self.context = 0  # the model's context length, when the server says
        self.flavour = ""  # "folio", "vllm", "llamacpp" (from /metrics) or ""
        self.has_metrics = False
        self.has_folio_cache = False
        self.connected_in = 0.0  # seconds `connect` took
        self.telemetry = Telemetry()
        self.pool = BlockPool()
        self._pool_lock = threading.Lock()
        self._figures: ServerFigures | None = None
        self._listeners: list[Callable[[JobEvent], None]] = []
        self._jobs: dict[int, _RemoteJob] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._snapshot: Published[EngineSnapshot] = Published()
        self._versions = itertools.count(1)
        self._last_state: tuple = ()
        self._server_version = -1  # of the Folio snapshot last drawn
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self.subscriber = None

    # -- connecting ---------------------------------------------------------------------

    def connect(self) -> RemoteEngine:
        """Check the server (its model list, then what it exposes), publish a first
        snapshot and start following it. RemoteError when it cannot be used."""
        t0 = time.monotonic()
        models = self._get_json("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise RemoteError(
                f"{self.url} answered GET /v1/models without a model list: it does not look "
                "like an OpenAI-compatible server. Check the address (the server's own, such "
                "as http://host:8000) and that vLLM, llama-server or folio serve runs there."
            )
        card = data[0]
        self.model_id = str(card.get("id", ""))
        self.context = int(card.get("max_model_len") or 0)
        self._scrape()
        self.has_folio_cache = self._probe(CACHE_PATH)
        if self.settings.kv_events:
            from engine.remote.subscriber import EventSubscriber

            try:
                self.subscriber = EventSubscriber(
                    self.settings.kv_events,
                    self._apply_events,
                    self.settings.kv_events_replay,
                    self.settings.kv_events_topic,
                ).start()
            except ValueError as exc:
                raise RemoteError(str(exc)) from None
        self._publish(force=True)
        self._poller = threading.Thread(target=self._poll, name="folio-remote", daemon=True)
        self._poller.start()
        self.connected_in = time.monotonic() - t0
        return self

    def _get_json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """The JSON `GET path` answers (None for 204 No Content); RemoteError in words."""
        try:
            response = self._client.get(path, params=params)
        except httpx.InvalidURL as exc:
            raise RemoteError(f"{self.url} is not a URL the app can use: {exc}") from None
        except httpx.HTTPError as exc:
            raise RemoteError(
                f"Cannot reach {self.url}: {exc or type(exc).__name__}. Check the address and "
                "port, that the server is running, and that this computer can reach it."
            ) from None
        if response.status_code >= 400:
            raise RemoteError(self._refusal(response, f"GET {path}"))
        if response.status_code == 204:
            return None
        try:
            return response.json()
        except ValueError:
            raise RemoteError(
                f"{self.url} answered GET {path} with something other than JSON "
                f"({response.headers.get('content-type', 'no content type')}): it does not "
                "look like an OpenAI-compatible server. Check the address."
            ) from None

    def _refusal(self, response: httpx.Response, what: str) -> str:
        code = response.status_code
        said = _error_message(response)
        if code in (401, 403):
            ask = (
                "Enter the key the server was started with."
                if self.settings.api_key
                else "It needs an API key: enter it in Settings > Engine."
            )
            return (
                f"{self.url} refused the API key (HTTP {code}{': ' + said if said else ''}). {ask}"
            )
        if code == 404:
            return (
                f"{self.url} has no {what.split(' ', 1)[-1]} (HTTP 404): it does not look like "
                "an OpenAI-compatible server. Check the address (the server's own, such as "
                "http://host:8000)."
            )
        return f"{self.url} answered {what} with HTTP {code}{': ' + said if said else ''}"

    def _probe(self, path: str) -> bool:
        try:
            return self._client.get(path).status_code == 200
        except httpx.HTTPError:
            return False

    # -- the engine's surface -------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._poller is not None and not self._stop.is_set()

    def add_listener(self, listener: Callable[[JobEvent], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[JobEvent], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def submit(self, request: JobRequest) -> JobHandle:
        """Stream a chat from the server. ValueError for what a remote server cannot take
        (token ids, beam search) and RuntimeError once shut down, as `Engine.submit`."""
        if not self.running:
            raise RuntimeError(f"not connected to {self.url}")
        request.validate()
        if request.messages is None:
            raise ValueError("a remote server takes chat messages, not token ids")
        if request.beam_width > 1 or request.grammar is not None:
            raise ValueError("beam search and grammars run on this computer's engine only")
        job_id = next(self._ids)
        handle = JobHandle(job_id, self)  # type: ignore[arg-type] - the same two calls
        job = _RemoteJob(
            job_id, request, handle, [""] * request.n, [""] * request.n, time.monotonic()
        )
        with self._lock:
            self._jobs[job_id] = job
        threading.Thread(
            target=self._stream, args=(job,), name=f"folio-remote-{job_id}", daemon=True
        ).start()
        return handle

    def cancel(self, job_id: int) -> None:
        """Close the job's stream: the server ends the request when its client goes."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            return
        job.cancelled = True
        response = job.response
        if response is not None:
            try:
                response.close()
            except Exception:  # noqa: BLE001 - closing a stream another thread reads
                log.debug("closing a remote stream", exc_info=True)

    def snapshot(self) -> EngineSnapshot:
        snapshot = self._snapshot.read()
        if snapshot is None:
            raise RuntimeError("not connected yet")
        return snapshot

    def server_snapshot(self, after: int | None = None) -> EngineSnapshot | None:
        """A Folio server's own page-table snapshot (`GET /folio/v1/cache`); None when
        it is no newer than version ``after`` (the server answers 204, sending nothing)."""
        data = self._get_json(CACHE_PATH, None if after is None else {"after": after})
        if data is None:
            return None
        try:
            return snapshot_from_json(data, self._tag_of, note=FOLIO_NOTE)
        except (ValueError, KeyError, TypeError) as exc:
            raise RemoteError(f"{self.url}'s cache snapshot could not be read: {exc}") from None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel this app's requests, stop following the server."""
        self._stop.set()
        with self._lock:
            jobs = list(self._jobs)
        for job_id in jobs:
            self.cancel(job_id)
        if self._poller is not None:
            self._poller.join(timeout)
        if self.subscriber is not None:
            self.subscriber.close()
        deadline = time.monotonic() + timeout
        while self._jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        self._client.close()

    # -- one chat, on its own thread ------------------------------------------------------

    def _stream(self, job: _RemoteJob) -> None:
        error, reason = "", ""
        try:
            self._run_stream(job)
        except RemoteError as exc:
            error = str(exc)
        except httpx.HTTPError as exc:
            if not job.cancelled:
                error = f"the connection to {self.url} broke: {exc or type(exc).__name__}"
        except ValueError as exc:
            error = f"{self.url} sent a stream that is not OpenAI's: {exc}"
        except Exception as exc:  # noqa: BLE001 - a request's failure ends that request
            log.exception("remote chat")
            error = f"the request failed: {exc}"
        if error:
            reason = "error"
        elif job.cancelled:
            reason = "cancelled"
        else:
            reason = job.reasons[0] or "stop"
        self._finish(job, reason, error)

    def _run_stream(self, job: _RemoteJob) -> None:
        body = _chat_body(job.request, self.model_id)
        with self._client.stream("POST", "/v1/chat/completions", json=body) as response:
            job.response = response
            if job.cancelled:
                return
            if response.status_code >= 400:
                response.read()
                raise RemoteError(self._refusal(response, "POST /v1/chat/completions"))
            job.state = "running"
            self._emit(job, JobEvent(job.job_id, EventKind.STARTED, tag=job.request.tag))
            for line in response.iter_lines():
                if job.cancelled:
                    return
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                self._chunk(job, json.loads(data))

    def _chunk(self, job: _RemoteJob, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise ValueError(f"a chunk that is not an object: {chunk!r:.80}")
        if "error" in chunk:
            err = chunk["error"]
            raise RemoteError(
                f"{self.url}: {err.get('message', err) if isinstance(err, dict) else err}"
            )
        job.request_id = job.request_id or str(chunk.get("id", ""))
        for choice in chunk.get("choices") or ():
            index = int(choice.get("index", 0))
            if not 0 <= index < len(job.texts):
                continue
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                if not job.first_token:
                    job.first_token = time.monotonic()
                job.texts[index] += text
                job.new_tokens += 1
                self._emit(
                    job,
                    JobEvent(
                        job.job_id, EventKind.STREAMING, index=index, text=text,
                        tag=job.request.tag,
                    ),
                )  # fmt: skip
            if choice.get("finish_reason"):
                job.reasons[index] = str(choice["finish_reason"])
        if isinstance(chunk.get("usage"), dict):
            job.usage = chunk["usage"]

    def _finish(self, job: _RemoteJob, reason: str, error: str) -> None:
        now = time.monotonic()
        usage = job.usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        first = job.first_token or now
        result = JobResult(
            texts=list(job.texts),
            eos_reasons=[r or reason for r in job.reasons],
            eos_reason=reason,
            error=error,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_tokens=int(cached),
            new_tokens=int(usage.get("completion_tokens") or job.new_tokens),
            time_prefill=first - job.submitted,
            time_generate=now - first,
        )
        self.telemetry.log(
            "job_done",
            job=job.job_id,
            tag=job.request.tag,
            eos_reason=reason,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            new_tokens=result.new_tokens,
            time_prefill=result.time_prefill,
            time_generate=result.time_generate,
        )
        with self._lock:
            self._jobs.pop(job.job_id, None)
        self._emit(
            job,
            JobEvent(
                job.job_id, EventKind.DONE, eos=True, eos_reason=reason, result=result,
                tag=job.request.tag,
            ),
        )  # fmt: skip

    def _emit(self, job: _RemoteJob, event: JobEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        job.handle._deliver(event)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener's bug must not end the stream
                log.exception("remote event listener failed")

    # -- following the server -------------------------------------------------------------

    def _apply_events(self, seq: int, events: list[dict[str, Any]]) -> None:
        """The subscriber's thread."""
        with self._pool_lock:
            self.pool.apply(events)

    def _scrape(self) -> None:
        try:
            response = self._client.get("/metrics")
            figures = ServerFigures.parse(response.text) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            figures = None
        self.has_metrics = figures is not None and bool(figures.flavour)
        if not self.has_metrics:
            return
        assert figures is not None
        self.flavour = figures.flavour
        with self._pool_lock:
            if figures.num_blocks:
                self.pool.num_blocks = figures.num_blocks
            if figures.block_size and not self.pool.block_size:
                self.pool.block_size = figures.block_size
            held, num = len(self.pool.blocks), max(self.pool.num_blocks, self.pool._cells)
        self.telemetry.record(step_record(time.monotonic(), self._figures, figures, num, held))
        self._figures = figures

    def _poll(self) -> None:
        next_scrape = time.monotonic() + METRICS_S
        while not self._stop.wait(POLL_S):
            try:
                if self.has_metrics and time.monotonic() >= next_scrape:
                    next_scrape = time.monotonic() + METRICS_S
                    self._scrape()
                self._publish()
            except Exception:  # noqa: BLE001 - the views keep the last snapshot
                log.exception("following %s", self.url)

    def _counters(self) -> dict[str, int]:
        f = self._figures
        if f is None or f.queries is None:
            return {}
        return {"prefix_query_tokens": int(f.queries), "prefix_hit_tokens": int(f.hits or 0)}

    def _our_jobs(self) -> list[JobInfo]:
        with self._lock:
            jobs = list(self._jobs.values())
        return [
            JobInfo(
                job_id=j.job_id,
                tag=j.request.tag,
                state="pending" if j.state == "pending" else "decode",
                prompt_tokens=int(j.usage.get("prompt_tokens") or 0),
                new_tokens=j.new_tokens,
                cached_tokens=0,
                skips=0,
                wait_reason="sent to the server" if j.state == "pending" else "",
                sequences=(),
                pages=0,
            )
            for j in jobs
        ]

    def _tag_of(self, job: dict[str, Any]) -> Any:
        """A Folio server's job as this app tags it: its chat when this app sent it."""
        rid = job.get("request_id")
        if rid:
            with self._lock:
                for ours in self._jobs.values():
                    if ours.request_id == rid:
                        return ours.request.tag
            return ApiTag(rid)
        return job.get("tag")

    def _publish(self, force: bool = False) -> None:
        """A new snapshot when anything the views draw may have moved."""
        jobs = self._our_jobs()
        if self.subscriber is None and self.has_folio_cache:
            try:
                snap = self.server_snapshot(after=self._server_version)
            except RemoteError:
                return
            if snap is None:  # unchanged on the server: nothing sent, nothing to redraw
                return
            self._server_version = snap.version
            key: tuple = (
                "folio",
                snap.version,
                tuple((j.job_id, j.state, j.new_tokens) for j in snap.jobs),
            )
            if key == self._last_state and not force:
                return
            self._last_state = key
            self._snapshot.publish(_with_version(snap, next(self._versions)))
            return
        note = LIMITS if self.subscriber is not None else NO_EVENTS_NOTE
        if not self.has_metrics:
            note += NO_METRICS
        if self.subscriber is not None and self.subscriber.error:
            note = self.subscriber.error + ". " + note
        with self._pool_lock:
            key = (
                "pool",
                self.pool.version,
                self.pool.num_blocks,
                self.telemetry.version,
                tuple((j.job_id, j.state, j.new_tokens) for j in jobs),
                note,
            )
            if key == self._last_state and not force:
                return
            self._last_state = key
            snap = self.pool.snapshot(next(self._versions), self._counters(), jobs, note)
        self._snapshot.publish(snap)


def _with_version(snap: EngineSnapshot, version: int) -> EngineSnapshot:
    from dataclasses import replace

    return replace(snap, version=version)


def _error_message(response: httpx.Response) -> str:
    """The server's own words: OpenAI's {"error": {"message"}}, or the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return str(err)[:300]
    return str(body)[:200]


def _chat_body(request: JobRequest, model: str) -> dict[str, Any]:
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in request.messages or ()],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "n": request.n,
    }
    # Beyond OpenAI's set, sent only when set: vLLM, llama-server and Folio take them.
    if s.top_k:
        body["top_k"] = s.top_k
    if s.min_p:
        body["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.seed is not None:
        body["seed"] = s.seed
    if request.stop_strings:
        body["stop"] = list(request.stop_strings)
    return body
