"""The OpenAI-compatible HTTP server on an Engine: the Starlette app, `serve` (uvicorn in
the foreground, for `folio serve`) and `Server` (uvicorn on a background thread, for tests
and the app).

The server does not own the engine: API jobs are submitted next to whatever else runs on
it (the app's chats), share its prefix cache and show in its snapshots, tagged `ApiTag`.

Routes: GET /health (never needs the key), GET /metrics, GET /v1/models,
GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions, and Folio's own
GET /folio/v1/cache (the page table's snapshot as JSON). With an API key
every route but /health wants `Authorization: Bearer KEY`, compared in constant time.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.engine import Engine
from engine.remote.wire import snapshot_json
from engine.server import responses
from engine.server.errors import (
    APIError,
    api_error_handler,
    client_gone_handler,
    http_error_handler,
    internal_error_handler,
)
from engine.server.metrics import CONTENT_TYPE, Metrics
from engine.server.responses import Head
from engine.server.schemas import APIRequest, Kind, ModelLimits, parse_chat, parse_completion
from engine.server.settings import (  # noqa: F401 - also imported from here
    DEFAULT_HOST,
    DEFAULT_PORT,
    ServerSettings,
    exposure_warning,
    is_loopback,
)
from engine.server.streaming import (
    ApiJob,
    EventRouter,
    EventStreamResponse,
    collect_events,
    stream_chunks,
)

log = logging.getLogger(__name__)


class _State:
    """What the routes share."""

    def __init__(self, engine: Engine, settings: ServerSettings):
        loaded = engine.loaded
        self.engine = engine
        self.settings = settings
        self.tokenizer = loaded.tokenizer
        self.limits = ModelLimits(
            model_id=settings.model_id or loaded.name,
            context=loaded.config.max_position_embeddings,
            vocab_size=loaded.config.vocab_size,
            page_size=engine.cache.page_size,
            num_pages=engine.cache.num_pages,
            max_batch_size=engine.generator.settings.max_batch_size,
            max_tokens=settings.max_tokens,
        )
        self.fingerprint = "folio-" + loaded.fingerprint[:16]
        self.created = int(time.time())
        self.router = EventRouter()
        self.metrics = Metrics(engine, self.limits.model_id)


def build_app(engine: Engine, settings: ServerSettings | None = None) -> Starlette:
    """The ASGI app serving `engine` (which the caller starts and shuts down)."""
    settings = settings or ServerSettings()
    settings.validate()
    state = _State(engine, settings)
    routes = _Routes(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.add_listener(state.router)
        engine.add_listener(state.metrics)
        try:
            yield
        finally:
            engine.remove_listener(state.router)
            engine.remove_listener(state.metrics)

    middleware = (
        [Middleware(APIKeyMiddleware, api_key=settings.api_key)] if settings.api_key else []
    )
    app = Starlette(
        routes=[
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
            Route("/v1/chat/completions", routes.chat, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/folio/v1/cache", routes.cache, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_error_handler,
            ClientDisconnect: client_gone_handler,
            Exception: internal_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.folio = state
    return app


class APIKeyMiddleware:
    """Every route but /health wants `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # Header values arrive decoded as latin-1: encoding them back gives the bytes sent.
        given = token.strip().encode("latin-1", "replace")
        if scheme.lower() == "bearer" and hmac.compare_digest(given, self.key):
            await self.app(scope, receive, send)
            return
        message = (
            "an API key is required: send the header Authorization: Bearer <key>"
            if not token
            else "the API key is not the server's: check the key the server was started with"
        )
        error = APIError(
            401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error.response()(scope, receive, send)


class _Routes:
    def __init__(self, state: _State):
        self.state = state

    async def health(self, request: Request) -> Response:
        if not self.state.engine.running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        body = await anyio.to_thread.run_sync(self.state.metrics.exposition)
        return Response(body, media_type=CONTENT_TYPE)

    async def cache(self, request: Request) -> Response:
        """Folio's own: the page table's latest snapshot (engine.remote.wire), for a Folio
        app that draws this server's memory; `?after=VERSION`: 204 when it is no newer."""
        snap = self.state.engine.snapshot()
        after = request.query_params.get("after", "")
        if after.isdigit() and snap.version <= int(after):
            return Response(status_code=204)  # nothing new since the client's copy
        return JSONResponse(await anyio.to_thread.run_sync(snapshot_json, snap))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.state.limits.model_id:
            raise APIError(
                404,
                f"the model {model_id[:200]!r} does not exist here: this server serves "
                f"{self.state.limits.model_id!r}",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        limits = self.state.limits
        return {
            "id": limits.model_id,
            "object": "model",
            "created": self.state.created,
            "owned_by": "folio",
            "max_model_len": limits.context,
        }

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, Kind.CHAT, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, Kind.COMPLETION, parse_completion)

    async def _complete(
        self, request: Request, kind: Kind, parse: Callable[..., APIRequest]
    ) -> Response:
        state = self.state
        body = await read_json(request, state.settings.max_body_bytes)
        # Tokenizing (the chat template, a long prompt) is CPU work: off the event loop.
        api = await anyio.to_thread.run_sync(parse, body, state.limits, state.tokenizer)
        prefix = "chatcmpl-" if kind is Kind.CHAT else "cmpl-"
        request_id = prefix + uuid.uuid4().hex
        head = Head(kind, request_id, int(time.time()), state.limits.model_id, state.fingerprint)
        job = ApiJob(state.engine, state.router, api.job, request_id)
        await job.start()
        if api.stream:
            return EventStreamResponse(job, stream_chunks(job, api, head, state.tokenizer))
        try:
            events = await collect_events(job, request.receive)
        finally:
            job.close()
        if events is None:  # the client has gone: nobody reads this
            return Response(status_code=499)
        result = events[-1].result
        assert result is not None
        error = responses.job_error(result)
        if error is not None:
            raise error
        asked = api.logprobs is not None
        reply = responses.completion(head, result, asked, state.tokenizer, api.tools)
        return JSONResponse(reply)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, read no further than `limit` bytes."""
    too_large = APIError(
        413,
        f"the request body exceeds {limit:,} bytes: send a shorter one, or start the server "
        "with a larger --max-body-bytes",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise APIError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError(
            400,
            f"the request body must be a JSON object, got {type(body).__name__}",
            code="invalid_json",
        )
    return body


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


# -- running it ----------------------------------------------------------------------------


def _uvicorn_server(app: Starlette, settings: ServerSettings, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http="h11",
        loop="asyncio",
        lifespan="on",
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
    )
    return uvicorn.Server(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(
    engine: Engine,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    *,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
    **settings: Any,
) -> None:
    """Serve `engine` in this thread until interrupted (Ctrl+C, SIGTERM). `on_ready` gets
    the server's URL once it listens. `settings`: the other `ServerSettings` fields."""
    config = ServerSettings(host=host, port=port, api_key=api_key, **settings)
    Server(engine, config, log_level=log_level).run(on_ready)


class Server:
    """The server on an engine it does not own. `run()` serves in the calling thread;
    `start()` on a background thread, returning once it listens, and `stop()` closes it
    (the engine keeps running). A context manager does start and stop."""

    def __init__(
        self, engine: Engine, settings: ServerSettings | None = None, log_level: str = "warning"
    ):
        self.settings = settings or ServerSettings(port=0)
        self.app = build_app(engine, self.settings)
        self._uvicorn = _uvicorn_server(self.app, self.settings, log_level)
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        """The base URL clients use (the OpenAI client's base_url is this + "/v1")."""
        assert self.port is not None, "the server has not started"
        return _url(self.settings.host, self.port)

    def run(self, on_ready: Callable[[str], None] | None = None) -> None:
        sock = self._listen()
        if on_ready is not None:
            on_ready(self.url)
        self._uvicorn.run(sockets=[sock])

    def start(self, timeout: float = 30.0) -> Server:
        sock = self._listen()
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [sock]}, name="folio-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._uvicorn.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the server did not stop within {timeout} s")
        self._thread = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _listen(self) -> socket.socket:
        """Bind here, so that port 0 is resolved before uvicorn starts (and say so when
        the address is reachable from elsewhere without a key)."""
        warning = exposure_warning(self.settings)
        if warning:
            log.warning(warning)
        sock = _bind(self.settings.host, self.settings.port)
        self.port = sock.getsockname()[1]
        return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"
