"""Tools on /v1/chat/completions: `tools` and `tool_choice` checked, handed to the model's
chat template, and the calls the model writes parsed back into `tool_calls`.

A model learns one way of writing a call; its chat template shows which. Two are common:
Hermes / Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text
around them allowed) and Llama 3.1's JSON (the whole reply one `{"name": ...,
"parameters": {...}}`, sometimes after `<|python_tag|>`). A template that mentions
`<tool_call>` is Hermes, any other template that reads `tools` is Llama 3.1's JSON.

`tool_choice`: `none` renders no tools and parses nothing; `auto` renders them and parses
whatever calls the model writes; `required` and a named function also constrain decoding
(engine/generator/grammar.py) to exactly one call of an offered function (of that function)
in the model's format, with arguments that follow its `parameters` schema, so even a model
that would never call it on its own writes a valid call.

Streaming: text that may begin a call is held back (like a stop string) until the call is
whole; the call then goes out as one `delta.tool_calls` chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.generator.grammar import JSON_OPTIONS, Grammar
from engine.server.errors import APIError, invalid

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolFormat(StrEnum):
    HERMES = "hermes"  # <tool_call>{"name", "arguments"}</tool_call>
    LLAMA3_JSON = "llama3_json"  # {"name", "parameters"} as the whole reply


class Choice(StrEnum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def for_template(self) -> dict[str, Any]:
        """The OpenAI form, which chat templates are written for."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(
            id=self.id,
            type="function",
            function={"name": self.name, "arguments": self.arguments},
        )
        return out


@dataclass(frozen=True)
class ToolRequest:
    """The checked `tools` and `tool_choice` of a request that renders tools."""

    tools: tuple[Tool, ...]
    choice: Choice
    format: ToolFormat
    named: str | None = None

    def for_template(self) -> list[dict[str, Any]]:
        return [t.for_template() for t in self.tools]

    def grammar(self) -> Grammar | None:
        """For `required` or a named function: one call, in the model's format, of an
        offered function (or the named one) with arguments that follow its schema."""
        if self.choice is Choice.AUTO:
            return None
        tools = [t for t in self.tools if self.named is None or t.name == self.named]
        key = "arguments" if self.format is ToolFormat.HERMES else "parameters"
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, key: dict(t.parameters)},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = {"x-guidance": JSON_OPTIONS, "anyOf": options}
        call = "call: %json " + json.dumps(schema)
        if self.format is ToolFormat.HERMES:
            start = f"start: {json.dumps(HERMES_OPEN + chr(10))} call {json.dumps(chr(10) + HERMES_CLOSE)}"
        else:
            start = "start: call"
        return Grammar.lark(f"{start}\n{call}\n")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's text outside calls (None when there is none) and its calls; text
        that only looks like a call (bad JSON, an unknown function) stays text."""
        names = {t.name for t in self.tools}
        if self.format is ToolFormat.HERMES:
            return _parse_hermes(text, names)
        return _parse_llama3_json(text, names)


def tool_format(template: str) -> ToolFormat:
    return ToolFormat.HERMES if HERMES_OPEN in template else ToolFormat.LLAMA3_JSON


def parse_tools(body: Mapping[str, Any], tokenizer: Any, model_id: str) -> ToolRequest | None:
    """`tools` and `tool_choice` of a chat body; None when no tools are to be rendered.
    Raises APIError: 422 for malformed values, 400 for a template without tools, a
    schema that cannot be followed or a tool_choice naming no offered function."""
    raw_tools = body.get("tools")
    choice = body.get("tool_choice")
    if raw_tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools: send the functions in tools", "tool_choice")
        return None
    if not isinstance(raw_tools, list) or len(raw_tools) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw_tools))
    if len({t.name for t in tools}) != len(tools):
        raise invalid("tools lists a function name twice: names must be unique", "tools")
    kind, named = _tool_choice(choice, tools)
    if kind is None:
        return None
    if tokenizer is None or not tokenizer.supports_tools:
        raise APIError(
            400,
            f"the model {model_id} has a chat template without tool support (it does not "
            "read `tools`): leave tools out, or serve a model whose template takes them",
            param="tools",
            code="tools_not_supported",
        )
    template = "\n".join(t for t in tokenizer.chat_templates.values() if t)
    return ToolRequest(tools, kind, tool_format(template), named)


def _tool(value: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not (isinstance(value, Mapping) and value.get("type") == "function"):
        raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise invalid(f"{where}.function must be an object with a name", "tools")
    name = function.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise invalid(
            f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r:.40}",
            "tools",
        )
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, Mapping):
        raise invalid(f"{where}.function.parameters must be a JSON schema object", "tools")
    try:
        Grammar.json_schema(parameters).check()
    except ValueError as exc:
        raise APIError(
            400,
            f"{where}.function.parameters ({name}) is not a schema this server can follow: {exc}",
            param="tools",
            code="invalid_json_schema",
        ) from None
    return Tool(name, description, parameters)


def _tool_choice(value: Any, tools: Sequence[Tool]) -> tuple[Choice | None, str | None]:
    """(None: render no tools) or the choice and the named function."""
    if value is None or value == "auto":
        return Choice.AUTO, None
    if value == "none":
        return None, None
    if value == "required":
        return Choice.REQUIRED, None
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise invalid('tool_choice.function must be {"name": "..."}', "tool_choice")
        offered = [t.name for t in tools]
        if name not in offered:
            raise APIError(
                400,
                f"tool_choice names the function {name[:64]!r}, which tools does not offer "
                f"(it offers {', '.join(offered)})",
                param="tool_choice",
                code="unknown_tool",
            )
        return Choice.NAMED, name
    raise invalid(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}, '
        f"got {value!r:.60}",
        "tool_choice",
    )


# -- messages of a round trip --------------------------------------------------------------


def assistant_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as chat templates read them: arguments as an
    object (OpenAI sends JSON text; templates write `arguments | tojson`)."""
    if not isinstance(value, list) or not value:
        raise invalid(f"{where}.tool_calls must be a non-empty list of calls", "messages")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not (isinstance(function, Mapping) and isinstance(function.get("name"), str)):
            raise invalid(f"{at} must have a function with a name", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise invalid(f"{at}.function.arguments is not valid JSON", "messages") from None
        if not isinstance(arguments, Mapping):
            raise invalid(f"{at}.function.arguments must be a JSON object", "messages")
        calls.append(
            {
                "id": str(call.get("id") or f"call_{j}"),
                "type": "function",
                "function": {"name": function["name"], "arguments": dict(arguments)},
            }
        )
    return calls


# -- parsing calls out of the output -----------------------------------------------------


_HERMES_CALL = re.compile(
    re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL
)


def _call_from(obj: Any, names: set[str], key: str) -> ToolCall | None:
    if not (isinstance(obj, Mapping) and obj.get("name") in names):
        return None
    arguments = obj.get(key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, Mapping):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _call_from(json.loads(match.group(1)), names, "arguments")
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[pos : match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _parse_llama3_json(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return (text or None), []
    calls = []
    for part in body.split(";"):
        try:
            call = _call_from(json.loads(part), names, "parameters")
        except ValueError:
            return (text or None), []
        if call is None:
            return (text or None), []
        calls.append(call)
    return None, calls


# -- streaming ---------------------------------------------------------------------------


class ToolCallStream:
    """One choice's streamed text with tools on: `feed` returns the content that can go out
    now (never the start of a call), `finish` the content held back and the calls."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.holding = request.choice is not Choice.AUTO  # a forced call: all of it is held

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        if self.request.format is ToolFormat.LLAMA3_JSON:
            head = self.text.lstrip()
            if not head:
                return ""
            if head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]):
                self.holding = True
                return ""
            return self._release(len(self.text))
        start = self.text.find(HERMES_OPEN, self.sent)
        if start >= 0:
            self.holding = True
            return self._release(start)
        return self._release(len(self.text) - _partial_marker(self.text, HERMES_OPEN))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls): all of the held text when it made no call.
        What was sent holds no call (feeding stops at a call's start), so the rest is
        parsed alone."""
        content, calls = self.request.parse(self.text[self.sent :])
        if not calls:
            return self._release(len(self.text)), []
        self.sent = len(self.text)
        return content or "", calls

    def _release(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
