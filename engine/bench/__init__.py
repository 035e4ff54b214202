"""`folio bench ...`: the benchmarks behind the README's figures, one module each.

`forward` (prefill and decode speed beside transformers), `batched` (llama-batched-bench's
table and requests arriving over time), `cache` (page table, storage and eviction
policies), `kv_quant` (perplexity per KV-cache format). Each prints JSON lines; the
command line (`engine/cli/main.py`) resolves the model before calling them.
"""
