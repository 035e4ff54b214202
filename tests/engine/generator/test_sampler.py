"""The sampler (docs/ENGINE.md §7): transformers' logits processors as the reference for
the processed distribution, then greedy, seeding, batch invariance and frequencies."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.generator.sampler import (
    MAX_LOGIT_BIAS,
    NothingToSample,
    Sampler,
    SamplingSettings,
    argmax_rows,
    empty_rows,
    make_generator,
    process_logits,
)

V = 97


def reference_scores(
    row: torch.Tensor, s: SamplingSettings, prompt: list[int], generated: list[int]
) -> torch.Tensor:
    """One row through transformers' own processors, in the sampler's order."""
    processors = LogitsProcessorList()
    if s.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in s.logit_bias}))
    history = prompt + generated
    if s.repetition_penalty != 1 and history:
        processors.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    processors.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k:
        processors.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1:
        processors.append(TopPLogitsWarper(s.top_p))
    if s.min_p:
        processors.append(MinPLogitsWarper(s.min_p))
    ids = torch.tensor([history or [0]], dtype=torch.long)  # [0] only feeds the bias processor
    return processors(ids, row[None].clone())[0]


def random_settings(rng: random.Random) -> SamplingSettings:
    return SamplingSettings(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 40]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.95]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        logit_bias=rng.choice([(), ((3, 2.5), (50, -1.0)), ((7, -math.inf),)]),
    )


@pytest.mark.parametrize("partial_sort", [False, True], ids=["full-sort", "top-k-sort"])
def test_processed_distribution_matches_transformers(partial_sort):
    rng = random.Random(0)
    torch.manual_seed(0)
    rows = 60
    logits = torch.randn(rows, V) * 3
    settings = [random_settings(rng) for _ in range(rows)]
    if partial_sort:  # every top-p row also has top-k: the sampler sorts only the top k
        settings = [
            replace(s, top_k=rng.choice([5, 40])) if s.top_p < 1 and not s.top_k else s
            for s in settings
        ]
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    generated = [[rng.randrange(V) for _ in range(rng.randrange(0, 8))] for _ in range(rows)]
    # Whole mixed batch in one call: per-row settings must not leak between rows.
    ours = process_logits(logits, settings, prompts, generated)
    for i in range(rows):
        expected = reference_scores(logits[i], settings[i], prompts[i], generated[i])
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(expected)), (i, settings[i])
        torch.testing.assert_close(ours[i].softmax(-1), expected.softmax(-1), rtol=1e-5, atol=1e-6)


def test_probabilities_sum_to_one_and_greedy_rows_are_one_hot():
    logits = torch.randn(3, V)
    settings = [
        SamplingSettings(temperature=0),
        SamplingSettings(top_p=0.8),
        SamplingSettings(min_p=0.1),
    ]
    probs = Sampler().probabilities(logits, settings, [[]] * 3, [[]] * 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert probs[0, logits[0].argmax()] == 1


def test_greedy_is_argmax_after_bias_and_penalties_and_draws_nothing():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    g = make_generator(5)
    state = g.get_state()
    plain = SamplingSettings(temperature=0, top_k=3, top_p=0.5, min_p=0.5)
    biased = SamplingSettings(temperature=0, logit_bias=((11, 100.0),))
    penalised = SamplingSettings(temperature=0, repetition_penalty=1e6, frequency_penalty=1e3)
    top = int(logits[2].argmax())
    settings = [plain, biased, penalised, plain]
    tokens = Sampler().sample(logits, settings, [g] * 4, [[], [], [], []], [[], [], [top], []])
    assert tokens.dtype == torch.int64
    assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()
    assert tokens[1] == 11
    without_top = logits[2].clone()
    without_top[top] = -math.inf
    assert tokens[2] == without_top.argmax()
    assert torch.equal(g.get_state(), state)


def run_sequences(settings, seeds, steps=50, vocab=64, table_seed=7):
    """A toy model: logits depend only on the row's last token, so a row's text is a
    function of its own draws. Returns each row's generated tokens."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(table_seed)) * 2
    sampler = Sampler()
    generators = [make_generator(seed) for seed in seeds]
    prompts = [[1, 2, 3] for _ in settings]
    generated: list[list[int]] = [[] for _ in settings]
    for _ in range(steps):
        last = torch.tensor([(g or p)[-1] for g, p in zip(generated, prompts)])
        tokens = sampler.sample(table[last], settings, generators, prompts, generated)
        for row, token in zip(generated, tokens.tolist()):
            row.append(token)
    return generated


def test_row_sampled_alone_or_in_a_mixed_batch_gives_the_same_tokens():
    ours = SamplingSettings(
        temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3
    )
    others = [
        SamplingSettings(temperature=0),
        SamplingSettings(temperature=1.3, min_p=0.05, frequency_penalty=0.5),
        SamplingSettings(temperature=0.5, top_p=0.6, logit_bias=((4, 3.0),)),
        SamplingSettings(temperature=1.0, top_k=2),
    ]
    alone = run_sequences([ours], [1234])[0]
    batch = run_sequences([others[0], others[1], ours, others[2], others[3]], [9, 8, 1234, 7, 6])
    assert batch[2] == alone
    assert len(set(alone)) > 5  # really sampled, not stuck on one token


def test_same_seed_reproduces_and_different_seeds_differ():
    s = SamplingSettings(temperature=1.0)
    first = run_sequences([s, s], [42, 43])
    again = run_sequences([s], [42])[0]
    assert first[0] == again
    assert first[0] != first[1]


def test_empirical_frequencies_match_probabilities():
    vocab, rows, steps = 8, 2500, 4
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    settings = [SamplingSettings(temperature=0.8, top_k=6, min_p=0.02)] * rows
    sampler = Sampler()
    expected = sampler.probabilities(logits[None], settings[:1], [[]], [[]])[0]
    generators = [make_generator(seed) for seed in range(rows)]
    counts = torch.zeros(vocab)
    for _ in range(steps):
        tokens = sampler.sample(
            logits.expand(rows, vocab), settings, generators, [[]] * rows, [[]] * rows
        )
        counts += torch.bincount(tokens, minlength=vocab)
    n = rows * steps
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    chi2 = float((((counts - n * expected) ** 2)[kept] / (n * expected[kept])).sum())
    assert chi2 < 25, chi2  # 5 degrees of freedom; p(chi2 > 25) ~ 1e-4
    torch.testing.assert_close(counts / n, expected, rtol=0, atol=0.015)


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    forced = SamplingSettings(temperature=1.0, logit_bias=((17, 100.0),))
    top = int(logits[1].argmax())
    banned = SamplingSettings(temperature=0, logit_bias=((top, -math.inf),))
    sampler = Sampler()
    generators = [make_generator(0), None]
    for _ in range(20):
        tokens = sampler.sample(logits, [forced, banned], generators, [[], []], [[], []])
        assert tokens[0] == 17 and tokens[1] != top


def test_presence_counts_once_frequency_counts_every_occurrence():
    logits = torch.zeros(3, 6)
    generated = [2, 2, 2, 4]
    settings = [
        SamplingSettings(temperature=1.0, presence_penalty=0.5),
        SamplingSettings(temperature=1.0, frequency_penalty=0.5),
        SamplingSettings(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.25),
    ]
    # Prompt tokens never count for these two penalties.
    out = process_logits(logits, settings, [[0, 1, 2]] * 3, [generated] * 3)
    assert out[0].tolist() == [0, 0, -0.5, 0, -0.5, 0]
    assert out[1].tolist() == [0, 0, -1.5, 0, -0.5, 0]
    assert out[2].tolist() == [0, 0, -1.75, 0, -1.25, 0]


def test_repetition_penalty_covers_prompt_and_generated_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    s = SamplingSettings(temperature=1.0, repetition_penalty=2.0)
    out = process_logits(logits, [s], [[0, 1, 1]], [[3]])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -4.0, 1.0]


def test_large_vocabulary_mixed_batch():
    logits = torch.randn(3, 262144, generator=torch.Generator().manual_seed(0))
    settings = [
        SamplingSettings(top_p=0.9),
        SamplingSettings(top_k=50),
        SamplingSettings(temperature=0),
    ]
    generators = [make_generator(1), make_generator(2), None]
    tokens = Sampler().sample(logits, settings, generators, [[5]] * 3, [[]] * 3)
    assert tokens.shape == (3,) and tokens[2] == logits[2].argmax()
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 262144


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"logit_bias": ((-1, 1.0),)}, "token id"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "more than once"),
        ({"logit_bias": ((3, math.inf),)}, "logit_bias for token 3"),
        ({"seed": -5}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_validate_rejects_out_of_range_values(change, message):
    with pytest.raises(ValueError, match=message):
        replace(SamplingSettings(), **change).validate()


def test_logit_bias_list_is_bounded():
    # issue 13, defect 9: the settings are checked on the engine thread at every step
    long = tuple((t, -1.0) for t in range(MAX_LOGIT_BIAS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_LOGIT_BIAS} are allowed"):
        SamplingSettings(logit_bias=long).validate()
    SamplingSettings(logit_bias=long[:MAX_LOGIT_BIAS]).validate()
    with pytest.raises(ValueError, match="list of \\(token_id, bias\\) pairs"):
        SamplingSettings(logit_bias=5).validate()


def test_validate_accepts_defaults_and_edges():
    SamplingSettings().validate()
    SamplingSettings(
        temperature=0, top_p=1.0, min_p=1.0, seed=2**64 - 1, logit_bias=((0, -math.inf),)
    ).validate()


def test_sample_rejects_mismatched_batch_and_bias_outside_vocab():
    sampler = Sampler()
    with pytest.raises(ValueError, match="batch of 2"):
        sampler.sample(torch.zeros(2, 5), [SamplingSettings()], [None], [[]], [[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.sample(
            torch.zeros(1, 5), [SamplingSettings(logit_bias=((5, 1.0),))], [None], [[]], [[]]
        )


# -- a row with nothing left, and values beyond float32 (issue 13, defect 4) ------------------


def test_a_row_with_every_token_banned_is_named_and_no_row_draws():
    vocab = 7
    banned = SamplingSettings(
        temperature=0.8, logit_bias=tuple((t, -math.inf) for t in range(vocab))
    )
    greedy_banned = replace(banned, temperature=0)
    sampled = SamplingSettings(temperature=0.8, seed=3)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    generator = make_generator(3)
    with pytest.raises(NothingToSample, match="nothing left to sample") as raised:
        Sampler().sample(
            logits, [banned, sampled, greedy_banned], [None, generator, None], [[]] * 3, [[]] * 3
        )
    assert raised.value.rows == [0, 2]
    # The sampled row drew nothing: alone it picks what it would have picked first.
    alone = Sampler().sample(logits[1:2], [sampled], [generator], [[]], [[]])
    assert (
        alone.tolist()
        == Sampler().sample(logits[1:2], [sampled], [make_generator(3)], [[]], [[]]).tolist()
    )


def test_huge_biases_are_refused_and_inf_or_nan_logits_never_yield_an_id_outside_the_vocab():
    huge = SamplingSettings(logit_bias=((1, 1e308), (2, 1e308)))
    with pytest.raises(ValueError, match="logit_bias for token 1"):
        huge.validate()
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingSettings(presence_penalty=1e308).validate()
    vocab = 5
    logits = torch.tensor(
        [
            [0.0, math.inf, math.inf, 0.0, 0.0],
            [math.nan] * vocab,
            [math.nan, 1.0, math.nan, -math.inf, 2.0],
            [1.0, 2.0, 3.0, 4.0, 5.0],
        ]
    )
    settings = [SamplingSettings(temperature=t, top_p=0.9, min_p=0.1) for t in (1.0, 0.5, 1e-30, 0)]
    settings[3] = SamplingSettings(temperature=0, logit_bias=((4, 1e6), (3, 1e6)))
    scores = process_logits(logits, settings, [[]] * 4, [[]] * 4)
    assert not scores.isnan().any() and not scores.isposinf().any()
    assert empty_rows(scores) == [1]
    tokens = (
        Sampler()
        .sample(
            logits[[0, 2, 3]],
            [settings[i] for i in (0, 2, 3)],
            [make_generator(s) for s in range(3)],
            [[]] * 3,
            [[]] * 3,
        )
        .tolist()
    )
    assert tokens[0] in (1, 2) and tokens[1] in (1, 4) and tokens[2] == 4
    for seed in range(50):
        token = Sampler().sample(logits[:1], settings[:1], [make_generator(seed)], [[]], [[]])
        assert 0 <= int(token) < vocab


def test_argmax_rows_answers_as_torch_does_with_ties_infinities_and_nans():
    """The greedy argmax (numpy's on CPU float32 logits) against torch's on the same rows:
    random rows, a tie for the maximum (the first wins), +inf and -inf, a NaN (the first
    NaN wins), an all -inf row, a non-contiguous view, and a bf16 batch (torch's path)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 50_000, generator=g)
    x[1, [7, 40_000]] = 9.0  # tie
    x[2, 123] = math.inf
    x[3, [5, 6]] = math.nan
    x[3, 4] = math.inf
    x[4] = -math.inf
    x[5, 49_999] = 100.0  # the last column
    x[6, [10, 20]] = math.inf  # tie of infinities
    for rows in (x, x[:, ::2], x[::3], x[:1]):
        got = argmax_rows(rows)
        assert got.dtype == torch.int64 and got.tolist() == rows.argmax(dim=-1).tolist()
    assert argmax_rows(x.bfloat16()).tolist() == x.bfloat16().argmax(dim=-1).tolist()
