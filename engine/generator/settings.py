"""The generator's limits: batch slots, prefill budgets, skips, requeue, caching."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GeneratorSettings:
    max_batch_size: int = 16  # sequences decoded together (a job takes n / beam width slots)
    max_chunk_size: int = 512  # prompt tokens one job prefills per step (whole pages)
    max_prefill_tokens: int = 1024  # per step over all jobs; a step always runs one chunk
    max_skips: int = 4  # a job skipped this often holds back every job behind it
    max_rq_tokens: int = 2048  # tokens a job generates per round before it is requeued
    prefix_caching: bool = True
    defrag: bool = True  # lay cached chains out contiguously when the queues drain
    # decode steps on a GPU replayed from CUDA graphs (engine/model/decode_graphs.py)
    cuda_graphs: bool = True

    def validate(self, page_size: int) -> None:
        for name in ("max_batch_size", "max_chunk_size", "max_prefill_tokens", "max_rq_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {self.max_skips}")
        if self.max_chunk_size < page_size:
            raise ValueError(
                f"max_chunk_size ({self.max_chunk_size}) must hold at least one page ({page_size} tokens)"
            )
