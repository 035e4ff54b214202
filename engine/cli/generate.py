"""`folio generate`: one prompt, the reply streamed to stdout (or one JSON object).

The prompt is one job on an `Engine`, submitted as the app and `folio chat` submit
theirs: the same generator, sampler and stop handling, so a seed gives the same text
here as there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from engine.cache.kv_cache import DEFAULT_PAGE_SIZE, CacheSettings
from engine.cli.cache import disk_cache_settings
from engine.cli.notes import slow_start_note
from engine.engine import Engine
from engine.generator.job import EventKind, JobRequest, JobResult
from engine.generator.sampler import SamplingSettings
from engine.generator.stops import StopReason
from engine.model.loader import DEFAULT_WEIGHT_MODE, LoadedModel, load_model


def run_generate(args: argparse.Namespace) -> int:
    sampling, max_new_tokens = request_settings(args)
    check_text("the prompt", args.prompt)
    loaded = load_model(
        args.model,
        weight_mode=args.weights or DEFAULT_WEIGHT_MODE,
        batched_weights="off",  # one sequence: no batch would read bf16 batch copies
        device=args.device,
    )
    tok = loaded.tokenizer
    if args.raw or not tok.has_chat_template:
        prompt_ids = tok.encode(args.prompt)
    else:
        prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    request = JobRequest(
        prompt=prompt_ids,
        sampling=sampling,
        max_new_tokens=_max_new_tokens(loaded, len(prompt_ids), max_new_tokens),
    )
    streamed = False
    cache = _cache_for(len(prompt_ids), request.max_new_tokens, disk_cache_settings(args))
    with slow_start_note():
        engine = Engine(loaded, cache)
    with engine:
        handle = engine.submit(request)
        for event in handle.events():
            if not args.json and event.kind is EventKind.STREAMING and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
                streamed = True
    result = handle.result
    assert result is not None
    if result.eos_reason == StopReason.ERROR:
        if streamed:
            sys.stdout.write("\n")  # end the reply's line; the error goes on its own
        raise ValueError(result.error)
    fields = completion_fields(result)
    if args.json:
        fields["load_seconds"] = round(loaded.load_seconds, 3)
        fields["model"] = str(loaded.path)
        print(json.dumps(fields, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if os.environ.get("FOLIO_VERBOSE"):
            print(json.dumps({k: v for k, v in fields.items() if k != "text"}), file=sys.stderr)
    return 0


def request_settings(args: argparse.Namespace) -> tuple[SamplingSettings, int]:
    """The sampling settings and max new tokens of `folio generate` and `folio chat`, checked
    as the engine checks a request, before the model loads: a bad value is refused the same
    way in both commands, and before the wait."""
    sampling = SamplingSettings(temperature=args.temperature, seed=args.seed)
    JobRequest(prompt=[0], sampling=sampling, max_new_tokens=args.max_new_tokens).validate()
    return sampling, args.max_new_tokens


def check_text(what: str, text: str) -> None:
    """Refuse text from the command line that is not UTF-8 (see `utf8_problem`)."""
    problem = utf8_problem(text)
    if problem is not None:
        raise ValueError(f"{what} is not valid UTF-8 ({problem})")


def utf8_problem(text: str) -> str | None:
    """Where ``text`` is not UTF-8, or None. Python hands undecodable bytes of the command
    line and stdin over as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        return f"{byte} at character {exc.start}"
    return None


def completion_fields(result: JobResult) -> dict[str, Any]:
    """The `--json` object of one reply (scripts read these names)."""
    new_tokens = result.new_tokens
    decode_steps = max(new_tokens - 1, 0)
    prefill, generate = result.time_prefill, result.time_generate
    return {
        "text": result.text,
        "token_ids": result.token_ids[0] if result.token_ids else [],
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "disk_pages": result.disk_pages,
        "disk_seconds": round(result.disk_seconds, 4),
        "new_tokens": new_tokens,
        "eos_reason": result.eos_reason,
        "time_prefill": round(prefill, 4),
        "time_generate": round(generate, 4),
        "prefill_tokens_per_s": round(result.prompt_tokens / prefill, 2) if prefill else None,
        "decode_tokens_per_s": (
            round(decode_steps / generate, 2) if generate and decode_steps else None
        ),
    }


def _max_new_tokens(loaded: LoadedModel, prompt_tokens: int, asked: int) -> int:
    """What was asked for, cut to the room the model's context leaves. A prompt that
    fills the context keeps one, so that the generator's check says to shorten it."""
    room = loaded.config.max_position_embeddings - prompt_tokens
    return min(asked, max(room, 1))


def _cache_for(prompt_tokens: int, max_new_tokens: int, disk: dict[str, Any]) -> CacheSettings:
    """A cache of the pages this one job needs, in the app's page size (so the prompt
    is prefilled in the same chunks as there, and its pages on disk are the app's)."""
    ps = DEFAULT_PAGE_SIZE
    pages = -(-(prompt_tokens + max_new_tokens) // ps)
    return CacheSettings(page_size=ps, token_budget=pages * ps, **disk)
