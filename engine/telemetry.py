"""Telemetry: a per-step history (the generator's work and the cache's figures, which
`engine.cache.snapshot` computes) and an event log.

The generator calls ``Telemetry.record`` once per step from the engine thread; a UI
thread reads series, rates and events at its own pace. Every read takes the lock
and returns copies, and ``version`` lets a reader skip a redraw when nothing was
recorded since its last look. History lives in preallocated ring buffers, one per
series, so recording never allocates and memory stays fixed however long it runs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from itertools import islice
from typing import Any

import numpy as np

from engine.cache.snapshot import CacheStats


@dataclass(frozen=True, kw_only=True)
class StepRecord(CacheStats):
    """One generator step: its work, the queue, and the cache's figures after it (the
    fields it inherits from `CacheStats`)."""

    time: float  # monotonic seconds at the end of the step
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_size: int = 0
    queue_depth: int = 0

    @classmethod
    def of(
        cls,
        time: float,
        cache: CacheStats,
        prefill_tokens: int = 0,
        decode_tokens: int = 0,
        batch_size: int = 0,
        queue_depth: int = 0,
    ) -> StepRecord:
        return cls(
            time=time,
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            batch_size=batch_size,
            queue_depth=queue_depth,
            **asdict(cache),
        )


_FIELDS = dataclass_fields(StepRecord)
SERIES = tuple(f.name for f in _FIELDS if f.name != "time")
_RESERVED_EVENT_KEYS = frozenset({"seq", "time", "kind"})


class Telemetry:
    def __init__(
        self,
        history: int = 600,
        max_events: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ):
        if history < 1:
            raise ValueError("history must be positive")
        self.history = history
        self._clock = clock
        self._lock = threading.Lock()
        self._buffers: dict[str, np.ndarray] = {
            f.name: np.zeros(history, dtype=np.float64 if f.type in ("float", float) else np.int64)
            for f in _FIELDS
        }
        self._head = 0  # next slot to write
        self._count = 0  # records held (<= history)
        self._version = 0
        self._latest: StepRecord | None = None
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._next_seq = 0

    # -- the engine thread ---------------------------------------------------------

    def record(self, step: StepRecord) -> None:
        with self._lock:
            if self._latest is not None and step.time < self._latest.time:
                raise ValueError(f"step time {step.time} before the last one {self._latest.time}")
            for name, buf in self._buffers.items():
                buf[self._head] = getattr(step, name)
            self._head = (self._head + 1) % self.history
            self._count = min(self._count + 1, self.history)
            self._latest = step
            self._version += 1

    def log(self, kind: str, /, **fields: Any) -> int:
        """Append an event (``seq``, ``time``, ``kind`` and the fields); returns its seq."""
        clash = _RESERVED_EVENT_KEYS & fields.keys()
        if clash:
            raise ValueError(f"event fields may not be named {sorted(clash)}")
        with self._lock:
            seq = self._next_seq
            self._events.append({"seq": seq, "time": self._clock(), "kind": kind, **fields})
            self._next_seq += 1
            return seq

    # -- readers (any thread) ------------------------------------------------------

    @property
    def version(self) -> int:
        """Records made so far; unchanged means nothing new to draw."""
        with self._lock:
            return self._version

    def __len__(self) -> int:
        with self._lock:
            return self._count

    def latest(self) -> StepRecord | None:
        with self._lock:
            return self._latest  # frozen: safe to hand out

    def _chronological(self, name: str) -> np.ndarray:
        """A copy of one series, oldest first (the caller holds the lock)."""
        buf = self._buffers[name]
        if self._count < self.history:
            return buf[: self._count].copy()
        return np.concatenate((buf[self._head :], buf[: self._head]))

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(times, values) of the records held, oldest first; both are copies."""
        if name not in SERIES:
            raise KeyError(f"no series {name!r}; known: {', '.join(SERIES)}")
        with self._lock:
            return self._chronological("time"), self._chronological(name)

    def _rate(self, name: str, window_s: float, now: float | None) -> float:
        times, tokens = self.series(name)
        if len(times) < 2:
            return 0.0
        end = times[-1] if now is None else now
        # A step's tokens were made before its timestamp, so the window is anchored on
        # the last record at or before its start and that record's tokens are left
        # out. Steps slower than the window stretch the span instead of reading zero.
        anchor = max(int(np.searchsorted(times, end - window_s, side="right")) - 1, 0)
        stop = int(np.searchsorted(times, end, side="right"))
        span = end - times[anchor]
        if span <= 0:
            return 0.0
        return float(tokens[anchor + 1 : stop].sum()) / float(span)

    def prefill_tokens_per_s(self, window_s: float = 2.0, now: float | None = None) -> float:
        """Prompt tokens per second over the trailing window. ``now`` (same clock as
        the records) ends the window there, so an idle engine decays to zero."""
        return self._rate("prefill_tokens", window_s, now)

    def decode_tokens_per_s(self, window_s: float = 2.0, now: float | None = None) -> float:
        return self._rate("decode_tokens", window_s, now)

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        """Events with ``seq >= since`` still held, oldest first (copies). A reader
        keeps ``last["seq"] + 1`` as its next ``since``."""
        with self._lock:
            if not self._events:
                return []
            first = self._events[0]["seq"]
            skip = max(since - first, 0)
            return [dict(e) for e in islice(self._events, skip, None)]
