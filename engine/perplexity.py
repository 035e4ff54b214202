"""Perplexity of a model over a text, through the paged cache in any cache format.

The yardstick for KV-cache quantization (docs/ENGINE.md §6): the same text, the same
weights, only the cache format changes. The text measured is the reference text
(engine/reference_text.py: Python's own `pydoc_data.topics`), so the figure is
reproducible anywhere. (A quantized K cache calibrates its key means on the middle of the
same text, far from the windows measured: engine/model/calibration.py.)
"""

from __future__ import annotations

import math

import torch

from engine.cache.kv_cache import CacheSettings, KVCache
from engine.model.calibration import calibration_for
from engine.model.loader import LoadedModel
from engine.model.runner import SequenceRunner


def perplexity(
    loaded: LoadedModel,
    ids: list[int],
    k_bits: int | None = None,
    v_bits: int | None = None,
    chunk: int = 512,
    page_size: int = 256,
) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes, fed in chunks
    so that every chunk attends to the earlier ones through the (quantized) pages."""
    settings = CacheSettings(
        page_size=page_size, token_budget=len(ids) + page_size, k_bits=k_bits, v_bits=v_bits
    )
    cache = KVCache.for_model(loaded, settings, calibration_for(loaded, settings))
    runner = SequenceRunner(loaded, cache, ids)
    nll, count = 0.0, 0
    for start in range(0, len(ids), chunk):
        size = min(chunk, len(ids) - start)
        logits = runner.step(size, all_logits=True)
        targets = torch.tensor(ids[start + 1 : start + size + 1])
        logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        nll -= logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        count += len(targets)
    runner.release()
    return math.exp(nll / count)
