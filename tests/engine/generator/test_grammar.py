"""Constrained decoding in the generator (engine/generator/grammar.py): a job with a grammar
produces output its grammar accepts, even from random weights; it leaves the other jobs of
its batch alone (same greedy tokens as alone); parallel samples each keep their own place
in the grammar; bad grammars are refused at submit."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.generator.grammar import Grammar, apply_bitmask
from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from engine.model.loader import load_model
from tests.engine.generator.helpers import GREEDY, drain, make_generator, run_alone
from tests.engine.tiny_models import write_chat_model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return load_model(write_chat_model(tmp_path_factory.mktemp("chat") / "m", context=256))


def _job(grammar=None, sampling=GREEDY, **kw) -> JobRequest:
    return JobRequest(
        messages=MESSAGES, sampling=sampling, max_new_tokens=150, grammar=grammar, **kw
    )


def test_a_grammar_job_leaves_its_batch_mates_alone(tiny_chat):
    plain = _job()
    alone = run_alone(tiny_chat, plain)
    constrained_alone = run_alone(tiny_chat, _job(Grammar.json_schema(SCHEMA)))
    object_alone = run_alone(tiny_chat, _job(Grammar.json_object()))
    gen = make_generator(tiny_chat)
    first = gen.submit(_job(Grammar.json_schema(SCHEMA)))
    second = gen.submit(plain)
    third = gen.submit(_job(Grammar.json_object()))
    steps_together = 0
    results = {}
    while not gen.idle:
        events = gen.iterate()
        if len([j for j in gen.active if j.sequences[0].generated]) == 3:
            steps_together += 1
        results.update({e.job_id: e.result for e in events if e.eos})
    assert steps_together > 0, "the jobs never decoded in one batch"
    assert results[second.job_id].token_ids == alone.token_ids
    # and the grammar jobs are the same in the batch as alone, each in its own grammar
    assert results[first.job_id].token_ids == constrained_alone.token_ids
    assert results[third.job_id].token_ids == object_alone.token_ids
    assert object_alone.text.startswith("{") and object_alone.text != alone.text
    # the unconstrained model does not write JSON: the mask is what made the difference
    with pytest.raises(ValueError):
        json.loads(alone.text)


def test_constrained_output_follows_the_schema_and_ends_with_it(tiny_chat):
    for seed in range(3):
        sampling = SamplingSettings(temperature=1.0, seed=seed)
        result = run_alone(tiny_chat, _job(Grammar.json_schema(SCHEMA), sampling))
        jsonschema.validate(json.loads(result.text), SCHEMA)
        # the object's last brace ends it: nothing but EOS could follow, so no token is
        # spent on sampling the EOS
        assert result.eos_reason == "stop_token" and result.text.endswith("}")
        assert tiny_chat.tokenizer.decode(result.token_ids[0]) == result.text


def test_parallel_samples_each_follow_the_grammar(tiny_chat):
    sampling = SamplingSettings(temperature=1.0, seed=7)
    gen = make_generator(tiny_chat)
    job = gen.submit(_job(Grammar.json_schema(SCHEMA), sampling, n=3))
    result = drain(gen)[job.job_id]
    docs = [json.loads(text) for text in result.texts]
    for doc in docs:
        jsonschema.validate(doc, SCHEMA)
    assert len({json.dumps(d) for d in docs}) > 1, "the samples should differ"


def test_a_job_that_ignores_eos_still_ends_with_its_grammar(tiny_chat):
    result = run_alone(tiny_chat, _job(Grammar.json_schema(SCHEMA), stop_token_ids=()))
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.eos_reason == "stop_token" and result.new_tokens < 150


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        (Grammar.json_schema({"type": "strin"}), "strin"),
        (Grammar.json_schema({"properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
        (Grammar.lark("start: missing_rule"), "missing_rule"),
    ],
)
def test_bad_grammars_are_refused_at_submit(tiny_chat, grammar, words):
    gen = make_generator(tiny_chat)
    with pytest.raises(ValueError, match=words):
        gen.submit(_job(grammar))
    assert gen.idle


def test_a_grammar_with_beam_search_is_refused(tiny_chat):
    gen = make_generator(tiny_chat)
    with pytest.raises(ValueError, match="beam search"):
        gen.submit(_job(Grammar.json_object(), beam_width=2))


def test_apply_bitmask_keeps_exactly_the_set_bits():
    vocab = 100  # not a multiple of 32: the last word is partly past the vocabulary
    generator = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    masked = logits.clone()
    apply_bitmask(masked, mask)
    for row in range(3):
        for token in range(vocab):
            bit = (int(mask[row, token // 32]) >> (token % 32)) & 1
            expected = logits[row, token].item() if bit else float("-inf")
            assert masked[row, token].item() == expected


def test_a_grammar_that_bias_leaves_nothing_ends_only_its_job(tiny_chat):
    brace = tiny_chat.tokenizer.encode("{", add_special_tokens=False)
    banned = SamplingSettings(temperature=0, logit_bias=((brace[0], float("-inf")),))
    alone = run_alone(tiny_chat, _job())
    gen = make_generator(tiny_chat)
    blocked = gen.submit(_job(Grammar.json_object(), banned))
    plain = gen.submit(_job())
    results = drain(gen)
    assert results[blocked.job_id].eos_reason == "error"
    assert "grammar allows no token" in results[blocked.job_id].error
    assert results[plain.job_id].token_ids == alone.token_ids


def test_requeues_and_cached_prompts_keep_the_grammars_place(tiny_chat):
    """A job requeued every page (its pages given back, its prompt re-admitted from the
    cache) goes on where its grammar was: the same tokens as a job never requeued."""
    request = _job(Grammar.json_schema(SCHEMA), SamplingSettings(temperature=1.0, seed=11))
    steady = run_alone(tiny_chat, request)
    gen = make_generator(tiny_chat, max_rq_tokens=16)
    job = gen.submit(request)
    requeued = drain(gen)[job.job_id]
    assert requeued.requeues > 0
    assert requeued.token_ids == steady.token_ids
    jsonschema.validate(json.loads(requeued.text), SCHEMA)
