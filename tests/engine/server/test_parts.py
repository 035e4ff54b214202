"""The server's parts on their own: the cache room it promises against the engine's own
check, logprobs formatting, the API tag, and the
`folio serve` command's wiring."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest

from engine.cache.page import CacheFullError
from engine.generator.job import JobRequest, TokenLogprob
from engine.server import cli
from engine.server.responses import chat_logprobs, completion_logprobs
from engine.server.schemas import ModelLimits
from engine.server.tag import ApiTag
from tests.engine.server.conftest import make_engine


def test_cache_room_is_exactly_what_the_engine_admits(tiny_chat):
    engine = make_engine(tiny_chat, cache_tokens=384, max_batch_size=4)  # 24 pages of 16
    try:
        limits = ModelLimits("m", 10_000, 300, 16, engine.cache.num_pages, 4, 10_000)
        check = engine.generator.scheduler.check_fits
        for prompt in (1, 15, 16, 17, 100, 200, 300, 383):
            for n in (1, 2, 3, 4):
                room = limits.cache_room(prompt, n)
                if room >= 1:
                    check(JobRequest(prompt=[1] * prompt, max_new_tokens=room, n=n), prompt)
                with pytest.raises(CacheFullError):
                    check(JobRequest(prompt=[1] * prompt, max_new_tokens=room + 1, n=n), prompt)
    finally:
        engine.shutdown()


class Letters:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_logprobs_take_openais_shapes():
    entries = [
        TokenLogprob(0, -0.1, ((0, -0.1), (1, -2.5))),
        TokenLogprob(2, -0.7, ((3, -0.5), (2, -0.7))),
    ]
    chat = chat_logprobs(entries, Letters())
    assert chat == {
        "content": [
            {
                "token": "a",
                "logprob": -0.1,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.1, "bytes": [97]},
                    {"token": "b", "logprob": -2.5, "bytes": [98]},
                ],
            },
            {
                "token": "c",
                "logprob": -0.7,
                "bytes": [99],
                "top_logprobs": [
                    {"token": "d", "logprob": -0.5, "bytes": [100]},
                    {"token": "c", "logprob": -0.7, "bytes": [99]},
                ],
            },
        ]
    }
    assert completion_logprobs(entries, Letters(), offset=5) == {
        "tokens": ["a", "c"],
        "token_logprobs": [-0.1, -0.7],
        "top_logprobs": [{"a": -0.1, "b": -2.5}, {"d": -0.5, "c": -0.7}],
        "text_offset": [5, 6],
    }
    assert chat_logprobs(None, Letters()) is None
    # JSON has no -inf or NaN: OpenAI's -9999 stands for a token that cannot come
    impossible = completion_logprobs([TokenLogprob(0, -math.inf, ((1, math.nan),))], Letters())
    assert impossible["token_logprobs"] == [-9999.0] and impossible["top_logprobs"] == [
        {"b": -9999.0}
    ]


def test_api_tags_are_one_colour_whatever_the_request():
    a, b = ApiTag("chatcmpl-1"), ApiTag("cmpl-2")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert str(a) == "API" and a.request_id == "chatcmpl-1"
    assert a != "API" and a != 7  # never a chat's tag


def test_folio_serve_parses_and_serves_the_engine_it_builds(tiny_chat, monkeypatch):
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["serve", "--model", "m.gguf", "--port", "0", "--api-key", "k", "--page-size", "16"]
        + ["--cache-tokens", "512", "--max-batch-size", "4", "--served-model-name", "x"]
    )
    assert args.command == "serve" and args.host == "127.0.0.1"
    seen = {}

    def fake_serve(engine, host, port, api_key, **kwargs):
        seen.update(host=host, port=port, key=api_key, **kwargs)
        seen["pages"] = engine.cache.num_pages
        seen["batch"] = engine.generator.settings.max_batch_size
        seen["running"] = engine.running

    monkeypatch.setattr("engine.model.loader.load_model", lambda path, **kw: tiny_chat)
    monkeypatch.setattr("engine.server.app.serve", fake_serve)
    assert cli.run_serve(args) == 0
    assert seen["pages"] == 32 and seen["batch"] == 4 and seen["running"]
    assert (seen["host"], seen["port"], seen["key"], seen["model_id"]) == ("127.0.0.1", 0, "k", "x")
    bad = SimpleNamespace(**{**vars(args), "max_tokens": 0})
    with pytest.raises(ValueError, match="max_tokens"):
        cli.run_serve(bad)


def test_folio_serve_is_a_folio_command(tiny_chat, monkeypatch, capsys):
    from folio.main import main

    seen = {}
    monkeypatch.setattr("engine.model.loader.load_model", lambda path, **kw: tiny_chat)
    monkeypatch.setattr(
        "engine.server.app.serve", lambda engine, host, port, api_key, **kw: seen.update(port=port)
    )
    assert main(["serve", "--model", str(tiny_chat.path), "--port", "0"]) == 0
    assert seen == {"port": 0}
    assert main(["serve", "--model", str(tiny_chat.path), "--max-tokens", "0"]) == 1
    err = capsys.readouterr().err
    assert "max_tokens" in err and len(err.strip().splitlines()) == 1
