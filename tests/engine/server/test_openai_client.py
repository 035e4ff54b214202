"""The official `openai` client against the server: chat and completions, streamed and
not, n, stop, seeds, usage with cached tokens, and the jobs' place on the engine."""

from __future__ import annotations

import openai
import pytest

from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from engine.server.schemas import logprobs_supported
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


@pytest.mark.skipif(logprobs_supported(), reason="the generator reports logprobs now")
def test_logprobs_are_refused_until_the_generator_reports_them(client):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model=MODEL_ID, messages=chat("hi"), max_tokens=2, logprobs=True, top_logprobs=2
        )
    assert info.value.body["param"] == "logprobs"
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, logprobs=1)
    # logprobs: false is no request for them
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=chat("hi"), max_tokens=2, logprobs=False
    )
    assert reply.choices[0].logprobs is None
