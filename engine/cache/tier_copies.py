"""Copies between the device pool and the host tier, and who waits for them (issue 18).

On the CPU a tier copy is a plain copy: done when the call returns. On a CUDA pool the
host tier is pinned RAM and its copies run on a side stream, so they neither block the
host nor queue behind the compute stream's later kernels: a push (device page to host
slot) or a restore (host slot to device page) first waits for the compute work queued so
far (the page as that work leaves it), then copies, and records an event. Who touches a
page or slot afterwards waits for that event, and only they do:

* a forward (`KVCache._layer_kv`, and `DecodeGraphs` before a replay) makes the compute
  stream wait for the copies of the pages its batch reads or writes: on a decode step
  those in its host block tables, on a prefill step every copy in flight;
* the device pool's own copies (copy-on-write, defragmentation, the disk tier's reads
  and writes) wait for the copies of their pages (`PagedKVStorage` calls `await_pages`);
* the host waits (``event.synchronize()``) before it reads a tier slot (the disk tier
  spilling a host entry).

A wait on the compute stream never blocks the host; once queued, every later kernel is
ordered after the copy, so the page leaves the set of pending copies. What stays pending
overlaps with the forwards of batches that do not touch it.

The stream calls sit behind `Streams` so the bookkeeping runs on the CPU too: the tests
hand `TierCopies` a fake that records what would have waited (tests/engine/cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch


class Streams(Protocol):
    """The stream operations the copies need; `CudaStreams` on a GPU."""

    def run_on_side(self, copy: Callable[[], None]) -> object:
        """After the compute stream's queued work, run ``copy`` on the side stream;
        returns the event that marks it done."""
        ...

    def compute_waits(self, event: object) -> None:
        """Order the compute stream's later work after ``event`` (the host does not wait)."""
        ...

    def host_waits(self, event: object) -> None: ...

    def finished(self, event: object) -> bool: ...

    def keep_alive(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep ``tensors``' memory from reuse until the side stream's work is done."""
        ...


class CudaStreams:
    """`Streams` on a CUDA device: one side stream, one event per copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def run_on_side(self, copy: Callable[[], None]) -> object:
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            copy()
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def compute_waits(self, event: object) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def host_waits(self, event: object) -> None:
        event.synchronize()

    def finished(self, event: object) -> bool:
        return event.query()

    def keep_alive(self, tensors: Iterable[torch.Tensor]) -> None:
        # the pool's tensors belong to the compute stream; freed while a side copy still
        # runs (a cache dropped for a new one), their memory must wait for it
        for t in tensors:
            t.record_stream(self.side)


class TierCopies:
    """The host tier's copies and the events of those still in flight, by device page and
    by host slot. ``streams`` None (a CPU pool): every copy is done when it returns."""

    def __init__(self, streams: Streams | None = None):
        self.streams = streams
        self._pages: dict[int, object] = {}  # device page -> event of its latest copy
        self._slots: dict[int, object] = {}  # host slot -> event of its latest copy

    @classmethod
    def for_pool(cls, tensors: list[torch.Tensor]) -> TierCopies:
        """The copies for a device pool of ``tensors``: on a side stream when they are on
        a CUDA device, plain copies otherwise."""
        device = tensors[0].device
        if device.type != "cuda":
            return cls(None)
        streams = CudaStreams(device)
        streams.keep_alive(tensors)
        return cls(streams)

    @property
    def pending(self) -> bool:
        """Whether any copy may still be in flight (always False on the CPU)."""
        return bool(self._pages)

    def pending_pages(self) -> set[int]:
        """Device pages whose copies are still in flight (finished ones are dropped)."""
        self._retire()
        return set(self._pages)

    def copy(self, copy: Callable[[], None], page: int, slot: int) -> None:
        """Run ``copy`` (between device page ``page`` and host slot ``slot``)."""
        if self.streams is None:
            copy()
            return
        event = self.streams.run_on_side(copy)
        self._pages[page] = event
        self._slots[slot] = event

    def await_pages(self, pages: Iterable[int] | None) -> None:
        """The compute stream waits for the copies of ``pages`` (None: of every page)."""
        if not self._pages:
            return
        wanted = self._pages.keys() if pages is None else set(pages) & self._pages.keys()
        for page in list(wanted):
            self.streams.compute_waits(self._pages.pop(page))

    def await_slot(self, slot: int) -> None:
        """The host waits for the copy of host slot ``slot`` before touching its bytes."""
        event = self._slots.pop(slot, None)
        if event is not None:
            self.streams.host_waits(event)

    def drain(self) -> None:
        """The host waits for every copy (before the tensors may go away)."""
        for event in {id(e): e for e in (*self._pages.values(), *self._slots.values())}.values():
            self.streams.host_waits(event)
        self._pages.clear()
        self._slots.clear()

    def _retire(self) -> None:
        for table in (self._pages, self._slots):
            for key in [k for k, e in table.items() if self.streams.finished(e)]:
                del table[key]
