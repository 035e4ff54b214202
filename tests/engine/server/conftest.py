"""The server's fixtures: a tiny random Qwen3 with a byte-level tokenizer and a ChatML
template (a real chat template, every text encodable, a forward of about a millisecond),
an Engine on it, and `folio serve`'s server on 127.0.0.1 with the official client."""

from __future__ import annotations

import time
from collections.abc import Callable

import openai
import pytest

from engine.cache.kv_cache import CacheSettings
from engine.engine import Engine, EngineSnapshot
from engine.generator.settings import GeneratorSettings
from engine.model.loader import load_model
from engine.server.app import Server, ServerSettings
from tests.engine.tiny_models import write_chat_model

MODEL_ID = "tiny-chat"
CONTEXT = 512


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server") / "tiny-chat"
    return load_model(write_chat_model(folder, context=CONTEXT, seed=11))


@pytest.fixture(scope="session")
def ascii_only(tiny_chat) -> dict[str, float]:
    """A logit_bias that bans every token that is not one printable ASCII character, so
    sampled text is readable and two samples differ in their text whenever they differ."""
    tok = tiny_chat.tokenizer
    text = [tok.decode([i]) for i in range(tok.vocab_size)]
    return {str(i): -100 for i, t in enumerate(text) if not (t.isascii() and t.isprintable())}


def make_engine(loaded, cache_tokens: int = 4096, max_batch_size: int = 16) -> Engine:
    return Engine(
        loaded,
        CacheSettings(page_size=16, token_budget=cache_tokens),
        GeneratorSettings(max_batch_size=max_batch_size),
    ).start()


@pytest.fixture(scope="module")
def engine(tiny_chat):
    eng = make_engine(tiny_chat)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with Server(engine, ServerSettings(port=0, model_id=MODEL_ID, max_tokens=256)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


def wait_idle(engine: Engine | Callable[[], EngineSnapshot], timeout: float = 30.0):
    """The engine's snapshot once no job is left and no page is referenced (``engine``:
    an Engine, or what reads a snapshot, such as a remote server's)."""
    read = engine if callable(engine) else engine.snapshot
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = read()
        if not snap.jobs and snap.stats.pages_referenced == 0:
            return snap
        time.sleep(0.02)
    snap = read()
    raise AssertionError(
        f"the engine kept {len(snap.jobs)} jobs and {snap.stats.pages_referenced} referenced pages"
    )
