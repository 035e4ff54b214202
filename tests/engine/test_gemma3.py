"""The second real model: Gemma 3 270M Q4_K_M (K-quants, sliding-window layers, 262k vocabulary)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generator.job import JobRequest
from engine.model.loader import load_model
from engine.model.runner import SequenceRunner
from tests.engine.generator.helpers import GREEDY, complete, make_generator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return load_model(gemma3_path, weight_mode="dequant")


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gemma3_path.parent, gguf_file=gemma3_path.name, dtype=torch.float32
    )
    return model.eval()


def test_gemma3_config(gemma3):
    cfg = gemma3.config
    assert cfg.arch == "gemma3" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert cfg.sliding_window == 512
    assert cfg.layer_types.count("full") == 3  # every sixth layer attends globally
    assert (
        gemma3.quant_types.get("Q4_K")
        and gemma3.quant_types.get("Q6_K")
        and gemma3.quant_types.get("Q5_0")
    )


def test_gemma3_logits_match_transformers(gemma3, gemma3_hf):
    # Longer than the 512-token sliding window, so local and global layers differ.
    text = (Path(__file__).parents[1] / "data" / "prose.txt").read_text()
    ids = gemma3.tokenizer.encode(text + "\n\n" + text)[:600]
    assert len(ids) == 600 and ids[0] == gemma3.tokenizer.bos_token_id
    ids = torch.tensor([ids])
    with torch.no_grad():
        ref = gemma3_hf(ids).logits[0]
    cache = KVCache.for_model(gemma3, CacheSettings(page_size=128, token_budget=640))
    runner = SequenceRunner(gemma3, cache, ids[0].tolist())
    ours = torch.cat([runner.step(550, all_logits=True), runner.step(50, all_logits=True)])
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.999


def test_native_mode_agrees_with_exact_weights(gemma3, gemma3_path):
    """The default mode on Q4_K and Q6_K (the in-register super-block kernels, two levels
    of int8 activations per 256) and Q5_0: token by token over a 512-token text, the
    argmax of the exact weights at >= 99% of positions."""
    from tests.engine.test_smollm2 import _agreement, _all_logits, _text_ids

    native = load_model(gemma3_path)  # the default weight mode
    assert native.weight_mode == "native"
    ids = _text_ids(gemma3.tokenizer, 512)
    exact = _all_logits(gemma3, ids)
    agree, top_err = _agreement(_all_logits(native, ids, chunk=1), exact)
    assert agree >= 0.99, f"argmax agrees on only {agree:.1%} of positions"
    assert top_err < 0.02, f"relative error of the leading logit {top_err:.2%}"


def test_gemma3_plain_completion_matches_transformers(gemma3, gemma3_hf):
    tok = gemma3.tokenizer
    assert not tok.has_chat_template  # a base model: plain completion
    ids = tok.encode("The capital of France is")
    gen = make_generator(gemma3, page_size=16, tokens=64)
    text, result = complete(gen, JobRequest(prompt=ids, sampling=GREEDY, max_new_tokens=16))
    with torch.no_grad():
        ref = gemma3_hf.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_ids
        )
    assert result.token_ids[0] == ref[0, len(ids) :].tolist()
    assert text == tok.decode([t for t in result.token_ids[0] if t not in tok.eos_token_ids])
