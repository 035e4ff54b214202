"""Admission and requeue (docs/ENGINE.md §3, §7): which jobs run, and which wait.

`Scheduler` owns the two queues: `pending` (jobs waiting for pages or batch slots, in
order; a requeued job goes back to the front) and `active` (jobs prefilling or
decoding). A pending job starts when the batch has a slot for each of its sequences
and the cache has the pages its round needs, less what running jobs with several
sequences may still copy. A job that does not fit is skipped; one skipped
`max_skips` times holds back every job behind it, so small jobs cannot starve it. A
job that could never fit (more sequences than the batch holds) is refused at once:
waiting would not help it, and it would hold back the rest.
Pages change hands only through the page table; this module decides *when*.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.cache.page import CacheFullError
from engine.cache.page_table import PageTable
from engine.generator.job import EventKind, Job, JobEvent, JobRequest, JobState, WaitKind
from engine.generator.settings import GeneratorSettings


class Scheduler:
    """The pending and active queues, and the admission decisions between them."""

    def __init__(self, pages: PageTable, settings: GeneratorSettings, clock: Callable[[], float]):
        self.pages = pages
        self.page_size = pages.page_size
        self.settings = settings
        self.clock = clock
        self.pending: deque[Job] = deque()
        self.active: list[Job] = []

    def check_fits(self, request: JobRequest, prompt_len: int) -> None:
        """Raise ValueError for a job that could never start: its sequences run at once,
        so they must fit the batch, and every token of a sequence must be in the cache
        while it runs, requeue or not (CacheFullError)."""
        too_wide = self._too_wide(request.width)
        if too_wide:
            raise ValueError(too_wide)
        total = self.pages.pages_total(prompt_len, request.max_new_tokens)
        full = (prompt_len - 1) // self.page_size
        need = total + (request.width - 1) * (total - full)
        if need > self.pages.num_pages:
            raise CacheFullError(
                need, self.pages.num_pages, prompt_len + request.max_new_tokens, self.page_size
            )

    def start_pending_jobs(self, events: list[JobEvent]) -> list[tuple[Job, str]]:
        """Start, in queue order, every pending job that fits; note why the others wait.
        Returns the jobs that can never start, taken out of the queue, with the reason:
        the generator ends them."""
        refused: list[tuple[Job, str]] = []
        if not self.pending:
            return refused
        slots = self.settings.max_batch_size - sum(j.width for j in self.active)
        available = len(self.pages.unreferenced) - self._reserved_for_copies()
        held_back = False
        reuse = self.settings.prefix_caching
        for job in list(self.pending):
            too_wide = self._too_wide(job.width)
            if too_wide:  # only a job queued without `check_fits` gets here
                self.pending.remove(job)
                refused.append((job, too_wide))
                continue
            if held_back:
                job.wait(
                    WaitKind.HELD, "held: a job ahead of it was skipped too often and goes first"
                )
                continue
            seq = job.sequences[0]
            rq = self._round_tokens(job)
            total = self.pages.pages_total(len(seq.tokens), rq)
            need = self.pages.pages_needed(seq.tokens, rq, reuse) + self._cow_pages(job, total)
            if job.width > slots:
                job.wait(
                    WaitKind.BATCH, f"batch full: needs {job.width} slot(s), {max(slots, 0)} free"
                )
            elif need > available:
                job.wait(
                    WaitKind.MEMORY,
                    f"not enough free pages: needs {need}, {max(available, 0)} free",
                )
            elif self.active and reuse and self.pages.read_ahead(seq.tokens):
                # Its pages come off the disk on the reader thread while the others step.
                job.wait(WaitKind.DISK, "reading its cached pages from disk")
                continue
            else:
                self.pending.remove(job)
                self._start(job, rq, events)
                slots -= job.width
                available -= need
                continue
            job.skips += 1
            if job.skips >= self.settings.max_skips:
                held_back = True
        return refused

    def requeue(self, job: Job) -> None:
        """The round's pages are full: give them back (their content stays cached) and
        go to the front of the queue with everything so far as the prompt (§7)."""
        job.sequences[0].release(self.pages)
        self.active.remove(job)
        job.state = JobState.PENDING
        job.requeues += 1
        job.skips = 0
        self.pending.appendleft(job)

    def remove(self, job: Job) -> None:
        """Take an ended job out of whichever queue holds it."""
        if job in self.active:
            self.active.remove(job)
        if job in self.pending:
            self.pending.remove(job)

    def _too_wide(self, width: int) -> str:
        """Why a job of `width` sequences can never start, or ""."""
        batch = self.settings.max_batch_size
        if width <= batch:
            return ""
        return (
            f"the request needs {width} sequences at once but the batch holds {batch}: "
            "lower n / beam width, or raise the batch size in Engine settings"
        )

    def _start(self, job: Job, rq: int, events: list[JobEvent]) -> None:
        seq = job.sequences[0]
        seq.alloc = self.pages.allocate(seq.seq_id, seq.tokens, rq, self.settings.prefix_caching)
        seq.stored = seq.alloc.cached_tokens
        job.prefill_start = seq.stored
        job.prefill_since = self.clock()
        job.wait(WaitKind.NONE, "")
        job.state = JobState.PREFILL
        self.active.append(job)
        job.note_peak_pages()
        if job.started is None:
            job.started = self.clock()
            job.cached_tokens = seq.alloc.cached_tokens
            job.disk_pages = seq.alloc.disk_pages
            job.disk_bytes = seq.alloc.disk_bytes
            job.disk_seconds = seq.alloc.disk_seconds
            events.append(job.prefill_event(EventKind.STARTED))

    def _round_tokens(self, job: Job) -> int:
        """Tokens the job may generate before its next requeue (all of them for jobs
        with several sequences: those are never requeued)."""
        seq = job.sequences[0]
        remaining = job.request.max_new_tokens - len(seq.generated)
        if job.width > 1:
            return remaining
        return min(remaining, self.settings.max_rq_tokens)

    def _cow_pages(self, job: Job, total: int) -> int:
        """Pages the job's extra sequences may still copy: (width - 1) per page that is
        not a full prompt page, less the pages it already holds beyond one table. Counted
        from the prompt, not from the tokens so far: pages that fill as the job generates
        are written by every sequence, so each still needs its own copy."""
        if job.width == 1:
            return 0
        full = (len(job.prompt_ids) - 1) // self.page_size
        bound = (job.width - 1) * (total - full)
        held = job.held_pages()
        return max(0, bound - (len(held) - total)) if held else bound

    def _reserved_for_copies(self) -> int:
        total = 0
        for job in self.active:
            if job.width > 1 and job.sequences[0].alloc is not None:
                total += self._cow_pages(job, len(job.sequences[0].alloc.block_table))
        return total
