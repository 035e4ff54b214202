"""`folio serve`: the OpenAI-compatible server on an Engine of its own.

`add_serve_parser(subparsers)` adds the command to `folio`'s parser; `run_serve(args)`
loads the model, starts the engine and serves until Ctrl+C.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engine.cache.kv_cache import CacheSettings
from engine.device import add_device_option
from engine.generator.settings import GeneratorSettings
from engine.model.weight_modes import DEFAULT_WEIGHT_MODE, WEIGHT_MODES
from engine.server.settings import DEFAULT_HOST, DEFAULT_PORT, ServerSettings

API_KEY_ENV = "FOLIO_API_KEY"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)"
    )
    serve.add_argument(
        "--model",
        type=Path,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only)",
    )
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port")
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"required as 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--served-model-name", help="the model id clients send (default: the model's file name)"
    )
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=ServerSettings.max_tokens,
        help="the most new tokens one request may ask for",
    )
    serve.add_argument("--max-body-bytes", type=int, default=ServerSettings.max_body_bytes)
    serve.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default=DEFAULT_WEIGHT_MODE,
        help=f"weight storage (default: {DEFAULT_WEIGHT_MODE}, as the file stores them)",
    )
    add_device_option(serve)
    serve.add_argument("--page-size", type=int, default=256)
    serve.add_argument("--cache-tokens", type=int, default=16384, help="KV-cache size in tokens")
    serve.add_argument(
        "--k-bits",
        type=int,
        help="cached keys: 2..8 bits (quantized), 16 or 32 (fp16, the default, or fp32)",
    )
    serve.add_argument(
        "--v-bits",
        type=int,
        help="cached values: 2..8 bits (quantized), 16 or 32 (fp16, the default, or fp32)",
    )
    serve.add_argument(
        "--max-batch-size",
        type=int,
        default=GeneratorSettings.max_batch_size,
        help="sequences decoded together (n > 1 takes n)",
    )
    from engine.cli.cache import add_disk_cache_options

    add_disk_cache_options(serve)
    serve.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish KV-cache events over ZMQ in vLLM's format, e.g. tcp://127.0.0.1:5557",
    )
    serve.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="--kv-events: a ROUTER socket that replays missed batches, e.g. tcp://127.0.0.1:5558",
    )
    serve.add_argument("--kv-events-topic", default="", help="--kv-events: the ZMQ topic")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return serve


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; bad settings raise ValueError naming the option."""
    from engine.cli.cache import disk_cache_settings
    from engine.cli.notes import slow_start_note
    from engine.engine import Engine
    from engine.model.loader import load_model
    from engine.server.app import serve

    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        model_id=args.served_model_name,
        max_tokens=args.max_tokens,
        max_body_bytes=args.max_body_bytes,
    )
    settings.validate()
    if args.cache_tokens < 1:
        raise ValueError(f"--cache-tokens must be at least 1, got {args.cache_tokens}")
    cache = CacheSettings(
        page_size=args.page_size,
        token_budget=args.cache_tokens,
        k_bits=args.k_bits,
        v_bits=args.v_bits,
        **disk_cache_settings(args),
    )
    generator = GeneratorSettings(max_batch_size=args.max_batch_size)
    generator.validate(cache.page_size)
    path = args.model
    if path is None:
        from engine.model.fetch import ensure_default_model

        path = ensure_default_model()
    loaded = load_model(path, weight_mode=args.weights, device=args.device)

    def ready(url: str) -> None:
        pages = engine.cache.pages
        print(
            f"{loaded.name}: serving {url}/v1 (model id {settings.model_id or loaded.name!r}), "
            f"cache {pages.num_pages * pages.page_size} tokens in {pages.num_pages} pages "
            f"of {pages.page_size}",
            flush=True,
        )

    if args.kv_events_replay and not args.kv_events:
        raise ValueError("--kv-events-replay needs --kv-events")
    publisher = None
    with slow_start_note():
        engine = Engine(loaded, cache, generator)
    with engine:
        if args.kv_events:
            from engine.server.kv_events import publish_engine_events, warn_if_exposed

            publisher = publish_engine_events(
                engine, args.kv_events, args.kv_events_replay, args.kv_events_topic
            )
            warn_if_exposed(args.kv_events)
            replay = publisher.replay_endpoint
            print(
                f"KV-cache events on {publisher.endpoint}"
                + (f", replays on {replay}" if replay else ""),
                flush=True,
            )
        try:
            serve(
                engine,
                settings.host,
                settings.port,
                settings.api_key,
                log_level=args.log_level,
                on_ready=ready,
                model_id=settings.model_id,
                max_tokens=settings.max_tokens,
                max_body_bytes=settings.max_body_bytes,
            )
        except KeyboardInterrupt:
            pass
    if publisher is not None:
        publisher.close()
    return 0
