"""This process's mappings as /proc/self/smaps lists them (Linux): tests of what is
resident, and how (huge pages, madvise flags)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
