"""The C allocator's habits that cost a loaded model memory it does not use (glibc on
Linux; elsewhere these do nothing).

glibc maps a block of 128 KB or more on its own and unmaps it when freed, but each such
free raises the size from which blocks are mapped, up to 32 MB. After a model's first
prefill, the activations of every later one (4-32 MB each at the Llama-3.2-1B shape: torch
has no caching allocator on the CPU) come from the heap instead, and the heap keeps its
freed middle resident: measured at that shape, a 4,096-token cache, 512-token prefills,
the process grew by 10-130 MB after prefilling (more when other work shared the cores)
and its peak moved with it. With the size fixed (:data:`MAP_FROM_BYTES`), large blocks
go back to the system when freed and the peak is what is live, run after run.
"""

from __future__ import annotations

import ctypes
import functools
import sys

# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Blocks from this size up are mapped apart and unmapped when freed. Decode's activations
# are far smaller, so decode still reuses heap memory; prefill's mapped blocks cost page
# faults on each use, measured with `folio bench forward --shape` (docs/ENGINE.md).
MAP_FROM_BYTES = 4 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):
        return None  # musl and others: their own policies
    return libc


def map_large_blocks() -> bool:
    """Fix the size from which blocks are mapped at :data:`MAP_FROM_BYTES` (glibc; idempotent).
    True when set."""
    libc = _glibc()
    if libc is None:
        return False
    # the top of the heap is given back above twice that, as glibc's own rule would set it
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MAP_FROM_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * MAP_FROM_BYTES)
    )


def release_free_memory() -> bool:
    """Give the free pages inside the heap back to the system (glibc's ``malloc_trim``):
    what parsing left behind, e.g. a tokenizer's JSON. True when some were released."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
