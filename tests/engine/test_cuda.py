"""Folio on a CUDA GPU: the Triton block kernels compiled for the device, the forward pass on
it, and the generator tests that matter there (batching, prefix caching and copy-on-write
change no token; no page leaks). Marked ``cuda`` and skipped where torch sees no GPU; the
GPU machine runs them through tools/device_check.sh."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from engine.model.loader import load_model
from kernels.quant.bench import random_blocks
from kernels.quant.device_linear import DECODE_MAX_ROWS, DeviceBlockLinear
from kernels.quant.reference import reference_dequantize
from tests.engine.generator.helpers import GREEDY, drain, make_generator, random_ids, run_alone
from tests.engine.test_forward_tiny import (
    FILE_MIXES,
    _assert_close,
    _folio_logits,
    _reference_logits,
)
from tests.engine.tiny_models import make_hf_model, write_gguf

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

CUDA = torch.device("cuda", 0)
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def tq():
    import kernels.triton_quant as module

    if module.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set: the kernels would not be compiled")
    return module


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernels_on_the_gpu_equal_gguf(tq, qtype):
    n, k = 40, 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 160
    raw = random_blocks(qtype, n, k, np.random.default_rng(int(qtype)))
    ref = reference_dequantize(raw, qtype, (n, k))
    data = torch.from_numpy(raw.copy()).to(CUDA)
    exact = tq.triton_dequantize(data, int(qtype), (n, k), torch.float32)
    assert torch.equal(exact.cpu(), torch.from_numpy(ref))
    for dtype in (torch.float16, torch.bfloat16):
        tile = tq.triton_dequantize(data, int(qtype), (n, k), dtype)
        assert torch.equal(tile.cpu(), torch.from_numpy(ref).to(dtype))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    y = tq.triton_quant_matmul(x.to(CUDA), data, int(qtype), (n, k)).cpu().double().numpy()
    x64, w64 = x.double().numpy(), ref.astype(np.float64)
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T)
    assert (np.abs(y - x64 @ w64.T) <= bound).all()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_batch_on_the_gpu(tq, qtype):
    n, k = 48, 1024
    data = torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(3)).copy()).to(CUDA)
    x = torch.randn(40, k, device=CUDA)

    def product(rows):
        return tq.triton_quant_matmul(rows, data, int(qtype), (n, k))

    alone = product(x[7:8])[0]
    assert torch.equal(product(x[:8])[7], alone)
    assert torch.equal(product(x)[7], alone)  # 40 rows: three row tiles
    assert torch.equal(product(torch.cat([x[8:], x[:8]]))[39], alone)  # last of the third


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = make_hf_model("llama", seed=5, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("cuda") / "m.gguf"
    model.load_state_dict(write_gguf(model, path, FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=2))
    return model, path


@pytest.fixture(scope="module")
def on_gpu(tiny_gguf):
    return load_model(tiny_gguf[1], load_tokenizer=False, device=CUDA)


def test_weights_and_pages_are_on_the_gpu(on_gpu):
    assert on_gpu.device == CUDA
    layer = on_gpu.model.layers[0]
    assert isinstance(layer.qkv, DeviceBlockLinear) and layer.qkv.parts[0].data.is_cuda
    cache = KVCache.for_model(on_gpu, CacheSettings(page_size=16, token_budget=64))
    assert all(t.is_cuda and t.dtype == torch.float16 for t in cache.storage.page_tensors())


def test_forward_on_the_gpu_matches_transformers(tiny_gguf, on_gpu):
    model, _ = tiny_gguf
    short = torch.randint(
        0, model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(1)
    )
    ours = _folio_logits(on_gpu, short, chunks=(15, 1, 1)).cpu()
    _assert_close(ours, _reference_logits(model, short), 5e-3)  # fp16 K/V pages
    n = DECODE_MAX_ROWS + 30
    long = torch.randint(
        0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(2)
    )
    ref = _reference_logits(model, long)
    ours = _folio_logits(on_gpu, long, chunks=(n - 2, 1)).cpu()
    _assert_close(ours, ref, 3e-2)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def _requests(vocab: int, count: int = 12) -> list[JobRequest]:
    return [
        JobRequest(
            prompt=random_ids(5 + 7 * i, seed=i, vocab=vocab),
            sampling=GREEDY,
            max_new_tokens=6 + i,
            stop_token_ids=(),
        )
        for i in range(count)
    ]


def test_batching_is_invisible_on_the_gpu(on_gpu):
    requests = _requests(on_gpu.config.vocab_size)
    alone = [run_alone(on_gpu, r, tokens=4096, max_chunk_size=32).token_ids[0] for r in requests]
    gen = make_generator(on_gpu, tokens=256, max_batch_size=4, max_chunk_size=32)
    jobs = [gen.submit(r) for r in requests]
    results = drain(gen)  # validates the page table each step; fails on a leaked page
    assert [results[j.job_id].token_ids[0] for j in jobs] == alone
    assert gen.pages.counters.evictions > 0, "the cache never filled: nothing was evicted"


def test_prefix_caching_is_invisible_on_the_gpu(on_gpu):
    vocab = on_gpu.config.vocab_size
    shared = random_ids(64, seed=40, vocab=vocab)
    first = JobRequest(
        prompt=shared + random_ids(9, 41, vocab),
        sampling=GREEDY,
        max_new_tokens=8,
        stop_token_ids=(),
    )
    second = JobRequest(
        prompt=shared + random_ids(11, 42, vocab),
        sampling=GREEDY,
        max_new_tokens=8,
        stop_token_ids=(),
    )
    gen = make_generator(on_gpu, tokens=1024)
    gen.submit(first)
    drain(gen)
    job = gen.submit(second)
    cached = drain(gen)[job.job_id]
    assert cached.cached_tokens >= 64
    uncached = run_alone(on_gpu, second, tokens=1024, prefix_caching=False)
    assert uncached.cached_tokens == 0 and cached.token_ids == uncached.token_ids


def test_copy_on_write_is_invisible_on_the_gpu(on_gpu):
    """n=4 samples fork the prompt's pages (the partial last page is copied on write):
    greedy, every fork writes what one job alone writes; sampled, the forks differ and use
    fewer pages than four independent jobs."""
    prompt = random_ids(40, 5, on_gpu.config.vocab_size)
    # this random model's logits are so spread that T=1 samples its argmax every time
    sampling = SamplingSettings(temperature=100.0, seed=3)
    forked = run_alone(
        on_gpu,
        JobRequest(prompt=prompt, sampling=sampling, max_new_tokens=12, n=4, stop_token_ids=()),
    )
    one = run_alone(
        on_gpu, JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=12, stop_token_ids=())
    )
    greedy = run_alone(
        on_gpu,
        JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=12, n=4, stop_token_ids=()),
    )
    assert all(t == one.token_ids[0] for t in greedy.token_ids)
    assert len({tuple(t) for t in forked.token_ids}) > 1
    assert forked.peak_pages < 4 * one.peak_pages


def test_host_tier_copies_on_a_side_stream():
    """Pinned slots; a push is read before the compute stream reuses its page, a restore
    lands before the page is read (engine/cache/tier_copies.py)."""
    from engine.cache import HostTier
    from engine.cache.storage import PagedKVStorage, dense_allocator
    from engine.cache.tier_copies import CudaStreams

    storage = PagedKVStorage(2, 8, 16, dense_allocator(2, 64, torch.float16, CUDA))
    for t in storage.page_tensors():
        t.copy_(torch.randn(t.shape, device=CUDA))
    tier = HostTier(4 * storage.bytes_per_page, storage)
    assert isinstance(tier.copies.streams, CudaStreams)
    assert all(t.is_pinned() for t in tier.storage.page_tensors())
    page = storage.read_page(1)
    for step in range(20):  # a race, if there were one, shows within a few tries
        h = bytes([step]) * 16
        assert tier.push(h, None, list(range(16)), storage, 1)
        storage.copies.await_pages([1])  # what a forward over page 1 does first
        for t in storage.page_tensors():
            t[1].mul_(-1)  # the page reused at once
        assert tier.read_slot(h) == page
        tier.restore(h, storage, 5)
        assert storage.read_page(5) == page
        for t in storage.page_tensors():
            t[1].mul_(-1)  # back to the bytes pushed next round


def test_the_host_tier_is_invisible_on_the_gpu(on_gpu):
    """A shared prefix pushed to pinned host RAM by other jobs and restored from it gives
    the tokens a run without any cache gives."""
    vocab = on_gpu.config.vocab_size
    shared = random_ids(64, seed=50, vocab=vocab)

    def request(prompt: list[int]) -> JobRequest:
        return JobRequest(prompt=prompt, sampling=GREEDY, max_new_tokens=8, stop_token_ids=())

    cache = CacheSettings(page_size=16, token_budget=160, host_bytes=64 << 20)
    gen = make_generator(on_gpu, cache=cache, max_batch_size=2)
    tier = gen.cache.pages.host_tier
    assert all(t.is_pinned() for t in tier.storage.page_tensors())
    gen.submit(request(shared + random_ids(9, 51, vocab)))
    drain(gen)
    for seed in range(3):  # fill the device pages: the prefix goes to the host tier
        gen.submit(request(random_ids(140, 60 + seed, vocab)))
        drain(gen)
    second = request(shared + random_ids(11, 52, vocab))
    job = gen.submit(second)
    restored = drain(gen)[job.job_id]
    assert gen.pages.counters.tier_restores >= 4
    fresh = run_alone(on_gpu, second, tokens=1024, prefix_caching=False)
    assert restored.token_ids == fresh.token_ids


def test_quantized_pages_on_the_gpu(on_gpu):
    """K and V in 8 bits on the device (keys calibrated by a forward on the GPU): the
    pages are there, the job runs to its length, and no page leaks."""
    cache = CacheSettings(page_size=16, token_budget=512, k_bits=8, v_bits=8)
    gen = make_generator(on_gpu, cache=cache)
    assert all(t.is_cuda for t in gen.cache.storage.page_tensors())
    request = JobRequest(
        prompt=random_ids(40, 6, on_gpu.config.vocab_size),
        sampling=GREEDY,
        max_new_tokens=10,
        stop_token_ids=(),
    )
    job = gen.submit(request)
    result = drain(gen)[job.job_id]
    assert len(result.token_ids[0]) == 10


@pytest.mark.parametrize("bits", [None, 4], ids=["fp16", "k4v4"])
def test_graph_replay_equals_eager(on_gpu, bits):
    """fp16 pages, and quantized K and V (codes, steps, minima, and the key offset tables
    reserved up front) replayed from the same graph as eager computes them."""
    from engine.cache.kv_cache import StepBatch
    from engine.model.calibration import calibrate_keys
    from engine.model.decode_graphs import DecodeGraphs
    from engine.model.runner import SequenceRunner

    settings = CacheSettings(page_size=16, token_budget=1024, k_bits=bits, v_bits=bits)
    calibration = calibrate_keys(on_gpu, count=64) if bits else None
    cache = KVCache.for_model(on_gpu, settings, calibration)
    graphs = DecodeGraphs(on_gpu.model, cache)
    runners = [SequenceRunner(on_gpu, cache, random_ids(n, n), 8, job_id=n) for n in (70, 5, 33)]
    for r in runners:
        r.step()
    for step in range(3):  # the first call captures, the next ones replay
        for r in runners:
            r.append(11 + step)
        batch = StepBatch.build([(r.alloc.block_table, r.stored, 1) for r in runners], 16)
        tokens = torch.tensor([r.tokens[r.stored] for r in runners])
        eager = on_gpu.model.forward(tokens, batch, cache)
        assert torch.equal(graphs.forward(tokens, batch), eager)
        for r in runners:
            r.stored += 1
    assert graphs.failure is None and graphs.captured_sizes == [3]


def test_generator_with_graphs_equals_without(on_gpu):
    requests = _requests(on_gpu.config.vocab_size, count=6)

    def tokens(graphs: bool):
        gen = make_generator(on_gpu, tokens=1024, max_batch_size=4, cuda_graphs=graphs)
        jobs = [gen.submit(r) for r in requests]
        results = drain(gen)
        return [results[j.job_id].token_ids[0] for j in jobs], gen

    eager, _ = tokens(False)
    replayed, gen = tokens(True)
    assert replayed == eager
    assert gen.graphs is not None and gen.graphs.failure is None and gen.graphs.captured_sizes
