"""Paged K/V storage: the tensors the page table hands out, in any cache format.

Per layer, K and V are each a dict ``name -> tensor`` whose first two dims are
``[num_pages, page_size]``. The unquantized format is ``{"data": [P, S, kv_heads,
head_dim]}``; a quantized format (``kernels/kvquant.py``) supplies e.g. ``{"codes",
"scales", "zeros"}`` through an allocator. The storage never looks inside a row, so every
copy it does (page, rows, cycle, across storages) works for every format, and its byte
counts (``bytes_per_page``, ``bytes_per_token``) are those of the tensors allocated: the
codes and every per-group fp16 parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.cache.tier_copies import TierCopies

PageTensors = dict[str, torch.Tensor]
Allocator = Callable[[int, int], PageTensors]


def dense_allocator(
    kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Allocator:
    """Allocator for the unquantized format: one ``data`` tensor per K or V."""

    def allocate(num_pages: int, page_size: int) -> PageTensors:
        shape = (num_pages, page_size, kv_heads, head_dim)
        return {"data": torch.zeros(shape, dtype=dtype, device=device)}

    return allocate


def kvformat_allocator(fmt, kv_heads: int, head_dim: int, device=None) -> Allocator:
    """Allocator for a ``kernels.kvquant.KVFormat`` (imported lazily)."""
    from kernels.kvquant import allocate_pages

    def allocate(num_pages: int, page_size: int) -> PageTensors:
        return allocate_pages(fmt, num_pages, page_size, kv_heads, head_dim, device)

    return allocate


def host_mirror(allocator: Allocator, pin_memory: bool = False) -> Allocator:
    """Allocator of CPU tensors shaped like ``allocator``'s (pinned for CUDA copies)."""

    def allocate(num_pages: int, page_size: int) -> PageTensors:
        probe = allocator(1, page_size)
        return {
            name: torch.zeros((num_pages, *t.shape[1:]), dtype=t.dtype, pin_memory=pin_memory)
            for name, t in probe.items()
        }

    return allocate


def _tensors_nbytes(tensors: PageTensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class PagedKVStorage:
    """Owns every layer's K and V page tensors plus one scratch page for cycle moves.
    K and V may have different formats (``v_allocator``; default: the K one)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        allocator: Allocator,
        v_allocator: Allocator | None = None,
    ):
        if num_layers < 1 or num_pages < 1 or page_size < 1:
            raise ValueError("num_layers, num_pages and page_size must be positive")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.allocator = allocator
        self.v_allocator = v_allocator or allocator
        self.k: list[PageTensors] = [allocator(num_pages, page_size) for _ in range(num_layers)]
        self.v: list[PageTensors] = [
            self.v_allocator(num_pages, page_size) for _ in range(num_layers)
        ]
        # Same layout as _all_tensors: K layers, then V layers.
        self._scratch: list[PageTensors] = [allocator(1, page_size) for _ in range(num_layers)]
        self._scratch += [self.v_allocator(1, page_size) for _ in range(num_layers)]
        for tensors in self._all_tensors():
            if tuple(tensors.shape[:2]) != (num_pages, page_size):
                raise ValueError(
                    f"allocator returned shape {tuple(tensors.shape)}, "
                    f"expected [{num_pages}, {page_size}, ...]"
                )
        # Copies done since construction, in page units (one page of every tensor).
        self.page_copies = 0
        # The host tier's copies to and from this pool (set by the tier): this pool's own
        # copies and reads wait for those of the same pages.
        self.copies: TierCopies | None = None

    # -- sizing --------------------------------------------------------------------

    @staticmethod
    def bytes_per_page_for(
        num_layers: int, page_size: int, allocator: Allocator, v_allocator: Allocator | None = None
    ) -> int:
        """Bytes one page costs across all layers' K and V, measured on a 1-page probe."""
        k = _tensors_nbytes(allocator(1, page_size))
        v = _tensors_nbytes((v_allocator or allocator)(1, page_size))
        return num_layers * (k + v)

    @classmethod
    def from_byte_budget(
        cls,
        num_layers: int,
        byte_budget: int,
        page_size: int,
        allocator: Allocator,
        v_allocator: Allocator | None = None,
    ) -> PagedKVStorage:
        per_page = cls.bytes_per_page_for(num_layers, page_size, allocator, v_allocator)
        num_pages = byte_budget // per_page
        if num_pages < 1:
            raise ValueError(f"{byte_budget} bytes hold no page of {per_page} bytes")
        return cls(num_layers, num_pages, page_size, allocator, v_allocator)

    @classmethod
    def from_token_budget(
        cls,
        num_layers: int,
        tokens: int,
        page_size: int,
        allocator: Allocator,
        v_allocator: Allocator | None = None,
    ) -> PagedKVStorage:
        num_pages = max(1, -(-tokens // page_size))
        return cls(num_layers, num_pages, page_size, allocator, v_allocator)

    @property
    def bytes_per_page(self) -> int:
        return self.nbytes() // self.num_pages

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_page / self.page_size

    def nbytes(self) -> int:
        """Bytes of the page pool (the scratch page is not counted)."""
        return sum(_tensors_nbytes(t) for t in self.k + self.v)

    # -- copies --------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._all_tensors()[0].device

    def _all_tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.k + self.v for _, t in sorted(layer.items())]

    def page_tensors(self) -> list[torch.Tensor]:
        """Every cache tensor in the order `read_page` and `write_page` lay a page out."""
        return self._all_tensors()

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside 0..{self.num_pages - 1}")

    def _await_copies(self, pages: Sequence[int]) -> None:
        if self.copies is not None:
            self.copies.await_pages(pages)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one whole page (every layer, K and V, every tensor)."""
        self._check(src)
        self._check(dst)
        self._await_copies((src, dst))
        for t in self._all_tensors():
            t[dst].copy_(t[src])
        self.page_copies += 1

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` token rows of page ``src`` into page ``dst``."""
        self._check(src)
        self._check(dst)
        if not 0 <= n <= self.page_size:
            raise ValueError(f"row count {n} outside 0..{self.page_size}")
        self._await_copies((src, dst))
        for t in self._all_tensors():
            t[dst, :n].copy_(t[src, :n])
        self.page_copies += 1

    def copy_page_between(self, other: PagedKVStorage, src: int, dst: int) -> None:
        """Copy page ``src`` of ``other`` into page ``dst`` of this storage (tier moves)."""
        other._check(src)
        self._check(dst)
        mine, theirs = self._all_tensors(), other._all_tensors()
        if [(t.shape[1:], t.dtype) for t in mine] != [(t.shape[1:], t.dtype) for t in theirs]:
            raise ValueError("storages have different page formats")
        for a, b in zip(mine, theirs):
            a[dst].copy_(b[src], non_blocking=True)
        self.page_copies += 1

    def move_cycle(self, cycle: Sequence[int]) -> int:
        """Rotate page contents along ``cycle``: content of cycle[j] goes to cycle[j+1]
        (the last one to cycle[0]), with one scratch page: len(cycle) + 1 copies."""
        if len(cycle) < 2:
            return 0
        self._await_copies(cycle)
        scratch = [t for layer in self._scratch for _, t in sorted(layer.items())]
        tensors = self._all_tensors()
        # _all_tensors lists K layers then V layers; the scratch list has the same layout.
        last = cycle[-1]
        for t, s in zip(tensors, scratch):
            s[0].copy_(t[last])
        for j in range(len(cycle) - 1, 0, -1):
            dst, src = cycle[j], cycle[j - 1]
            for t in tensors:
                t[dst].copy_(t[src])
        for t, s in zip(tensors, scratch):
            t[cycle[0]].copy_(s[0])
        copies = len(cycle) + 1
        self.page_copies += copies
        return copies

    # -- inspection ----------------------------------------------------------------

    def read_page(self, page: int, rows: int | None = None) -> bytes:
        """Snapshot of a page's bytes (first ``rows`` rows if given), comparable in tests."""
        self._check(page)
        self._await_copies((page,))
        n = self.page_size if rows is None else rows
        return b"".join(
            t[page, :n].contiguous().cpu().view(torch.uint8).numpy().tobytes()
            for t in self._all_tensors()
        )

    @functools.cached_property
    def _host_pages(self) -> list[np.ndarray] | None:
        """Each tensor as a uint8 array ``[num_pages, its bytes per page]`` over the same
        memory (the tensors are made once, in ``__init__``); None unless every page is
        plain contiguous host memory."""
        tensors = self._all_tensors()
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            return None
        return [t.view(torch.uint8).numpy().reshape(self.num_pages, -1) for t in tensors]

    @property
    def addressable(self) -> bool:
        """Whether every page is plain contiguous host memory (`page_buffers`); not so
        for a GPU pool, where `write_page` copies instead."""
        return self._host_pages is not None

    def page_buffers(self, page: int) -> list[np.ndarray]:
        """A page's own memory as writable uint8 arrays, in `read_page`'s order: what the
        disk tier reads a record into, with no copy. Only for an `addressable` pool."""
        self._check(page)
        arrays = self._host_pages
        if arrays is None:
            raise ValueError("this pool's pages are not host memory")
        self._await_copies((page,))
        return [a[page] for a in arrays]

    def write_page(self, page: int, data: bytes | memoryview) -> None:
        """Fill a whole page from bytes laid out as `read_page` returns them (the disk
        tier's records, read in place). ValueError when the length is not one page's."""
        self._check(page)
        self._await_copies((page,))
        tensors = self._all_tensors()
        sizes = [t[page].numel() * t.element_size() for t in tensors]
        if len(data) != sum(sizes):
            raise ValueError(f"{len(data)} bytes for a page of {sum(sizes)} bytes")
        source = np.frombuffer(data, dtype=np.uint8)
        start = 0
        for t, size in zip(tensors, sizes):
            dst = t[page]
            if dst.device.type == "cpu" and dst.is_contiguous():
                # A plain memcpy through numpy: torch's copy_ of one page's slice cost
                # about 1 ms per 196 KB on a loaded 2-core machine (ENGINE.md §10).
                dst.view(torch.uint8).numpy().reshape(-1)[:] = source[start : start + size]
            else:
                chunk = torch.from_numpy(source[start : start + size].copy())
                dst.copy_(chunk.view(t.dtype).view(dst.shape))
            start += size
        self.page_copies += 1
