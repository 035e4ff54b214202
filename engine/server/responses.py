"""The OpenAI response objects built from the engine's results and events: whole
completions, stream chunks, usage, finish reasons and logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.generator.job import JobResult, TokenLogprob
from engine.generator.stops import StopReason
from engine.server.errors import APIError
from engine.server.schemas import Kind
from engine.server.tools import ToolCall, ToolRequest

FINISH_REASONS = {
    StopReason.STOP_TOKEN: "stop",
    StopReason.STOP_STRING: "stop",
    StopReason.MAX_NEW_TOKENS: "length",
}
IMPOSSIBLE_LOGPROB = -9999.0


@dataclass(frozen=True)
class Head:
    """What every object of one response repeats."""

    kind: Kind
    id: str
    created: int
    model: str
    system_fingerprint: str

    def fields(self, chunk: bool = False) -> dict[str, Any]:
        if self.kind is Kind.CHAT:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }


def finish_reason(reason: str, called: bool = False) -> str:
    """OpenAI's finish reason for an engine's; a reply that ended by itself having made
    tool calls finished for "tool_calls"."""
    out = FINISH_REASONS.get(reason, reason)
    return "tool_calls" if called and out == "stop" else out


def job_error(result: JobResult) -> APIError | None:
    """The error a job that did not finish normally answers with, or None."""
    if result.eos_reason == StopReason.ERROR:
        return APIError(
            500, f"the engine failed on this request: {result.error}", code="engine_error"
        )
    if result.eos_reason == StopReason.CANCELLED:
        return APIError(
            503, "the request was cancelled: the server is shutting down", code="cancelled"
        )
    return None


def usage(result: JobResult) -> dict[str, Any]:
    """Tokens of the prompt (once, whatever n) and of every sample."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.new_tokens,
        "total_tokens": result.prompt_tokens + result.new_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def completion(
    head: Head,
    result: JobResult,
    logprobs: bool,
    tokenizer: Any,
    tools: ToolRequest | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) chat completion or text completion; `logprobs`: the request
    asked for them (the result has them per sample); `tools`: calls are parsed out of each
    reply into `message.tool_calls`."""
    choices = []
    for i, (text, reason) in enumerate(zip(result.texts, result.eos_reasons)):
        entries = result.logprobs[i] if logprobs else None
        choice: dict[str, Any] = {"index": i}
        calls: list[ToolCall] = []
        if head.kind is Kind.CHAT:
            content: str | None = text
            if tools is not None:
                content, calls = tools.parse(text)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [c.as_dict() for c in calls]
            choice["logprobs"] = chat_logprobs(entries, tokenizer)
        else:
            choice["text"] = text
            choice["logprobs"] = completion_logprobs(entries, tokenizer)
        choice["finish_reason"] = finish_reason(reason, bool(calls))
        choices.append(choice)
    return {**head.fields(), "choices": choices, "usage": usage(result)}


def chunk(
    head: Head,
    index: int,
    text: str | None = None,
    *,
    role: bool = False,
    finish: str | None = None,
    logprobs: Any = None,
    tool_calls: Sequence[ToolCall] = (),
) -> dict[str, Any]:
    """One streamed piece of one choice."""
    choice: dict[str, Any] = {"index": index}
    if head.kind is Kind.CHAT:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [c.as_dict(i) for i, c in enumerate(tool_calls)]
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish
    return {**head.fields(chunk=True), "choices": [choice]}


def usage_chunk(head: Head, result: JobResult) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage (stream_options.include_usage)."""
    return {**head.fields(chunk=True), "choices": [], "usage": usage(result)}


# -- logprobs -----------------------------------------------------------------------------


def chat_logprobs(entries: Sequence[TokenLogprob] | None, tokenizer: Any) -> dict | None:
    """`choice.logprobs` of a chat completion: {"content": [{token, logprob, bytes,
    top_logprobs}]}."""
    if entries is None:
        return None

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **token(e.token_id, e.logprob),
                "top_logprobs": [token(t, lp) for t, lp in e.top],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob] | None, tokenizer: Any, offset: int = 0
) -> dict | None:
    """`choice.logprobs` of a text completion: parallel lists of tokens, their
    logprobs, the top alternatives and each token's character offset in the text."""
    if entries is None:
        return None
    tokens, offsets = [], []
    for e in entries:
        text = _token_text(tokenizer, e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [
            {_token_text(tokenizer, t): _finite(lp) for t, lp in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token that cannot be sampled gets OpenAI's -9999."""
    logprob = float(logprob)
    return logprob if logprob >= IMPOSSIBLE_LOGPROB else IMPOSSIBLE_LOGPROB  # NaN too


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else ""
