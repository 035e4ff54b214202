"""What a snapshot says of a job in progress: a started job is prefilling before its
first chunk runs, how far its prefill is and at what measured rate, and why a pending
job waits (as a kind to branch on, with the scheduler's figures)."""

from __future__ import annotations

import pytest

from engine.engine import _job_info
from engine.generator.job import EventKind, JobRequest, JobState, WaitKind
from engine.model.loader import load_model
from tests.engine.generator.helpers import GREEDY, drain, make_generator, random_ids
from tests.engine.tiny_models import make_hf_model, save_hf_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_folder(make_hf_model("qwen3", seed=11), tmp_path_factory.mktemp("tiny") / "m")
    return load_model(folder, load_tokenizer=False)


def request(tiny, n: int, seed: int, max_new: int = 4) -> JobRequest:
    return JobRequest(
        prompt=random_ids(n, seed, tiny.config.vocab_size),
        sampling=GREEDY,
        max_new_tokens=max_new,
        stop_token_ids=(),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_started_job_is_prefilling_before_its_first_chunk_and_reports_progress(tiny):
    gen = make_generator(tiny, page_size=16, tokens=1024, max_chunk_size=32)
    clock = Clock()
    gen.scheduler.clock = clock
    job = gen.submit(request(tiny, 100, 1))
    started = gen.admit()
    # Admission alone: the job holds its pages and is prefilling, nothing computed yet.
    assert [e.kind for e in started] == [EventKind.STARTED]
    assert job.state is JobState.PREFILL
    info = _job_info(job)
    assert (info.prefill_done, info.prefill_total, info.prefill_from) == (0, 100, 0)
    assert info.prefill_since == 100.0
    assert info.prefill_rate(100.0) is None and info.prefill_eta(100.0) is None

    events = gen.advance()
    prefill = [e for e in events if e.kind is EventKind.PREFILL]
    assert prefill and prefill[-1].prefill_done == 32
    info = _job_info(job)
    assert info.prefill_done == 32
    # 32 tokens in the 2 s since the prefill began: 16 tok/s, so 68 left take 4.25 s.
    assert info.prefill_rate(102.0) == pytest.approx(16.0)
    assert info.prefill_eta(102.0) == pytest.approx(68 / 16)
    drain(gen)
    assert _job_info(job).prefill_since is None  # no longer prefilling


def test_iterate_is_admit_then_advance(tiny):
    """The split changes nothing: the same requests give the same events either way."""
    runs = []
    for split in (False, True):
        gen = make_generator(tiny, page_size=16, tokens=512, max_chunk_size=32)
        for i in range(3):
            gen.submit(request(tiny, 40 + 10 * i, 5 + i, max_new=6))
        kinds = []
        while not gen.idle:
            events = gen.admit() + gen.advance() if split else gen.iterate()
            kinds += [(e.job_id, e.kind, e.prefill_done, tuple(e.token_ids)) for e in events]
        runs.append(kinds)
    assert runs[0] == runs[1]


def test_a_pending_job_says_why_it_waits(tiny):
    # Batch of one: the second job waits for a slot.
    gen = make_generator(tiny, page_size=16, tokens=1024, max_batch_size=1)
    gen.submit(request(tiny, 20, 1, max_new=8))
    second = gen.submit(request(tiny, 20, 2))
    gen.iterate()
    info = _job_info(second)
    assert info.state == "pending" and info.wait_kind == WaitKind.BATCH
    assert info.wait_reason.startswith("batch full")
    drain(gen)

    # A cache of 10 pages, 8 held by the first job: the second waits for memory.
    gen = make_generator(tiny, page_size=16, tokens=160, max_batch_size=8)
    gen.submit(request(tiny, 60, 3, max_new=60))
    gen.iterate()
    big = gen.submit(request(tiny, 70, 4, max_new=20))
    gen.iterate()
    info = _job_info(big)
    assert info.wait_kind == WaitKind.MEMORY and "free pages" in info.wait_reason
    drain(gen)
    assert _job_info(big).wait_kind == WaitKind.NONE  # it started in the end
