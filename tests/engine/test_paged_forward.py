"""The forward pass through the paged cache: page boundaries, cache hits, quantized caches."""

from __future__ import annotations

import pytest
import torch

import engine.cache.kv_cache as kv_cache
from engine.cache.kv_cache import CacheSettings, KeyCalibration, KVCache
from engine.generator.generator import Generator
from engine.generator.job import JobRequest
from engine.model.calibration import calibrate_keys, calibration_for, calibration_ids
from engine.model.loader import load_model
from engine.model.runner import SequenceRunner
from engine.model.transformer import apply_rope
from kernels.paged_attention import CPU_HALF_PAGES, paged_attention_reference
from tests.engine.generator.helpers import GREEDY, complete, make_generator
from tests.engine.tiny_models import make_hf_model, save_hf_folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_hf_folder(make_hf_model("qwen3", seed=11), tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_model(tiny_folder, load_tokenizer=False)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """Sliding-window layers with their own (local) RoPE base, a global layer every 6th."""
    model = make_hf_model("gemma3", seed=12)
    return load_model(
        save_hf_folder(model, tmp_path_factory.mktemp("gemma") / "m"), load_tokenizer=False
    )


def _ids(n: int, seed: int = 0, vocab: int = 384) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# fp32 pages: the cache-hit tests compare runs that differ in their chunks, which fp16's
# rounding of K/V would amplify past float32's (SmolLM2, 200 of 300 tokens a hit: 1.5e-4)
EXACT = {"k_bits": 32, "v_bits": 32}


def _fresh_logits(loaded, ids: list[int], page_size: int = 16) -> torch.Tensor:
    settings = CacheSettings(page_size=page_size, token_budget=2 * len(ids) + page_size, **EXACT)
    cache = KVCache.for_model(loaded, settings)
    return SequenceRunner(loaded, cache, ids).step(all_logits=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_cache_hit_skips_prefix_and_keeps_logits(tiny):
    prefix = _ids(70, seed=1)  # 4 full 16-token pages and a partial one
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=512, **EXACT))
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
    first 4 rows of the second are copied from the cached sibling (docs/ENGINE.md §2)."""
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=256, **EXACT))
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
    settings = CacheSettings(page_size=16, token_budget=128, k_bits=bits, v_bits=bits)
    cache = KVCache.for_model(tiny, settings, calibration_for(tiny, settings))
    fp32 = CacheSettings(page_size=16, token_budget=128, **EXACT)
    assert cache.nbytes() < KVCache.for_model(tiny, fp32).nbytes() / 2
    logits = SequenceRunner(tiny, cache, ids).step(all_logits=True)
    assert _rel(logits, _fresh_logits(tiny, ids)) < tolerance


def _greedy_logits(loaded, cache: KVCache, ids: list[int], steps: int) -> torch.Tensor:
    """The prompt's last logits, then those of ``steps`` greedy decode steps."""
    runner = SequenceRunner(loaded, cache, ids, max_new_tokens=steps)
    out = [runner.step()]
    for _ in range(steps):
        runner.append(int(out[-1].argmax()))
        out.append(runner.step())
    return torch.stack(out)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_fp16_pages_by_default_close_to_fp32(tiny, tiny_gemma, family):
    """A cache asked for no width stores fp16 pages (where the CPU's kernels read them):
    half fp32's bytes, its own fingerprint (a disk store of one is never read as the
    other), logits through prefill and decode within fp16's rounding of fp32 pages'."""
    loaded = tiny if family == "qwen3" else tiny_gemma
    small = dict(page_size=16, token_budget=256)
    default = KVCache.for_model(loaded, CacheSettings(**small))
    fp32 = KVCache.for_model(loaded, CacheSettings(**small, k_bits=32, v_bits=32))
    half = KVCache.for_model(loaded, CacheSettings(**small, k_bits=16, v_bits=16))
    assert default.fmt_k.dtype == (torch.float16 if CPU_HALF_PAGES else torch.float32)
    assert half.fmt_k.dtype == half.fmt_v.dtype == torch.float16
    assert fp32.nbytes() == 2 * half.nbytes()
    assert half.fingerprint != fp32.fingerprint
    assert half.fingerprint.k_bits == 16 and fp32.fingerprint.v_bits == 32
    ids = _ids(70, seed=8)
    want = _greedy_logits(loaded, fp32, ids, 12)
    got = _greedy_logits(loaded, half, ids, 12)
    assert _rel(got, want) < 2e-3  # measured 2.5e-4 (qwen3), 4.7e-4 (gemma3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cache_settings_refuse_other_widths():
    for bits in (1, 9, 12, 64):
        with pytest.raises(ValueError, match="2..8 \\(quantized\\), 16 or 32"):
            CacheSettings(k_bits=bits)


# ---- quantized K: keys stored relative to the calibrated mean ----------------------------


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_key_calibration_is_the_pre_rope_key_mean(tiny, tiny_gemma, monkeypatch, family):
    """The means are those of the keys before RoPE (after k_norm: both families have one),
    undone with each layer's own rope: Gemma 3's sliding layers use the local base."""
    loaded = tiny if family == "qwen3" else tiny_gemma
    ids, source = calibration_ids(loaded)
    assert len(ids) == loaded.config.max_position_embeddings == 512 and "random" in source
    model = loaded.model
    assert any(layer.sliding for layer in model.layers) == (family == "gemma3")
    keys = {}
    write = KVCache.write

    def recording_write(self, layer, k, v, batch):
        rope = model.rope_local if model.layers[layer].sliding else model.rope
        cos, sin = rope.tables(batch.positions)
        keys[layer] = apply_rope(k.float(), cos, -sin)  # R(p)^-1 = R(-p)
        write(self, layer, k, v, batch)

    monkeypatch.setattr(KVCache, "write", recording_write)
    # fp32 pages, as calibration runs: later layers' keys depend on the pages' rounding
    cache = KVCache.for_model(loaded, CacheSettings(page_size=64, token_budget=len(ids), **EXACT))
    SequenceRunner(loaded, cache, ids).step()
    monkeypatch.undo()
    calibration = calibrate_keys(loaded)
    for layer, k in keys.items():
        torch.testing.assert_close(calibration.means[layer], k.mean(0), atol=1e-5, rtol=1e-5)
    # deterministic, so that equal caches fingerprint equally
    assert calibrate_keys(loaded).digest == calibration.digest


def test_quantized_k_cache_calibrates_once_and_fingerprints_it(tiny_folder):
    loaded = load_model(tiny_folder, load_tokenizer=False)
    small = dict(page_size=16, token_budget=64)

    def for_model(settings: CacheSettings) -> KVCache:
        return KVCache.for_model(loaded, settings, calibration_for(loaded, settings))

    for_model(CacheSettings(**small, v_bits=4))
    assert loaded.key_calibration is None  # only quantized keys need the mean
    k4 = for_model(CacheSettings(**small, k_bits=4, v_bits=4))
    calibration = loaded.key_calibration
    assert isinstance(calibration, KeyCalibration) and k4.calibration is calibration
    assert for_model(CacheSettings(**small, k_bits=8)).calibration is calibration
    assert k4.fingerprint.calibration == calibration.digest

    cfg = loaded.config
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.fingerprint)
    settings = CacheSettings(**small, k_bits=4, v_bits=4)
    same = KVCache(*shape, settings, calibration)
    assert same.pages.root_digest == k4.pages.root_digest
    shifted = KeyCalibration.of(calibration.means + 1e-3, calibration.inv_freq, "shifted")
    assert KVCache(*shape, settings, shifted).pages.root_digest != k4.pages.root_digest
    assert KVCache(*shape, settings).pages.root_digest != k4.pages.root_digest
    # an unquantized K cache ignores a calibration
    plain = KVCache(*shape, CacheSettings(**small), calibration)
    assert plain.calibration is None and plain.fingerprint.calibration == ""


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_quantized_decode_kernel_matches_reference(tiny, tiny_gemma, monkeypatch, family):
    """Decode steps through the numba kernel (or whichever decode path this machine has)
    and through the SDPA reference read the same quantized pages: equal logits. Gemma 3's
    8-token sliding window is crossed by the 40-token context."""
    loaded = tiny if family == "qwen3" else tiny_gemma
    ids = _ids(30, seed=7)
    follow = _ids(10, seed=8)

    def run() -> torch.Tensor:
        settings = CacheSettings(page_size=16, token_budget=128, k_bits=4, v_bits=4)
        cache = KVCache.for_model(loaded, settings, calibration_for(loaded, settings))
        runner = SequenceRunner(loaded, cache, ids, max_new_tokens=len(follow))
        out = [runner.step()]
        for token in follow:
            runner.append(token)
            out.append(runner.step())
        return torch.stack(out)

    fast = run()
    monkeypatch.setattr(kv_cache, "decode_numba_unchecked", None)  # fail loudly if reached
    monkeypatch.setattr(kv_cache, "numba_supported", lambda *args: False)
    monkeypatch.setattr(kv_cache, "paged_attention", paged_attention_reference)
    reference = run()
    # rounding differences between the paths can flip a code of a later token: 2e-5 seen
    assert _rel(fast, reference) < 1e-4


def test_prompt_larger_than_cache_is_refused(tiny):
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=64))
    with pytest.raises(ValueError, match="pages"):
        SequenceRunner(tiny, cache, _ids(100))


@pytest.mark.slow
def test_smollm2_paged_generation_reuses_prefix(smollm2_dequant):
    tok = smollm2_dequant.tokenizer
    system = {"role": "system", "content": "You are a concise assistant. " * 30}
    cache = KVCache.for_model(smollm2_dequant, CacheSettings(page_size=64, token_budget=4096))
    on_shared_cache = Generator(smollm2_dequant, cache)  # outlives the jobs
    replies = []
    for question in ("What is two plus two?", "Name a planet."):
        ids = tok.encode_chat([system, {"role": "user", "content": question}])
        request = JobRequest(prompt=ids, sampling=GREEDY, max_new_tokens=12)
        shared_text, shared = complete(on_shared_cache, request)
        alone_text, alone = complete(make_generator(smollm2_dequant, page_size=64), request)
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
    cache = KVCache.for_model(
        smollm2_dequant, CacheSettings(page_size=64, token_budget=1024, **EXACT)
    )
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
