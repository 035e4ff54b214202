"""The CUDA code path on the CPU: the model moved with `Transformer.to(device, triton=True)`
keeps the file's blocks as uint8 tensors and multiplies them with the Triton kernels
(kernels/quant/device_linear.py), here in Triton's interpreter, against transformers'
forward on the weights gguf's dequantizer makes of the same bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.cache.kv_cache import CacheSettings, KVCache, StepBatch
from engine.model.errors import ModelLoadError
from engine.model.loader import load_model
from kernels.paged_attention import CPU_HALF_PAGES
from kernels.quant.device_linear import DECODE_MAX_ROWS, DeviceBlockEmbedding, DeviceBlockLinear
from tests.engine.test_forward_tiny import (
    FILE_MIXES,
    _assert_close,
    _folio_logits,
    _reference_logits,
)
from tests.engine.tiny_models import make_hf_model, write_gguf

pytest.importorskip("triton")

# Q4_K_M's types, and the legacy ones plus Q5_K in another file
MIXES = {
    "Q4_K_M": (FILE_MIXES["Q4_K_M"], Q.Q4_K),
    "legacy": ({"q": Q.Q4_0, "k": Q.Q4_1, "v": Q.Q8_0, "o": Q.Q5_K, "gate": Q.Q4_1, "up": Q.Q4_0, "down": Q.Q5_K, "embd": Q.Q8_0, "output": Q.Q4_0}, Q.Q8_0),
}  # fmt: skip


@pytest.fixture(scope="module")
def interpreter(triton_quant_interpreted):
    return triton_quant_interpreted


@pytest.fixture(scope="module", params=list(MIXES))
def files(request, tmp_path_factory):
    mix, default = MIXES[request.param]
    model = make_hf_model("llama", seed=5, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    model.load_state_dict(write_gguf(model, path, mix, default=default, seed=2))
    return model, path


def _on_triton(path):
    loaded = load_model(path, load_tokenizer=False)
    loaded.model.to("cpu", triton=True)
    return loaded


def test_weights_are_the_files_bytes_on_the_device_path(interpreter, files, monkeypatch):
    _, path = files
    loaded = _on_triton(path)
    model = loaded.model
    assert isinstance(model.embedding, DeviceBlockEmbedding)
    assert isinstance(model.lm_head, DeviceBlockLinear)
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(lin, DeviceBlockLinear)
            assert all(p.data.dtype == torch.uint8 for p in lin.parts)
    # the CPU's native weights as the file has them (not repacked into tiles, which
    # only the CPU's kernels read: kernels/quant/tiles.py)
    monkeypatch.setattr("kernels.quant.linear.tiles_supported", lambda name: False)
    native = load_model(path, load_tokenizer=False)
    assert loaded.weight_bytes == native.weight_bytes  # no copy in another precision


def test_decode_sized_forwards_match_transformers(interpreter, files):
    """Chunks of at most DECODE_MAX_ROWS rows: the float32 Triton kernels, exact up to
    float32 rounding (the CPU kernels' int8 activations need 5e-2 here)."""
    model, path = files
    loaded = _on_triton(path)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(1)
    )
    _assert_close(
        _folio_logits(loaded, ids, chunks=(15, 1, 1)), _reference_logits(model, ids), 1e-4
    )


def test_prefill_sized_forwards_take_fp16_tiles(interpreter, files):
    """Longer chunks: fp16 tiles of the weights and split fp16 activations (the weights'
    rounding to 11 bits is the error left: 0.0087 here, 0.109 with bf16)."""
    model, path = files
    loaded = _on_triton(path)
    n = DECODE_MAX_ROWS + 6
    ids = torch.randint(
        0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(2)
    )
    ref = _reference_logits(model, ids)
    ours = _folio_logits(loaded, ids, chunks=(n - 2, 1))
    _assert_close(ours, ref, 2e-2)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"argmax agrees at {agree:.0%} of positions"


def test_int4_weights_are_refused_on_a_gpu(files):
    _, path = files
    with pytest.raises(
        ModelLoadError, match="int4 weights are a CPU format; on cuda:0 load with native"
    ):
        load_model(path, weight_mode="int4", load_tokenizer=False, device="cuda:0")
    packed = load_model(path, weight_mode="int4", load_tokenizer=False)
    with pytest.raises(ValueError, match="CPU formats"):
        packed.model.to("cpu", triton=True)


def test_step_batch_moves_its_tensors_and_keeps_the_host_arrays():
    batch = StepBatch.build([([3, 4], 17, 1), ([5], 2, 1)], 16)
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    assert moved.positions.device.type == "meta" and moved.block_tables.device.type == "meta"
    assert moved.host is batch.host and moved.decode_only


def test_cache_pages_live_on_the_models_device_in_fp16(files):
    """A cache on another device (``meta`` stands in for a GPU: tensors without storage)
    allocates every page there, unquantized pages in fp16 (half the bytes of fp32 pages,
    whose fingerprint differs; the CPU's default fp16 pages share it: the same bytes)."""
    _, path = files
    loaded = load_model(path, load_tokenizer=False)
    settings = CacheSettings(page_size=16, token_budget=64)
    fp32 = KVCache.for_model(loaded, dataclasses.replace(settings, k_bits=32, v_bits=32))
    meta = KVCache(3, 2, 64, loaded.fingerprint, settings, device="meta")
    assert all(
        t.device.type == "meta" and t.dtype == torch.float16 for t in meta.storage.page_tensors()
    )
    assert all(t.dtype == torch.float32 for t in fp32.storage.page_tensors())
    assert meta.nbytes() * 2 == fp32.nbytes()
    assert meta.fingerprint != fp32.fingerprint
    assert not meta.numba_decode
    if CPU_HALF_PAGES:
        cpu = KVCache.for_model(loaded, settings)
        assert cpu.nbytes() == meta.nbytes() and cpu.fingerprint == meta.fingerprint


def test_a_type_without_a_gpu_kernel_is_refused_at_load(interpreter, tmp_path):
    model = make_hf_model("llama", seed=5, tie_word_embeddings=False)
    write_gguf(model, tmp_path / "q5.gguf", {"q": Q.Q5_0}, default=Q.Q8_0)
    loaded = load_model(tmp_path / "q5.gguf", load_tokenizer=False)
    with pytest.raises(ValueError, match="Q5_0 weights have no GPU kernel"):
        loaded.model.to("cpu", triton=True)
