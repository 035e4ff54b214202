"""API jobs between the engine thread and the event loop: each request's events, the
server-sent-event stream, and the cancel when a client goes away.

The engine calls its listeners on its own thread with every job's events. `EventRouter` is
one such listener: it hands each API job's events to the event loop of the request that
waits for them, found by the request id in the job's tag. A request opens its mailbox
before it submits, so no event can come before there is somewhere to put it.

A client that disconnects ends its job at once: Starlette cancels a streaming response
when the connection reports `http.disconnect`, and `ApiJob.close` (always run, in a
`finally`) cancels the job unless it has ended; the engine releases its pages at the
start of its next step. A non-streamed request watches for the disconnect while it waits
(`collect_events`).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.engine import Engine, JobHandle
from engine.generator.job import EventKind, JobEvent, JobRequest
from engine.server import responses
from engine.server.errors import APIError
from engine.server.responses import Head
from engine.server.schemas import APIRequest, Kind
from engine.server.tag import ApiTag
from engine.server.tools import ToolCallStream


class _Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[JobEvent] = asyncio.Queue()

    def put(self, event: JobEvent) -> None:
        """From the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass


class EventRouter:
    """An engine listener that hands API jobs' events to the requests waiting for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[str, _Mailbox] = {}

    def open(self, request_id: str) -> _Mailbox:
        """A mailbox for the job tagged with this request id (in the event loop)."""
        box = _Mailbox(asyncio.get_running_loop())
        with self._lock:
            self._boxes[request_id] = box
        return box

    def close(self, request_id: str) -> None:
        with self._lock:
            self._boxes.pop(request_id, None)

    @property
    def open_requests(self) -> int:
        """Requests still waiting for events (none once every client is answered or gone)."""
        with self._lock:
            return len(self._boxes)

    def __call__(self, event: JobEvent) -> None:
        tag = event.tag
        if not isinstance(tag, ApiTag):
            return
        with self._lock:
            box = self._boxes.get(tag.request_id)
        if box is not None:
            box.put(event)


class ApiJob:
    """One request's job: submitted from a worker thread, its events read in the event
    loop. `close()` must follow `start()`: it cancels the job unless it has ended."""

    def __init__(self, engine: Engine, router: EventRouter, request: JobRequest, request_id: str):
        self.engine = engine
        self.router = router
        self.request_id = request_id
        self.request = replace(request, tag=ApiTag(request_id))
        self.handle: JobHandle | None = None
        self.ended = False
        self._box: _Mailbox | None = None

    async def start(self) -> None:
        """Submit; a request the engine refuses raises APIError (400)."""
        self._box = self.router.open(self.request_id)
        try:
            # The worker thread sets `handle` itself: if this task is cancelled meanwhile,
            # anyio still waits for the thread, and `close` then finds the job to cancel.
            await anyio.to_thread.run_sync(self._submit)
        except ValueError as exc:
            self.router.close(self.request_id)
            raise APIError(400, str(exc), code="refused_by_engine") from None
        except RuntimeError as exc:  # the engine is shut down
            self.router.close(self.request_id)
            raise APIError(503, str(exc), code="engine_stopped") from None
        except BaseException:
            self.close()
            raise

    def _submit(self) -> None:
        self.handle = self.engine.submit(self.request)

    async def events(self) -> AsyncIterator[JobEvent]:
        """The job's events, ending with its last (eos) one."""
        assert self._box is not None
        while not self.ended:
            event = await self._box.queue.get()
            if event.eos:
                self.ended = True
            yield event

    def close(self) -> None:
        """Cancel the job if it is still running (its client left) and stop routing."""
        if self.handle is not None and not self.ended:
            self.engine.cancel(self.handle.job_id)
        self.router.close(self.request_id)


async def collect_events(job: ApiJob, receive: Receive) -> list[JobEvent] | None:
    """Every event of a job, or None if the client disconnected first."""
    events: list[JobEvent] = []
    gone = False
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        async for event in job.events():
            events.append(event)
        group.cancel_scope.cancel()
    return None if gone else events


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


async def stream_chunks(
    job: ApiJob, api: APIRequest, head: Head, tokenizer: Any
) -> AsyncIterator[bytes]:
    """The events of a job as OpenAI stream chunks: per choice its text as it comes and a
    chunk with its finish reason; then usage if asked; then `data: [DONE]`. With tools, a
    choice's calls are held back until whole and go out as one `delta.tool_calls` chunk
    before its finish reason (`ToolCallStream`)."""
    if api.kind is Kind.CHAT:
        for i in range(api.job.n):
            yield sse(responses.chunk(head, i, "", role=True))
    finished: set[int] = set()
    offsets: dict[int, int] = defaultdict(int)
    calls = {i: ToolCallStream(api.tools) for i in range(api.job.n)} if api.tools else None
    async for event in job.events():
        if event.kind is EventKind.STREAMING:
            i = event.index
            entries = event.logprobs if api.logprobs is not None else None
            text = calls[i].feed(event.text) if calls else event.text
            if text or entries:
                if api.kind is Kind.CHAT:
                    logprobs = responses.chat_logprobs(entries, tokenizer)
                else:
                    logprobs = responses.completion_logprobs(entries, tokenizer, offsets[i])
                    # Offsets count the tokens' own texts, as the whole response does: the
                    # text released so far lags them while stop handling holds text back.
                    offsets[i] += sum(map(len, logprobs["tokens"])) if logprobs else 0
                yield sse(responses.chunk(head, i, text, logprobs=logprobs))
            if event.finished:
                finished.add(i)
                for piece in _closing(head, i, event.finished, calls):
                    yield piece
        elif event.eos:
            result = event.result
            assert result is not None
            error = responses.job_error(result)
            if error is not None:
                yield sse(error.body())
                break
            for i, reason in enumerate(result.eos_reasons):
                if i not in finished:
                    for piece in _closing(head, i, reason, calls):
                        yield piece
            if api.include_usage:
                yield sse(responses.usage_chunk(head, result))
    yield sse("[DONE]")


def _closing(
    head: Head, index: int, reason: str, calls: dict[int, ToolCallStream] | None
) -> list[bytes]:
    """A choice's last chunks: with tools, the text held back and its calls; then the
    finish reason ("tool_calls" when it called any)."""
    out = []
    made: list = []
    if calls is not None:
        rest, made = calls[index].finish()
        if rest:
            out.append(sse(responses.chunk(head, index, rest)))
        if made:
            out.append(sse(responses.chunk(head, index, tool_calls=made)))
    finish = responses.finish_reason(reason, bool(made))
    out.append(sse(responses.chunk(head, index, finish=finish)))
    return out


class EventStreamResponse(StreamingResponse):
    """A server-sent-event stream of one job that cancels the job however it ends:
    finished, the client gone (Starlette cancels the stream), or a failure."""

    media_type = "text/event-stream"

    def __init__(self, job: ApiJob, chunks: AsyncIterator[bytes]):
        super().__init__(chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
