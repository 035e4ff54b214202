"""300 random jobs from 4 threads into a small cache, with cancels at every stage and a
10 Hz snapshot reader: every job ends (done, cancelled, or refused at submit with a
message), none with an error, no page stays held, the page table validates."""

from __future__ import annotations

import pytest

from engine.bench.load import LoadSettings, run_load
from engine.model.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.engine.tiny_models import make_hf_model, save_hf_folder

    folder = save_hf_folder(make_hf_model("qwen3", seed=5), tmp_path_factory.mktemp("tiny") / "m")
    return load_model(folder, load_tokenizer=False)


def _assert_every_job_ended_cleanly(report, jobs: int) -> None:
    print(report.as_dict())  # shown when an assertion fails
    assert report.submitted + report.refused_at_submit == jobs
    assert report.errors == 0, report.error_messages[:5]
    assert report.unfinished == 0
    assert report.done + report.cancelled == report.submitted
    assert report.pages_held_after == 0
    assert report.snapshots > 0 and not report.snapshot_problems, report.snapshot_problems[:5]
    # The load reached what it is meant to: refusals, cancels at each stage, pressure.
    assert report.refused_at_submit > 0 and report.cancelled > 0
    assert set(report.cancels_asked) == {"queued", "prefill", "decode"}
    assert any("batch holds" in message for message in report.refusals)


@pytest.mark.parametrize("seed", [0, 1])
def test_300_random_jobs_on_a_tiny_model(tiny, seed):
    report = run_load(tiny, LoadSettings(jobs=300, seed=seed, cache_tokens=512))
    _assert_every_job_ended_cleanly(report, 300)


def test_300_random_jobs_on_smollm2(smollm2_int4):
    # Prompts shorter than a prefill chunk of 64 rows (which dequantizes every matrix,
    # docs/ARCHITECTURE.md) and short replies keep this near a minute on two cores;
    # `folio bench load` runs the full-length version (README figures).
    settings = LoadSettings(jobs=300, seed=3, max_prompt=40, max_new_tokens=6, cache_tokens=256)
    report = run_load(smollm2_int4, settings)
    _assert_every_job_ended_cleanly(report, 300)
