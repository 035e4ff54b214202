"""Folio's forward pass equals transformers' on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.model.loader import load_model
from engine.model.runner import SequenceRunner
from tests.engine.tiny_models import FAMILIES, make_hf_model, save_hf_folder, write_gguf

PROMPT_LEN = 21  # longer than Gemma's test sliding window (8), not a multiple of anything


def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].float()


def _folio_logits(loaded, ids: torch.Tensor, chunks: tuple[int, ...] = (), page_size: int = 16) -> torch.Tensor:
    """Logits for every position through the paged cache (16-token pages, so prompts
    cross page boundaries), fed in the given chunk sizes (the rest in one go)."""
    cache = KVCache.for_model(loaded, CacheSettings(page_size=page_size, token_budget=4 * ids.shape[1]))
    runner = SequenceRunner(loaded, cache, ids[0].tolist())
    out = []
    for size in (*chunks, ids.shape[1]):
        size = min(size, ids.shape[1] - runner.stored)
        if size <= 0:
            break
        out.append(runner.step(size, all_logits=True))
    cache.pages.validate()
    return torch.cat(out)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (ours - ref).norm() / ref.norm()
    assert err < rel, f"relative error {err:.2e} exceeds {rel:.0e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_safetensors_logits_match_transformers(family, tmp_path):
    model = make_hf_model(family)
    save_hf_folder(model, tmp_path / family)
    loaded = load_model(tmp_path / family, load_tokenizer=False)
    assert loaded.config.arch == family
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    ref = _reference_logits(model, ids)
    _assert_close(_folio_logits(loaded, ids), ref, 1e-4)
    # Same logits when the prompt arrives in chunks and then token by token (KV cache path).
    _assert_close(_folio_logits(loaded, ids, chunks=(5, 7, 1, 1)), ref, 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_and_untied_heads(family, tmp_path):
    tie = family != "llama"
    model = make_hf_model(family, seed=3, tie_word_embeddings=not tie)
    save_hf_folder(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m", load_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    _assert_close(_folio_logits(loaded, ids), _reference_logits(model, ids), 1e-4)


# One GGUF per quant family (legacy blocks, K-quants, floats), across architectures;
# llama exercises llama.cpp's q/k row permutation.
GGUF_CASES = [
    ("llama", {"q": Q.Q4_0, "k": Q.Q4_1, "v": Q.Q5_0, "o": Q.Q5_1, "gate": Q.Q8_0, "up": Q.Q4_0, "down": Q.Q4_1, "embd": Q.Q8_0, "output": Q.Q6_K}),
    ("llama", {"q": Q.Q2_K, "k": Q.Q3_K, "v": Q.Q4_K, "o": Q.Q5_K, "gate": Q.Q6_K, "up": Q.Q4_K, "down": Q.Q6_K, "embd": Q.Q4_K, "output": Q.Q5_K}),
    ("qwen2", {"q": Q.F16, "k": Q.BF16, "v": Q.F32, "o": Q.Q8_0, "gate": Q.Q4_K, "up": Q.Q5_0, "down": Q.Q6_K, "embd": Q.F16}),
    ("qwen3", {"q": Q.Q4_1, "k": Q.Q8_0, "v": Q.Q4_K, "o": Q.Q4_0, "embd": Q.Q8_0}),
    ("gemma3", {"q": Q.Q5_0, "k": Q.Q5_0, "v": Q.Q8_0, "o": Q.Q4_K, "down": Q.Q6_K, "embd": Q.Q8_0}),
]


@pytest.mark.parametrize("family,qtypes", GGUF_CASES, ids=lambda v: v if isinstance(v, str) else "-".join(sorted({t.name for t in v.values()})))
def test_gguf_dequant_logits_match_transformers(family, qtypes, tmp_path):
    model = make_hf_model(family, seed=5)
    ref_state = write_gguf(model, tmp_path / "m.gguf", qtypes)
    model.load_state_dict(ref_state)
    loaded = load_model(tmp_path / "m.gguf", weight_mode="dequant", load_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(4))
    _assert_close(_folio_logits(loaded, ids, chunks=(6, 1)), _reference_logits(model, ids), 1e-4)


def test_gguf_int4_mode_close_to_dequant(tmp_path):
    model = make_hf_model("llama", seed=6)
    write_gguf(model, tmp_path / "m.gguf", {}, default=Q.Q4_1)
    exact = load_model(tmp_path / "m.gguf", weight_mode="dequant", load_tokenizer=False)
    packed = load_model(tmp_path / "m.gguf", weight_mode="int4", load_tokenizer=False)
    assert packed.weight_bytes < exact.weight_bytes
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    _assert_close(_folio_logits(packed, ids), _folio_logits(exact, ids), 2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sharded_half_precision_folder(dtype, tmp_path):
    """A folder saved in fp16/bf16 and split into several shards with an index."""
    model = make_hf_model("llama", seed=8)
    model.to(dtype).save_pretrained(tmp_path / "m", safe_serialization=True, max_shard_size="400KB")
    shards = list((tmp_path / "m").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "m" / "model.safetensors.index.json").exists()
    loaded = load_model(tmp_path / "m", load_tokenizer=False)
    assert loaded.quant_types == {"F16" if dtype == torch.float16 else "BF16": len(model.state_dict())}
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(9))
    ref = _reference_logits(model.float(), ids)  # the same half-precision weights, computed in fp32
    _assert_close(_folio_logits(loaded, ids), ref, 1e-4)
