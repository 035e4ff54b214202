"""`folio bench batched` and `folio bench serve` on small shapes: the JSON lines carry
llama-batched-bench's keys with consistent arithmetic, and the serving workload reports
its latencies and the prefix hit rate (a shared system prompt must hit)."""

from __future__ import annotations

import json

import pytest

from folio.main import main

KEYS = {"PP", "TG", "B", "shared", "T_PP", "S_PP", "T_TG", "S_TG", "T", "S", "pages"}


@pytest.fixture(autouse=True)
def _default_model_is_smollm2(smollm2_path, monkeypatch):
    monkeypatch.setattr("engine.cli.main.model_path", lambda arg: smollm2_path)


def test_batched_json_lines(capsys):
    assert (
        main(
            [
                "bench",
                "batched",
                "--json",
                "--pp",
                "40",
                "--tg",
                "4",
                "--batch",
                "1",
                "2",
                "--skip-transformers",
            ]
        )
        == 0
    )
    lines = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    rows = [r for r in lines if "S_TG" in r]
    assert {(r["B"], r["shared"]) for r in rows} == {(1, False), (1, True), (2, False), (2, True)}
    for r in rows:
        assert KEYS <= r.keys()
        assert r["S_TG"] == pytest.approx(r["B"] * r["TG"] / r["T_TG"], rel=0.02)
        pp_tokens = r["PP"] if r["shared"] else r["B"] * r["PP"]
        assert r["S_PP"] == pytest.approx(pp_tokens / r["T_PP"], rel=0.02)
        assert r["T"] >= r["T_PP"] + r["T_TG"] - 0.002  # each rounded to 1 ms
        assert r["pages"] >= r["B"]
    assert any(r.get("ratio") for r in lines)


def test_serve_reports_latencies_and_hits(capsys):
    argv = [
        "bench",
        "serve",
        "--json",
        "--requests",
        "4",
        "--groups",
        "2",
        "--system-tokens",
        "300",
        "--new-tokens",
        "3",
        "--rate",
        "100",
        "--cache-tokens",
        "4096",
    ]
    assert main(argv) == 0
    lines = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    on, off, lru = lines[:3]
    assert (on["caching"], off["caching"], lru["eviction"]) == (True, False, "lru")
    assert on["prefix_hit_rate"] > 0.3 and off["prefix_hit_rate"] == 0
    for row in (on, off, lru):
        assert (
            row["requests"] == 4
            and row["ttft_median"] > 0
            and row["ttft_p90"] >= row["ttft_median"]
        )
    assert "throughput_caching_on_vs_off" in lines[3]
    assert lines[4]["ttft_uncached"] > 0 and lines[4]["ttft_cached"] > 0


def test_serve_tiers_run_the_workload_with_and_without_the_disk(capsys):
    # Which of these arrivals hit depends on timing; that the disk tier keeps what the
    # host tier cannot is tests/engine/cache/test_disk_restart.py's.
    argv = ["bench", "serve", "--json", "--requests", "4", "--groups", "2",
            "--system-tokens", "300", "--new-tokens", "2", "--rate", "100",
            "--cache-tokens", "1024", "--tiers", "--host-mb", "12"]  # fmt: skip
    assert main(argv) == 0
    lines = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    host, disk, summary = lines
    assert (host["host_mb"], host["disk"], disk["disk"]) == (12, False, True)
    assert host["disk_restores"] == 0 and host["requests"] == disk["requests"] == 4
    assert summary["hit_rate_host_vs_host_disk"] == [
        host["prefix_hit_rate"],
        disk["prefix_hit_rate"],
    ]
