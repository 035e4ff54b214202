"""Running the generator to completion in tests, checking the page table after every step."""

from __future__ import annotations

import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generator.generator import Generator, GeneratorSettings
from engine.generator.job import EventKind, JobEvent, JobRequest, JobResult
from engine.generator.sampler import SamplingSettings
from engine.model.calibration import calibration_for

GREEDY = SamplingSettings(temperature=0)


def random_ids(n: int, seed: int, vocab: int = 384) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_generator(
    loaded, page_size: int = 16, tokens: int = 1024, cache: CacheSettings | None = None, **settings
) -> Generator:
    cache_settings = cache or CacheSettings(page_size=page_size, token_budget=tokens)
    kv = KVCache.for_model(loaded, cache_settings, calibration_for(loaded, cache_settings))
    return Generator(loaded, kv, GeneratorSettings(**settings))


def drain(
    gen: Generator, events: list[JobEvent] | None = None, max_steps: int = 100_000
) -> dict[int, JobResult]:
    """Iterate until idle; validate the page table after every step; return results by job id."""
    results: dict[int, JobResult] = {}
    for _ in range(max_steps):
        if gen.idle:
            break
        for event in gen.iterate():
            if events is not None:
                events.append(event)
            if event.eos:
                results[event.job_id] = event.result
        gen.pages.validate()
    assert gen.idle, "the generator did not drain"
    assert_no_leaks(gen)
    return results


def assert_no_leaks(gen: Generator) -> None:
    pages = gen.pages
    pages.validate()
    assert not pages.referenced, (
        f"pages still referenced: {sorted(r.index for r in pages.referenced.values())}"
    )
    assert not pages.allocations, f"allocations left: {list(pages.allocations)}"
    assert len(pages.unreferenced) == pages.num_pages


def run_alone(loaded, request: JobRequest, **kwargs) -> JobResult:
    gen = make_generator(loaded, **kwargs)
    job = gen.submit(request)
    return drain(gen)[job.job_id]


def complete(gen: Generator, request: JobRequest) -> tuple[str, JobResult]:
    """One job run to its end on `gen`: the text its events streamed, and its result."""
    events: list[JobEvent] = []
    job = gen.submit(request)
    result = drain(gen, events)[job.job_id]
    return stream_text(events, job.job_id), result


def stream_text(events: list[JobEvent], job_id: int, index: int = 0) -> str:
    return "".join(
        e.text
        for e in events
        if e.job_id == job_id and e.kind is EventKind.STREAMING and e.index == index
    )
