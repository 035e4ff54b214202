"""A value one thread publishes and any thread reads, without the readers slowing the
publisher.

A read is a reference copy under a lock, so it never waits for the engine's step. But
a reader that polls in a tight loop holds the GIL almost all the time, and the engine
thread, which gives the GIL up around every torch call, then waits up to the interpreter's
switch interval (5 ms) to get it back, hundreds of times per step: decode fell from 27
to 2.6 tokens/s with one such reader. So a thread that asks again, within `repeat_s` of
its last read, for the value it already holds sleeps (without the GIL) until a newer one
is published or `repeat_s` has passed. A reader on a timer (a GUI at 10-60 Hz) never
waits; a tight loop becomes at most one read per `repeat_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

REPEAT_S = 0.002  # a repeat read sooner than this is a poll: pace it


class Published(Generic[T]):
    def __init__(
        self,
        repeat_s: float = REPEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.repeat_s = repeat_s
        self._clock = clock
        self._changed = threading.Condition(threading.Lock())
        self._value: T | None = None
        self._readers = threading.local()  # each thread's last value and read time

    def publish(self, value: T) -> None:
        with self._changed:
            self._value = value
            self._changed.notify_all()

    def read(self) -> T | None:
        """The latest value (None before the first publish)."""
        seen = self._readers
        with self._changed:
            value = self._value
            if (
                value is not None
                and value is getattr(seen, "value", None)
                and self._clock() - seen.time < self.repeat_s
            ):
                # Wait releases the lock and the GIL; a publish wakes it early.
                self._changed.wait_for(lambda: self._value is not value, self.repeat_s)
                value = self._value
        seen.value = value
        seen.time = self._clock()
        return value


__all__ = ["REPEAT_S", "Published"]
