"""What the engine is doing, in words, from one snapshot (Qt-free).

The status bar, the memory panel's header and the chat bubbles all read these, so they
say the same thing at the same moment: a job is prefilling (tokens done of how many,
and the time left at the rate it has measured), decoding, or waiting (and why); the
cache's pages are in use (held by a job), reclaimable (cached prompt pages any job may
take over) or free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.generator.job import WaitKind
from engine.units import format_bytes

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot, JobInfo

# Why a job waits, in words, with what ends the wait.
WAIT_WORDS = {
    WaitKind.MEMORY: "waiting for memory: the KV cache has too few free pages{detail};"
    " it starts when another reply ends and gives its pages back",
    WaitKind.BATCH: "waiting for a batch slot: other replies fill the batch{detail};"
    " it starts when one of them ends",
    WaitKind.HELD: "waiting its turn: a request ahead of it waited too long and goes first",
    WaitKind.DISK: "reading this chat's cached pages back from disk",
    WaitKind.NONE: "queued: it starts at the engine's next step",
}
# The same, short, for the status bar.
WAIT_SHORT = {
    WaitKind.MEMORY: "for memory",
    WaitKind.BATCH: "for a batch slot",
    WaitKind.HELD: "their turn",
    WaitKind.DISK: "on the disk cache",
    WaitKind.NONE: "to start",
}


def wait_words(kind: str, reason: str) -> str:
    """'waiting for memory: the KV cache has too few free pages (needs 20, 3 free); …'."""
    wait = WaitKind(kind) if kind in WaitKind._value2member_map_ else WaitKind.NONE
    if wait is WaitKind.NONE and reason:
        return f"waiting: {reason}"  # a reason this module has no words for yet
    detail = reason.split(": ", 1)[1] if ": " in reason else ""
    return WAIT_WORDS[wait].format(detail=f" ({detail})" if detail else "")


def seconds_words(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def prefill_words(done: int, total: int, eta: float | None = None) -> str:
    """'prefilling 1,200 / 3,000 tokens · about 8 s left'."""
    text = f"prefilling {done:,} / {total:,} tokens"
    if eta is not None:
        text += f" · about {seconds_words(eta)} left"
    return text


def job_words(job: JobInfo, now: float) -> str:
    """One job's state for its chat bubble (`now`: the snapshot's time)."""
    if job.state == "pending":
        return wait_words(job.wait_kind, job.wait_reason)
    if job.state == "prefill":
        return prefill_words(job.prefill_done, job.prefill_total, job.prefill_eta(now))
    return "generating…"


def engine_words(snapshot: EngineSnapshot) -> str:
    """Every job at once, for the status bar: 'prefilling 1,200 / 3,000 tokens · about
    8 s left · 1 decoding · 2 waiting for memory'; 'idle' without jobs."""
    jobs = snapshot.jobs
    if not jobs:
        return "idle"
    parts = []
    prefilling = [j for j in jobs if j.state == "prefill"]
    if len(prefilling) == 1:
        parts.append(job_words(prefilling[0], snapshot.time))
    elif prefilling:
        done = sum(j.prefill_done for j in prefilling)
        total = sum(j.prefill_total for j in prefilling)
        parts.append(f"{len(prefilling)} prefilling ({done:,} / {total:,} tokens)")
    decoding = sum(1 for j in jobs if j.state == "decode")
    if decoding:
        parts.append(f"{decoding} decoding")
    waiting = [j for j in jobs if j.state == "pending"]
    if waiting:
        kinds = {j.wait_kind for j in waiting}
        why = WAIT_SHORT[WaitKind(kinds.pop())] if len(kinds) == 1 else ""
        parts.append(f"{len(waiting)} waiting {why}".rstrip())
    return " · ".join(parts)


@dataclass(frozen=True)
class MemoryFigures:
    """The cache's figures from one snapshot, as the status bar and the memory panel
    both show them."""

    pages: int
    page_size: int
    cache_bytes: int
    in_use: int  # referenced by a running job
    reclaimable: int  # cached: kept for prefix hits, taken over when a job needs room
    free: int
    host_bytes: int
    hit_rate: float

    @property
    def page_bytes(self) -> float:
        return self.cache_bytes / max(1, self.pages)

    def cache_text(self) -> str:
        """'128 pages × 16 = 2,048 tokens · 180.0 MB KV'."""
        tokens = self.pages * self.page_size
        text = f"{self.pages:,} pages × {self.page_size} = {tokens:,} tokens"
        if self.cache_bytes:  # a remote server's bytes are not known, its pages are
            text += f" · {format_bytes(self.cache_bytes, binary=True)} KV"
        return text

    def use_text(self) -> str:
        """'KV 1.4 MB in use · 2.8 MB reclaimable' ('KV 12 pages in use · 30 pages
        reclaimable' for a remote server, whose bytes are not known)."""

        def size(pages: int) -> str:
            if self.cache_bytes:
                return format_bytes(pages * self.page_bytes, binary=True)
            return f"{pages:,} pages"

        text = f"KV {size(self.in_use)} in use"
        if self.reclaimable:
            text += f" · {size(self.reclaimable)} reclaimable"
        if self.host_bytes:
            text += f" · host tier {format_bytes(self.host_bytes, binary=True)}"
        return text

    def pages_text(self) -> str:
        """The memory panel's header: 'KV cache 128 × 16 tok · 180.0 MB · 12 in use ·
        30 reclaimable · 86 free · hit rate 40%'."""
        text = f"KV cache {self.pages:,} × {self.page_size} tok"
        if self.cache_bytes:
            text += f" · {format_bytes(self.cache_bytes, binary=True)}"
        return text + (
            f" · {self.in_use:,} in use · {self.reclaimable:,} reclaimable · {self.free:,} free"
            f" · hit rate {100 * self.hit_rate:.0f}%"
        )


def memory_figures(snapshot: EngineSnapshot) -> MemoryFigures:
    s = snapshot.stats
    return MemoryFigures(
        pages=snapshot.num_pages,
        page_size=snapshot.page_size,
        cache_bytes=snapshot.cache_bytes,
        in_use=s.pages_referenced,
        reclaimable=s.pages_cached,
        free=s.pages_free,
        host_bytes=snapshot.host_bytes,
        hit_rate=s.prefix_hit_rate,
    )
