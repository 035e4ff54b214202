"""`folio bench load`: a randomized load as a hostile or unlucky set of users makes it.

Several threads submit jobs at once (random prompts from one token to three thousand,
some sharing a system prompt, n 1-4, beams, sampling or greedy, some wider than the
batch), a deliberately small cache, cancels at every stage (still queued, prefilling,
decoding), a snapshot reader at 10 Hz checking every snapshot it gets, and optionally
one reader polling as fast as it can. Every job must end: done, cancelled, or refused at
submit with a message; none may end with an error, no page may stay held, and the page
table must validate. `run_load` returns the counts; the tests and the README use it.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from engine.cache.kv_cache import CacheSettings
from engine.engine import Engine, EngineSnapshot
from engine.generator.generator import GeneratorSettings
from engine.generator.job import EventKind, JobEvent, JobRequest
from engine.generator.sampler import SamplingSettings
from engine.model.loader import LoadedModel, load_model

CANCEL_STAGES = ("queued", "prefill", "decode")


@dataclass
class LoadSettings:
    jobs: int = 300
    threads: int = 4
    seed: int = 0
    max_prompt: int = 3000  # the longest random prompt (most of those are refused)
    max_new_tokens: int = 24
    cache_tokens: int = 1024  # small on purpose: jobs wait, evict and are refused
    page_size: int = 16
    max_batch_size: int = 8
    cancel_fraction: float = 0.2
    reader_hz: float = 10.0
    tight_reader: bool = False  # also poll snapshot() in a loop as fast as possible
    timeout_s: float = 1800.0  # for the whole load, then unfinished jobs are reported


@dataclass
class LoadReport:
    submitted: int = 0
    refused_at_submit: int = 0
    done: int = 0
    cancelled: int = 0
    errors: int = 0  # ended with an error after submit: must be 0
    unfinished: int = 0  # still running at the timeout: must be 0
    cancels_asked: Counter = field(default_factory=Counter)  # by stage
    refusals: Counter = field(default_factory=Counter)  # message (numbers stripped) -> count
    error_messages: list[str] = field(default_factory=list)
    snapshots: int = 0
    snapshot_problems: list[str] = field(default_factory=list)
    tight_reads: int = 0
    pages_held_after: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (
            self.errors or self.unfinished or self.snapshot_problems or self.pages_held_after
        )

    def as_dict(self) -> dict:
        out = asdict(self)
        out["cancels_asked"] = dict(self.cancels_asked)
        out["refusals"] = dict(self.refusals)
        out["clean"] = self.clean
        return out


def _request(rng: random.Random, vocab: int, system: list[int], s: LoadSettings) -> JobRequest:
    roll = rng.random()
    top = s.max_prompt
    if roll < 0.6:
        length = rng.randint(1, min(64, top))
    elif roll < 0.9:
        length = rng.randint(min(65, top), min(600, top))
    else:
        length = rng.randint(min(601, top), top)
    tail = [rng.randrange(1, vocab) for _ in range(length)]
    prompt = system + tail if rng.random() < 0.4 else tail
    sampling = (
        SamplingSettings(temperature=0)
        if rng.random() < 0.4
        else SamplingSettings(
            temperature=rng.choice([0.3, 0.8, 1.2]),
            top_k=rng.choice([0, 20]),
            top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(2**32),
        )
    )
    kind = rng.random()
    n, beams = 1, 1
    if kind < 0.25:
        n = rng.randint(2, 4)
    elif kind < 0.35:
        beams = rng.randint(2, 4)
    elif kind < 0.37:
        n = s.max_batch_size + rng.randint(1, 8)  # wider than the batch: refused
    return JobRequest(
        prompt=prompt,
        sampling=sampling if beams == 1 else SamplingSettings(temperature=0),
        max_new_tokens=rng.randint(1, s.max_new_tokens),
        stop_token_ids=(),
        n=n,
        beam_width=beams,
    )


def _refusal_key(message: str) -> str:
    words = [w for w in message.split() if not any(c.isdigit() for c in w)]
    return " ".join(words)[:80]


class _Canceller:
    """Cancels chosen jobs when they reach their chosen stage (a listener: it runs on
    the engine thread and only queues the cancel)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stage: dict[int, str] = {}
        self._lock = threading.Lock()

    def __call__(self, event: JobEvent) -> None:
        with self._lock:
            stage = self.stage.get(event.job_id)
        if stage == "prefill" and event.kind is EventKind.STARTED:
            self.engine.cancel(event.job_id)
        elif stage == "decode" and event.kind is EventKind.STREAMING:
            self.engine.cancel(event.job_id)


def _check_snapshot(snap: EngineSnapshot, last_version: int) -> str:
    st = snap.stats
    total = st.pages_free + st.pages_referenced + st.pages_cached
    if total != snap.num_pages:
        return f"v{snap.version}: {total} pages counted, the cache has {snap.num_pages}"
    if snap.version < last_version:
        return f"version went back from {last_version} to {snap.version}"
    held = sum(job.pages for job in snap.jobs)
    if st.pages_referenced > held:
        return f"v{snap.version}: {st.pages_referenced} pages referenced, jobs hold {held}"
    return ""


def run_load(loaded: LoadedModel, s: LoadSettings | None = None) -> LoadReport:
    s = s or LoadSettings()
    report = LoadReport()
    engine = Engine(
        loaded,
        CacheSettings(page_size=s.page_size, token_budget=s.cache_tokens),
        GeneratorSettings(max_batch_size=s.max_batch_size),
    )
    canceller = _Canceller(engine)
    engine.add_listener(canceller)
    vocab = loaded.config.vocab_size
    system = [random.Random(s.seed).randrange(1, vocab) for _ in range(3 * s.page_size)]
    handles = []
    lock = threading.Lock()
    stop_readers = threading.Event()

    def submitter(worker: int) -> None:
        rng = random.Random(s.seed * 1000 + worker)
        for _ in range(worker, s.jobs, s.threads):
            request = _request(rng, vocab, system, s)
            stage = rng.choice(CANCEL_STAGES) if rng.random() < s.cancel_fraction else ""
            try:
                handle = engine.submit(request)
            except ValueError as exc:
                with lock:
                    report.refused_at_submit += 1
                    report.refusals[_refusal_key(str(exc))] += 1
                continue
            with lock:
                handles.append(handle)
                if stage:
                    report.cancels_asked[stage] += 1
            if stage == "queued":
                handle.cancel()
            elif stage:
                with canceller._lock:
                    canceller.stage[handle.job_id] = stage
            time.sleep(rng.random() * 0.02)

    def reader() -> None:
        last = 0
        while not stop_readers.wait(1.0 / s.reader_hz):
            snap = engine.snapshot()
            problem = _check_snapshot(snap, last)
            last = snap.version
            with lock:
                report.snapshots += 1
                if problem:
                    report.snapshot_problems.append(problem)

    def tight_reader() -> None:
        while not stop_readers.is_set():
            engine.snapshot()
            report.tight_reads += 1

    start = time.monotonic()
    engine.start()
    readers = [threading.Thread(target=reader, daemon=True)]
    if s.tight_reader:
        readers.append(threading.Thread(target=tight_reader, daemon=True))
    for thread in readers:
        thread.start()
    submitters = [threading.Thread(target=submitter, args=(w,)) for w in range(s.threads)]
    for thread in submitters:
        thread.start()
    for thread in submitters:
        thread.join()
    deadline = start + s.timeout_s
    for handle in handles:
        try:
            result = handle.wait(max(deadline - time.monotonic(), 0.01))
        except TimeoutError:
            report.unfinished += 1
            continue
        report.new_tokens += result.new_tokens
        if result.eos_reason == "cancelled":
            report.cancelled += 1
        elif result.eos_reason == "error":
            report.errors += 1
            report.error_messages.append(result.error)
        else:
            report.done += 1
    report.seconds = time.monotonic() - start
    stop_readers.set()
    for thread in readers:
        thread.join()
    report.submitted = len(handles)
    engine.shutdown()
    pages = engine.cache.pages
    pages.validate()
    report.pages_held_after = len(pages.referenced) + len(pages.allocations)
    return report


def _poll(engine: Engine, stop: threading.Event, count: list[int]) -> None:
    while not stop.is_set():
        engine.snapshot()
        count[0] += 1


def tight_reader_case(loaded: LoadedModel, tokens: int = 64, rounds: int = 3) -> dict:
    """Decode speed of one greedy job alone, with a thread polling `snapshot()` in a
    tight loop, and with that poll unpaced (`repeat_s` 0: what the engine did before),
    alternated so drift on a shared machine hits all three alike."""
    prompt = [1 + i % (loaded.config.vocab_size - 1) for i in range(32)]
    request = JobRequest(
        prompt=prompt,
        max_new_tokens=tokens,
        stop_token_ids=(),
        sampling=SamplingSettings(temperature=0),
    )
    speeds: dict[str, list[float]] = {"alone": [], "paced": [], "unpaced": []}
    reads: dict[str, int] = {"paced": 0, "unpaced": 0}
    with Engine(loaded) as engine:
        paced_s = engine._snapshot.repeat_s
        engine.generate(request, timeout=600)  # warm-up
        for _ in range(rounds):
            for variant in speeds:
                stop = threading.Event()
                count = [0]

                engine._snapshot.repeat_s = 0.0 if variant == "unpaced" else paced_s
                reader = threading.Thread(target=_poll, args=(engine, stop, count), daemon=True)
                if variant != "alone":
                    reader.start()
                result = engine.generate(request, timeout=600)
                stop.set()
                if variant != "alone":
                    reader.join()
                    reads[variant] += count[0]
                speeds[variant].append(result.new_tokens / max(result.time_generate, 1e-9))
        engine._snapshot.repeat_s = paced_s
    best = {name: max(values) for name, values in speeds.items()}
    return {
        "decode_tok_s": {name: round(v, 1) for name, v in best.items()},
        "paced_vs_alone": round(best["paced"] / best["alone"], 3),
        "unpaced_vs_alone": round(best["unpaced"] / best["alone"], 3),
        "reads": reads,
    }


def run_load_bench(args: argparse.Namespace) -> None:
    loaded = load_model(args.model)
    settings = LoadSettings(
        jobs=args.jobs,
        seed=args.seed,
        cache_tokens=args.cache_tokens,
        tight_reader=args.tight_reader,
    )
    report = run_load(loaded, settings)
    out = {"model": str(args.model), **report.as_dict()}
    out["tight_reader"] = tight_reader_case(loaded)
    print(json.dumps(out, indent=None if args.json else 2))
    if not report.clean:
        raise SystemExit(1)
