"""The continuous-batching generator (docs/ENGINE.md §3, §7, §8) on a tiny random model and
on SmolLM2: batching, prefix caching and requeue change nothing in the output; pages
never leak; sharing saves pages; bad input ends cleanly."""

from __future__ import annotations

import math
import random

import pytest

from engine.cache.kv_cache import CacheSettings
from engine.cache.page import CacheFullError
from engine.generator.job import EventKind, JobRequest, JobResult
from engine.generator.sampler import SamplingSettings
from engine.model.loader import load_model
from tests.engine.generator.helpers import (
    GREEDY,
    assert_no_leaks,
    drain,
    make_generator,
    random_ids,
    run_alone,
    stream_text,
)
from tests.engine.tiny_models import make_hf_model, save_hf_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_folder(make_hf_model("qwen3", seed=11), tmp_path_factory.mktemp("tiny") / "m")
    return load_model(folder, load_tokenizer=False)


def _varied_requests(count: int, vocab: int, seed: int = 0, max_new: int = 24) -> list[JobRequest]:
    rng = random.Random(seed)
    return [
        JobRequest(
            prompt=random_ids(rng.randint(3, 90), seed=seed * 100 + i, vocab=vocab),
            sampling=GREEDY,
            max_new_tokens=rng.randint(4, max_new),
            stop_token_ids=(),
        )
        for i in range(count)
    ]


def _batched(loaded, requests, **kwargs):
    gen = make_generator(loaded, **kwargs)
    jobs = [gen.submit(r) for r in requests]
    skipped: set[int] = set()
    results = {}
    while not gen.idle:
        for event in gen.iterate():
            if event.eos:
                results[event.job_id] = event.result
        skipped |= {j.job_id for j in gen.pending if j.skips}
        gen.pages.validate()
    drain(gen)  # checks that nothing leaked
    return [results[j.job_id] for j in jobs], gen, skipped


def test_batching_is_invisible_on_a_tiny_model(tiny):
    requests = _varied_requests(16, tiny.config.vocab_size)
    alone = [run_alone(tiny, r, tokens=4096).token_ids[0] for r in requests]
    # 16 pages of 16 tokens: jobs must wait for each other, and cached pages get evicted.
    batched, gen, skipped = _batched(
        tiny, requests, tokens=256, max_batch_size=4, max_chunk_size=32
    )
    assert [r.token_ids[0] for r in batched] == alone
    assert skipped, "the cache was large enough that no job was ever skipped"
    assert gen.pages.counters.evictions > 0, "no page was evicted: the test does not test eviction"


def _assert_batching_is_invisible_on_smollm2(loaded):
    requests = _varied_requests(16, loaded.config.vocab_size, seed=1, max_new=12)
    # Same chunk size alone and batched: a chunk's row count picks the int4 kernel or
    # the exact dense path (kernels differ in rounding), so the chunking must match;
    # chunked prefill itself is covered on the tiny model above.
    alone = [run_alone(loaded, r, tokens=4096, max_chunk_size=128).token_ids[0] for r in requests]
    batched, gen, skipped = _batched(
        loaded, requests, tokens=320, max_batch_size=4, max_chunk_size=128
    )
    assert [r.token_ids[0] for r in batched] == alone
    assert skipped and gen.pages.counters.evictions > 0


def test_batching_is_invisible_on_smollm2(smollm2_int4):
    _assert_batching_is_invisible_on_smollm2(smollm2_int4)


def test_batching_is_invisible_on_smollm2_native(smollm2_native):
    """The default mode's decode rows (norm, gate and RoPE fused into numba calls, the
    file's blocks multiplied per row) give each sequence the same tokens in any batch."""
    _assert_batching_is_invisible_on_smollm2(smollm2_native)


def _chat_ids(tokenizer, system: str, user: str) -> list[int]:
    return tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": user}]
    )


SYSTEM = (
    "You are Folio's test assistant. You answer in one short sentence, you never use lists, "
    "and you always name the colour of the sky when asked about weather. Keep answers plain."
)


def test_prefix_caching_is_invisible(smollm2_int4):
    tok = smollm2_int4.tokenizer
    first = _chat_ids(tok, SYSTEM, "What is the capital of France?")
    second = _chat_ids(tok, SYSTEM, "What is the weather like today?")
    gen = make_generator(smollm2_int4, page_size=16, tokens=2048)

    def drain_one(ids):
        return drain_job(gen, JobRequest(prompt=ids, sampling=GREEDY, max_new_tokens=24))

    drain_one(first)
    cached = drain_one(second)
    assert cached.cached_tokens >= 16 * 3, "the shared system prompt was not found in the cache"
    uncached = run_alone(
        smollm2_int4,
        JobRequest(prompt=second, sampling=GREEDY, max_new_tokens=24),
        tokens=2048,
        prefix_caching=False,
    )
    assert uncached.cached_tokens == 0
    assert cached.token_ids == uncached.token_ids


def drain_job(gen, request):
    job = gen.submit(request)
    return drain(gen)[job.job_id]


def test_chat_continued_turn_by_turn_reuses_every_full_page(smollm2_int4):
    tok = smollm2_int4.tokenizer
    ps = 16
    gen = make_generator(smollm2_int4, page_size=ps, tokens=4096)
    history = _chat_ids(tok, SYSTEM, "Name three fruits.")
    for turn in range(3):
        result = drain_job(gen, JobRequest(prompt=history, sampling=GREEDY, max_new_tokens=20))
        stored = len(history) + len(result.token_ids[0]) - 1  # the last token is never fed
        history = (
            history
            + result.token_ids[0]
            + tok.encode(
                f"\n<|im_start|>user\nAnd {turn + 2} more?<|im_end|>\n<|im_start|>assistant\n"
            )
        )
        nxt = gen.submit(JobRequest(prompt=history, sampling=GREEDY, max_new_tokens=1))
        results = drain(gen)
        assert results[nxt.job_id].cached_tokens >= stored // ps * ps, (
            f"turn {turn}: full pages recomputed"
        )


def test_requeue_is_invisible(smollm2_int4):
    prompt = smollm2_int4.tokenizer.encode("The history of the printing press begins")
    request = JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=300, stop_token_ids=())
    once = run_alone(smollm2_int4, request, page_size=16, tokens=1024)
    requeued = run_alone(smollm2_int4, request, page_size=16, tokens=1024, max_rq_tokens=16)
    assert len(once.token_ids[0]) == 300
    assert requeued.requeues >= 8
    assert requeued.token_ids == once.token_ids


def test_a_skipped_job_starts_after_max_skips(tiny):
    vocab = tiny.config.vocab_size
    gen = make_generator(tiny, page_size=16, tokens=160, max_skips=3, max_batch_size=8)
    hog = gen.submit(
        JobRequest(
            prompt=random_ids(60, 1, vocab), sampling=GREEDY, max_new_tokens=60, stop_token_ids=()
        )
    )
    gen.iterate()  # the hog holds 8 of 10 pages
    big = gen.submit(
        JobRequest(
            prompt=random_ids(70, 2, vocab), sampling=GREEDY, max_new_tokens=20, stop_token_ids=()
        )
    )
    for i in range(12):
        gen.submit(
            JobRequest(
                prompt=random_ids(5, 10 + i, vocab),
                sampling=GREEDY,
                max_new_tokens=4,
                stop_token_ids=(),
            )
        )
    order: list[int] = []
    while not gen.idle:
        for event in gen.iterate():
            if event.kind is EventKind.STARTED:
                order.append(event.job_id)
        gen.pages.validate()
    assert hog.job_id not in order  # it started before we recorded
    started_before_big = order[: order.index(big.job_id)]
    # Small jobs passed the big one while it was skipped, but no more than max_skips times.
    assert 1 <= len(started_before_big) <= 3
    assert big.skips >= 3  # it kept waiting for the hog, holding the rest back


def test_stress_random_jobs_cancellations_and_sharing_never_leak(tiny):
    rng = random.Random(7)
    vocab = tiny.config.vocab_size
    gen = make_generator(
        tiny, page_size=16, tokens=512, max_batch_size=8, max_chunk_size=32, max_rq_tokens=32
    )
    shared = random_ids(40, 99, vocab)
    submitted = 0
    finished = 0
    while submitted < 200 or not gen.idle:
        for _ in range(rng.randint(0, 3)):
            if submitted >= 200:
                break
            prompt = (shared if rng.random() < 0.4 else []) + random_ids(
                rng.randint(1, 60), rng.randint(0, 10**6), vocab
            )
            kind = rng.random()
            request = JobRequest(
                prompt=prompt,
                sampling=SamplingSettings(
                    temperature=rng.choice([0.0, 0.9]), seed=rng.randint(0, 99)
                ),
                max_new_tokens=rng.randint(1, 40),
                stop_token_ids=(rng.randrange(vocab),),
                n=4 if kind < 0.15 else 1,
                beam_width=3 if 0.15 <= kind < 0.3 else 1,
            )
            gen.submit(request)
            submitted += 1
        if gen.jobs and rng.random() < 0.2:
            finished += sum(e.eos for e in gen.cancel(rng.choice(list(gen.jobs))))
        for event in gen.iterate():
            finished += event.eos
        gen.pages.validate()
    drain(gen)
    assert finished == 200


def test_parallel_sampling_and_beam_search_share_pages(tiny):
    prompt = random_ids(100, 5, tiny.config.vocab_size)
    one = run_alone(
        tiny, JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=40, stop_token_ids=())
    )
    sampled = run_alone(
        tiny,
        JobRequest(
            prompt=prompt,
            sampling=SamplingSettings(temperature=1.0, seed=3),
            max_new_tokens=40,
            n=4,
            stop_token_ids=(),
        ),
    )
    beams = run_alone(
        tiny,
        JobRequest(
            prompt=prompt, sampling=GREEDY, max_new_tokens=40, beam_width=4, stop_token_ids=()
        ),
    )
    independent = 4 * one.peak_pages
    print(
        f"\npages: 4 independent jobs {independent}, n=4 {sampled.peak_pages} "
        f"({sampled.peak_pages / independent:.2f}), beam 4 {beams.peak_pages} ({beams.peak_pages / independent:.2f})"
    )
    assert len(sampled.texts) == 4 and len({tuple(t) for t in sampled.token_ids}) > 1
    assert sampled.peak_pages < independent
    assert beams.peak_pages < independent
    assert len(beams.token_ids) == 4 and all(len(t) == 40 for t in beams.token_ids)
    assert beams.beam_scores == sorted(beams.beam_scores, reverse=True)


def test_beam_search_width_one_candidate_matches_greedy_scores(tiny):
    """The best beam scores at least as well as the greedy path (it searches a superset)."""
    import torch

    prompt = random_ids(20, 8, tiny.config.vocab_size)
    greedy = run_alone(
        tiny, JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=12, stop_token_ids=())
    )
    beams = run_alone(
        tiny,
        JobRequest(
            prompt=prompt, sampling=GREEDY, max_new_tokens=12, beam_width=4, stop_token_ids=()
        ),
    )

    def score(tokens):
        from engine.cache.kv_cache import KVCache, StepBatch

        ids = prompt + tokens
        cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=256))
        alloc = cache.pages.allocate(1, ids, 0)
        batch = StepBatch.build([(alloc.block_table, 0, len(ids))], 16, all_logits=True)
        logp = torch.log_softmax(tiny.model.forward(torch.tensor(ids), batch, cache), -1)
        return sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens))

    assert score(beams.token_ids[0]) >= score(greedy.token_ids[0]) - 1e-4
    assert beams.beam_scores[0] == pytest.approx(score(beams.token_ids[0]) / 12, abs=1e-3)


def test_same_seed_same_text_batched_or_alone(smollm2_int4):
    tok = smollm2_int4.tokenizer
    sampling = SamplingSettings(temperature=0.9, top_p=0.95, seed=1234)
    requests = [
        JobRequest(prompt=_chat_ids(tok, SYSTEM, q), sampling=sampling, max_new_tokens=16)
        for q in ("Tell me a joke.", "Describe a cat.", "What is rain?")
    ]
    alone = [run_alone(smollm2_int4, r, tokens=2048).token_ids for r in requests]
    gen = make_generator(smollm2_int4, tokens=2048)
    jobs = [gen.submit(r) for r in requests]
    results = drain(gen)
    assert [results[j.job_id].token_ids for j in jobs] == alone


def test_events_stream_the_reply(smollm2_int4):
    tok = smollm2_int4.tokenizer
    gen = make_generator(smollm2_int4, tokens=2048)
    job = gen.submit(
        JobRequest(
            prompt=_chat_ids(tok, SYSTEM, "Count to five."),
            sampling=GREEDY,
            max_new_tokens=30,
            stop_strings=("4",),
        )
    )
    events = []
    result = drain(gen, events)[job.job_id]
    kinds = [e.kind for e in events]
    assert kinds[0] is EventKind.STARTED and kinds[-1] is EventKind.DONE
    assert EventKind.PREFILL in kinds and EventKind.STREAMING in kinds
    assert stream_text(events, job.job_id) == result.text
    if result.eos_reason == "stop_string":
        assert "4" not in result.text
    assert result.prompt_tokens == len(_chat_ids(tok, SYSTEM, "Count to five."))
    assert result.time_prefill > 0 and result.time_generate >= 0


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        ({"prompt": []}, "empty"),
        ({"prompt": [1, 2], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": [1, 2], "max_new_tokens": -5}, "max_new_tokens"),
        ({"prompt": [1, 2], "sampling": SamplingSettings(temperature=-1)}, "temperature"),
        ({"prompt": [1, 2], "sampling": SamplingSettings(top_p=2.0)}, "top_p"),
        ({"prompt": [1, 2], "n": 2, "beam_width": 2}, "not both"),
        ({"prompt": [10**9]}, "vocabulary"),
        ({"prompt": list(range(300)), "max_new_tokens": 10}, "pages"),
    ],
)
def test_bad_requests_are_refused_with_a_clear_message(tiny, request_kwargs, message):
    gen = make_generator(tiny, page_size=16, tokens=256)
    with pytest.raises(ValueError, match=message):
        gen.submit(JobRequest(**request_kwargs))
    assert gen.idle


def test_a_prompt_longer_than_the_cache_names_the_sizes(tiny):
    gen = make_generator(tiny, page_size=16, tokens=256)
    with pytest.raises(CacheFullError) as info:
        gen.submit(JobRequest(prompt=random_ids(400, 1), max_new_tokens=8))
    assert info.value.pages_total == 16 and info.value.pages_needed > 16


def test_an_error_in_one_job_ends_it_and_the_others_go_on(tiny, monkeypatch):
    gen = make_generator(tiny, page_size=16, tokens=1024)
    poison = 17
    real_forward = gen.model.forward

    def forward(tokens, batch, cache):
        if len(tokens) > 1 and int(tokens[0]) == poison:
            raise RuntimeError("simulated kernel failure")
        return real_forward(tokens, batch, cache)

    monkeypatch.setattr(gen.model, "forward", forward)
    good = gen.submit(
        JobRequest(
            prompt=[5] + random_ids(30, 1), sampling=GREEDY, max_new_tokens=8, stop_token_ids=()
        )
    )
    bad = gen.submit(
        JobRequest(
            prompt=[poison] + random_ids(30, 2),
            sampling=GREEDY,
            max_new_tokens=8,
            stop_token_ids=(),
        )
    )
    results = drain(gen)
    assert results[bad.job_id].eos_reason == "error"
    assert "simulated kernel failure" in results[bad.job_id].error
    assert results[good.job_id].eos_reason == "max_new_tokens"
    assert len(results[good.job_id].token_ids[0]) == 8


def test_cancel_releases_pages_at_once(tiny):
    gen = make_generator(tiny, page_size=16, tokens=1024)
    job = gen.submit(
        JobRequest(prompt=random_ids(50, 3), sampling=GREEDY, max_new_tokens=100, stop_token_ids=())
    )
    other = gen.submit(
        JobRequest(prompt=random_ids(20, 4), sampling=GREEDY, max_new_tokens=30, stop_token_ids=())
    )
    for _ in range(5):
        gen.iterate()
    seq_ids = {s.seq_id for s in job.sequences}
    assert seq_ids & gen.pages.allocations.keys()
    events = gen.cancel(job.job_id)
    assert events[-1].eos and events[-1].eos_reason == "cancelled"
    assert not seq_ids & gen.pages.allocations.keys()
    assert all(not seq_ids & rec.owners for rec in gen.pages.pages)
    gen.pages.validate()
    results = drain(gen)
    assert results[other.job_id].eos_reason == "max_new_tokens"
    assert gen.cancel(job.job_id) == []  # cancelling twice does nothing


def test_identical_generations_share_their_pages(tiny):
    gen = make_generator(tiny, page_size=16, tokens=1024)
    prompt = random_ids(20, 21, tiny.config.vocab_size)
    jobs = [
        gen.submit(JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=60, stop_token_ids=()))
        for _ in range(2)
    ]
    results = drain(gen)
    assert results[jobs[0].job_id].token_ids == results[jobs[1].job_id].token_ids
    # Each generated page that filled was found already stored by the other job.
    assert gen.pages.counters.dedup_switches >= 3
    assert results[jobs[1].job_id].peak_pages <= 6


@pytest.mark.parametrize("width", [{"n": 3}, {"beam_width": 3}])
def test_a_request_wider_than_the_batch_is_refused_naming_the_setting(tiny, width):
    gen = make_generator(tiny, page_size=16, tokens=256, max_batch_size=2)
    with pytest.raises(ValueError, match="needs 3 sequences at once but the batch holds 2"):
        gen.submit(JobRequest(prompt=[1, 2, 3], max_new_tokens=4, **width))
    assert gen.idle


def test_a_job_queued_wider_than_the_batch_ends_and_holds_nobody_back(tiny):
    from engine.generator.job import Job

    vocab = tiny.config.vocab_size
    gen = make_generator(tiny, page_size=16, tokens=512, max_batch_size=2, max_skips=1)
    request = JobRequest(prompt=[1, 2, 3], sampling=GREEDY, max_new_tokens=4, n=3)
    wide = Job(gen.new_job_id(), request, [1, 2, 3], frozenset(), gen.clock())
    gen.enqueue(wide)  # past `prepare`, as a caller of the generator may
    small = [
        gen.submit(
            JobRequest(
                prompt=random_ids(5, i, vocab), sampling=GREEDY, max_new_tokens=4, stop_token_ids=()
            )
        )
        for i in range(6)
    ]
    results = drain(gen, max_steps=500)
    assert results[wide.job_id].eos_reason == "error"
    assert "raise the batch size" in results[wide.job_id].error
    assert all(results[j.job_id].new_tokens == 4 for j in small)
    assert not gen.jobs and not gen.seq_jobs  # ended like any job: nothing left behind


def test_a_job_with_every_token_banned_ends_alone_and_its_batch_goes_on(tiny):
    vocab = tiny.config.vocab_size
    ban_all = tuple((t, -math.inf) for t in range(vocab))
    greedy = JobRequest(
        prompt=random_ids(12, 31, vocab), sampling=GREEDY, max_new_tokens=20, stop_token_ids=()
    )
    solo = run_alone(tiny, greedy)
    gen = make_generator(tiny)
    kept = gen.submit(greedy)
    banned = [
        gen.submit(
            JobRequest(
                prompt=random_ids(9, 32 + i, vocab),
                sampling=SamplingSettings(temperature=t, seed=1, logit_bias=ban_all),
                max_new_tokens=20,
                stop_token_ids=(),
                **extra,
            )
        )
        for i, (t, extra) in enumerate([(0.0, {}), (0.9, {"n": 2}), (0.0, {"beam_width": 2})])
    ]
    results = drain(gen)
    assert results[kept.job_id].token_ids == solo.token_ids
    assert results[kept.job_id].eos_reason == "max_new_tokens"
    for job in banned:
        assert results[job.job_id].eos_reason == "error"
        assert "nothing left to sample" in results[job.job_id].error


@pytest.mark.parametrize("length_penalty", [1e308, -1e308])
def test_an_extreme_length_penalty_is_refused_or_ranks_without_overflow(tiny, length_penalty):
    request = JobRequest(
        prompt=random_ids(10, 41, tiny.config.vocab_size),
        sampling=GREEDY,
        max_new_tokens=6,
        beam_width=3,
        stop_token_ids=(),
        length_penalty=length_penalty,
    )
    try:
        request.validate()
    except ValueError as exc:
        assert "length_penalty" in str(exc)
        return
    result = run_alone(tiny, request)
    assert result.eos_reason == "max_new_tokens"
    assert [len(ids) for ids in result.token_ids] == [6, 6, 6]


@pytest.mark.parametrize("stage", ["forward", "sample", "stops"])
def test_a_failure_in_one_sequence_of_a_decode_step_ends_only_its_job(tiny, monkeypatch, stage):
    vocab = tiny.config.vocab_size

    def requests():
        return [
            JobRequest(prompt=random_ids(14, 51, vocab), sampling=GREEDY, max_new_tokens=16),
            JobRequest(
                prompt=random_ids(21, 52, vocab),
                sampling=SamplingSettings(temperature=0.9, top_p=0.9, seed=5),
                max_new_tokens=16,
                n=2,
            ),
            JobRequest(
                prompt=random_ids(9, 53, vocab),
                sampling=SamplingSettings(temperature=0, presence_penalty=0.5),
                max_new_tokens=16,
            ),
        ]

    clean = make_generator(tiny)
    clean_jobs = [clean.submit(r) for r in requests()]
    clean_results = drain(clean)
    expected = [clean_results[j.job_id].token_ids for j in clean_jobs]

    gen = make_generator(tiny)
    jobs = [gen.submit(r) for r in requests()]
    bad = gen.submit(
        JobRequest(
            prompt=random_ids(17, 54, vocab),
            sampling=SamplingSettings(temperature=0.7, seed=9),
            max_new_tokens=16,
        )
    )

    def bad_is_due(rows=None) -> bool:
        seqs = bad.sequences
        mine = rows is None or any(seq in seqs for seq in rows)
        return mine and len(seqs[0].generated) >= 3

    if stage == "forward":
        real = gen._decode_forward
        monkeypatch.setattr(
            gen,
            "_decode_forward",
            lambda rows: (
                (_ for _ in ()).throw(RuntimeError("injected")) if bad_is_due(rows) else real(rows)
            ),
        )
    elif stage == "sample":
        real = gen.sampler.sample

        def sample(logits, settings, *args):
            if bad.request.sampling in settings and bad_is_due():
                raise RuntimeError("injected")
            return real(logits, settings, *args)

        monkeypatch.setattr(gen.sampler, "sample", sample)
    else:
        gen.iterate()  # admitted and prefilled: its stop handler exists now
        real = bad.sequences[0].stops.feed

        def feed(token):
            if bad_is_due():
                raise RuntimeError("injected")
            return real(token)

        monkeypatch.setattr(bad.sequences[0].stops, "feed", feed)
    results = drain(gen)
    assert results[bad.job_id].eos_reason == "error"
    assert "injected" in results[bad.job_id].error
    assert [results[j.job_id].token_ids for j in jobs] == expected


def test_parallel_samples_under_cache_pressure_never_cost_another_job_its_reply(tiny):
    """The pages an n>1 job's forks may still copy stay reserved while it generates, so a
    job admitted meanwhile never takes them: every job, of any width, ends normally."""
    vocab = tiny.config.vocab_size
    errors = []
    for seed in range(12):
        rng = random.Random(seed)
        gen = make_generator(tiny, page_size=16, tokens=16 * 24, max_batch_size=8)
        arrivals = [
            JobRequest(
                prompt=random_ids(rng.randint(2, 60), 1000 * seed + i, vocab),
                sampling=SamplingSettings(temperature=1.0, seed=i),
                max_new_tokens=rng.randint(8, 64),
                n=rng.choice([1, 1, 2, 3, 4]),
                stop_token_ids=(),
            )
            for i in range(10)
        ]
        results: dict[int, JobResult] = {}
        steps = 0
        while arrivals or not gen.idle:
            if arrivals and steps % 3 == 0:
                gen.submit(arrivals.pop(0))
            for event in gen.iterate():
                if event.eos:
                    results[event.job_id] = event.result
            gen.pages.validate()
            steps += 1
            assert steps < 20_000, "the generator did not drain"
        assert_no_leaks(gen)
        errors += [(seed, r.error) for r in results.values() if r.eos_reason == "error"]
    assert not errors, errors


def test_batching_is_invisible_over_the_tile_kernel(tmp_path, monkeypatch):
    """A Q4_K_M model where the CPU takes its Q4_K / Q6_K weights as tiles
    (kernels/quant/tiles.py): prompt chunks of any size and decode steps of up to 40
    sequences (more than DECODE_MAX_ROWS) through the one tile kernel: every job's tokens
    equal its tokens alone."""
    import kernels.quant.linear as linear
    from kernels.quant.linear import LANE_MIN_ROWS, BlockLinear
    from kernels.quant.matmul import DECODE_MAX_ROWS
    from kernels.quant.tiles import tiles_supported
    from tests.engine.test_forward_tiny import FILE_MIXES
    from tests.engine.tiny_models import Q, make_hf_model, write_gguf

    if not tiles_supported("Q4_K"):
        pytest.skip("this CPU has no AVX-512 VNNI: k-quants stay in file blocks here")
    model = make_hf_model("llama", seed=21, tie_word_embeddings=False)
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=5)
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    lins = [lin for layer in loaded.model.layers for lin in (layer.qkv, layer.down)]
    assert all(isinstance(lin, BlockLinear) and lin.repacked() for lin in lins)
    requests = _varied_requests(40, loaded.config.vocab_size, seed=3, max_new=6)
    alone = [run_alone(loaded, r, tokens=4096, max_chunk_size=32).token_ids[0] for r in requests]
    seen = []
    tiles = linear._tiles
    monkeypatch.setattr(
        linear, "_tiles", lambda group, act, cols: seen.append(len(cols)) or tiles(group, act, cols)
    )
    batched, _, _ = _batched(loaded, requests, tokens=8192, max_batch_size=40, max_chunk_size=32)
    assert [r.token_ids[0] for r in batched] == alone
    assert any(rows >= LANE_MIN_ROWS for rows in seen)  # prompt chunks
    assert any(rows > DECODE_MAX_ROWS // 2 for rows in seen)  # many sequences decoded
