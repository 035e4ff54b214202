"""The command-line contract that scripts rely on (`folio generate`, `folio models fetch-default`)."""

from __future__ import annotations

import json

import pytest

from engine.cache.kv_cache import CacheSettings
from engine.engine import Engine
from engine.generator.job import EventKind, JobRequest
from engine.generator.sampler import SamplingSettings
from engine.model.loader import load_model
from folio.main import main

pytestmark = pytest.mark.slow


def test_generate_json_contract(smollm2_path, smollm2_int4, capsys):
    code = main(
        [
            "generate",
            "Name a colour.",
            "--model",
            str(smollm2_path),
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "text",
        "token_ids",
        "prompt_tokens",
        "cached_tokens",
        "new_tokens",
        "eos_reason",
        "time_prefill",
        "time_generate",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "load_seconds",
        "model",
    ):
        assert key in out, key
    tok = smollm2_int4.tokenizer
    assert out["prompt_tokens"] == len(
        tok.encode_chat([{"role": "user", "content": "Name a colour."}])
    )
    assert out["new_tokens"] == len(out["token_ids"]) <= 12
    assert out["cached_tokens"] == 0
    if out["eos_reason"] == "stop_token":
        assert out["token_ids"][-1] in tok.eos_token_ids
    else:
        assert out["eos_reason"] == "max_new_tokens" and out["new_tokens"] == 12
    assert out["text"] == tok.decode([t for t in out["token_ids"] if t not in tok.eos_token_ids])


def test_generate_streams_text_and_is_reproducible(smollm2_path, capsys):
    args = [
        "generate",
        "Tell me a fact about owls.",
        "--model",
        str(smollm2_path),
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.8",
        "--seed",
        "7",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.strip()
    assert main([*args[:-1], "8"]) == 0  # another seed: (almost surely) another reply
    assert capsys.readouterr().out != first


def test_greedy_temperature_zero_is_deterministic(smollm2_path, capsys):
    args = [
        "generate",
        "Count to five.",
        "--model",
        str(smollm2_path),
        "--max-new-tokens",
        "10",
        "--temperature",
        "0",
        "--json",
    ]
    main(args)
    a = json.loads(capsys.readouterr().out)["token_ids"]
    main([*args, "--seed", "123"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == a


def test_fetch_default_prints_path(smollm2_path, capsys):
    assert main(["models", "fetch-default"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_path)


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "hi", "--model", str(tmp_path / "none.gguf")]) == 1
    err = capsys.readouterr().err
    assert "no such model" in err and "none.gguf" in err


def test_prompt_longer_than_context(smollm2_int4):
    limit = smollm2_int4.config.max_position_embeddings
    engine = Engine(smollm2_int4, CacheSettings(page_size=16, token_budget=64))
    with pytest.raises(
        ValueError, match=f"{limit + 5} tokens but the model's context holds {limit}"
    ):
        engine.submit(JobRequest(prompt=[1] * (limit + 5), max_new_tokens=4))


def test_generate_gives_the_text_of_an_app_job_with_the_same_seed(smollm2_path, capsys):
    """`folio generate` is one job on the app's generator: a chat message submitted to
    an Engine as the app submits it, with the same sampling settings, streams the same
    text and ends for the same reason."""
    prompt, seed = "Tell me a fact about owls.", 7
    assert (
        main(
            [
                "generate",
                prompt,
                "--model",
                str(smollm2_path),
                "--max-new-tokens",
                "24",
                "--temperature",
                "0.8",
                "--seed",
                str(seed),
                "--json",
            ]
        )
        == 0
    )
    cli = json.loads(capsys.readouterr().out)
    loaded = load_model(smollm2_path, batched_weights="off")  # as `folio generate` loads it
    request = JobRequest(
        messages=[{"role": "user", "content": prompt}],
        sampling=SamplingSettings(temperature=0.8, seed=seed),
        max_new_tokens=24,
    )
    with Engine(loaded, CacheSettings(token_budget=1024)) as engine:  # the app's page size
        handle = engine.submit(request)
        streamed = "".join(
            e.text for e in handle.events(timeout=120) if e.kind is EventKind.STREAMING
        )
    app = handle.result
    assert cli["text"] == streamed == app.text and cli["text"].strip()
    assert cli["token_ids"] == app.token_ids[0] and cli["eos_reason"] == app.eos_reason
    assert cli["prompt_tokens"] == app.prompt_tokens


def test_a_slow_engine_start_says_why_once_and_a_quick_one_says_nothing():
    """`folio chat`, `generate` and `serve` start their engine inside slow_start_note: a
    start still running after its threshold (the warm-up compiling the kernels, a first
    start after an install or update) prints one line saying so; one that ends first
    prints nothing, even after the threshold has passed."""
    import io
    import time

    from engine.cli.notes import SLOW_START, slow_start_note

    slow = io.StringIO()
    with slow_start_note(slow, after_s=0.05):
        deadline = time.monotonic() + 10
        while not slow.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # no second line
    assert slow.getvalue() == SLOW_START + "\n"
    assert "compiles" in SLOW_START and "install or an update" in SLOW_START

    quick = io.StringIO()
    with slow_start_note(quick, after_s=0.2):
        pass
    time.sleep(0.4)
    assert quick.getvalue() == ""


def test_the_slow_start_note_goes_to_a_terminal_only(capsys, monkeypatch):
    """By default the note is for a person at a terminal: stderr read by a script or a
    log (here pytest's capture) gets nothing, however long the start."""
    import io
    import sys
    import time

    from engine.cli.notes import SLOW_START, slow_start_note

    with slow_start_note(after_s=0.01):
        time.sleep(0.2)
    assert capsys.readouterr().err == ""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with slow_start_note(after_s=0.01):
        deadline = time.monotonic() + 10
        while not terminal.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert terminal.getvalue() == SLOW_START + "\n"
