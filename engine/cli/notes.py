"""What the command line says while something takes longer than a user would expect."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from engine.model.runner import COMPILED_S

SLOW_START = (
    "Warming up the kernels: the first start after an install or an update compiles them"
    " for this CPU (up to a minute; later starts take a second) ..."
)


@contextlib.contextmanager
def slow_start_note(stream: TextIO | None = None, after_s: float = COMPILED_S) -> Iterator[None]:
    """Around an engine's start: if it is still starting after ``after_s`` seconds (its
    warm-up is compiling the kernels, engine.model.runner.warm_up), say so once on
    ``stream``, by default stderr when it is a terminal (scripts and logs that read
    stderr get no progress chatter), so that a first ``folio chat`` or ``folio serve``
    does not sit silent for a minute; a start that loads cached kernels says nothing."""
    out = stream
    if out is None:
        isatty = getattr(sys.stderr, "isatty", None)
        out = sys.stderr if isatty is not None and isatty() else None
    if out is None:
        yield
        return
    timer = threading.Timer(after_s, lambda: print(SLOW_START, file=out, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
