"""Refusals: each an OpenAI error object with its status code and a message naming what to
change; the key; bounds on bodies; and the engine serving on after all of them."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.server.app import Server, ServerSettings, exposure_warning
from tests.engine.server.conftest import CONTEXT, MODEL_ID, make_engine, wait_idle

KEY = "s3cret-key"
CACHE_TOKENS = 384  # below the model's context of 512, so a prompt can fit one and not the other


@pytest.fixture(scope="module")
def small_engine(tiny_chat):
    eng = make_engine(tiny_chat, cache_tokens=CACHE_TOKENS, max_batch_size=4)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(small_engine):
    settings = ServerSettings(port=0, model_id=MODEL_ID, max_tokens=64, max_body_bytes=4096)
    with Server(small_engine, settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(small_engine):
    with Server(small_engine, ServerSettings(port=0, model_id=MODEL_ID, api_key=KEY)) as srv:
        yield srv


def chat_body(**fields) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **fields}


def assert_error(response: httpx.Response, status: int, *words: str, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_malformed_bodies_are_400(http):
    for content, word in (
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"model": NaN}', "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"[" * 2000 + b"]" * 2000, "not valid JSON"),  # nested beyond the parser's recursion
        (b"[" * 3000 + b"]" * 3000, "request body exceeds"),  # over the 4 KiB bound
    ):
        status = 413 if word.startswith("request") else 400
        r = http.post("/v1/chat/completions", content=content)
        assert_error(r, status, word)


def test_unknown_model_and_routes_are_404(http):
    r = http.post("/v1/chat/completions", json=chat_body(model="gpt-4o"))
    error = assert_error(r, 404, "'gpt-4o'", MODEL_ID, param="model")
    assert error["code"] == "model_not_found"
    assert_error(http.get("/v1/models/gpt-4o"), 404, MODEL_ID)
    assert_error(http.get("/v1/nothing"), 404, "/v1/nothing")
    assert_error(http.get("/v1/chat/completions"), 405, "GET")


@pytest.mark.parametrize(
    ("fields", "param", "word"),
    [
        ({"temperature": -1}, "temperature", "[0, 2]"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"top_k": 1.5}, "top_k", "integer"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": 65}, "max_tokens", "at most 64"),
        ({"max_completion_tokens": True}, "max_completion_tokens", "integer"),
        ({"n": 5}, "n", "from 1 to 4"),
        ({"seed": -1}, "seed", "integer"),
        ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"stop": [""]}, "stop", "stop string"),
        ({"stop": ["x"] * 17}, "stop", "at most 16"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages", "content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "image_url",
        ),
        ({"model": None}, "model", "required"),
    ],
)
def test_bad_parameter_values_are_422_naming_the_parameter(http, fields, param, word):
    r = http.post("/v1/chat/completions", json=chat_body(**fields))
    assert_error(r, 422, word, param=param)


def test_completion_parameters(http):
    body = {"model": MODEL_ID, "prompt": "hi"}
    assert_error(http.post("/v1/completions", json={**body, "prompt": ""}), 422, "empty")
    assert_error(
        http.post("/v1/completions", json={**body, "prompt": ["a", "b"]}), 422, "one prompt"
    )
    assert_error(http.post("/v1/completions", json={**body, "prompt": [1, 999]}), 422, "vocabulary")
    assert_error(http.post("/v1/completions", json={**body, "echo": True}), 422, param="echo")
    assert_error(http.post("/v1/completions", json={**body, "best_of": 3}), 422, param="best_of")
    assert_error(http.post("/v1/completions", json={**body, "logprobs": 21}), 422, param="logprobs")


def test_prompts_longer_than_the_context_or_the_cache_are_413(http):
    too_long = {"model": MODEL_ID, "prompt": [65] * (CONTEXT + 1)}
    error = assert_error(http.post("/v1/completions", json=too_long), 413, "context holds 512")
    assert error["code"] == "context_length_exceeded"
    # fits the context (512) but not the cache (384 tokens)
    r = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": [65] * 400})
    assert_error(r, 413, "cache of 384 tokens", "--cache-tokens", param="prompt")
    # fits alone, not as 4 samples that each need pages of their own
    r = http.post(
        "/v1/completions", json={"model": MODEL_ID, "prompt": [65] * 300, "n": 4, "max_tokens": 40}
    )
    assert_error(r, 422, "at most", param="max_tokens")
    r = http.post(
        "/v1/completions", json={"model": MODEL_ID, "prompt": [65] * 380, "max_tokens": 60}
    )
    assert_error(r, 422, "ask for at most 4", param="max_tokens")


def test_the_official_client_raises_its_error_classes(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], temperature=9
        )
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL_ID, prompt=[65] * 400)
    assert info.value.status_code == 413


def test_the_key_is_required_on_every_route_but_health(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}
        for path in ("/v1/models", "/metrics", "/v1/nothing"):
            r = http.get(path)
            assert_error(r, 401, "Authorization: Bearer")
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer not-it"})
        assert_error(wrong, 401, "not the server's")
        basic = http.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
        assert basic.status_code == 401
        good = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/v1/models", headers=good).status_code == 200
        assert http.get("/metrics", headers=good).status_code == 200
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_binding_beyond_this_machine_without_a_key_warns():
    assert exposure_warning(ServerSettings(host="127.0.0.1")) is None
    assert exposure_warning(ServerSettings(host="::1")) is None
    assert exposure_warning(ServerSettings(host="0.0.0.0", api_key="k")) is None
    assert "--api-key" in exposure_warning(ServerSettings(host="0.0.0.0"))
    assert ServerSettings().host == "127.0.0.1"


def test_the_engine_serves_on_after_every_refusal(http, small_engine):
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=3, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    snap = wait_idle(small_engine)
    assert snap.stats.pages_referenced == 0


def test_a_stopped_engine_is_503(tiny_chat):
    engine = make_engine(tiny_chat, cache_tokens=256)
    with Server(engine, ServerSettings(port=0, model_id=MODEL_ID)) as server:
        engine.shutdown()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").status_code == 503
            r = http.post("/v1/chat/completions", json=chat_body())
            assert_error(r, 503, "shut down")
