"""The server tests' tiny chat model, shared (a session fixture: loaded once)."""

from tests.engine.server.conftest import tiny_chat  # noqa: F401 - a fixture
