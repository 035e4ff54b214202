"""Tools through the official client on a tiny random model with a Hermes/Qwen-style
template: `tool_choice` required and named force a valid call (random weights never write
one on their own), streamed and not; the call's round trip (assistant tool_calls, a `tool`
result) renders and completes; calls are parsed out of text; the refusals."""

from __future__ import annotations

import contextlib
import json

import jsonschema
import openai
import pytest

from engine.generator.job import JobRequest
from engine.model.loader import load_model
from engine.server.app import Server, ServerSettings
from engine.server.schemas import ModelLimits, parse_chat
from engine.server.tools import (
    Choice,
    Tool,
    ToolCallStream,
    ToolFormat,
    ToolRequest,
    parse_tools,
)
from tests.engine.server.conftest import MODEL_ID, make_engine, wait_idle
from tests.engine.tiny_models import HERMES_TOOLS, write_chat_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 16}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "search", "description": "Search the web", "parameters": SEARCH},
    },
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "tiny-tools"
    return load_model(write_chat_model(folder, template=HERMES_TOOLS, context=2048, seed=5))


@contextlib.contextmanager
def _served(loaded):
    """`folio serve` on its own engine for `loaded`, and the official client on it."""
    engine = make_engine(loaded, cache_tokens=8192)
    settings = ServerSettings(port=0, model_id=MODEL_ID, max_tokens=256)
    try:
        with Server(engine, settings) as server:
            with openai.OpenAI(
                base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
            ) as client:
                yield client, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tool_client(tool_model):
    with _served(tool_model) as served:
        yield served


def _ask(client, tool_choice, messages=QUESTION, **kwargs):
    kwargs = {"max_tokens": 200, "temperature": 1.0, "seed": 3, **kwargs}
    return client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=TOOLS, tool_choice=tool_choice, **kwargs
    )


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_and_named_force_a_valid_call(tool_client):
    client, engine = tool_client
    required = _ask(client, "required")
    (choice,) = required.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_call(call)
    for name in SCHEMAS:
        named = _ask(client, {"type": "function", "function": {"name": name}})
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == name
        _check_call(call)
    # left to itself (auto) the random model writes no call
    auto = _ask(client, "auto", max_tokens=30)
    assert auto.choices[0].message.tool_calls is None
    assert auto.choices[0].finish_reason in ("stop", "length")
    wait_idle(engine)


def test_a_forced_call_streams_as_delta_tool_calls(tool_client):
    client, _ = tool_client
    stream = _ask(client, {"type": "function", "function": {"name": "get_weather"}}, stream=True)
    chunks = list(stream)
    calls = [c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or ()]
    contents = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
    reasons = [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason]
    assert reasons == ["tool_calls"] and contents == ""
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    _check_call(call)


def test_the_round_trip_renders_and_completes(tool_client, tool_model):
    client, _ = tool_client
    first = _ask(client, "required")
    (call,) = first.choices[0].message.tool_calls
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = _ask(client, "auto", messages=messages, max_tokens=20)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # what the model read: the call as the template writes it, then the tool's result
    body = {"model": MODEL_ID, "messages": messages, "tools": TOOLS}
    limits = ModelLimits(MODEL_ID, 2048, tool_model.config.vocab_size, 16, 512, 16, 256)
    prompt = tool_model.tokenizer.decode(parse_chat(body, limits, tool_model.tokenizer).job.prompt)
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'"name": "{call.function.name}", "arguments": {arguments}' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    assert prompt.count("<tools>") == 1 and '"name": "search"' in prompt


# Llama 3.1's way, on the tiny model's ChatML tokens: the call is the whole reply, a JSON
# object with "parameters"; results come back in an "ipython" turn.
LLAMA_TOOLS = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}"
    '\nReply with {"name": ..., "parameters": {...}}<|im_end|>\n{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    '{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", '
    '"parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_llama_style_template_gets_its_own_call_format(tmp_path):
    folder = write_chat_model(tmp_path / "tiny-llama-tools", template=LLAMA_TOOLS, context=2048)
    loaded = load_model(folder)
    named = {"type": "function", "function": {"name": "search"}}
    request = parse_tools({"tools": TOOLS, "tool_choice": named}, loaded.tokenizer, MODEL_ID)
    assert request.format is ToolFormat.LLAMA3_JSON
    with _served(loaded) as (client, engine):
        # what the model writes: the bare JSON call, with "parameters"
        prompt = loaded.tokenizer.encode_chat(QUESTION, tools=request.for_template())
        job = JobRequest(prompt=prompt, max_new_tokens=200, grammar=request.grammar())
        raw = engine.generate(job, timeout=120).text
        assert raw.startswith('{"name": "search", "parameters": {"query": '), raw
        for stream in (False, True):
            if stream:
                chunks = list(_ask(client, named, stream=True))
                deltas = [ch.delta for chunk in chunks for ch in chunk.choices]
                (call,) = [c for d in deltas for c in d.tool_calls or ()]
                assert "".join(d.content or "" for d in deltas) == ""
            else:
                (call,) = _ask(client, named).choices[0].message.tool_calls
            assert call.function.name == "search"
            _check_call(call)


def _hermes(choice: Choice = Choice.AUTO) -> ToolRequest:
    tools = tuple(Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in TOOLS)
    return ToolRequest(tools, choice, ToolFormat.HERMES)


def test_hermes_calls_are_parsed_out_of_text():
    text = (
        'Let me check.\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n'
        '</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    )
    content, calls = _hermes().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"query": "x"})]
    # the unknown function stays text, as does the text before the call
    assert content.startswith("Let me check.") and '"nope"' in content
    assert _hermes().parse("no call here") == ("no call here", [])


def test_llama3_json_calls_are_parsed():
    tools = _hermes().tools
    request = ToolRequest(tools, Choice.AUTO, ToolFormat.LLAMA3_JSON)
    content, calls = request.parse('<|python_tag|>{"name": "search", "parameters": {"query": "q"}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("search", '{"query": "q"}')
    ]
    assert request.parse("{not json") == ("{not json", [])


def test_streamed_text_never_shows_the_start_of_a_call():
    text = 'Sure. <tool_call>{"name": "search", "arguments": {"query": "cats"}}</tool_call>'
    stream = ToolCallStream(_hermes())
    sent = "".join(stream.feed(ch) for ch in text)
    assert sent == "Sure. "
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["search"]
    # text that only began like a call comes out whole at the end
    stream = ToolCallStream(_hermes())
    sent = "".join(stream.feed(ch) for ch in "a <tool")
    assert sent == "a " and stream.finish() == ("<tool", [])


def _refusal(client, **fields) -> openai.APIStatusError:
    body = {"tools": TOOLS, "max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=QUESTION, **body)
    return info.value


def test_an_unknown_tool_choice_is_a_400_naming_it(tool_client):
    client, _ = tool_client
    error = _refusal(client, tool_choice={"type": "function", "function": {"name": "fly"}})
    assert error.status_code == 400 and error.body["code"] == "unknown_tool"
    assert "'fly'" in error.body["message"] and "get_weather" in error.body["message"]


def test_a_bad_parameters_schema_is_a_400(tool_client):
    client, _ = tool_client
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    error = _refusal(client, tools=bad)
    assert error.status_code == 400 and error.body["code"] == "invalid_json_schema"
    assert "objekt" in error.body["message"] and "tools[0]" in error.body["message"]


def test_a_forced_call_with_a_response_format_is_a_422(tool_client):
    client, _ = tool_client
    error = _refusal(client, tool_choice="required", response_format={"type": "json_object"})
    assert error.status_code == 422 and error.body["param"] == "response_format"


def test_tools_on_a_template_without_them_are_a_400_naming_the_model(client):
    # `client`: the conftest server, whose ChatML template never reads tools
    error = _refusal(client)
    assert error.status_code == 400 and error.body["code"] == "tools_not_supported"
    assert MODEL_ID in error.body["message"]
    # tool_choice none renders no tools: nothing to refuse
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert reply.choices[0].message.tool_calls is None
