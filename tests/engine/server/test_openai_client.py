"""The official `openai` client against the server: chat and completions, streamed and
not, n, stop, seeds, usage with cached tokens, logprobs, and the jobs' place on the engine."""

from __future__ import annotations

import pytest

from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from engine.server.tag import ApiTag
from tests.engine.server.conftest import CONTEXT, MODEL_ID, wait_idle

SYSTEM = "You are a terse assistant. Answer in one short line."


def chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons per choice index, and every chunk."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == MODEL_ID and model.owned_by == "folio"
    assert model.max_model_len == CONTEXT
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat_streamed_and_not_give_the_engines_text(client, engine):
    messages = chat("Name a colour.")
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=12, temperature=0
    )
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    # the same chat submitted to the engine directly, as the app submits its chats
    direct = engine.generate(
        JobRequest(messages=messages, sampling=SamplingSettings(temperature=0), max_new_tokens=12),
        timeout=60,
    )
    assert choice.message.content == direct.text
    assert (
        choice.finish_reason
        == {"stop_token": "stop", "max_new_tokens": "length"}[direct.eos_reason]
    )
    assert reply.usage.prompt_tokens == direct.prompt_tokens
    assert reply.usage.completion_tokens == direct.new_tokens
    assert reply.usage.total_tokens == direct.prompt_tokens + direct.new_tokens

    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, chunks = stream_text(stream)
    assert texts == {0: direct.text} and reasons == {0: choice.finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == direct.new_tokens
    # the stream's prompt was the cached chat: all but its last token came from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == direct.prompt_tokens - 1


def test_completion_streamed_and_not(client):
    kwargs = dict(model=MODEL_ID, prompt="The sky is", max_tokens=10, temperature=0)
    reply = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    (choice,) = reply.choices
    assert reply.object == "text_completion" and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 10
    assert reply.usage.prompt_tokens == len("The sky is")  # one byte, one token
    texts, reasons, chunks = stream_text(
        client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    )
    assert texts == {0: choice.text} and reasons == {0: "length"}
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks
    # token ids as the prompt
    ids = client.completions.create(
        model=MODEL_ID, prompt=[84, 104, 101], max_tokens=4, temperature=0
    )
    assert ids.usage.prompt_tokens == 3


def test_n_samples_share_the_prompt_and_differ(client, ascii_only):
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=chat("Tell me a word."),
        max_tokens=16,
        n=3,
        temperature=1.0,
        seed=7,
        logit_bias=ascii_only,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) == 3, texts
    assert all(t.isascii() for t in texts)
    # the prompt once, every sample's tokens
    assert reply.usage.completion_tokens >= 3
    texts_streamed, reasons, _ = stream_text(
        client.chat.completions.create(
            model=MODEL_ID,
            messages=chat("Tell me a word."),
            max_tokens=16,
            n=3,
            temperature=1.0,
            seed=7,
            logit_bias=ascii_only,
            stream=True,
        )
    )
    assert [texts_streamed[i] for i in range(3)] == texts  # a seed gives the same samples
    assert set(reasons) == {0, 1, 2}


def test_seed_reproduces_and_another_seed_differs(client, ascii_only):
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=MODEL_ID,
            prompt="Once upon a time",
            max_tokens=24,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            logit_bias=ascii_only,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_strings_cut_the_text(client, ascii_only):
    base = client.completions.create(
        model=MODEL_ID,
        prompt="abc",
        max_tokens=24,
        temperature=1.0,
        seed=3,
        logit_bias=ascii_only,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert len(base.text) >= 8
    stop = base.text[4:6]
    for stream in (False, True):
        kwargs = dict(
            model=MODEL_ID,
            prompt="abc",
            max_tokens=24,
            temperature=1.0,
            seed=3,
            logit_bias=ascii_only,
            stop=[stop, "never-seen"],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            texts, reasons, _ = stream_text(client.completions.create(**kwargs))
            text, reason = texts[0], reasons[0]
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert text == base.text[: base.text.index(stop)] and reason == "stop"


def test_a_repeated_system_prompt_is_served_from_the_cache(client):
    system = "You are the keeper of a long system prompt. " * 3
    first = client.chat.completions.create(
        model=MODEL_ID, messages=chat("First question?", system), max_tokens=2, temperature=0
    )
    second = client.chat.completions.create(
        model=MODEL_ID, messages=chat("Another one?", system), max_tokens=2, temperature=0
    )
    # both prompts open with the same ~150 tokens; whole pages of them are hits
    assert first.usage.prompt_tokens > 150
    assert second.usage.prompt_tokens_details.cached_tokens >= 144


def test_api_jobs_carry_the_api_tag(client, engine):
    seen = []
    engine.add_listener(seen.append)
    try:
        client.chat.completions.create(
            model=MODEL_ID, messages=chat("Tag?"), max_tokens=3, temperature=0
        )
    finally:
        engine.remove_listener(seen.append)
    tags = {e.tag for e in seen if isinstance(e.tag, ApiTag)}
    assert tags == {ApiTag()} and str(next(iter(tags))) == "API"
    assert all(e.tag.request_id.startswith("chatcmpl-") for e in seen if e.tag is not None)
    wait_idle(engine)


def _greedy_logprobs(k: int) -> JobRequest:
    return JobRequest(
        messages=chat("Name a colour."),
        sampling=SamplingSettings(temperature=0),
        max_new_tokens=8,
        stop_token_ids=(),
        logprobs=k,
    )


def _check_entries(tokens: list[str], logprobs: list[float], tops: list[list[float]], k: int):
    """The shape every logprobs response has, greedy: values <= 0, k alternatives each, the
    chosen token the likeliest of them."""
    assert len(tokens) == len(logprobs) == len(tops)
    assert all(lp <= 0 for lp in logprobs)
    assert all(len(top) == k and top == sorted(top, reverse=True) for top in tops)
    assert logprobs == [max(top) for top in tops]


def test_chat_logprobs_streamed_and_not(client, engine):
    kwargs = dict(
        model=MODEL_ID,
        messages=chat("Name a colour."),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    _check_entries(
        [c.token for c in content],
        [c.logprob for c in content],
        [[t.logprob for t in c.top_logprobs] for c in content],
        3,
    )
    assert all(c.bytes == list(c.token.encode()) for c in content)
    # the engine's own numbers for the same chat, passed through unchanged
    (direct,) = engine.generate(_greedy_logprobs(3), timeout=60).logprobs
    tok = engine.loaded.tokenizer
    assert [c.logprob for c in content] == [e.logprob for e in direct]
    assert [[t.token for t in c.top_logprobs] for c in content] == [
        [tok.decode([t]) for t, _ in e.top] for e in direct
    ]

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [
        c
        for chunk in chunks
        for choice in chunk.choices
        if choice.logprobs
        for c in choice.logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 for c in streamed)

    # parallel samples each have their own; logprobs: false is no request for them
    samples = client.chat.completions.create(**{**kwargs, "temperature": 1.0, "seed": 5}, n=2)
    assert sum(len(c.logprobs.content) for c in samples.choices) == samples.usage.completion_tokens
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(client):
    kwargs = dict(
        model=MODEL_ID,
        prompt="The sky is",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    reply = client.completions.create(**kwargs)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == reply.usage.completion_tokens == 6
    _check_entries(
        lp.tokens, lp.token_logprobs, [sorted(t.values(), reverse=True) for t in lp.top_logprobs], 2
    )
    assert lp.text_offset == [sum(map(len, lp.tokens[:j])) for j in range(len(lp.tokens))]

    # A stop string that starts at the first token's text and never completes: the stream
    # holds that text back, so its text lags its tokens; the offsets must not.
    held = [lp.tokens[0] + "\x7f"]
    tokens, logprobs, offsets = [], [], []
    for chunk in client.completions.create(**kwargs, stop=held, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
