"""The real default model: SmolLM2-135M-Instruct Q4_1, against transformers' loading of the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generator.job import JobRequest
from engine.model.runner import SequenceRunner
from tests.engine.generator.helpers import GREEDY, complete, make_generator

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
    return torch.cat(
        [
            runner.step(min(step, ids.shape[1] - i), all_logits=True)
            for i in range(0, ids.shape[1], step)
        ]
    )


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
    top_err = (
        (packed.gather(-1, best) - exact.gather(-1, best)).norm() / exact.gather(-1, best).norm()
    ).item()
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
    # int4 storage alone (the bf16 copies for batched rows, when kept, are extra)
    assert (
        smollm2_int4.weight_bytes - smollm2_int4.batched_weights_bytes
        < 0.5 * smollm2_dequant.weight_bytes
    )


def test_native_mode_agrees_with_dequant_mode(smollm2_native, smollm2_dequant, smollm2_path):
    """The default mode reads the file's Q4_1 blocks in place: a 512-token prompt in one
    go (dequantized tiles and torch's GEMM) and token by token (int8 activations, integer
    dot products) pick the exact weights' argmax at >= 99% of positions."""
    ids = _text_ids(smollm2_dequant.tokenizer, 512)
    exact = _all_logits(smollm2_dequant, ids)
    agree, top_err = _agreement(_all_logits(smollm2_native, ids), exact)
    assert agree >= 0.99 and top_err < 0.02, (agree, top_err)
    agree, top_err = _agreement(_all_logits(smollm2_native, ids, chunk=1), exact)
    assert agree >= 0.99, f"argmax agrees on only {agree:.1%} of positions"
    assert top_err < 0.02, f"relative error of the leading logit {top_err:.2%}"
    # nothing but the file's bytes (and fp32 norms)
    assert smollm2_native.weight_bytes <= 1.05 * smollm2_path.stat().st_size


def test_a_loaded_model_keeps_its_file_open_but_not_its_vocabulary(smollm2_native, smollm2_path):
    """The model reads embedding rows from its GGUF file, which it keeps open; the file's
    metadata arrays (49,152 token strings, the merges) were read by loading and are not
    kept with it."""
    import numpy as np

    from engine.model.gguf_file import GGUFFile

    read = smollm2_native.model.embedding.read
    files = [
        c.cell_contents for c in read.__closure__ or () if isinstance(c.cell_contents, GGUFFile)
    ]
    assert len(files) == 1, "the embedding's row reader should hold the model's GGUF file"
    kept = files[0]
    assert len(GGUFFile(smollm2_path).get("tokenizer.ggml.tokens")) == 49152
    assert kept.get("tokenizer.ggml.tokens") is None
    assert not [k for k, v in kept.metadata.items() if isinstance(v, (list, np.ndarray))]
    assert kept.architecture == "llama"  # the scalars stay
    ids = torch.tensor([0, 17, 49151])
    rows = smollm2_native.model.embedding(ids)
    assert rows.shape == (3, smollm2_native.config.hidden_size) and torch.isfinite(rows).all()


def test_bf16_batch_copies_agree_with_dequant_as_well_as_int4(smollm2_int4, smollm2_dequant):
    if not smollm2_int4.batched_weights_bytes:
        pytest.skip("no bf16 batch copies: this CPU has no AMX bf16 (kernels/bf16.py)")
    ids = _text_ids(smollm2_dequant.tokenizer, 256)
    exact = _all_logits(smollm2_dequant, ids)
    batched = _all_logits(smollm2_int4, ids, chunk=16)  # prefill chunks: the bf16 copies
    int4 = _all_logits(smollm2_int4, ids, chunk=1)  # one decode row: torch's int4 kernel
    assert not torch.equal(batched, int4)
    agree, top_err = _agreement(batched, exact)
    _, int4_err = _agreement(int4, exact)
    assert agree >= 0.98, f"argmax agrees on only {agree:.1%} of positions"
    assert top_err < 1.5 * int4_err, (top_err, int4_err)
    # two bytes per weight of every projection and of the (tied) head, counted on the
    # dequantized model's dense matrices
    dense = smollm2_dequant.model
    params = sum(
        lin.weight.numel()
        for layer in dense.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    assert smollm2_int4.batched_weights_bytes == 2 * (params + dense.embedding.numel())


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_chat_matches_transformers_generate(prompt, smollm2_dequant, smollm2_hf):
    tok = smollm2_dequant.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    gen = make_generator(smollm2_dequant, page_size=64, tokens=256)
    _, result = complete(gen, JobRequest(prompt=ids, sampling=GREEDY, max_new_tokens=32))
    with torch.no_grad():
        ref = smollm2_hf.generate(
            torch.tensor([ids]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=tok.eos_token_ids,
            pad_token_id=tok.pad_token_id,
        )[0, len(ids) :].tolist()
    assert result.token_ids[0] == ref
    assert result.text == tok.decode([t for t in ref if t not in tok.eos_token_ids])


def test_chat_template_and_stop(smollm2_int4):
    tok = smollm2_int4.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Say hello."}])
    assert tok.decode(ids).rstrip().endswith("<|im_start|>assistant")
    gen = make_generator(smollm2_int4, page_size=64, tokens=256)
    text, result = complete(gen, JobRequest(prompt=ids, sampling=GREEDY, max_new_tokens=64))
    assert text == result.text and text.strip()
    assert result.eos_reason in ("stop_token", "max_new_tokens")
    if result.eos_reason == "stop_token":
        assert result.token_ids[0][-1] in tok.eos_token_ids
    else:
        assert result.new_tokens == 64


def test_batched_weights_policy(smollm2_path, monkeypatch):
    from engine.model import loader

    def kept(**kwargs) -> int:
        loaded = loader.load_model(smollm2_path, weight_mode="int4", load_tokenizer=False, **kwargs)
        has = loaded.model.has_batched_weights
        assert has == (loaded.batched_weights_bytes > 0)
        return loaded.batched_weights_bytes

    assert kept(batched_weights="off") == 0
    monkeypatch.setattr(loader, "packed_bf16_available", lambda: False)
    assert kept() == 0  # auto: not on a CPU without AMX bf16
    monkeypatch.setattr(loader, "packed_bf16_available", lambda: True)
    monkeypatch.setattr(loader, "BATCHED_AUTO_MAX_BYTES", 1 << 20)
    assert kept() == 0  # auto: not when the copies would cost more than the cap
    monkeypatch.setattr(loader, "packed_bf16_supported", lambda: False)
    with pytest.raises(loader.ModelLoadError, match="'auto' or 'off'"):
        kept(batched_weights="on")
    with pytest.raises(ValueError, match="auto, on, off"):
        kept(batched_weights="always")


def test_a_refused_packing_loads_without_copies(smollm2_path, monkeypatch):
    """oneDNN refusing to pack midway leaves no partial copies: auto loads without them,
    on says what failed and what to do."""
    from engine.model import loader, transformer

    monkeypatch.setattr(loader, "packed_bf16_available", lambda: True)
    monkeypatch.setattr(loader, "packed_bf16_supported", lambda: True)
    from kernels.bf16 import PackedBF16

    packed = []

    def fails_third_time(weight):
        if len(packed) == 2:
            raise RuntimeError("mkldnn: could not create a primitive")
        packed.append(weight.shape)
        # a bf16 copy as the real packing makes, without oneDNN (CPUs without bf16 lack it)
        w = weight.detach().to(torch.bfloat16).contiguous()
        return PackedBF16(w, w.shape[0], w.shape[1])

    monkeypatch.setattr(transformer, "pack_bf16", fails_third_time)
    loaded = loader.load_model(smollm2_path, weight_mode="int4", load_tokenizer=False)
    assert len(packed) == 2  # two copies were made before the failure, then dropped
    assert loaded.batched_weights_bytes == 0 and not loaded.model.has_batched_weights
    assert (
        loaded.weight_bytes
        == loader.load_model(
            smollm2_path, weight_mode="int4", load_tokenizer=False, batched_weights="off"
        ).weight_bytes
    )
    packed.clear()
    with pytest.raises(
        loader.ModelLoadError, match="could not create a primitive.*'auto' or 'off'"
    ):
        loader.load_model(
            smollm2_path, weight_mode="int4", load_tokenizer=False, batched_weights="on"
        )


def test_weight_estimate_before_download_matches_the_loaded_model(
    smollm2_path, smollm2_native, smollm2_int4
):
    """The model manager's fit label counts what loading keeps: the file's bytes in the
    default mode; in int4 mode the repacked and fp32 weights, bf16 batch copies included."""
    from engine.hub.gguf_info import estimate_weight_bytes, summary_from_file
    from engine.model.gguf_file import GGUFFile

    estimate = summary_from_file(smollm2_path).weight_bytes
    assert abs(estimate - smollm2_native.weight_bytes) < 0.05 * smollm2_native.weight_bytes
    tensors = list(GGUFFile(smollm2_path).tensors.values())
    assert smollm2_native.weight_bytes <= 1.05 * sum(t.nbytes for t in tensors)
    int4 = estimate_weight_bytes(tensors, "int4")
    assert abs(int4 - smollm2_int4.weight_bytes) < 0.05 * smollm2_int4.weight_bytes


def test_forward_picks_bf16_copies_for_prefill_and_big_decode_batches(smollm2_int4, monkeypatch):
    """Prefill at any length and decode from BATCHED_FROM_ROWS sequences read the bf16
    copies; smaller decode batches read the int4 weights (faster there)."""
    from engine.cache.kv_cache import StepBatch
    from engine.model import transformer
    from kernels.bf16 import BATCHED_FROM_ROWS

    if not smollm2_int4.batched_weights_bytes:
        pytest.skip("no bf16 batch copies: this CPU has no AMX bf16 (kernels/bf16.py)")
    calls = []
    real = transformer.bf16_linear
    monkeypatch.setattr(
        transformer, "bf16_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w)
    )
    cache = KVCache.for_model(smollm2_int4, CacheSettings(page_size=16, token_budget=16 * 16))

    def forward(sequences: int, new_tokens: int) -> int:
        calls.clear()
        seqs = [([i], 16 - new_tokens, new_tokens) for i in range(sequences)]
        batch = StepBatch.build(seqs, 16)
        tokens = torch.arange(sequences * new_tokens) % 1000 + 100
        smollm2_int4.model.forward(tokens, batch, cache)
        return len(calls)

    assert forward(1, 3) > 0  # a 3-token prefill chunk
    assert forward(BATCHED_FROM_ROWS - 1, 1) == 0
    assert forward(BATCHED_FROM_ROWS, 1) > 0
