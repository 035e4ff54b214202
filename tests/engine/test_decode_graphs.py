"""engine.model.decode_graphs on the CPU: the static buffers a CUDA graph replays from,
run eagerly (``capture=False``), give what the model gives on the step's own tensors.
The capture and replay themselves need a GPU: tests/engine/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import CacheSettings, KVCache, StepBatch
from engine.model.decode_graphs import DecodeGraphs
from engine.model.loader import load_model
from engine.model.runner import SequenceRunner
from tests.engine.generator.helpers import random_ids
from tests.engine.tiny_models import make_hf_model, save_hf_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_folder(make_hf_model("llama", seed=3), tmp_path_factory.mktemp("g") / "m")
    return load_model(folder, load_tokenizer=False)


def _runners(tiny, cache, lengths):
    runners = [SequenceRunner(tiny, cache, random_ids(n, seed=n), 8, job_id=n) for n in lengths]
    for r in runners:
        r.step()
        r.append(7)
    return runners


def _decode_batch(runners, page_size):
    batch = StepBatch.build([(r.alloc.block_table, r.stored, 1) for r in runners], page_size)
    tokens = torch.tensor([r.tokens[r.stored] for r in runners])
    return tokens, batch


def test_buffers_give_the_models_logits(tiny):
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=1024))
    # attention through the block tables on the device (the buffers'), as on a GPU, not
    # the numba kernel's host copies
    cache.numba_decode = False
    graphs = DecodeGraphs(tiny.model, cache, capture=False)
    assert graphs.width == cache.num_pages
    long = _runners(tiny, cache, [70, 5, 33])  # block tables of 5, 1 and 3 pages
    tokens, batch = _decode_batch(long, cache.page_size)
    eager = tiny.model.forward(tokens, batch, cache)
    assert torch.equal(graphs.forward(tokens, batch), eager)
    # the same size again with shorter tables: the buffers' old columns must not leak in
    short = _runners(tiny, cache, [3, 4, 20])
    tokens, batch = _decode_batch(short, cache.page_size)
    eager = tiny.model.forward(tokens, batch, cache)
    assert torch.equal(graphs.forward(tokens, batch), eager)
    assert graphs._sizes[3].batch.block_tables[0, 2:].eq(-1).all()


def test_only_decode_steps_and_unquantized_keys(tiny):
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=256))
    graphs = DecodeGraphs(tiny.model, cache, capture=False)
    runner = SequenceRunner(tiny, cache, random_ids(10, seed=1), 4)
    prefill = StepBatch.build([(runner.alloc.block_table, 0, 10)], cache.page_size)
    with pytest.raises(ValueError, match="decode steps only"):
        graphs.forward(torch.tensor(runner.tokens), prefill)
    assert not DecodeGraphs.supports(cache)  # the CPU runs eager

    class Calibrated:
        calibration = object()

    with pytest.raises(ValueError, match="quantized K cache"):
        DecodeGraphs(tiny.model, Calibrated(), capture=False)
