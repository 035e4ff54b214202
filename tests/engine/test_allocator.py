"""engine.allocator: free pages inside glibc's heap go back to the system."""

from __future__ import annotations

import sys

import pytest

from tests.child_process import run_json

# 100k blocks of 1,000 bytes (above Python's small-object allocator: malloc's), every
# sixteenth kept: the heap's top stays in use, so glibc keeps the holes resident.
_CHILD = """
import json, sys
from engine import allocator
from engine.units import rss_bytes

blocks = [bytes(1000) for _ in range(100_000)]
kept = blocks[::16]
before = rss_bytes()
del blocks
freed = rss_bytes()
released = allocator.release_free_memory() if sys.argv[1] == "release" else None
print(json.dumps({"held": before - rss_bytes(), "by_free": before - freed, "released": released}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_free_pages_inside_the_heap_go_back():
    kept = run_json(_CHILD, "keep")
    released = run_json(_CHILD, "release")
    assert released["released"] is True
    # about 94 MB freed in holes: most of it leaves the process when released ...
    assert released["held"] > 50e6, released
    # ... and, in the same run, freeing alone leaves it resident
    assert kept["held"] < 10e6, kept
