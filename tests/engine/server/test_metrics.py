"""GET /metrics: Prometheus text with vLLM's names under `folio:`, counting what the
requests did."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.server.app import Server, ServerSettings
from tests.engine.server.conftest import MODEL_ID, make_engine, wait_idle


def scrape(url: str) -> dict[str, float]:
    """Sample name -> value (histogram buckets left out)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_bucket")
    }


def test_metrics_count_the_requests(tiny_chat):
    engine = make_engine(tiny_chat)  # its own, so every count starts at zero
    try:
        with Server(engine, ServerSettings(port=0, model_id=MODEL_ID)) as server:
            before = scrape(server.url)
            assert before["folio:num_requests_running"] == 0
            assert before["folio:kv_cache_usage_perc"] == 0
            assert before["folio:prefix_cache_hits_total"] == 0
            system = {"role": "system", "content": "Shared instructions for every request. " * 2}
            usages = []
            for question in ("One?", "Two?", "Three?"):
                r = httpx.post(
                    server.url + "/v1/chat/completions",
                    json={
                        "model": MODEL_ID,
                        "messages": [system, {"role": "user", "content": question}],
                        "max_tokens": 5,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                    timeout=60,
                )
                usages.append(r.json()["usage"])
            wait_idle(engine)
            after = scrape(server.url)
    finally:
        engine.shutdown()
    assert after["folio:generation_tokens_total"] == 15
    assert after["folio:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert after["folio:request_success_total"] == 3
    assert after["folio:time_to_first_token_seconds_count"] == 3
    assert after["folio:e2e_request_latency_seconds_count"] == 3
    assert after["folio:inter_token_latency_seconds_count"] == 3 * 4
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert after["folio:prefix_cache_hits_total"] >= cached > 0
    assert after["folio:prefix_cache_queries_total"] >= after["folio:prefix_cache_hits_total"]
    assert after["folio:num_requests_waiting"] == 0
