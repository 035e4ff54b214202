"""`folio bench kv-quant`: perplexity of one text through the paged cache in each
KV-cache format, with the bytes one token's K and V take in it."""

from __future__ import annotations

import json

from engine.model.loader import load_model
from engine.perplexity import perplexity
from engine.reference_text import reference_text

# (K bits, V bits) of `folio bench kv-quant`: fp32 (the reference), fp16 (the default),
# both at each quantized width, then 8-bit keys with 4-bit values
KV_QUANT_FORMATS = ((32, 32), (16, 16), (8, 8), (6, 6), (4, 4), (2, 2), (8, 4))


def run_kv_quant_bench(args) -> None:
    """`folio bench kv-quant`: perplexity and KV bytes per token for each cache format."""
    loaded = load_model(args.model, weight_mode=args.weights)
    ids = loaded.tokenizer.encode(reference_text())[: args.tokens]
    base = None
    for k_bits, v_bits in KV_QUANT_FORMATS:
        ppl = perplexity(loaded, ids, k_bits=k_bits, v_bits=v_bits)
        base = base or ppl
        print(json.dumps({
            "bench": "kv-quant", "model": loaded.name, "weights": loaded.weight_mode,
            "tokens": len(ids),
            "k_bits": k_bits, "v_bits": v_bits,
            "perplexity": round(ppl, 4), "vs_fp32": round(ppl / base - 1, 5),
            "kv_bytes_per_token": loaded.config.kv_bytes_per_token(k_bits, v_bits),
        }), flush=True)  # fmt: skip
