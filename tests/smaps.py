"""This process's mappings as /proc/self/smaps lists them (Linux): tests of what is
resident, and how (huge pages, madvise flags)."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Mapping:
    start: int
    end: int
    path: str
    kb: dict[str, int] = field(default_factory=dict)  # "Rss", "FilePmdMapped", ...: kB
    flags: frozenset[str] = frozenset()  # VmFlags: "hg" for MADV_HUGEPAGE, ...


def mappings() -> list[Mapping] | None:
    """Every mapping of this process, or None where there is no /proc/self/smaps."""
    try:
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().splitlines()
    except OSError:
        return None
    out: list[Mapping] = []
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append(Mapping(lo, hi, fields[5] if len(fields) >= 6 else ""))
        elif fields[0] == "VmFlags:":
            out[-1].flags = frozenset(fields[1:])
        elif len(fields) == 3 and fields[2] == "kB":
            out[-1].kb[fields[0].rstrip(":")] = int(fields[1])
    return out


def covering(address: int, nbytes: int) -> list[Mapping] | None:
    """The mappings that hold some of ``[address, address + nbytes)``, or None where there
    is no /proc/self/smaps."""
    every = mappings()
    if every is None:
        return None
    return [m for m in every if m.start < address + nbytes and m.end > address]


def huge_bytes_of(path: Path, advise: bool = False) -> int:
    """Bytes of ``path`` that a read-only mapping of it, every page read, maps as huge
    pages (``FilePmdMapped``: 2 MB folios in the page cache); ``advise``: the mapping
    marked ``MADV_HUGEPAGE`` first (what is not cached then comes in 2 MB folios)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    if advise:
        data.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(data, np.uint8)
    a[::4096].sum()
    huge = sum(m.kb.get("FilePmdMapped", 0) for m in covering(a.ctypes.data, a.nbytes) or [])
    del a
    data.close()
    return huge * 1024


def maps_file_huge_pages(directory: Path) -> bool:
    """Whether this kernel maps the cached pages of a file in ``directory`` (written in one
    4 MB write) as huge pages: Linux 6.x on a filesystem with large folios (ext4, xfs)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or mappings() is None:
        return False
    probe = Path(directory) / "huge-page-probe"
    with open(probe, "wb") as f:
        os.pwrite(f.fileno(), b"\x01" * (4 << 20), 0)
    try:
        return huge_bytes_of(probe, advise=True) > 0
    finally:
        probe.unlink()
