"""`folio bench serve --http`'s plumbing on a tiny model (no timing asserted): the bench
starts `folio serve` itself and drives it with streaming clients, or drives a server at a
URL; every request's tokens arrive, and the cached tokens it reports are the ones the
engine says it found in its cache."""

from __future__ import annotations

import argparse
import json

from engine.bench.http_serve import run_http_serve_bench, workload
from folio.main import main


def bench_args(**over) -> argparse.Namespace:
    base = dict(requests=6, groups=2, system_tokens=40, new_tokens=4, rate=20.0,
                cache_tokens=2048, url=None, api_key=None, llama_server=None, json=True,
                model=None, threads=None)  # fmt: skip
    return argparse.Namespace(**{**base, **over})


def test_the_workload_is_the_same_for_every_target():
    a, b = workload(bench_args()), workload(bench_args())
    assert [(r.at, r.prompt) for r in a] == [(r.at, r.prompt) for r in b]
    groups = {r.group for r in a}
    assert len(groups) == 2
    for g in groups:  # a group's requests start with one system prompt
        prompts = [r.prompt for r in a if r.group == g]
        head = prompts[0].split("\n\nQuestion: ")[0]
        assert all(p.startswith(head + "\n\nQuestion: ") for p in prompts)


def test_against_a_server_at_a_url(server, engine):
    since = len(engine.telemetry.events())
    rows = run_http_serve_bench(bench_args(url=server.url + "/v1"))
    (row,) = rows
    assert row["target"] == "url" and row["requests"] == 6
    assert row["output_tokens"] == 6 * 4  # ignore_eos: every token asked for
    assert row["itl_median_s"] is not None and row["ttft_p90_s"] >= row["ttft_median_s"]
    done = [e for e in engine.telemetry.events()[since:] if e["kind"] == "job_done"]
    assert len(done) == 6
    assert row["prompt_tokens"] == sum(e["prompt_tokens"] for e in done)
    assert row["cached_tokens"] == sum(e["cached_tokens"] for e in done)


def test_the_bench_starts_folio_serve_itself(tiny_chat, capsys):
    code = main(["bench", "serve", "--http", "--model", str(tiny_chat.path),
                 "--requests", "4", "--groups", "2", "--system-tokens", "30",
                 "--new-tokens", "3", "--rate", "50", "--cache-tokens", "2048", "--json"])  # fmt: skip
    assert code in (0, None)
    rows = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    (row,) = rows
    assert row["target"] == "folio" and row["output_tokens"] == 4 * 3
    assert row["prompt_tokens"] > 0


def test_a_llama_server_that_cannot_run_is_said_before_anything_runs(tiny_chat, capsys):
    common = ["bench", "serve", "--http", "--requests", "2"]
    assert main([*common, "--model", str(tiny_chat.path), "--llama-server", "/bin/true"]) != 0
    assert "--llama-server needs --model FILE.gguf" in capsys.readouterr().err
    gguf = tiny_chat.path.parent / "not-run.gguf"
    assert main([*common, "--model", str(gguf), "--llama-server", "/no/llama-server"]) != 0
    assert "no llama-server at /no/llama-server" in capsys.readouterr().err
