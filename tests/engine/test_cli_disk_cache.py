"""`folio generate` uses the disk tier by default, so the next run finds this one's pages;
`folio cache stats|clear` list and delete the stores; bad disk-cache options get a clear
message and a run that works without the tier."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine import paths
from folio.main import main

pytestmark = pytest.mark.slow

# A prompt of more than one 256-token page (the page size every command uses).
PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(48))


def _generate(model: Path, capsys, *extra: str) -> dict:
    args = ["generate", PROMPT, "--model", str(model), "--max-new-tokens", "6"]
    assert main([*args, "--temperature", "0", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _cache_json(capsys, *args: str) -> dict:
    assert main(["cache", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_next_run_reads_this_runs_pages_from_disk(smollm2_path, capsys):
    first = _generate(smollm2_path, capsys)
    assert first["prompt_tokens"] > 256 and first["cached_tokens"] == 0
    second = _generate(smollm2_path, capsys)
    full_pages = (first["prompt_tokens"] - 1) // 256
    assert second["disk_pages"] == full_pages >= 1
    assert second["cached_tokens"] == full_pages * 256
    assert second["token_ids"] == first["token_ids"]  # greedy: the same reply

    stats = _cache_json(capsys, "stats")
    assert stats["location"] == str(paths.kv_cache_dir())
    (store,) = stats["stores"]
    assert store["model"] == smollm2_path.stem and store["pages"] == full_pages
    assert store["path"] == str(smollm2_path.resolve()) and not store["in_use"]

    cleared = _cache_json(capsys, "clear", "--model", str(smollm2_path))
    assert cleared["freed_bytes"] == store["bytes"] > 0
    assert _cache_json(capsys, "stats")["stores"] == []
    assert _generate(smollm2_path, capsys)["cached_tokens"] == 0  # recomputed


def test_no_disk_cache_keeps_nothing(smollm2_path, capsys):
    _generate(smollm2_path, capsys, "--no-disk-cache")
    assert _generate(smollm2_path, capsys, "--no-disk-cache")["cached_tokens"] == 0
    assert _cache_json(capsys, "stats")["stores"] == []


def test_an_unusable_location_turns_the_tier_off_and_the_run_works(
    smollm2_path, capsys, caplog, tmp_path
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = _generate(smollm2_path, capsys, "--disk-cache", str(blocker / "kv"))
    assert out["new_tokens"] >= 1 and out["cached_tokens"] == 0
    # One line on stderr (Python's last-resort log handler, outside pytest).
    assert "disk cache off: cannot use" in caplog.text


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_budget_is_refused_with_its_option(smollm2_path, capsys, value):
    code = main(["generate", "Hi.", "--model", str(smollm2_path), "--disk-cache-gb", value])
    assert code != 0
    assert "--disk-cache-gb must be more than 0" in capsys.readouterr().err


def test_clear_names_a_model_that_is_not_there(capsys, tmp_path):
    assert main(["cache", "clear", "--model", str(tmp_path / "gone.gguf")]) != 0
    assert "no such model file" in capsys.readouterr().err


def test_stats_of_an_empty_location(capsys, tmp_path):
    assert main(["cache", "stats", "--disk-cache", str(tmp_path / "none")]) == 0
    assert "no disk cache in" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []  # looking does not create the folder
