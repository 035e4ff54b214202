"""`folio`'s command line: generate, chat, models, bench.

The parser also knows `folio` alone and `folio app`, so that `folio --help` lists the
desktop app; starting it is `folio/main.py`'s job, because the engine never imports the
GUI. `parse_args` reads a command line, `run` carries out every command but the app.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from pathlib import Path

from engine.device import add_device_option
from engine.model.weight_modes import DEFAULT_WEIGHT_MODE, WEIGHT_MODES

EXIT_USAGE = 2
EXIT_FAILED = 1

# Every character str.splitlines() breaks at, so that an error naming what the user typed
# (a path, a prompt) stays on one line: scripts read the last line of stderr.
_LINE_BREAKS = {c: repr(chr(c))[1:-1] for c in (10, 11, 12, 13, 28, 29, 30, 0x85, 0x2028, 0x2029)}


def one_line(message: str) -> str:
    """``message`` with its line breaks escaped."""
    return message.translate(_LINE_BREAKS)


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other error of the command line."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="folio", description="Run quantized language models locally.")
    # `folio --smoke-test` (what the launchers check) = `folio app --smoke-test`. Its own dest:
    # the `app` subparser's default would overwrite a shared one.
    parser.add_argument(
        "--smoke-test",
        dest="top_smoke_test",
        action="store_true",
        help="the desktop app: start, load, run briefly, exit (0 = fine)",
    )
    sub = parser.add_subparsers(dest="command")  # no command: the desktop app
    app = sub.add_parser("app", help="the desktop app (also what `folio` alone starts)")
    app.add_argument("--smoke-test", action="store_true", help="start, load, run briefly, exit")

    gen = sub.add_parser("generate", help="answer one prompt, streaming the reply to stdout")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model",
        type=Path,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--seed", type=int)
    gen.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default=None,
        help=f"weight storage (default: {DEFAULT_WEIGHT_MODE}, as the file stores them)",
    )
    add_device_option(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming text"
    )
    from engine.cli.cache import add_cache_parser, add_disk_cache_options

    add_disk_cache_options(gen)

    chat = sub.add_parser(
        "chat", help="an interactive chat in the terminal (/stats, /reset, /quit)"
    )
    chat.add_argument(
        "--model",
        type=Path,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--max-new-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--seed", type=int)
    add_device_option(chat)
    _add_cache_options(chat)
    add_disk_cache_options(chat)
    add_cache_parser(sub)

    from engine.cli.models import add_models_parser

    add_models_parser(sub)

    from engine.server.cli import add_serve_parser

    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (JSON lines)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    fwd = bsub.add_parser("forward", help="prefill and decode speed, Folio vs transformers")
    fwd.add_argument("--model", type=Path)
    fwd.add_argument("--prefill-tokens", type=int, default=512)
    fwd.add_argument("--decode-tokens", type=int, default=64)
    fwd.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds, each figure the best (default 3; --shape, --llama-cpp: 1, "
        "Folio and llama.cpp in turns)",
    )
    fwd.add_argument("--skip-transformers", action="store_true")
    fwd.add_argument(
        "--shape",
        choices=(
            "llama-3.2-1b",
            "qwen2.5-3b",
            "qwen2-7b",
            "llama-3.1-8b",
            "gemma3-270m",
            "tiny-llama",
            "tiny-qwen2",
        ),
        help="a random-weight GGUF with this real model's shapes and tensor types "
        "(written once, cached): load, RSS, prefill, decode, S_TG, GB/s",
    )
    fwd.add_argument("--quant", choices=("q4_k_m", "q4_0", "q8_0"), default="q4_k_m")
    fwd.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        help="only this weight mode (default: every mode; --shape, --llama-cpp: "
        f"{DEFAULT_WEIGHT_MODE})",
    )
    add_device_option(fwd)
    fwd.add_argument("--threads", type=int, help="threads for both engines (default: torch's)")
    fwd.add_argument(
        "--tg", type=int, default=128, help="--shape, --llama-cpp: generated tokens per S_TG case"
    )
    fwd.add_argument(
        "--prompt-tokens",
        type=int,
        default=512,
        help="--shape, --llama-cpp: the prompt prefill is timed on",
    )
    fwd.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[4, 16],
        help="--shape, --llama-cpp: S_TG batch sizes",
    )
    fwd.add_argument(
        "--kv-bits",
        type=int,
        choices=(16, 32),
        help="--shape, --llama-cpp: K/V pages in fp16 (the default) or fp32",
    )
    fwd.add_argument(
        "--llama-cpp",
        type=Path,
        help="a folder with llama-bench and llama-batched-bench, run on the same file: the "
        "--shape file, or else --model (a GGUF; default: the default model), with the "
        "--shape options",
    )
    cache = bsub.add_parser("cache", help="page table and cache storage speed, KV bytes per token")
    cache.add_argument("--pages", type=int, default=4096)
    cache.add_argument("--page-size", type=int, default=16)
    cache.add_argument("--rounds", type=int, default=20)
    cache.add_argument("--tier-pages", type=int, default=8)
    batched = bsub.add_parser(
        "batched", help="llama-batched-bench's table: PP x TG x B, shared prompt or not"
    )
    batched.add_argument("--model", type=Path)
    batched.add_argument(
        "--quick", action="store_true", help="a subset that runs in under two minutes"
    )
    batched.add_argument("--json", action="store_true", help="one JSON object per line")
    add_device_option(batched)
    batched.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        default="on",
        help="on a GPU: decode steps replayed from CUDA graphs (off: run eagerly)",
    )
    batched.add_argument("--pp", type=int, nargs="+", default=[128, 512])
    batched.add_argument("--tg", type=int, nargs="+", default=[32, 128])
    batched.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    batched.add_argument("--skip-transformers", action="store_true")
    batched.add_argument(
        "--batched-weights",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 copies for decode batches of 12+ sequences; with auto, those also run without them, side by side",
    )
    serve = bsub.add_parser(
        "serve", help="requests arriving over time, groups sharing system prompts"
    )
    serve.add_argument("--model", type=Path)
    serve.add_argument("--requests", type=int, default=64)
    serve.add_argument("--groups", type=int, default=8)
    serve.add_argument("--system-tokens", type=int, default=1024)
    serve.add_argument("--new-tokens", type=int, default=32)
    serve.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second")
    serve.add_argument("--cache-tokens", type=int, default=12288)
    serve.add_argument(
        "--tiers",
        action="store_true",
        help="instead: the workload with a host tier of --host-mb, then with a disk tier too",
    )
    serve.add_argument("--host-mb", type=int, default=256, help="--tiers: the host tier's size")
    serve.add_argument(
        "--http",
        action="store_true",
        help="instead: the workload over HTTP, streaming clients against folio serve (or --url)",
    )
    serve.add_argument("--url", help="--http: the server to drive, instead of starting folio serve")
    serve.add_argument("--api-key", help="--http: the key --url wants")
    serve.add_argument(
        "--threads", type=int, help="--http: threads for both servers (default: each its own)"
    )
    serve.add_argument(
        "--llama-server",
        type=Path,
        metavar="PATH",
        help="--http: also llama.cpp's llama-server binary on the same --model GGUF and prompts",
    )
    serve.add_argument("--json", action="store_true")
    kvq = bsub.add_parser(
        "kv-quant", help="perplexity per KV-cache format (pydoc_data.topics text)"
    )
    kvq.add_argument("--model", type=Path)
    kvq.add_argument("--tokens", type=int, default=4096)
    kvq.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default=DEFAULT_WEIGHT_MODE,
        help="weight mode of the model (each record names it)",
    )
    grammar = bsub.add_parser(
        "grammar",
        help="constrained decoding: per-token mask time per library at a 150k vocabulary",
    )
    grammar.add_argument("--vocab", type=int, default=150_000, help="vocabulary size")
    grammar.add_argument("--rounds", type=int, default=3, help="walks per schema; the best")
    grammar.add_argument(
        "--libraries",
        nargs="+",
        choices=("llguidance", "xgrammar", "outlines-core"),
        help="default: every one installed",
    )
    restore = bsub.add_parser(
        "restore",
        help="time to first token after a restart: a long chat read back from disk vs prefilled",
    )
    restore.add_argument("--model", type=Path, help="a .gguf file (default: SmolLM2-135M)")
    restore.add_argument(
        "--shape",
        choices=("llama-3.2-1b", "qwen2.5-3b", "qwen2-7b", "llama-3.1-8b", "tiny-llama"),
        help="a random-weight GGUF with this real model's shapes and types instead",
    )
    restore.add_argument("--quant", choices=("q4_k_m", "q4_0", "q8_0"), default="q4_k_m")
    restore.add_argument("--tokens", type=int, default=4000, help="the conversation's length")
    restore.add_argument(
        "--page-size",
        type=int,
        default=32,
        help="tokens per page (32, the app's default: the last, partial page is recomputed)",
    )
    restore.add_argument("--seed", type=int, default=0)
    restore.add_argument("--weights", choices=WEIGHT_MODES, default=DEFAULT_WEIGHT_MODE)
    load = bsub.add_parser(
        "load",
        help="300 random jobs from 4 threads, cancels, a small cache: every job must end cleanly",
    )
    load.add_argument("--model", type=Path)
    load.add_argument("--jobs", type=int, default=300)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--cache-tokens", type=int, default=1024)
    load.add_argument("--tight-reader", action="store_true", help="also poll snapshot() nonstop")
    load.add_argument("--json", action="store_true")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as a namespace; argparse exits with a usage message on bad input."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.top_smoke_test and args.command not in (None, "app"):
        parser.error("--smoke-test applies to the desktop app only")
    return args


def starts_app(args: argparse.Namespace) -> bool:
    """`folio` alone or `folio app`: the desktop app, which the engine does not start."""
    return args.command in (None, "app")


def app_argv(args: argparse.Namespace) -> list[str]:
    """The desktop app's own arguments for a command line that starts it."""
    return ["--smoke-test"] if args.top_smoke_test or getattr(args, "smoke_test", False) else []


def run(args: argparse.Namespace) -> int:
    """Carry out one command (not the app); the process exit status."""
    if starts_app(args):
        raise ValueError(
            "the desktop app is started by folio.main, not by the engine's command line"
        )
    try:
        # Before the model is read or fetched: fail fast. Only commands that run a model
        # (add_device_option); `models files --device` names where a download's fit is
        # priced, a GPU this machine may not have.
        if getattr(args, "resolve_device", False):
            from engine.device import resolve_device

            args.device = resolve_device(args.device)
        if args.command in ("generate", "chat", "bench", "serve") and hasattr(args, "model"):
            args.model = model_path(args.model)
        if args.command == "generate":
            from engine.cli.generate import run_generate

            return run_generate(args)
        if args.command == "models":
            from engine.cli.models import run_models

            return run_models(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "cache":
            from engine.cli.cache import run_cache

            return run_cache(args)
        if args.command == "serve":
            from engine.server.cli import run_serve

            return run_serve(args)
        if args.command == "bench":
            _bench(args)
            return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:
        print(f"folio: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_USAGE


def _bench(args: argparse.Namespace) -> None:
    if args.bench_command == "cache":
        from engine.bench.cache import run_cache_bench

        run_cache_bench(args)
    elif args.bench_command == "batched":
        from engine.bench.batched import run_batched_bench

        run_batched_bench(args)
    elif args.bench_command == "serve" and args.http:
        from engine.bench.http_serve import run_http_serve_bench

        run_http_serve_bench(args)
    elif args.bench_command == "serve":
        from engine.bench.batched import run_serve_bench

        run_serve_bench(args)
    elif args.bench_command == "grammar":
        from engine.bench.grammar import run_grammar_bench

        run_grammar_bench(args)
    elif args.bench_command == "restore":
        from engine.bench.restore import run_restore_bench

        run_restore_bench(args)
    elif args.bench_command == "load":
        from engine.bench.load import run_load_bench

        run_load_bench(args)
    elif args.bench_command == "kv-quant":
        from engine.bench.kv_quant import run_kv_quant_bench

        run_kv_quant_bench(args)
    elif getattr(args, "shape", None):
        from engine.bench.real_shapes import run_shape_bench

        run_shape_bench(args)
    elif getattr(args, "llama_cpp", None):
        from engine.bench.real_shapes import run_file_bench

        run_file_bench(args)
    else:
        from engine.bench.forward import run_forward_bench

        run_forward_bench(args)


def _add_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=16384, help="KV-cache size in tokens")
    parser.add_argument(
        "--k-bits",
        type=int,
        help="cached keys: 2..8 bits (quantized), 16 or 32 (fp16, the default, or fp32)",
    )
    parser.add_argument(
        "--v-bits",
        type=int,
        help="cached values: 2..8 bits (quantized), 16 or 32 (fp16, the default, or fp32)",
    )


def _chat(args: argparse.Namespace) -> int:
    from engine.cli.chat import run_chat
    from engine.cli.generate import check_text, request_settings
    from engine.cli.notes import slow_start_note
    from engine.engine import Engine
    from engine.model.loader import load_model

    sampling, max_new_tokens = request_settings(args)
    if args.system is not None:
        check_text("the system prompt", args.system)
    if args.cache_tokens < 1:
        raise ValueError(f"--cache-tokens must be at least 1, got {args.cache_tokens}")
    # one conversation decodes one sequence: no batch would read bf16 batch copies
    loaded = load_model(args.model, batched_weights="off", device=args.device)
    if not loaded.tokenizer.has_chat_template:
        raise ValueError(
            f"{loaded.path.name} has no chat template: use `folio generate --raw` instead"
        )
    # A template that cannot render fails every turn: say so now, once, and exit.
    probe = [{"role": "system", "content": args.system}] if args.system else []
    loaded.tokenizer.encode_chat([*probe, {"role": "user", "content": "Hello."}])
    with slow_start_note():
        engine = Engine(loaded, _cache_settings(args, loaded))
    with engine:
        pages = engine.cache.pages
        print(
            f"{loaded.path.name}: {loaded.config.arch}, cache {pages.num_pages * pages.page_size} "
            f"tokens in {pages.num_pages} page{'s' if pages.num_pages != 1 else ''} of {pages.page_size}"
        )
        if isinstance(sys.stdin, io.TextIOWrapper):
            # undecodable bytes reach run_chat as lone surrogates, which it refuses line by line
            sys.stdin.reconfigure(errors="surrogateescape")
        run_chat(engine, sys.stdin, sys.stdout, args.system, sampling, max_new_tokens)
    return 0


def _cache_settings(args: argparse.Namespace, loaded):
    """The cache `folio chat` asks for, refused with the sizes when memory cannot hold it
    (allocating it would fail deep in torch, or have the system kill the process)."""
    from engine.cache.kv_cache import CacheSettings
    from engine.cli.cache import disk_cache_settings
    from engine.hub.fit import free_memory, kv_bytes_per_token

    cache = CacheSettings(
        page_size=args.page_size,
        token_budget=args.cache_tokens,
        k_bits=args.k_bits,
        v_bits=args.v_bits,
        **disk_cache_settings(args),
    )
    cfg = loaded.config
    tokens = -(-args.cache_tokens // cache.page_size) * cache.page_size
    need = tokens * kv_bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.k_bits, args.v_bits
    )
    free = free_memory(loaded.device.type)
    if free is not None and need > free:
        raise ValueError(
            f"a KV cache of {tokens:,} tokens needs {need / 1e9:,.1f} GB but {free / 1e9:.1f} GB "
            "are free: choose a smaller --cache-tokens"
        )
    return cache


def model_path(arg: Path | None) -> Path:
    """The model a command names, else the default model (fetched on first use)."""
    if arg is not None:
        _check_model_path(arg)
        return arg
    from engine.model.fetch import ensure_default_model

    return ensure_default_model()


def _check_model_path(path: Path) -> None:
    """Errors the loader would report as a missing file, named for what they are."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path}: a loop of symbolic links, not a model file") from None
        if exc.errno == errno.ENOENT and path.is_symlink():
            target = os.readlink(path)
            raise ValueError(f"{path}: a symbolic link to {target}, which does not exist") from None
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
