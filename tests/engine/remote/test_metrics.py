"""A server's /metrics in each vocabulary the app recognises: vLLM's (written by
prometheus_client, as vLLM does), llama-server's (its own writer's layout: HELP, TYPE,
value per metric) and Folio's (the real exposition of an engine); and two scrapes as one
telemetry record."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from engine.remote.metrics import ServerFigures, step_record


def vllm_exposition(values: dict[str, float], blocks: int, block_size: int) -> str:
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    for name, value in values.items():
        if name.endswith(("_tokens", "_queries", "_hits")):
            Counter(name, name, labels, registry=r).labels("m", "0").inc(value)
        else:
            Gauge(name, name, labels, registry=r).labels("m", "0").set(value)
    info = Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks"], registry=r)
    info.labels(str(block_size), str(blocks)).set(1)
    return generate_latest(r).decode()


def llama_exposition(values: dict[str, tuple[str, float]]) -> str:
    """As llama-server's /metrics writes them (tools/server/server-task.cpp)."""
    out = []
    for name, (kind, value) in values.items():
        out += [f"# HELP llamacpp:{name} {name}", f"# TYPE llamacpp:{name} {kind}"]
        out.append(f"llamacpp:{name} {value}")
    return "\n".join(out) + "\n"


def test_vllm_names():
    text = vllm_exposition(
        {
            "vllm:num_requests_running": 3,
            "vllm:num_requests_waiting": 2,
            "vllm:kv_cache_usage_perc": 0.25,
            "vllm:prefix_cache_queries": 1000,
            "vllm:prefix_cache_hits": 400,
            "vllm:prompt_tokens": 1200,
            "vllm:generation_tokens": 345,
        },
        blocks=2048,
        block_size=16,
    )
    f = ServerFigures.parse(text)
    assert f.flavour == "vllm"
    assert (f.running, f.waiting, f.usage) == (3, 2, 0.25)
    assert (f.queries, f.hits, f.prompt_tokens, f.generation_tokens) == (1000, 400, 1200, 345)
    assert (f.num_blocks, f.block_size) == (2048, 16)


def test_llama_server_names():
    text = llama_exposition(
        {
            "prompt_tokens_total": ("counter", 900),
            "prompt_tokens_cached_total": ("counter", 300),
            "tokens_predicted_total": ("counter", 120),
            "requests_processing": ("gauge", 2),
            "requests_deferred": ("gauge", 1),
            "prompt_tokens_seconds": ("gauge", 55.5),
        }
    )
    f = ServerFigures.parse(text)
    assert f.flavour == "llamacpp"
    assert (f.running, f.waiting, f.generation_tokens) == (2, 1, 120)
    # llama.cpp's prompt count leaves the cached tokens out: the queries are both.
    assert (f.hits, f.queries, f.prompt_tokens) == (300, 1200, 900)
    assert f.usage is None and f.num_blocks == 0


def test_folio_names(tiny_chat):
    from engine.generator.job import JobRequest
    from engine.generator.sampler import SamplingSettings
    from engine.server.metrics import Metrics
    from tests.engine.server.conftest import make_engine

    engine = make_engine(tiny_chat, cache_tokens=512)
    metrics = Metrics(engine, "tiny")
    engine.add_listener(metrics)
    prompt = list(range(3, 3 + 40))
    try:
        for _ in range(2):
            engine.submit(
                JobRequest(prompt=prompt, max_new_tokens=5, sampling=SamplingSettings(0))
            ).wait(60)
    finally:
        engine.shutdown()  # publishes its last snapshot, which the scrape reads too
    snap = engine.snapshot()
    f = ServerFigures.parse(metrics.exposition().decode())
    assert f.flavour == "folio"
    assert (f.num_blocks, f.block_size) == (snap.num_pages, snap.page_size)
    assert f.queries == snap.cache.counters["prefix_query_tokens"]
    assert f.hits == snap.cache.counters["prefix_hit_tokens"] > 0
    assert f.prompt_tokens == 80 and f.generation_tokens == 10


def test_two_scrapes_make_one_record():
    before = ServerFigures(flavour="vllm", prompt_tokens=100, generation_tokens=10, hits=0)
    after = ServerFigures(
        flavour="vllm", running=2, waiting=1, usage=0.5, queries=400, hits=100,
        prompt_tokens=500, generation_tokens=60,
    )  # fmt: skip
    rec = step_record(12.0, before, after, num_pages=100, pages_held=70)
    assert (rec.prefill_tokens, rec.decode_tokens) == (400, 50)
    assert (rec.batch_size, rec.queue_depth) == (2, 1)
    assert (rec.pages_referenced, rec.pages_cached, rec.pages_free) == (50, 20, 30)
    assert rec.prefix_hit_rate == pytest.approx(0.25)
    # A restarted server's counters start again: no negative rates.
    again = step_record(13.0, after, before, num_pages=100, pages_held=0)
    assert (again.prefill_tokens, again.decode_tokens) == (0, 0)


def test_what_is_not_prometheus_is_refused():
    with pytest.raises(ValueError, match="not Prometheus metrics"):
        ServerFigures.parse("<html>{not metrics}</html>\n")
    assert ServerFigures.parse("").flavour == ""
