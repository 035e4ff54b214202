"""`response_format` through the official client: json_schema and json_object output that
parses and validates, streamed and not, on a tiny random model (which writes no JSON on its
own: the constrained decoding is all that makes it valid), and the refusals."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.engine.server.conftest import MODEL_ID, wait_idle
from tests.engine.server.test_openai_client import chat, stream_text

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "member"],
    "additionalProperties": False,
}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}


def _describe(client, **kwargs):
    """A sampled chat asking for a person, with the schema unless told otherwise."""
    kwargs = {"response_format": JSON_SCHEMA, "max_tokens": 200, **kwargs}
    return client.chat.completions.create(
        model=MODEL_ID, messages=chat("Describe a person."), temperature=1.0, **kwargs
    )


def test_json_schema_output_validates(client, engine):
    reply = _describe(client, seed=4, n=3)
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    # without the schema the same request gives no JSON
    plain = _describe(client, seed=4, response_format=None, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)
    wait_idle(engine)


def test_json_schema_streamed_validates(client):
    texts, reasons, _ = stream_text(_describe(client, seed=9, stream=True))
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert reasons == {0: "stop"}


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_is_a_json_object(client, stream):
    kwargs = dict(
        model=MODEL_ID,
        messages=chat("Give me JSON."),
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    if stream:
        texts, _, _ = stream_text(client.chat.completions.create(**kwargs, stream=True))
        text = texts[0]
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_a_schema_too(client, stream):
    kwargs = dict(
        model=MODEL_ID,
        prompt="A person as JSON:",
        max_tokens=200,
        temperature=1.0,
        seed=2,
        extra_body={"response_format": JSON_SCHEMA},
    )
    if stream:
        texts, _, _ = stream_text(client.completions.create(**kwargs, stream=True))
        text = texts[0]
    else:
        text = client.completions.create(**kwargs).choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)


def _error(client, response_format) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=MODEL_ID, messages=chat("hi"), response_format=response_format, max_tokens=4
        )
    return info.value


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "strin"}, "strin"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "string", "pattern": "(["}, "regex"),
    ],
)
def test_a_bad_schema_is_a_400_naming_it(client, schema, named):
    error = _error(
        client, {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    )
    assert error.status_code == 400
    body = error.body
    assert body["code"] == "invalid_json_schema" and body["param"] == "response_format"
    assert named in body["message"] and "bad" in body["message"]


@pytest.mark.parametrize(
    ("response_format", "named"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "schema"),
    ],
)
def test_a_malformed_response_format_is_a_422(client, response_format, named):
    error = _error(client, response_format)
    assert error.status_code == 422
    assert error.body["param"] == "response_format" and named in error.body["message"]
