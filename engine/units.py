"""Byte counts in words, one formatter for the engine's messages, the command line and the GUI;
and the process's peak resident bytes, in the same units.

Standard library only: engine/model/fetch.py uses it, and the installer loads that file
straight from its path in a fresh venv.
"""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("B", "KB", "MB", "GB")
# About three significant figures in the range each unit covers.
_DECIMALS = {"B": 0, "KB": 0, "MB": 1, "GB": 2}


def format_bytes(
    n: float | None, unit: str | None = None, *, binary: bool = False, unknown: str = "?"
) -> str:
    """``1_234_567`` -> ``"1.2 MB"``; ``None`` -> ``unknown``.

    Without ``unit`` the largest unit up to GB that keeps the number at least 1 is used.
    With ``unit`` (``"B"``, ``"KB"``, ``"MB"`` or ``"GB"``) the count is given in that
    unit as a whole number with thousands separators (``"12,345 MB"``), so that figures
    in one message compare at a glance. Units are decimal (1 MB = 10**6 bytes, as the Hub
    and disk vendors count) unless ``binary`` (1 MB = 2**20 bytes, as memory is counted).
    """
    if n is None:
        return unknown
    base = 1024 if binary else 1000
    if unit is not None:
        return f"{n / base ** _UNITS.index(unit):,.0f} {unit}"
    power = 0
    while power < len(_UNITS) - 1 and abs(n) >= base ** (power + 1):
        power += 1
    unit = _UNITS[power]
    return f"{n / base**power:.{_DECIMALS[unit]}f} {unit}"


def rss_bytes() -> int | None:
    """This process's resident memory now: ``VmRSS`` of /proc/self/status (Linux; None
    elsewhere)."""
    return _proc_status_bytes("VmRSS")


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started its program: ``VmHWM`` of
    /proc/self/status (Linux). Not getrusage's ``ru_maxrss``, which survives ``exec``:
    a child started from a large process reports the parent's size until it grows past
    it. Elsewhere, ``ru_maxrss`` (bytes on macOS, KiB on Linux and BSD)."""
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
