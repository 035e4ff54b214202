"""Decode steps replayed from CUDA graphs (issue 18).

On a GPU a small model's decode step is bounded by Python: each layer launches a dozen
kernels, and launching costs more than running them. :class:`DecodeGraphs` captures the
whole decode forward once per batch size (each size its own graph, on demand, all
sharing one memory pool) over static input buffers: tokens, positions, write slots,
block tables padded to the cache's page count, sequence lengths. A step copies its
batch into the buffers and replays the graph; the logits come out of the graph's output
buffer.

What makes the forward capturable (no host synchronisation, no tensor whose size depends
on device data): the rotary tables grown up front to the cache's capacity and sized from
the batch's host arrays (`Transformer.forward`), the embedding's bounds check skipped
while capturing (sampled tokens are in range), and the Triton attention kernel's decode
work list built without a device round trip (`kernels.triton_paged_attention`). A
quantized K cache's pages have more tensors (codes, scales, minima), all allocated once
with the cache, so the graph reads them in place like fp16 pages; what grew with the
context were its key offset tables (keys are stored relative to ``R(p) mu``), and those
are now built to the same capacity up front (`KVCache.reserve_key_offsets`), as are the
rotary tables. The attention kernel checks those tables against the batch's longest
context from its host copy, not by reading the sequence lengths back.

``capture=False`` runs the same buffers eagerly: how the CPU tests check the buffer
plumbing without a GPU. Replay equals eager bit for bit on the GPU: tests/engine/test_cuda.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.cache.kv_cache import KVCache, StepBatch

log = logging.getLogger(__name__)


@dataclass
class _Static:
    """One batch size's input buffers, its graph and its output."""

    tokens: torch.Tensor
    batch: StepBatch
    graph: object | None = None  # torch.cuda.CUDAGraph
    logits: torch.Tensor | None = None


class DecodeGraphs:
    """Decode forwards of ``model`` on ``cache`` replayed from CUDA graphs."""

    def __init__(self, model, cache: KVCache, capture: bool = True):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.capture = capture
        self.width = cache.num_pages  # block-table columns: any sequence fits
        capacity = min(model.config.max_position_embeddings, cache.num_pages * cache.page_size)
        # the rotary tables at full size now: a graph must never see them reallocated
        top = torch.tensor([capacity - 1], device=self.device)
        model.rope.tables(top, capacity)
        model.rope_local.tables(top, capacity)
        cache.reserve_key_offsets(capacity)  # and a quantized K cache's key offsets
        self._sizes: dict[int, _Static] = {}
        self._pool = None  # the graphs' shared memory pool
        self.failure: str | None = None  # why capturing failed (then every step is eager)

    @staticmethod
    def supports(cache: KVCache) -> bool:
        return cache.device.type == "cuda"

    def forward(self, tokens: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode step (every sequence one token)."""
        if not batch.decode_only:
            raise ValueError("DecodeGraphs runs decode steps only (one token per sequence)")
        size = int(tokens.shape[0])
        static = self._sizes.get(size)
        fresh = static is None
        if fresh:
            static = self._sizes[size] = self._buffers(size)
        self._fill(static, tokens, batch)
        self.cache.await_copies(batch)  # a replay runs no Python: wait for tier copies here
        if not self.capture:
            return self.model.forward(static.tokens, static.batch, self.cache)
        if fresh:
            try:
                self._capture(static)
            except RuntimeError as exc:  # an op that cannot be captured: run eager from now
                self.capture, self.failure = False, f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
                return self.model.forward(static.tokens, static.batch, self.cache)
        static.graph.replay()
        return static.logits.clone()

    def _buffers(self, size: int) -> _Static:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=self.device)

        batch = StepBatch(
            positions=zeros(size),
            write_pages=zeros(size),
            write_slots=zeros(size),
            block_tables=torch.full((size, self.width), -1, dtype=torch.int64, device=self.device),
            seq_lens=zeros(size),
            q_lens=torch.ones(size, dtype=torch.int64, device=self.device),
            logits_rows=torch.arange(size, device=self.device),
            decode_only=True,
        )
        return _Static(zeros(size), batch)

    def _fill(self, static: _Static, tokens: torch.Tensor, batch: StepBatch) -> None:
        s = static.batch
        s.host = batch.host  # read on the host while capturing, never by the graph
        static.tokens.copy_(tokens, non_blocking=True)
        for name in ("positions", "write_pages", "write_slots", "seq_lens"):
            getattr(s, name).copy_(getattr(batch, name), non_blocking=True)
        width = batch.block_tables.shape[1]
        s.block_tables[:, :width].copy_(batch.block_tables, non_blocking=True)
        s.block_tables[:, width:] = -1

    def _capture(self, static: _Static) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles), then
        capture. Both runs write the same K/V to the same slots as the replay that
        follows: the step's own inputs are in the buffers."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.model.forward(static.tokens, static.batch, self.cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: the UI thread may ask the driver for free memory meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static.logits = self.model.forward(static.tokens, static.batch, self.cache)
        static.graph = graph

    @property
    def status(self) -> str:
        """In words, for benchmark records."""
        if self.failure is not None:
            return f"capture failed ({self.failure}); eager"
        return f"replayed (batch sizes {self.captured_sizes})" if self.capture else "eager"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(size for size, s in self._sizes.items() if s.graph is not None)
