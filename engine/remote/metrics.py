"""A server's `/metrics` read into the figures the memory views draw, whichever of the
three vocabularies it speaks: vLLM's (`vllm:...`), Folio's (the same names under
`folio:`), or llama.cpp's `llama-server --metrics` (`llamacpp:...`).

`ServerFigures.parse(text)` reads one scrape; `step_record(previous, current)` turns two
scrapes into one `StepRecord` of the engine's telemetry (tokens since the last scrape,
requests running and waiting, pages by use, the cumulative prefix hit rate), so the
graphs draw a remote server with the code that draws the local engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from engine.cache.snapshot import CacheStats
from engine.telemetry import StepRecord

# Per figure, the sample names that carry it, first found wins.
_NAMES = {
    "running": ("folio:num_requests_running", "vllm:num_requests_running",
                "llamacpp:requests_processing"),
    "waiting": ("folio:num_requests_waiting", "vllm:num_requests_waiting",
                "llamacpp:requests_deferred"),
    "usage": ("folio:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"),
    "queries": ("folio:prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                "vllm:gpu_prefix_cache_queries_total"),
    "hits": ("folio:prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
             "vllm:gpu_prefix_cache_hits_total", "llamacpp:prompt_tokens_cached_total"),
    "prompt_tokens": ("folio:prompt_tokens_total", "vllm:prompt_tokens_total",
                      "llamacpp:prompt_tokens_total"),
    "generation_tokens": ("folio:generation_tokens_total", "vllm:generation_tokens_total",
                          "llamacpp:tokens_predicted_total"),
}  # fmt: skip
_INFO = ("folio:cache_config_info", "vllm:cache_config_info")


@dataclass(frozen=True)
class ServerFigures:
    """One scrape. None: the server does not report that figure."""

    flavour: str = ""  # "folio", "vllm", "llamacpp" or "" (none of them)
    running: float | None = None
    waiting: float | None = None
    usage: float | None = None  # fraction of the KV pool in use, 0..1
    queries: float | None = None  # prompt tokens looked up in the prefix cache
    hits: float | None = None  # of them, found
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    num_blocks: int = 0  # the KV pool's size in blocks, when the server says
    block_size: int = 0

    @classmethod
    def parse(cls, text: str) -> ServerFigures:
        """ValueError when ``text`` is not Prometheus' text format."""
        values: dict[str, float] = {}
        info: dict[str, str] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    # Summed over labels (models, engines, finish reasons).
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
                    if sample.name in _INFO and not info:
                        info = dict(sample.labels)
        except (ValueError, TypeError, IndexError) as exc:
            raise ValueError(f"not Prometheus metrics: {exc}") from None
        found = {
            figure: next((values[n] for n in names if n in values), None)
            for figure, names in _NAMES.items()
        }
        llama = "llamacpp:prompt_tokens_total" in values
        if llama and found["hits"] is not None and found["prompt_tokens"] is not None:
            # llama.cpp counts prompt tokens without the cached ones: queries are both.
            found["queries"] = found["prompt_tokens"] + found["hits"]
        flavour = next(
            (
                f
                for f in ("folio", "vllm", "llamacpp")
                if any(n.startswith(f + ":") for n in values)
            ),
            "",
        )
        return cls(
            flavour=flavour,
            num_blocks=_int(info.get("num_gpu_blocks")),
            block_size=_int(info.get("block_size")),
            **found,
        )


def _int(text: str | None) -> int:
    try:
        return int(float(text)) if text not in (None, "", "None") else 0
    except ValueError:
        return 0


def step_record(
    now: float,
    previous: ServerFigures | None,
    current: ServerFigures,
    num_pages: int,
    pages_held: int,
) -> StepRecord:
    """The telemetry record of the time between two scrapes. ``pages_held``: blocks the
    events say the server holds (0 without events), of which ``usage`` are in use."""

    def delta(name: str) -> int:
        now_v, then_v = getattr(current, name), getattr(previous, name, None)
        if now_v is None or then_v is None or now_v < then_v:  # a restart resets counters
            return 0
        return int(now_v - then_v)

    referenced = round((current.usage or 0.0) * num_pages)
    cached = max(pages_held - referenced, 0)
    hit_rate = (current.hits or 0.0) / current.queries if current.queries else 0.0
    stats = CacheStats(
        pages_free=max(num_pages - referenced - cached, 0),
        pages_referenced=referenced,
        pages_cached=cached,
        prefix_hit_rate=hit_rate,
    )
    return StepRecord.of(
        now,
        stats,
        prefill_tokens=delta("prompt_tokens"),
        decode_tokens=delta("generation_tokens"),
        batch_size=int(current.running or 0),
        queue_depth=int(current.waiting or 0),
    )
