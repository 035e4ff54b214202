"""engine.model.decode_graphs on the CPU: the static buffers a CUDA graph replays from,
run eagerly (``capture=False``), give what the model gives on the step's own tensors.
The capture and replay themselves need a GPU: tests/engine/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import CacheSettings, KVCache, StepBatch
from engine.model.calibration import calibrate_keys
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


def test_only_decode_steps(tiny):
    cache = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=256))
    graphs = DecodeGraphs(tiny.model, cache, capture=False)
    runner = SequenceRunner(tiny, cache, random_ids(10, seed=1), 4)
    prefill = StepBatch.build([(runner.alloc.block_table, 0, 10)], cache.page_size)
    with pytest.raises(ValueError, match="decode steps only"):
        graphs.forward(torch.tensor(runner.tokens), prefill)
    assert not DecodeGraphs.supports(cache)  # the CPU runs eager


def test_a_quantized_k_cache_keeps_its_tensors_in_place(tiny):
    """A graph replays the tensors it was captured on: with quantized K (codes, step,
    minimum, and keys stored relative to a key offset whose tables grew with the context)
    the buffers still give the model's logits, and no table moves as contexts grow."""
    settings = CacheSettings(page_size=16, token_budget=1024, k_bits=4, v_bits=4)
    cache = KVCache.for_model(tiny, settings, calibrate_keys(tiny, count=64))
    cache.numba_decode = False  # attention through the block tables, as on a GPU
    assert cache.key_offset_positions == 0  # built on demand, until a graph needs them
    graphs = DecodeGraphs(tiny.model, cache, capture=False)
    reserved = cache.key_offset_positions
    assert reserved == min(tiny.config.max_position_embeddings, cache.num_pages * 16)
    tables = [kv.k_offset.table.data_ptr() for kv in cache._layers]
    pages = [t.data_ptr() for t in cache.storage.page_tensors()]
    assert {"codes", "scales", "zeros"} <= cache.storage.k[0].keys()
    runners = _runners(tiny, cache, [70, 5, 33])
    for step in range(3):
        tokens, batch = _decode_batch(runners, cache.page_size)
        eager = tiny.model.forward(tokens, batch, cache)
        assert torch.equal(graphs.forward(tokens, batch), eager)
        for r in runners:
            r.stored += 1
            r.append(9 + step)
    assert [kv.k_offset.table.data_ptr() for kv in cache._layers] == tables
    assert [t.data_ptr() for t in cache.storage.page_tensors()] == pages


def test_key_offsets_grow_on_demand_without_a_graph(tiny):
    settings = CacheSettings(page_size=16, token_budget=1024, k_bits=4, v_bits=4)
    cache = KVCache.for_model(tiny, settings, calibrate_keys(tiny, count=64))
    runner = SequenceRunner(tiny, cache, random_ids(300, seed=2), 4)
    runner.step()
    assert cache.key_offset_positions >= 300
    # once reserved (as DecodeGraphs does), a longer context is refused: never a silent
    # reallocation under a captured graph
    fixed = KVCache.for_model(tiny, settings, calibrate_keys(tiny, count=64))
    fixed.reserve_key_offsets(128)
    assert fixed.key_offset_positions == 128
    runner = SequenceRunner(tiny, fixed, random_ids(200, seed=2), 4)
    with pytest.raises(ValueError, match="200 positions is beyond the 128 the key offsets"):
        runner.step()
    plain = KVCache.for_model(tiny, CacheSettings(page_size=16, token_budget=256))
    plain.reserve_key_offsets(4096)  # unquantized K: no key offset to reserve
    assert plain.key_offset_positions == 0
