"""One sequence's forward passes on the paged cache, with no sampling.

`SequenceRunner` allocates a sequence's pages, feeds it tokens and records after each
step what the page table must know (fills, content hashes). Perplexity, the forward
bench and the tests of the forward pass use it; generation goes through
`engine.generator`, which does the same for many sequences at once.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from engine import allocator
from engine.cache.kv_cache import CacheSettings, KeyCalibration, KVCache, StepBatch
from engine.model.loader import LoadedModel


class SequenceRunner:
    """One sequence on a paged cache: its pages, the tokens whose K/V are stored, and
    the page table's bookkeeping after each step (fills, content hashes)."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache: KVCache,
        prompt_ids: list[int],
        max_new_tokens: int = 0,
        job_id: int = 0,
        graphs=None,
    ):
        """``graphs``: an ``engine.model.decode_graphs.DecodeGraphs`` on ``cache`` that
        single-token steps replay from (a GPU's decode, as the generator runs it)."""
        self.model = loaded.model
        self.graphs = graphs
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
        tokens = torch.tensor(self.tokens[start : start + count])
        if self.graphs is not None and batch.decode_only and not all_logits:
            logits = self.graphs.forward(tokens, batch)
        else:
            logits = self.model.forward(tokens, batch, self.cache)
        self.stored = start + count
        for logical in range(start // ps, (self.stored - 1) // ps + 1):
            fill = min(ps, self.stored - logical * ps)
            self.cache.pages.mark_filled(
                self.alloc, logical, self.tokens[logical * ps : logical * ps + fill], fill
            )
        return logits if all_logits else logits[0]

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def release(self) -> None:
        self.cache.pages.release(self.alloc)


WARM_UP_PAGE = 16  # the smallest page CacheSettings allows
# A one-token warm-up longer than this compiled the kernels rather than loading them (a
# first start after an install or an update: numba's cache is keyed on the package's
# source): 15-25 s on a 2-core machine, where loading them takes 0.25-0.5 s
COMPILED_S = 3.0
# and then a prompt in two steps compiles what prompts and batches run too: a short one
# (the decode kernels over several rows, their drivers over numba's threads) and one
# past their DECODE_MAX_ROWS rows (the prompt path), which first prompts at the 1B shape
# otherwise waited for: 40 tokens 21 s, 20 tokens (after the long one compiled) 3.5 s
PROMPT_WARM_UP_STEPS = (16, 40)


def warm_up(
    loaded: LoadedModel, settings: CacheSettings, calibration: KeyCalibration | None = None
) -> None:
    """Run one token through the model on a scratch one-page cache of ``settings``' K/V
    format (no tiers): a process's first forward loads numba's typing context and every
    kernel the model's weight and K/V types use, about 0.25 s on a 2-core machine, which
    the engine pays while it starts rather than in the first reply. Its page holds
    WARM_UP_PAGE tokens whatever ``settings`` say (the kernels do not depend on it; a
    1,024-token page of a 7B model's fp32 K/V would be 117 MB). Then the libraries' code
    leaves the resident set, to come back as it runs again
    (`engine.allocator.release_library_code`: what only loading ran stays out, 120 MiB at
    the Llama-3.2-1B shape): call it before allocating the model's cache, or the peak RSS
    holds both.

    A prompt's kernels (a few more, 40-60 ms to load) are left to the first prompt: a
    16-token forward loading them took 0.17 s at the 1B shape and 0.6 s at the 7B one.
    Unless the one token took longer than COMPILED_S: the kernels were compiled then, not
    loaded, and so would the prompts' be (about 25 s at the 1B shape), so a prompt in the
    steps of PROMPT_WARM_UP_STEPS compiles them now, while the app says it is warming up,
    instead of in the first reply."""
    start = time.perf_counter()
    _warm_forward(loaded, settings, calibration, [0], [1])
    steps = PROMPT_WARM_UP_STEPS
    if (
        time.perf_counter() - start > COMPILED_S
        and sum(steps) <= loaded.config.max_position_embeddings
    ):
        prompt = [i % loaded.config.vocab_size for i in range(sum(steps))]
        _warm_forward(loaded, settings, calibration, prompt, steps)
    allocator.release_library_code()


def _warm_forward(loaded, settings, calibration, tokens: list[int], steps) -> None:
    """``tokens`` through the model, ``steps`` tokens a forward, on a scratch cache just
    large enough in pages of WARM_UP_PAGE, of ``settings``' K/V format."""
    scratch = dataclasses.replace(
        settings,
        page_size=WARM_UP_PAGE,
        token_budget=-(-len(tokens) // WARM_UP_PAGE) * WARM_UP_PAGE,
        byte_budget=None,
        host_bytes=0,
        disk_dir=None,
    )
    cache = KVCache.for_model(loaded, scratch, calibration)
    runner = SequenceRunner(loaded, cache, tokens)
    with torch.inference_mode():
        for count in steps:
            runner.step(count)
