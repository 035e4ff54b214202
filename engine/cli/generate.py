"""`folio generate`: one prompt, the reply streamed to stdout (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def run_generate(args: argparse.Namespace) -> int:
    from engine.generate import Completion, generate
    from engine.model.loader import DEFAULT_WEIGHT_MODE, load_model

    loaded = load_model(
        args.model,
        weight_mode=args.weights or DEFAULT_WEIGHT_MODE,
        batched_weights="off",  # one sequence: no batch would read bf16 batch copies
    )
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
            print(
                json.dumps({k: v for k, v in completion.as_dict().items() if k != "text"}),
                file=sys.stderr,
            )
    return 0
