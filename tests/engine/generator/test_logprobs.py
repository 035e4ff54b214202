"""Per-token logprobs (`JobRequest.logprobs`, docs/ENGINE.md §7): the model's own
log-probabilities, as transformers computes them over prompt + generated tokens; they
change no sampled token; they stay aligned with the token ids through stop handling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.cache.kv_cache import CacheSettings
from engine.generator.job import EventKind, JobEvent, JobRequest, JobResult
from engine.generator.sampler import SamplingSettings
from engine.model.loader import load_model
from tests.engine.generator.helpers import GREEDY, drain, make_generator, random_ids
from tests.engine.tiny_models import make_hf_model, save_hf_folder, write_chat_model

TOL = 1e-4
# Sampling that reshapes the distribution every way the sampler can: the logprobs must
# still be the model's, not the processed distribution's.
SHAPED = SamplingSettings(
    temperature=0.8,
    top_k=40,
    top_p=0.9,
    repetition_penalty=1.3,
    presence_penalty=0.5,
    logit_bias=((7, 5.0), (11, -100.0)),
    seed=5,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The generator tests' tiny Qwen3, with its transformers original as the reference."""
    hf = make_hf_model("qwen3", seed=11)
    folder = save_hf_folder(hf, tmp_path_factory.mktemp("tiny") / "m")
    return hf, load_model(folder, load_tokenizer=False)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A tiny model with a byte-level tokenizer: text, so stop strings can match."""
    return load_model(write_chat_model(tmp_path_factory.mktemp("chat") / "m", context=256))


def _reference(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at the positions that predicted `generated`."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def _run(gen, requests: list[JobRequest]) -> tuple[list[JobResult], list[JobEvent]]:
    events: list[JobEvent] = []
    jobs = [gen.submit(r) for r in requests]
    results = drain(gen, events)
    return [results[j.job_id] for j in jobs], events


def test_logprobs_are_the_models_own(tiny):
    hf, loaded = tiny
    k = 5
    prompt = random_ids(40, seed=1)  # three pages, prefilled in 16-token chunks
    requests = [
        JobRequest(
            prompt=prompt, sampling=SHAPED, max_new_tokens=10, stop_token_ids=(), logprobs=k
        ),
        JobRequest(
            prompt=random_ids(9, seed=2),
            sampling=GREEDY,
            max_new_tokens=8,
            stop_token_ids=(),
            logprobs=k,
        ),
        JobRequest(
            prompt=random_ids(20, seed=3),
            sampling=SamplingSettings(temperature=1.0, seed=9),
            max_new_tokens=6,
            stop_token_ids=(),
            n=2,
            logprobs=k,
        ),
    ]
    # fp32 pages: transformers' arithmetic; single samples requeue
    exact = CacheSettings(page_size=16, token_budget=1024, k_bits=32, v_bits=32)
    gen = make_generator(loaded, cache=exact, max_chunk_size=16, max_rq_tokens=4)
    results, _ = _run(gen, requests)
    assert results[0].requeues > 0
    in_top = 0
    for request, result in zip(requests, results, strict=True):
        for generated, entries in zip(result.token_ids, result.logprobs, strict=True):
            ref = _reference(hf, list(request.prompt), generated)
            assert [e.token_id for e in entries] == generated
            for j, e in enumerate(entries):
                assert e.logprob == pytest.approx(ref[j, e.token_id].item(), abs=TOL)
                ids = [t for t, _ in e.top]
                lps = [lp for _, lp in e.top]
                assert len(ids) == k and lps == sorted(lps, reverse=True)
                assert lps == pytest.approx(ref[j, ids].tolist(), abs=TOL)
                kth_best = ref[j].topk(k).values[-1].item()
                assert lps[-1] == pytest.approx(kth_best, abs=TOL)  # they are the top k
                if ref[j, e.token_id] > kth_best + TOL:
                    assert e.token_id in ids
                    in_top += 1
            if request.sampling.greedy:
                assert all(e.logprob == e.top[0][1] for e in entries)
    assert in_top > 0, "no chosen token was in its top k: the check above never ran"
    # bias and penalties moved the shaped job's choices away from the model's argmax
    shaped = results[0].logprobs[0]
    assert any(e.token_id != e.top[0][0] for e in shaped)


def test_logprobs_change_no_token(tiny):
    _, loaded = tiny

    def requests(logprobs: int | None) -> list[JobRequest]:
        return [
            JobRequest(
                prompt=random_ids(30, seed=4),
                sampling=SHAPED,
                max_new_tokens=12,
                stop_token_ids=(),
                logprobs=logprobs,
            ),
            JobRequest(
                prompt=random_ids(12, seed=5),
                sampling=SamplingSettings(temperature=1.2, min_p=0.01, seed=3),
                max_new_tokens=12,
                stop_token_ids=(),
                n=3,
                logprobs=logprobs,
            ),
            # a neighbour that never asks: the batch is mixed either way
            JobRequest(prompt=random_ids(7, seed=6), sampling=GREEDY, max_new_tokens=12),
        ]

    plain, plain_events = _run(make_generator(loaded), requests(None))
    asked, asked_events = _run(make_generator(loaded), requests(3))
    assert [r.token_ids for r in asked] == [r.token_ids for r in plain]
    assert len(set(map(tuple, plain[1].token_ids))) > 1, "the samples are all alike"
    # nothing is computed or reported where nobody asks
    assert all(not r.logprobs for r in plain) and not asked[2].logprobs
    assert all(not e.logprobs for e in plain_events)
    assert [len(lp) for lp in asked[1].logprobs] == [len(ids) for ids in asked[1].token_ids]
    # k = 0: the chosen token's logprob, no alternatives
    zero = _run(make_generator(loaded), requests(0))[0][0]
    assert zero.token_ids == plain[0].token_ids
    assert all(e.top == () for e in zero.logprobs[0])
    assert [e.logprob for e in zero.logprobs[0]] == [e.logprob for e in asked[0].logprobs[0]]


def _ascii_only(tokenizer) -> tuple[tuple[int, float], ...]:
    """Bans every token that is not one printable ASCII character: readable text."""
    text = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    return tuple(
        (i, -100.0)
        for i, t in enumerate(text)
        if not (len(t) == 1 and t.isascii() and t.isprintable())
    )


def test_logprobs_stay_aligned_through_stop_strings(tiny_chat):
    sampling = SamplingSettings(
        temperature=1.0, seed=21, logit_bias=_ascii_only(tiny_chat.tokenizer)
    )
    prompt = tiny_chat.tokenizer.encode("Once upon a time")
    base = JobRequest(prompt=prompt, sampling=sampling, max_new_tokens=24, stop_token_ids=())
    gen = make_generator(tiny_chat)
    (free,), _ = _run(gen, [base])
    text = free.text
    assert len(text) == 24
    # One stop string that starts matching and then diverges (its text held, then released)
    # and one that completes (its text held, then dropped with the token that completes it).
    false_start = text[2] + "\x7f"
    stop = text[12:15]
    assert text.find(stop) == 12 and text.find(text[2]) == 2
    request = replace(base, stop_strings=(false_start, stop), logprobs=2)
    (result,), events = _run(gen, [request])
    assert result.eos_reason == "stop_string" and result.text == text[:12]
    assert result.token_ids[0] == free.token_ids[0][:15]  # the stop string's tokens stay
    streamed = [e for e in events if e.kind is EventKind.STREAMING]
    assert all(len(e.logprobs) == len(e.token_ids) for e in streamed)
    assert any(e.token_ids and not e.text for e in streamed), "no text was held back"
    entries = [lp for e in streamed for lp in e.logprobs]
    assert entries == result.logprobs[0]
    assert [e.token_id for e in entries] == result.token_ids[0]


def test_logprobs_are_checked_at_submit():
    for bad in (-1, 21, 1.5, True, "3"):
        with pytest.raises(ValueError, match="logprobs"):
            JobRequest(prompt=[1], logprobs=bad).validate()
    with pytest.raises(ValueError, match="beam search"):
        JobRequest(prompt=[1], beam_width=2, logprobs=1).validate()
    for fine in (None, 0, 20):
        JobRequest(prompt=[1], logprobs=fine).validate()
