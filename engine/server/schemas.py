"""OpenAI request bodies, checked and turned into the engine's `JobRequest`.

Every field is read with its API name, so an error names the parameter the client sent
(`max_tokens`, not the engine's `max_new_tokens`) and says what to send instead. Wrong
types and values are 422, a prompt that can never fit (the model's context, the cache) is
413, an unknown model 404. Unknown fields are ignored, as vLLM and llama.cpp ignore
them; fields the server knows but does not implement yet are refused, not ignored, so a
client never gets an answer it did not ask for.

The prompt is tokenized here, chats with the model's chat template (`Tokenizer.encode_chat`,
the call `Generator.prepare` makes for `JobRequest(messages=...)`, so an API chat and an app
chat with the same messages have the same ids and share cached pages). Knowing the length
before submitting gives the default `max_tokens` (what the context and the cache leave)
and errors with exact counts.

`response_format` (json_object, json_schema) becomes the job's grammar
(engine/generator/grammar.py), checked here so a schema the server cannot follow is a 400
naming the problem; `tools` and `tool_choice` are checked and rendered by `tools.py`, whose
forced calls (required, a named function) are a grammar too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from engine.generator.grammar import Grammar
from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from engine.server.errors import APIError, invalid, unsupported
from engine.server.tools import ToolRequest, assistant_tool_calls, parse_tools

# What the API allows beyond which a request is refused before any work. OpenAI's own
# limits where it has them (logit_bias, top_logprobs); generous ones elsewhere.
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = {"system", "developer", "user", "assistant", "tool"}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Kind(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"


@dataclass(frozen=True)
class ModelLimits:
    """What the served model and its engine allow, read once when the server starts."""

    model_id: str
    context: int  # the model's context in tokens
    vocab_size: int
    page_size: int
    num_pages: int
    max_batch_size: int
    max_tokens: int  # the server's cap on max_tokens per sample

    def cache_room(self, prompt_tokens: int, n: int) -> int:
        """The most new tokens per sample that fit the cache with this prompt, as
        `Scheduler.check_fits` counts them: ceil((prompt + new) / page_size) pages, and
        n - 1 copies of every page but the prompt's full ones. May be < 1."""
        full = (prompt_tokens - 1) // self.page_size
        total = (self.num_pages + (n - 1) * full) // n
        return total * self.page_size - prompt_tokens


@dataclass(frozen=True)
class APIRequest:
    """A checked request: the job to submit and how to answer."""

    kind: Kind
    job: JobRequest
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no logprobs; k: the chosen token's and the k most likely
    tools: ToolRequest | None = None  # tool calls are parsed out of the output


def parse_chat(body: Mapping[str, Any], limits: ModelLimits, tokenizer: Any) -> APIRequest:
    """A /v1/chat/completions body as a job; raises APIError."""
    _check_model(body, limits)
    _refuse_unsupported(body, ("functions", "audio", "prediction", "web_search_options"))
    if body.get("function_call") not in (None, "none"):
        raise unsupported("function_call", ": send tools and tool_choice")
    tools = parse_tools(body, tokenizer, limits.model_id)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise unsupported("modalities", " other than ['text']")
    messages = _messages(body.get("messages"))
    if tokenizer is None or not tokenizer.has_chat_template:
        raise APIError(
            400,
            f"the model {limits.model_id} has no chat template: use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    try:
        prompt = list(
            tokenizer.encode_chat(messages, tools=tools.for_template() if tools else None)
        )
    except ValueError as exc:  # the template refused the conversation, or bad text
        raise invalid(f"messages: {exc}", "messages") from None
    logprobs = None
    if _boolean(body, "logprobs", False):
        logprobs = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    asked = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    grammar = _one_grammar(_response_format(body.get("response_format")), tools)
    request = _request(Kind.CHAT, body, limits, prompt, asked, logprobs, grammar)
    return replace(request, tools=tools)


def parse_completion(body: Mapping[str, Any], limits: ModelLimits, tokenizer: Any) -> APIRequest:
    """A /v1/completions body as a job; raises APIError."""
    _check_model(body, limits)
    if _boolean(body, "echo", False):
        raise unsupported("echo")
    if body.get("suffix") is not None:
        raise unsupported("suffix")
    prompt = _prompt(body.get("prompt"), limits, tokenizer)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    asked = _max_tokens(body, ("max_tokens",))
    grammar = _response_format(body.get("response_format"))
    request = _request(Kind.COMPLETION, body, limits, prompt, asked, logprobs, grammar)
    best_of = body.get("best_of")
    if best_of is not None and best_of != request.job.n:
        raise unsupported("best_of", " different from n")
    return request


# -- the parts ---------------------------------------------------------------------------


def _request(
    kind: Kind,
    body: Mapping[str, Any],
    limits: ModelLimits,
    prompt: list[int],
    asked: tuple[str, int] | None,
    logprobs: int | None,
    grammar: Grammar | None,
) -> APIRequest:
    """The parts both endpoints share; `asked` is the max_tokens field given and its value."""
    n = _integer(body, "n", 1, 1, min(MAX_N, limits.max_batch_size))
    max_new = _fit_max_tokens(kind, len(prompt), n, asked, limits)
    stop_ids = _stop_token_ids(body, limits)
    if _boolean(body, "ignore_eos", False) and stop_ids is None:
        stop_ids = ()
    job = JobRequest(
        prompt=prompt,
        sampling=_sampling(body, limits),
        max_new_tokens=max_new,
        stop_strings=_stop(body.get("stop")),
        stop_token_ids=stop_ids,
        n=n,
        logprobs=logprobs,
        grammar=grammar,
    )
    try:
        job.validate()
    except ValueError as exc:  # the engine's own checks, past the ones above
        raise invalid(str(exc), None) from None
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, Mapping):
            raise invalid("stream_options must be an object", "stream_options")
        include_usage = _boolean(options, "include_usage", False, "stream_options.include_usage")
    return APIRequest(kind, job, stream, include_usage, logprobs)


def _one_grammar(response_format: Grammar | None, tools: ToolRequest | None) -> Grammar | None:
    """The grammar of a chat: its response_format's or a forced tool call's, not both."""
    forced = tools.grammar() if tools is not None else None
    if forced is not None and response_format is not None:
        raise invalid(
            "response_format and a required or named tool_choice both constrain the reply: "
            "send one of them",
            "response_format",
        )
    return forced or response_format


def _response_format(value: Any) -> Grammar | None:
    """`response_format` as the grammar the output must follow: none for text, any JSON
    object for json_object, the given schema for json_schema (checked here, so a schema the
    server cannot follow is a 400 naming the problem, before any work)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid(
            'response_format must be an object: {"type": "text" | "json_object" | "json_schema"}',
            "response_format",
        )
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise invalid(
            f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}",
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise invalid(
            'response_format.json_schema must be an object: {"name": ..., "schema": {...}}',
            "response_format",
        )
    name = spec.get("name")
    if not (isinstance(name, str) and _SCHEMA_NAME.fullmatch(name)):
        raise invalid(
            "response_format.json_schema.name must be 1-64 letters, digits, _ or -, "
            f"got {name!r:.40}",
            "response_format",
        )
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise invalid("response_format.json_schema.strict must be true or false", "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise invalid(
            "response_format.json_schema.schema must be a JSON schema object, "
            f"got {type(schema).__name__}",
            "response_format",
        )
    grammar = Grammar.json_schema(schema)
    try:
        grammar.check()
    except ValueError as exc:
        raise APIError(
            400,
            f"response_format.json_schema.schema ({name}) cannot be followed: {exc}",
            param="response_format",
            code="invalid_json_schema",
        ) from None
    return grammar


def _check_model(body: Mapping[str, Any], limits: ModelLimits) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid(
            f"model is required: send the served model's id, {limits.model_id!r}", "model"
        )
    if model != limits.model_id:
        raise APIError(
            404,
            f"the model {model[:200]!r} does not exist here: this server serves "
            f"{limits.model_id!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def _refuse_unsupported(body: Mapping[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) not in (None, [], {}):
            raise unsupported(name)


def _messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template takes them: a role and text content. Text
    parts are joined; `developer` is the newer name of `system`; an assistant's tool calls
    and a tool's result keep their fields (`tool_calls`, `tool_call_id`, `name`)."""
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(value)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise invalid(f"{where} must be an object with role and content", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(
            f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r:.40}",
            "messages",
        )
    content = message.get("content")
    calls = message.get("tool_calls")
    if content is None and role == "assistant":
        content = ""
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(content, where),
    }
    if calls is not None:
        if role != "assistant":
            raise invalid(f"{where}: only assistant messages carry tool_calls", "messages")
        out["tool_calls"] = assistant_tool_calls(calls, where)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{where}.tool_call_id must name the call this answers", "messages")
        out["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise unsupported(
                    "messages", f" content of type {kind!r:.40} ({where}.content[{j}])"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.content[{j}].text must be a string", "messages")
            parts.append(text)
        return "".join(parts)
    raise invalid(f"{where}.content must be a string or a list of text parts", "messages")


def _prompt(value: Any, limits: ModelLimits, tokenizer: Any) -> list[int]:
    """A completion prompt: text, or token ids; a list of one of those is the same."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if tokenizer is None:
            raise APIError(
                400,
                f"the model {limits.model_id} has no tokenizer: send the prompt as token ids",
                param="prompt",
            )
        if not value:
            raise invalid("prompt is empty: send some text", "prompt")
        try:
            return list(tokenizer.encode(value))
        except ValueError as exc:
            raise invalid(f"prompt: {exc}", "prompt") from None
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        bad = [t for t in value if not 0 <= t < limits.vocab_size]
        if bad:
            raise invalid(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})",
                "prompt",
            )
        return list(value)
    if isinstance(value, list) and len(value) > 1:
        raise unsupported("prompt", " with several prompts: send one prompt per request")
    raise invalid("prompt must be a string or a non-empty list of token ids", "prompt")


def _max_tokens(body: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, int] | None:
    """The first of `names` the body gives, and its value (None: none does)."""
    for name in names:
        if body.get(name) is not None:
            return name, _integer(body, name, None, 1, None)
    return None


def _fit_max_tokens(
    kind: Kind, prompt_tokens: int, n: int, asked: tuple[str, int] | None, limits: ModelLimits
) -> int:
    """max_tokens checked against the server's cap, the context and the cache. Omitted, it
    is what they leave for a chat (as OpenAI does) and at most 16 for a completion."""
    where = "messages" if kind is Kind.CHAT else "prompt"
    context_room = limits.context - prompt_tokens
    if context_room < 1:
        raise APIError(
            413,
            f"the prompt has {prompt_tokens} tokens but the model's context holds "
            f"{limits.context}: shorten it",
            param=where,
            code="context_length_exceeded",
        )
    cache_room = limits.cache_room(prompt_tokens, n)
    cache = f"the cache of {limits.num_pages * limits.page_size} tokens"
    if cache_room < 1:
        samples, fewer = (f" with n={n}", ", lower n") if n > 1 else ("", "")
        raise APIError(
            413,
            f"the prompt has {prompt_tokens} tokens and does not fit{samples} in {cache} "
            f"({limits.num_pages} pages of {limits.page_size}): shorten it{fewer} or start "
            "the server with a larger --cache-tokens",
            param=where,
            code="prompt_too_large",
        )
    room = min(context_room, cache_room, limits.max_tokens)
    if asked is None:
        return room if kind is Kind.CHAT else min(room, COMPLETION_DEFAULT_MAX_TOKENS)
    name, value = asked
    if value > limits.max_tokens:
        raise invalid(
            f"{name} is {value} but this server allows at most {limits.max_tokens} "
            "(its --max-tokens)",
            name,
        )
    if value > context_room:
        raise invalid(
            f"the prompt ({prompt_tokens} tokens) plus {name} ({value}) exceed the model's "
            f"context of {limits.context} tokens: ask for at most {context_room}",
            name,
            "context_length_exceeded",
        )
    if value > cache_room:
        each = f" for each of n={n} samples" if n > 1 else ""
        raise invalid(
            f"the prompt ({prompt_tokens} tokens) plus {name} ({value}){each} do not fit "
            f"{cache}: ask for at most {cache_room}",
            name,
        )
    return value


def _sampling(body: Mapping[str, Any], limits: ModelLimits) -> SamplingSettings:
    top_k = _integer(body, "top_k", 0, -1, None)
    seed = body.get("seed")
    if seed is not None:
        seed = _integer(body, "seed", None, 0, MAX_SEED - 1)
    return SamplingSettings(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k, 0),  # -1 is vLLM's "off"
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 100.0, low_open=True),
        logit_bias=_logit_bias(body.get("logit_bias"), limits),
        seed=seed,
    )


def _logit_bias(value: Any, limits: ModelLimits) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise invalid('logit_bias must be an object of {"token id": bias}', "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(
            f"logit_bias has {len(value)} entries: at most {MAX_LOGIT_BIAS} are allowed",
            "logit_bias",
        )
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise invalid(f"logit_bias keys must be token ids, got {key!r:.40}", "logit_bias")
        token = int(key)
        if token >= limits.vocab_size:
            raise invalid(
                f"logit_bias token {token} is outside the vocabulary (0..{limits.vocab_size - 1})",
                "logit_bias",
            )
        if not _is_real(bias) or not -100 <= bias <= 100:
            raise invalid(
                f"logit_bias for token {token} must be a number in [-100, 100], got {bias!r:.40}",
                "logit_bias",
            )
        out.append((token, float(bias)))
    return tuple(out)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise invalid(
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop"
        )
    for stop in stops:
        if not isinstance(stop, str) or not stop or len(stop) > MAX_STOP_CHARS:
            raise invalid(
                f"each stop string must be text of 1 to {MAX_STOP_CHARS} characters, "
                f"got {stop!r:.40}",
                "stop",
            )
    return tuple(stops)


def _stop_token_ids(body: Mapping[str, Any], limits: ModelLimits) -> tuple[int, ...] | None:
    """vLLM's `stop_token_ids`: ids that end a sample besides the model's EOS ids."""
    value = body.get("stop_token_ids")
    if value is None:
        return None
    if not (
        isinstance(value, list)
        and len(value) <= MAX_STOP_STRINGS
        and all(_is_int(t) and 0 <= t < limits.vocab_size for t in value)
    ):
        raise invalid(
            f"stop_token_ids must be a list of at most {MAX_STOP_STRINGS} token ids "
            f"(0..{limits.vocab_size - 1})",
            "stop_token_ids",
        )
    return tuple(value)


# -- typed fields -----------------------------------------------------------------------


def _integer(
    body: Mapping[str, Any], name: str, default: int | None, low: int, high: int | None
) -> int:
    value = body.get(name)
    if value is None and default is not None:
        return default
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise invalid(f"{name} must be an integer {bound}, got {value!r:.40}", name)
    return value


def _number(
    body: Mapping[str, Any],
    name: str,
    default: float,
    low: float,
    high: float,
    low_open: bool = False,
) -> float:
    """A number in [low, high], or (low, high] with `low_open`."""
    value = body.get(name)
    if value is None:
        return default
    if (
        _is_real(value)
        and math.isfinite(value)
        and (value > low or not low_open and value == low)
        and value <= high
    ):
        return float(value)
    bracket = "(" if low_open else "["
    raise invalid(
        f"{name} must be a number in {bracket}{low:g}, {high:g}], got {value!r:.40}", name
    )


def _boolean(body: Mapping[str, Any], name: str, default: bool, label: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{label or name} must be true or false, got {value!r:.40}", label or name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
