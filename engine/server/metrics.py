"""GET /metrics: the engine's figures in Prometheus' text format, named after vLLM's
(`vllm:num_requests_running` is `folio:num_requests_running` here), so dashboards made
for vLLM read them with the prefix changed.

They describe the whole engine, whose jobs the API shares with the app's chats: the
gauges and prefix-cache counters are read from `Engine.snapshot()` when scraped; the
latency histograms and token counters are fed by an engine listener from every job's
events (TTFT and end-to-end latency from each job's result, inter-token latency from the
time between a sample's streamed tokens).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.engine import Engine
from engine.generator.job import EventKind, JobEvent
from engine.generator.stops import StopReason

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ITL_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
E2E_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM's finished_reason label values
_FINISHED = {
    StopReason.STOP_TOKEN: "stop",
    StopReason.STOP_STRING: "stop",
    StopReason.MAX_NEW_TOKENS: "length",
    StopReason.CANCELLED: "abort",
    StopReason.ERROR: "error",
}


class Metrics:
    """One server's registry (not the process-wide one: tests run several servers). Call
    it with every engine event (it is an engine listener)."""

    def __init__(self, engine: Engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), registry=r, buckets=buckets).labels(**labels)

        self.prompt_tokens = counter("folio:prompt_tokens", "Prompt tokens of finished jobs.")
        self.generation_tokens = counter("folio:generation_tokens", "Tokens generated.")
        self._success = Counter(
            "folio:request_success",
            "Finished jobs by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            "folio:time_to_first_token_seconds",
            "Submission to first token (queue and prefill).",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "folio:inter_token_latency_seconds", "Time between a sample's tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "folio:e2e_request_latency_seconds", "Submission to the job's end.", E2E_BUCKETS
        )
        self._model_name = model_name
        self._last_token: dict[tuple[int, int], float] = {}  # (job, sample) -> time
        self._lock = threading.Lock()
        r.register(_EngineCollector(engine, model_name))

    def __call__(self, event: JobEvent) -> None:
        if event.kind is EventKind.STREAMING and event.token_ids:
            now = time.monotonic()
            self.generation_tokens.inc(len(event.token_ids))
            key = (event.job_id, event.index)
            with self._lock:
                last = self._last_token.get(key)
                self._last_token[key] = now
            if last is not None:
                self.itl.observe(now - last)
        elif event.eos and event.result is not None:
            self._finished(event)

    def _finished(self, event: JobEvent) -> None:
        result = event.result
        assert result is not None
        with self._lock:
            for key in [k for k in self._last_token if k[0] == event.job_id]:
                del self._last_token[key]
        self.prompt_tokens.inc(result.prompt_tokens)
        reason = _FINISHED.get(result.eos_reason, result.eos_reason or "unknown")
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc()
        if result.new_tokens:
            self.ttft.observe(result.time_queued + result.time_prefill)
        self.e2e.observe(result.time_queued + result.time_prefill + result.time_generate)

    def exposition(self) -> bytes:
        """The text /metrics answers with (reads a snapshot: call it off the event loop)."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Figures read from the engine's latest snapshot at each scrape."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self.engine.snapshot()
        except RuntimeError:  # not started: nothing to report yet
            return
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        states = [job.state for job in snap.jobs]
        yield gauge(
            "folio:num_requests_running",
            "Jobs prefilling or decoding.",
            sum(s != "pending" for s in states),
        )
        yield gauge("folio:num_requests_waiting", "Jobs waiting to start.", states.count("pending"))
        yield gauge(
            "folio:kv_cache_usage_perc",
            "Fraction of KV-cache pages held by jobs (1 = full).",
            snap.stats.pages_referenced / snap.num_pages if snap.num_pages else 0.0,
        )
        # vLLM's name and labels: a client learns the pool's size and page size here.
        info = GaugeMetricFamily(
            "folio:cache_config_info",
            "The KV cache's layout.",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        info.add_metric([self.model_name, str(snap.page_size), str(snap.num_pages)], 1.0)
        yield info
        counters = snap.cache.counters
        yield counter(
            "folio:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            counters.get("prefix_query_tokens", 0),
        )
        yield counter(
            "folio:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            counters.get("prefix_hit_tokens", 0),
        )
