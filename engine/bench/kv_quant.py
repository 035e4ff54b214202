"""`folio bench kv-quant`: perplexity of one text through the paged cache in each
KV-cache format, with the bytes one token's K and V take in it."""

from __future__ import annotations

import json

from engine.cache.kv_cache import kv_formats
from engine.model.loader import LoadedModel, load_model
from engine.perplexity import perplexity, reference_text

# (K bits, V bits) of `folio bench kv-quant`: both at each width, then 8-bit keys with
# 4-bit values
KV_QUANT_FORMATS = ((None, None), (8, 8), (6, 6), (4, 4), (2, 2), (8, 4))


def kv_bytes_per_token(loaded: LoadedModel, k_bits: int | None, v_bits: int | None) -> int:
    """Bytes one token's K and V take over all layers, in the formats the cache uses."""
    cfg = loaded.config
    fmt_k, fmt_v = kv_formats(k_bits, v_bits)
    per_layer = sum(f.bytes_per_token(cfg.num_kv_heads, cfg.head_dim) for f in (fmt_k, fmt_v))
    return cfg.num_layers * per_layer


def run_kv_quant_bench(args) -> None:
    """`folio bench kv-quant`: perplexity and KV bytes per token for each cache format."""
    loaded = load_model(args.model)
    ids = loaded.tokenizer.encode(reference_text())[: args.tokens]
    base = None
    for k_bits, v_bits in KV_QUANT_FORMATS:
        ppl = perplexity(loaded, ids, k_bits=k_bits, v_bits=v_bits)
        base = base or ppl
        print(json.dumps({
            "bench": "kv-quant", "model": loaded.name, "tokens": len(ids),
            "k_bits": k_bits or 32, "v_bits": v_bits or 32,
            "perplexity": round(ppl, 4), "vs_fp32": round(ppl / base - 1, 5),
            "kv_bytes_per_token": kv_bytes_per_token(loaded, k_bits, v_bits),
        }), flush=True)  # fmt: skip
