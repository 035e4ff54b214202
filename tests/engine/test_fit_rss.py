"""The fit estimate a user sees before a download (engine/hub/fit.py) against what
loading then takes: the peak RSS of a fresh process that loads the model in the default
(native) weight mode, warms it up as the engine does (which drops the code only loading
ran), allocates a 4,096-token cache, prefills 512 tokens and decodes 32."""

from __future__ import annotations

import pytest

from tests.child_process import run_json

_CHILD = """
import json, sys
import torch
torch.set_num_threads(2)
from engine.bench.forward import prefill_then_decode
from engine.cache.kv_cache import CacheSettings, KVCache
from engine.hub.fit import CachePlan, estimate_fit, kv_bytes_per_token
from engine.hub.gguf_info import summary_from_file
from engine.model.loader import load_model
from engine.model.runner import warm_up
from engine.units import peak_rss_bytes

path = sys.argv[1]
summary = summary_from_file(path)
kv = kv_bytes_per_token(summary.num_layers, summary.num_kv_heads, summary.head_dim)
plan = CachePlan(context_tokens=4096, page_size=256)
fit = estimate_fit(summary.weight_bytes, kv, plan, free_bytes=1 << 40, vocab_size=summary.vocab_size)
loaded = load_model(path)
settings = CacheSettings(page_size=256, token_budget=4096)
warm_up(loaded, settings)  # as engine.Engine starts: before its cache
cache = KVCache.for_model(loaded, settings)
prefill_then_decode(loaded, cache, 512, 32)
peak = peak_rss_bytes()
print(json.dumps({"need": fit.need_bytes, "peak": peak, "weights": loaded.weight_bytes}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_fit_estimate_is_within_10_percent_of_the_peak_rss(model, request):
    path = request.getfixturevalue(model)

    def child() -> dict:
        return run_json(_CHILD, str(path), timeout=600)

    # The first run may compile kernels this model's types need (LLVM's memory, once per
    # machine, which the installer's compile step does for the common types): the user's
    # every later start reads them from numba's cache, and that start is what is measured.
    child()
    got = child()
    assert abs(got["need"] - got["peak"]) <= 0.10 * got["peak"], got
