"""Single-sequence generation on the paged KV cache.

`SequenceRunner` is one sequence's life on the cache (allocate, feed, record pages,
release); `generate` streams a reply with it. The continuous-batching generator
builds on the same pieces for many sequences at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.cache.kv_cache import CacheSettings, KVCache, StepBatch
from engine.model.loader import LoadedModel


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    eos_reason: str = ""
    time_prefill: float = 0.0
    time_generate: float = 0.0

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def as_dict(self) -> dict:
        decode_steps = max(self.new_tokens - 1, 0)
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "eos_reason": self.eos_reason,
            "time_prefill": round(self.time_prefill, 4),
            "time_generate": round(self.time_generate, 4),
            "prefill_tokens_per_s": round(self.prompt_tokens / self.time_prefill, 2) if self.time_prefill else None,
            "decode_tokens_per_s": round(decode_steps / self.time_generate, 2) if self.time_generate and decode_steps else None,
        }


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None, top_k: int = 0, top_p: float = 1.0) -> int:
    """One token from logits [vocab]; temperature 0 is greedy."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class SequenceRunner:
    """One sequence on a paged cache: its pages, the tokens whose K/V are stored, and
    the page table's bookkeeping after each step (fills, content hashes)."""

    def __init__(self, loaded: LoadedModel, cache: KVCache, prompt_ids: list[int], max_new_tokens: int = 0, job_id: int = 0):
        self.model = loaded.model
        self.cache = cache
        self.tokens = [int(t) for t in prompt_ids]
        self.alloc = cache.pages.allocate(job_id, self.tokens, max_rq_tokens=max_new_tokens)
        self.stored = self.alloc.cached_tokens  # leading tokens whose K/V are in the cache

    @property
    def cached_tokens(self) -> int:
        return self.alloc.cached_tokens

    def step(self, count: int | None = None, all_logits: bool = False) -> torch.Tensor:
        """Run the next `count` tokens not yet in the cache (default: all of them).
        Returns the logits of the last one [vocab], or of each [count, vocab]."""
        start = self.stored
        count = len(self.tokens) - start if count is None else count
        if count < 1 or start + count > len(self.tokens):
            raise ValueError(f"cannot run {count} tokens from {start} of {len(self.tokens)}")
        ps = self.cache.page_size
        for logical in range(start // ps, (start + count - 1) // ps + 1):
            self.cache.pages.ensure_writable(self.alloc, logical)
        batch = StepBatch.build([(self.alloc.block_table, start, count)], ps, all_logits)
        logits = self.model.forward(torch.tensor(self.tokens[start : start + count]), batch, self.cache)
        self.stored = start + count
        for logical in range(start // ps, (self.stored - 1) // ps + 1):
            fill = min(ps, self.stored - logical * ps)
            self.cache.pages.mark_filled(self.alloc, logical, self.tokens[logical * ps : logical * ps + fill], fill)
        return logits if all_logits else logits[0]

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def release(self) -> None:
        self.cache.pages.release(self.alloc)


def generate(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    completion: Completion | None = None,
    cache: KVCache | None = None,
) -> Iterator[str]:
    """Yield text deltas as they become complete; fill `completion` with the result.

    With a `cache` that outlives the call, a prompt that shares pages with an earlier
    one reuses their K/V (`completion.cached_tokens`)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    out = completion if completion is not None else Completion()
    out.prompt_tokens = len(prompt_ids)
    tokenizer = loaded.tokenizer
    stops = set(stop_token_ids if stop_token_ids is not None else tokenizer.eos_token_ids)
    limit = loaded.config.max_position_embeddings
    if len(prompt_ids) >= limit:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context holds {limit}: shorten it"
        )
    max_new_tokens = min(max_new_tokens, limit - len(prompt_ids))
    if cache is None:
        ps = CacheSettings().page_size
        pages = -(-(len(prompt_ids) + max_new_tokens) // ps)
        cache = KVCache.for_model(loaded, CacheSettings(token_budget=pages * ps))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    decoder = tokenizer.incremental_decoder()

    t0 = time.perf_counter()
    runner = SequenceRunner(loaded, cache, prompt_ids, max_new_tokens)
    try:
        out.cached_tokens = runner.cached_tokens
        logits = runner.step()
        out.time_prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        out.eos_reason = "max_new_tokens"
        for step in range(max_new_tokens):
            token = sample(logits, temperature, generator)
            out.token_ids.append(token)
            if token in stops:
                out.eos_reason = "stop_token"
                break
            delta = decoder.feed(token)
            if delta:
                out.text += delta
                yield delta
            if step + 1 < max_new_tokens:
                runner.append(token)
                logits = runner.step()
        out.time_generate = time.perf_counter() - t1
    finally:
        runner.release()
    rest = decoder.flush()
    if rest:
        out.text += rest
        yield rest
