"""The forward pass through the paged cache: page boundaries, cache hits, quantized caches."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generate import Completion, SequenceRunner, generate
from engine.model.loader import load_model
from tests.engine.tiny_models import make_hf_model, save_hf_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_folder(make_hf_model("qwen3", seed=11), tmp_path_factory.mktemp("tiny") / "m")
    return load_model(folder, load_tokenizer=False)


def _ids(n: int, seed: int = 0, vocab: int = 384) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fresh_logits(loaded, ids: list[int], page_size: int = 16) -> torch.Tensor:
    cache = KVCache.for_model(loaded, CacheSettings(page_size=page_size, token_budget=2 * len(ids) + page_size))
    return SequenceRunner(loaded, cache, ids).step(all_logits=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_cache_hit_skips_prefix_and_keeps_logits(tiny):
    prefix = _ids(70, seed=1)  # 4 full 16-token pages and a partial one
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=512))
    first = SequenceRunner(tiny, cache, prefix + _ids(9, seed=2), job_id=1)
    first.step()
    first.release()
    cache.pages.validate()
    full = prefix + _ids(30, seed=3)
    again = SequenceRunner(tiny, cache, full, job_id=2)
    assert again.cached_tokens >= 64  # the four full pages of the shared prefix are hits
    tail = again.step(all_logits=True)
    assert tail.shape[0] == len(full) - again.cached_tokens
    ref = _fresh_logits(tiny, full)[again.cached_tokens :]
    assert _rel(tail, ref) < 1e-4
    again.release()
    cache.pages.validate()


def test_partial_page_rows_are_reused(tiny):
    """A prompt that shares 20 tokens with a cached one: the first page is a hit and the
    first 4 rows of the second are copied from the cached sibling (ENGINE_SPEC §2)."""
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=256))
    base = _ids(40, seed=4)
    run = SequenceRunner(tiny, cache, base, job_id=1)
    run.step()
    run.release()
    other = base[:20] + _ids(20, seed=5)
    second = SequenceRunner(tiny, cache, other, job_id=2)
    assert second.cached_tokens == 20
    assert _rel(second.step(all_logits=True), _fresh_logits(tiny, other)[20:]) < 1e-4
    second.release()


@pytest.mark.parametrize("bits,tolerance", [(8, 0.02), (4, 0.12)])
def test_quantized_cache_close_to_fp32(tiny, bits, tolerance):
    ids = _ids(50, seed=6)
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=128, k_bits=bits, v_bits=bits))
    assert cache.nbytes() < KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=128)).nbytes() / 2
    logits = SequenceRunner(tiny, cache, ids).step(all_logits=True)
    assert _rel(logits, _fresh_logits(tiny, ids)) < tolerance


def test_prompt_larger_than_cache_is_refused(tiny):
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=64))
    with pytest.raises(ValueError, match="pages"):
        SequenceRunner(tiny, cache, _ids(100))


@pytest.mark.slow
def test_smollm2_paged_generation_reuses_prefix(smollm2_dequant):
    tok = smollm2_dequant.tokenizer
    system = {"role": "system", "content": "You are a concise assistant. " * 30}
    cache = KVCache.for_model(smollm2_dequant, CacheSettings(page_size=64, token_budget=4096))
    replies = []
    for question in ("What is two plus two?", "Name a planet."):
        ids = tok.encode_chat([system, {"role": "user", "content": question}])
        shared, alone = Completion(), Completion()
        shared_text = "".join(generate(smollm2_dequant, ids, max_new_tokens=12, temperature=0, completion=shared, cache=cache))
        alone_text = "".join(generate(smollm2_dequant, ids, max_new_tokens=12, temperature=0, completion=alone))
        assert shared_text == alone_text and shared.token_ids == alone.token_ids
        replies.append(shared)
        cache.pages.validate()
    assert replies[0].cached_tokens == 0
    # The second question shares the system prompt's full pages.
    assert replies[1].cached_tokens >= 64 * (replies[1].prompt_tokens // 2 // 64)
    assert replies[1].cached_tokens > 0


@pytest.mark.slow
def test_smollm2_cache_hit_logits_equal_a_fresh_run(smollm2_dequant):
    """SmolLM2 through 64-token pages: a prompt crossing several page boundaries, then a
    longer one that skips its cached prefix, with the logits of a fresh run."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "data" / "prose.txt").read_text()
    ids = smollm2_dequant.tokenizer.encode(text)[:300]
    cache = KVCache.for_model(smollm2_dequant, CacheSettings(page_size=64, token_budget=1024))
    first = SequenceRunner(smollm2_dequant, cache, ids[:200], job_id=1)
    first.step()
    first.release()
    second = SequenceRunner(smollm2_dequant, cache, ids, job_id=2)
    # Three full pages of the first prompt, and the 8 rows of its partial fourth page
    # copied into this job's own page.
    assert second.cached_tokens == 200 and second.alloc.partial_rows == 8
    hit = second.step(all_logits=True)
    fresh = _fresh_logits(smollm2_dequant, ids, page_size=64)
    assert _rel(hit, fresh[200:]) < 1e-4
    second.release()
    cache.pages.validate()
