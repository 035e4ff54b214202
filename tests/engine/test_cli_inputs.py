"""What `folio generate` and `folio chat` do with bad input: one line on stderr naming the
problem, a nonzero exit, never a traceback. A tiny random model with a byte-level tokenizer
and a ChatML template keeps each call well under a second."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from folio.main import main
from tests.engine.tiny_models import write_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return write_chat_model(tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory) -> dict[str, Path]:
    """Models whose chat template cannot render: a syntax error, a sandbox escape."""
    root = tmp_path_factory.mktemp("broken")
    return {
        name: write_chat_model(root / name, template)
        for name, template in (
            ("syntax", "{% if %}"),
            ("security", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
        )
    }


def folio(
    argv: list[str], capsys, stdin: str | None = None, monkeypatch=None
) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of one command line (argparse's exits included)."""
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *words: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err


# -- defect 8, the CLI part: chat templates that fail -----------------------------------------


@pytest.mark.parametrize("kind", ["syntax", "security"])
def test_template_failure_is_one_line_in_generate(broken_models, kind, capsys):
    path = broken_models[kind]
    code, out, err = folio(["generate", "hi", "--model", str(path)], capsys)
    assert_one_line_error(code, err, str(path), "chat template")
    assert out == ""


@pytest.mark.parametrize("kind", ["syntax", "security"])
def test_template_failure_ends_chat_before_the_first_turn(broken_models, kind, capsys, monkeypatch):
    # before: every turn printed the error and the chat went on, exiting 0 at the end
    path = broken_models[kind]
    code, out, err = folio(["chat", "--model", str(path)], capsys, "hi\nagain\n", monkeypatch)
    assert_one_line_error(code, err, str(path), "chat template")
    assert "Type a message" not in out


# -- defect 10: generate checks what chat checks, the same way, before loading ----------------

BAD_SETTINGS = [
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--max-new-tokens", "-1"], "max_new_tokens"),
    (["--seed", str(2**64)], "seed"),
    (["--seed", "-1"], "seed"),
]


@pytest.mark.parametrize(("options", "field"), BAD_SETTINGS)
def test_generate_and_chat_refuse_bad_settings_alike_before_loading(
    chat_model, options, field, capsys, monkeypatch
):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr("engine.cli.generate.load_model", no_load)
    monkeypatch.setattr("engine.model.loader.load_model", no_load)
    errors = []
    for command in (["generate", "hi"], ["chat"]):
        code, _, err = folio(
            [*command, "--model", str(chat_model), *options], capsys, "hi\n", monkeypatch
        )
        assert_one_line_error(code, err, field)
        errors.append(err)
    assert errors[0] == errors[1]


@pytest.mark.parametrize("raw", [False, True])
def test_prompt_that_is_not_utf8_is_one_line(chat_model, raw, capsys):
    # argv's undecodable bytes arrive as lone surrogates (PEP 383); --raw raised TypeError
    prompt = os.fsdecode(b"ab\xff\xfe")
    argv = ["generate", prompt, "--model", str(chat_model), *(["--raw"] if raw else [])]
    code, _, err = folio(argv, capsys)
    assert_one_line_error(code, err, "not valid UTF-8", "0xff", "character 2")


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(chat_model, capsys, monkeypatch):
    bad = os.fsdecode(b"caf\xe9")
    argv = ["chat", "--model", str(chat_model), "--max-new-tokens", "2", "--temperature", "0"]
    code, out, err = folio(argv, capsys, f"{bad}\nhello\n", monkeypatch)
    assert code == 0 and err == ""
    assert "not valid UTF-8 (byte 0xe9 at character 3); type it again" in out
    assert out.count("> ") >= 3  # the bad line, the good one answered, and the end


def test_generate_still_answers(chat_model, capsys):
    # Sampled without a seed, so a random model may end its reply early on <|im_end|>.
    argv = ["generate", "hi", "--model", str(chat_model), "--max-new-tokens", "3", "--json"]
    code, out, err = folio(argv, capsys)
    assert code == 0 and err == ""
    result = json.loads(out)
    assert 1 <= result["new_tokens"] <= 3
    assert result["eos_reason"] in ("max_new_tokens", "stop_token")


# -- issue 13, minor: the cache size, symlinks, usage errors -----------------------------------


@pytest.mark.parametrize("tokens", ["0", "-5"])
def test_cache_tokens_below_one_is_refused(chat_model, tokens, capsys, monkeypatch):
    # before: 0 became the default 16,384 and -5 one page, and the banner printed what was typed
    argv = ["chat", "--model", str(chat_model), "--cache-tokens", tokens]
    code, out, err = folio(argv, capsys, "hi\n", monkeypatch)
    assert_one_line_error(code, err, "--cache-tokens", tokens)


def test_chat_banner_prints_the_cache_allocated(chat_model, capsys, monkeypatch):
    argv = ["chat", "--model", str(chat_model), "--cache-tokens", "20", "--page-size", "16"]
    code, out, _ = folio(argv, capsys, "/quit\n", monkeypatch)
    assert code == 0
    assert "cache 32 tokens in 2 pages of 16" in out.splitlines()[0]


def test_cache_larger_than_memory_is_refused(chat_model, capsys, monkeypatch):
    # before: torch's allocation failure, a traceback
    argv = ["chat", "--model", str(chat_model), "--cache-tokens", str(10**12)]
    code, _, err = folio(argv, capsys, "hi\n", monkeypatch)
    assert_one_line_error(code, err, "GB", "--cache-tokens")


def test_symlink_loop_is_named(tmp_path, capsys):
    loop = tmp_path / "a.gguf"
    loop.symlink_to(tmp_path / "b.gguf")
    (tmp_path / "b.gguf").symlink_to(loop)
    code, _, err = folio(["generate", "hi", "--model", str(loop)], capsys)
    assert_one_line_error(code, err, str(loop), "loop of symbolic links")
    assert "no such model" not in err


def test_broken_symlink_names_its_target(tmp_path, capsys):
    link = tmp_path / "m.gguf"
    link.symlink_to(tmp_path / "gone.gguf")
    code, _, err = folio(["generate", "hi", "--model", str(link)], capsys)
    assert_one_line_error(code, err, str(link), "gone.gguf", "does not exist")


def test_missing_model_is_still_the_loaders_error(tmp_path, capsys):
    code, _, err = folio(["generate", "hi", "--model", str(tmp_path / "x.gguf")], capsys)
    assert_one_line_error(code, err, "x.gguf", "no such model")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate"],
        ["generate", "hi", "--bogus"],
        ["generate", "hi", "--max-new-tokens", "ten"],
        ["generate", "hi", "--weights", "int3"],
        ["chat", "--page-size", "1e3"],
        ["frobnicate"],
    ],
)
def test_usage_errors_are_one_line(argv, capsys):
    # before: argparse's usage block, then the error
    code, _, err = folio(argv, capsys)
    assert code == 2
    assert_one_line_error(code, err, "error:", "--help")


def test_an_error_naming_a_line_break_stays_one_line(tmp_path, capsys):
    code, _, err = folio(["generate", "hi", "--model", str(tmp_path / "two\nlines")], capsys)
    assert_one_line_error(code, err, "two\\nlines")
