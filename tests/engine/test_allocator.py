"""engine.allocator: free pages inside glibc's heap, and the pages of the shared libraries'
code, go back to the system."""

from __future__ import annotations

import sys

import pytest

from engine import allocator
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


_SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fd:01 11 /venv/torch/lib/libtorch_cpu.so
Rss:                 400 kB
Anonymous:             0 kB
VmFlags: rd mr mw me
7f0000100000-7f0000900000 r-xp 00100000 fd:01 11 /venv/torch/lib/libtorch_cpu.so
Rss:                8000 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
7f0000900000-7f0000a00000 r--p 00900000 fd:01 11 /venv/torch/lib/libtorch_cpu.so
Rss:                1024 kB
Anonymous:            96 kB
VmFlags: rd mr mw me ac
7f0000a00000-7f0000a10000 rw-p 00a00000 fd:01 11 /venv/torch/lib/libtorch_cpu.so
Rss:                  64 kB
Anonymous:            64 kB
7f0001000000-7f0001800000 r-xp 00000000 fd:01 12 /venv/llvmlite/binding/libllvmlite.so
Rss:                5000 kB
Anonymous:             0 kB
7f0002000000-7f0002100000 r-xp 00000000 fd:01 13 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 900 kB
Anonymous:             0 kB
7f0003000000-7f0013000000 r--s 00000000 fd:01 14 /models/model.gguf
Rss:              200000 kB
Anonymous:             0 kB
7f0014000000-7f0014100000 r-xp 00000000 fd:01 15 /old/libtorch_cpu.so (deleted)
Rss:                 100 kB
Anonymous:             0 kB
7f0015000000-7f0015100000 r--p 00000000 fd:01 16 /usr/lib/locale/locale-archive
Rss:                 100 kB
Anonymous:             0 kB
7f0015100000-7f0015200000 r--p 00000000 fd:01 17 /models/model.so.gguf
Rss:                 100 kB
Anonymous:             0 kB
7f0016000000-7f0016200000 rw-p 00000000 00:00 0
Rss:                2048 kB
Anonymous:          2048 kB
"""


def test_library_code_is_the_clean_read_only_mappings_of_shared_libraries():
    """Only shared libraries' code and read-only data as the file has them: not their
    relocated (RELRO) or writable parts, not other files (a model's pages, the locale
    archive), not a library replaced on disk, not anonymous memory."""
    ranges = allocator.library_code_ranges(_SMAPS.splitlines(keepends=True))
    assert ranges == [
        (0x7F0000000000, 0x7F0000100000, 400 * 1024),
        (0x7F0000100000, 0x7F0000900000, 8000 * 1024),
        (0x7F0001000000, 0x7F0001800000, 5000 * 1024),
        (0x7F0002000000, 0x7F0002100000, 900 * 1024),
    ]


# A fresh process: torch and numba loaded and used, then the libraries' code released;
# what stays resident of it, and whether torch and numba still compute right after.
_RELEASE_CHILD = """
import json
import numba, numpy as np, torch
from engine import allocator

@numba.njit(cache=False)
def dot(a, b):
    s = 0.0
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s

def resident():
    with open("/proc/self/smaps") as smaps:
        return sum(r for _, _, r in allocator.library_code_ranges(smaps))

a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
x = np.arange(100, dtype=np.float64)
expect_mm, expect_dot = (a @ a).numpy(), float(x @ x)
dot(x, x)
before = resident()
released = allocator.release_library_code()
ok = np.allclose((a @ a).numpy(), expect_mm) and dot(x, x) == expect_dot
after = resident()
print(json.dumps({"before": before, "released": released, "after": after, "ok": bool(ok)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc and madvise")
def test_library_code_leaves_the_resident_set_and_still_runs():
    got = run_json(_RELEASE_CHILD)
    assert got["before"] > 50e6, got  # LLVM's and torch's alone: tens of MB once used
    assert got["released"] >= 0.9 * got["before"], got
    # back after it: only the pages that the two calls after it ran
    assert 0 < got["after"] < 0.3 * got["before"], got
    assert got["ok"], got
