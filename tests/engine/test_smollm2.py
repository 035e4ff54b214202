"""The real default model: SmolLM2-135M-Instruct Q4_1, against transformers' loading of the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generate import Completion, SequenceRunner, generate

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
]


def _text_ids(tokenizer, n: int) -> torch.Tensor:
    """n tokens of English prose as a [1, n] tensor."""
    text = (Path(__file__).parents[1] / "data" / "prose.txt").read_text()
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    return torch.tensor([ids[:n]])


def _all_logits(loaded, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Logits at every position, the prompt fed in one go or `chunk` tokens at a time."""
    cache = KVCache.for_model(loaded, CacheSettings(page_size=64, token_budget=ids.shape[1]))
    runner = SequenceRunner(loaded, cache, ids[0].tolist())
    step = chunk or ids.shape[1]
    return torch.cat([runner.step(min(step, ids.shape[1] - i), all_logits=True) for i in range(0, ids.shape[1], step)])


def test_dequant_logits_match_transformers(smollm2_dequant, smollm2_hf):
    ids = _text_ids(smollm2_dequant.tokenizer, 128)
    with torch.no_grad():
        ref = smollm2_hf(ids).logits[0]
    ours = _all_logits(smollm2_dequant, ids)
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"


def _agreement(packed: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """Share of positions with the same argmax, and the relative error of the logit of
    the exact argmax (the value sampling depends on most)."""
    best = exact.argmax(-1, keepdim=True)
    agree = (packed.argmax(-1) == best[:, 0]).float().mean().item()
    top_err = ((packed.gather(-1, best) - exact.gather(-1, best)).norm() / exact.gather(-1, best).norm()).item()
    return agree, top_err


def test_int4_mode_agrees_with_dequant_mode(smollm2_int4, smollm2_dequant):
    ids = _text_ids(smollm2_dequant.tokenizer, 512)
    exact = _all_logits(smollm2_dequant, ids)
    # A 512-token prompt takes the dense fp32 path (dequantized on the fly): exact.
    agree, top_err = _agreement(_all_logits(smollm2_int4, ids), exact)
    assert agree >= 0.99 and top_err < 1e-4, (agree, top_err)
    # Token by token, as in decoding: torch's int4 kernel with bf16 activations.
    agree, top_err = _agreement(_all_logits(smollm2_int4, ids[:, :256], chunk=1), exact[:256])
    assert agree >= 0.98, f"argmax agrees on only {agree:.1%} of positions"
    assert top_err < 0.02, f"relative error of the leading logit {top_err:.2%}"
    assert smollm2_int4.weight_bytes < 0.5 * smollm2_dequant.weight_bytes


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_chat_matches_transformers_generate(prompt, smollm2_dequant, smollm2_hf):
    tok = smollm2_dequant.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    completion = Completion()
    for _ in generate(smollm2_dequant, ids, max_new_tokens=32, temperature=0.0, completion=completion):
        pass
    with torch.no_grad():
        ref = smollm2_hf.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id
        )[0, len(ids) :].tolist()
    assert completion.token_ids == ref
    assert completion.text == tok.decode([t for t in ref if t not in tok.eos_token_ids])


def test_chat_template_and_stop(smollm2_int4):
    tok = smollm2_int4.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Say hello."}])
    assert tok.decode(ids).rstrip().endswith("<|im_start|>assistant")
    completion = Completion()
    text = "".join(generate(smollm2_int4, ids, max_new_tokens=64, temperature=0.0, completion=completion))
    assert text == completion.text and text.strip()
    assert completion.eos_reason in ("stop_token", "max_new_tokens")
    if completion.eos_reason == "stop_token":
        assert completion.token_ids[-1] in tok.eos_token_ids
    else:
        assert completion.new_tokens == 64
