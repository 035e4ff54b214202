"""Single-sequence generation on a contiguous KV cache.

This is the first, simple path behind `folio generate`; the paged cache and the
continuous-batching generator replace it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.model.loader import LoadedModel
from engine.model.transformer import KVCache


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


def generate(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    completion: Completion | None = None,
) -> Iterator[str]:
    """Yield text deltas as they become complete; fill `completion` with the result."""
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
    cache = KVCache(loaded.config, 1, len(prompt_ids) + max_new_tokens, dtype=loaded.model.dtype)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    decoder = tokenizer.IncrementalDecoder(tokenizer) if hasattr(tokenizer, "IncrementalDecoder") else None

    t0 = time.perf_counter()
    logits = loaded.model.forward(torch.tensor([prompt_ids]), cache)[0]
    out.time_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    out.eos_reason = "max_new_tokens"
    for step in range(max_new_tokens):
        token = sample(logits, temperature, generator)
        out.token_ids.append(token)
        if token in stops:
            out.eos_reason = "stop_token"
            break
        delta = decoder.feed([token]) if decoder else tokenizer.decode([token])
        if delta:
            out.text += delta
            yield delta
        if step + 1 < max_new_tokens:
            logits = loaded.model.forward(torch.tensor([[token]]), cache)[0]
    if decoder:
        rest = decoder.flush()
        if rest:
            out.text += rest
            yield rest
    out.time_generate = time.perf_counter() - t1
