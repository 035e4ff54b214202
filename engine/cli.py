"""`folio` on the command line: generate, models, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_USAGE = 2
EXIT_FAILED = 1


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Run quantized language models locally.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt, streaming the reply to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--model", type=Path, help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--weights", choices=("int4", "dequant"), default=None, help="weight storage (default: int4)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    models = sub.add_parser("models", help="manage models")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("fetch-default", help="make sure the default model is on disk and print its path")

    bench = sub.add_parser("bench", help="benchmarks (JSON lines)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    fwd = bsub.add_parser("forward", help="prefill and decode speed, Folio vs transformers")
    fwd.add_argument("--model", type=Path)
    fwd.add_argument("--prefill-tokens", type=int, default=512)
    fwd.add_argument("--decode-tokens", type=int, default=64)
    fwd.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each figure is the best")
    fwd.add_argument("--skip-transformers", action="store_true")
    cache = bsub.add_parser("cache", help="page table and cache storage speed, KV bytes per token")
    cache.add_argument("--pages", type=int, default=4096)
    cache.add_argument("--page-size", type=int, default=16)
    cache.add_argument("--rounds", type=int, default=20)
    cache.add_argument("--tier-pages", type=int, default=8)
    kvq = bsub.add_parser("kv-quant", help="perplexity per KV-cache format (pydoc_data.topics text)")
    kvq.add_argument("--model", type=Path)
    kvq.add_argument("--tokens", type=int, default=4096)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "models":
            return _models(args)
        if args.command == "bench":
            if args.bench_command == "cache":
                from engine.bench_cache import run_cache_bench

                run_cache_bench(args)
            elif args.bench_command == "kv-quant":
                from engine.perplexity import run_kv_quant_bench

                run_kv_quant_bench(args)
            else:
                from engine.bench import run_forward_bench

                run_forward_bench(args)
            return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_USAGE


def _model_path(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    from engine.model.fetch import ensure_default_model

    return ensure_default_model()


def _generate(args: argparse.Namespace) -> int:
    from engine.generate import Completion, generate
    from engine.model.loader import DEFAULT_WEIGHT_MODE, load_model

    loaded = load_model(_model_path(args.model), weight_mode=args.weights or DEFAULT_WEIGHT_MODE)
    tok = loaded.tokenizer
    if args.raw or not tok.has_chat_template:
        prompt_ids = tok.encode(args.prompt)
    else:
        prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    completion = Completion()
    stream = generate(
        loaded,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        completion=completion,
    )
    if args.json:
        for _ in stream:
            pass
        result = completion.as_dict()
        result["load_seconds"] = round(loaded.load_seconds, 3)
        result["model"] = str(loaded.path)
        print(json.dumps(result, ensure_ascii=False))
    else:
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if os.environ.get("FOLIO_VERBOSE"):
            print(json.dumps({k: v for k, v in completion.as_dict().items() if k != "text"}), file=sys.stderr)
    return 0


def _models(args: argparse.Namespace) -> int:
    if args.models_command == "fetch-default":
        from engine.model.fetch import ensure_default_model

        print(ensure_default_model())
        return 0
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
