"""Memory the process holds but no longer needs, handed back to the system (Linux;
elsewhere nothing happens): free memory that glibc's malloc keeps, and the pages of
library code that loading a model ran and nothing runs since.

glibc returns freed memory inside its heap only when the top of the heap is free; freed
blocks in the middle stay resident. Loading a model leaves such holes: the header's
vocabulary and the tokenizer's JSON are parsed and dropped while longer-lived objects
are allocated around them (about 18 MB at a 128k-token vocabulary).

Not done here, measured at the Llama-3.2-1B shape: fixing glibc's mmap threshold at 4 MB,
so that prefill's activations are unmapped when freed rather than kept in the heap, took
43 MB off the peak RSS of a 512-token prefill but cost 0.3-0.6 million more page faults
per prefill (1.1 us each, measured with other work on the machine: up to a tenth of a
6 s prefill); a threshold of 8 or 16 MB took nothing off.
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys
from collections.abc import Iterable

#: A shared library's path (``libc.so.6``, ``libtorch_cpu.so``, a Python extension's
#: ``.cpython-311-x86_64-linux-gnu.so``); not one replaced on disk (`` (deleted)``).
SHARED_LIBRARY = re.compile(r"\.so(\.[0-9]+)*$")
_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process already runs on (Linux), ``madvise`` typed."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _glibc() -> ctypes.CDLL | None:
    """:func:`_libc` where it is glibc (musl and others: their own heap policies)."""
    libc = _libc()
    return libc if libc is not None and hasattr(libc, "gnu_get_libc_version") else None


def release_free_memory() -> bool:
    """Give the wholly free pages inside the heap back to the system (glibc's
    ``malloc_trim``). True when some were released."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def library_code_ranges(smaps: Iterable[str]) -> list[tuple[int, int, int]]:
    """``(start, end, resident bytes)`` of each mapping in ``smaps`` (the lines of
    /proc/self/smaps) that holds a shared library's code or read-only data exactly as
    the file has it: private, not writable, and with no page of its own (``Anonymous:
    0 kB``). A library's relocated read-only part (RELRO: written while the library was
    loaded, then made read-only) has pages of its own and is not among them."""
    found = []
    current = None  # [start, end, resident] of the mapping being read, if a candidate
    for line in smaps:
        fields = line.split(None, 5)
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping's first line: range perms offset dev inode path
            current = None
            if len(fields) == 6 and fields[1] in ("r-xp", "r--p"):
                if SHARED_LIBRARY.search(fields[5].strip()):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    current = [start, end, 0]
        elif current is not None and fields[0] == "Rss:":
            current[2] = int(fields[1]) * 1024
        elif current is not None and fields[0] == "Anonymous:":
            if int(fields[1]) == 0:
                found.append(tuple(current))
            current = None
    return found


def release_library_code() -> int:
    """Drop the shared libraries' code and read-only data (:func:`library_code_ranges`)
    from this process's resident set; the bytes that were resident (0 where nothing was
    dropped). The pages stay in the system's file cache, and what runs again maps them
    back, a minor page fault for each 4 KiB: what comes back is the code in use, what
    stays out is what only starting and loading ran (at the Llama-3.2-1B shape after the
    engine's warm-up, 160 MiB dropped, 42 MiB back through two prompts and their
    replies; most of what stays out is LLVM's, which linked numba's cached kernels in,
    and torch's operator registration at import). Call when a model is loaded and its
    kernels are warm."""
    libc = _libc()
    if libc is None:
        return 0
    try:
        with open("/proc/self/smaps") as smaps:
            ranges = library_code_ranges(smaps)
    except OSError:
        return 0
    released = 0
    for start, end, resident in ranges:
        if libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            released += resident
    return released
