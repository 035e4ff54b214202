"""The continuous-batching loop (ENGINE_SPEC §3, §7, §8).

`Generator.iterate()` is one step: start the pending jobs that fit, run one prefill
chunk per job with prompt left, run one batched decode forward over every sequence
whose prompt is in the cache, then sample, apply stop conditions and report events.
Pages change hands only through the page table; this module decides *when*.

Numerics do not depend on the batch: each job's prefill is its own forward with
chunk boundaries that depend only on the job, and the decode forward treats its rows
independently (the int4 kernel and the paged-attention kernels are row-independent),
so a greedy job produces the same tokens alone or among others.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.cache.kv_cache import KVCache, StepBatch
from engine.cache.page import CacheFullError
from engine.generator.job import (
    BeamHypothesis,
    EventKind,
    Job,
    JobEvent,
    JobRequest,
    JobResult,
    JobState,
    Sequence,
)
from engine.generator.sampler import Sampler, make_generator, process_logits
from engine.generator.stops import StopHandler, StopReason
from engine.model.loader import LoadedModel
from engine.telemetry import StepRecord, Telemetry


@dataclass(frozen=True)
class GeneratorSettings:
    max_batch_size: int = 16  # sequences decoded together (a job takes n / beam width slots)
    max_chunk_size: int = 512  # prompt tokens one job prefills per step (whole pages)
    max_prefill_tokens: int = 1024  # per step over all jobs; a step always runs one chunk
    max_skips: int = 4  # a job skipped this often holds back every job behind it
    max_rq_tokens: int = 2048  # tokens a job generates per round before it is requeued
    prefix_caching: bool = True
    defrag: bool = True  # lay cached chains out contiguously when the queues drain

    def validate(self, page_size: int) -> None:
        for name in ("max_batch_size", "max_chunk_size", "max_prefill_tokens", "max_rq_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {self.max_skips}")
        if self.max_chunk_size < page_size:
            raise ValueError(
                f"max_chunk_size ({self.max_chunk_size}) must hold at least one page ({page_size} tokens)"
            )


class Generator:
    """Owns the queues and every job's sequences; call `iterate()` until `idle`."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache: KVCache,
        settings: GeneratorSettings | None = None,
        telemetry: Telemetry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer if loaded.tokenizer is not None else _NoText()
        self.model = loaded.model
        self.cache = cache
        self.pages = cache.pages
        self.page_size = cache.page_size
        self.settings = settings or GeneratorSettings()
        self.settings.validate(self.page_size)
        self.telemetry = telemetry
        self.clock = clock
        self.sampler = Sampler()
        self.pending: deque[Job] = deque()
        self.active: list[Job] = []
        self.jobs: dict[int, Job] = {}
        self._job_ids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self.seq_jobs: dict[int, int] = {}  # live sequence id -> job id
        self.steps = 0

    # -- the public surface ----------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.pending and not self.active

    def prepare(self, request: JobRequest) -> tuple[list[int], frozenset[int]]:
        """Validate a request against the model and cache; return its prompt ids and
        stop token ids. Raises ValueError (CacheFullError included) saying what to do."""
        request.validate()
        tokenizer = self.tokenizer
        if request.messages is not None:
            if not tokenizer.has_chat_template:
                raise ValueError("this model has no chat template: send prompt token ids instead")
            prompt = list(tokenizer.encode_chat([dict(m) for m in request.messages]))
        else:
            prompt = [int(t) for t in request.prompt]  # type: ignore[union-attr]
        vocab = self.loaded.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        for token, _ in request.sampling.logit_bias:
            if token >= vocab:
                raise ValueError(
                    f"logit_bias token id {token} is outside the vocabulary (0..{vocab - 1})"
                )
        limit = self.loaded.config.max_position_embeddings
        if len(prompt) + request.max_new_tokens > limit:
            room = limit - len(prompt)
            if room < 1:
                raise ValueError(
                    f"the prompt has {len(prompt)} tokens but the model's context holds {limit}: shorten it"
                )
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                f"exceed the model's context of {limit} tokens: ask for at most {room} new tokens"
            )
        self._check_fits(request, len(prompt))
        stops = request.stop_token_ids
        stop_ids = frozenset(tokenizer.eos_token_ids if stops is None else stops)
        return prompt, stop_ids

    def new_job_id(self) -> int:
        return next(self._job_ids)

    def submit(self, request: JobRequest) -> Job:
        prompt, stop_ids = self.prepare(request)
        job = Job(self.new_job_id(), request, prompt, stop_ids, self.clock())
        self.enqueue(job)
        return job

    def enqueue(self, job: Job) -> None:
        """Queue a job built from a prepared request (see `prepare`)."""
        job.sequences = [self._new_sequence(job, 0, list(job.prompt_ids))]
        self.jobs[job.job_id] = job
        self.pending.append(job)

    def cancel(self, job_id: int) -> list[JobEvent]:
        """End a job now and release its pages. Unknown or finished ids do nothing."""
        job = self.jobs.get(job_id)
        if job is None or job.state is JobState.DONE:
            return []
        events: list[JobEvent] = []
        self._finish_job(job, StopReason.CANCELLED, events)
        return events

    def fail_all(self, message: str) -> list[JobEvent]:
        """End every job with an error (the loop itself failed)."""
        events: list[JobEvent] = []
        for job in list(self.active) + list(self.pending):
            self._finish_job(job, StopReason.ERROR, events, message)
        return events

    def iterate(self) -> list[JobEvent]:
        events: list[JobEvent] = []
        self.start_pending_jobs(events)
        prefilled = self.prefill(events)
        decoded = self.decode(events)
        if self.idle and self.settings.defrag and not self.pages.referenced:
            self.pages.defrag()
        self.steps += 1
        if self.telemetry is not None:
            self._record(prefilled, decoded)
        return events

    # -- admission (§3) ----------------------------------------------------------------

    def _round_tokens(self, job: Job) -> int:
        """Tokens the job may generate before its next requeue (all of them for jobs
        with several sequences: those are never requeued)."""
        seq = job.sequences[0]
        remaining = job.request.max_new_tokens - len(seq.generated)
        if job.width > 1:
            return remaining
        return min(remaining, self.settings.max_rq_tokens)

    def _check_fits(self, request: JobRequest, prompt_len: int) -> None:
        """Every token of a sequence must be in the cache while it runs, requeue or not."""
        total = self.pages.pages_total(prompt_len, request.max_new_tokens)
        full = (prompt_len - 1) // self.page_size
        need = total + (request.width - 1) * (total - full)
        if need > self.pages.num_pages:
            raise CacheFullError(
                need, self.pages.num_pages, prompt_len + request.max_new_tokens, self.page_size
            )

    def _cow_pages(self, job: Job, total: int) -> int:
        """Pages the job's extra sequences may still copy: (width - 1) per page that is
        not a full prompt page, less the pages it already holds beyond one table."""
        if job.width == 1:
            return 0
        seq = job.sequences[0]
        full = (len(seq.tokens) - 1) // self.page_size
        bound = (job.width - 1) * (total - full)
        held = job.held_pages()
        return max(0, bound - (len(held) - total)) if held else bound

    def _reserved_for_copies(self) -> int:
        total = 0
        for job in self.active:
            if job.width > 1 and job.sequences[0].alloc is not None:
                total += self._cow_pages(job, len(job.sequences[0].alloc.block_table))
        return total

    def start_pending_jobs(self, events: list[JobEvent]) -> None:
        if not self.pending:
            return
        slots = self.settings.max_batch_size - sum(j.width for j in self.active)
        available = len(self.pages.unreferenced) - self._reserved_for_copies()
        held_back = False
        reuse = self.settings.prefix_caching
        for job in list(self.pending):
            if held_back:
                job.wait_reason = "held: a job ahead of it was skipped too often and goes first"
                continue
            seq = job.sequences[0]
            rq = self._round_tokens(job)
            total = self.pages.pages_total(len(seq.tokens), rq)
            need = self.pages.pages_needed(seq.tokens, rq, reuse) + self._cow_pages(job, total)
            if job.width > slots:
                job.wait_reason = f"batch full: needs {job.width} slot(s), {max(slots, 0)} free"
            elif need > available:
                job.wait_reason = f"not enough free pages: needs {need}, {max(available, 0)} free"
            else:
                self.pending.remove(job)
                self._start(job, rq, events)
                slots -= job.width
                available -= need
                continue
            job.skips += 1
            if job.skips >= self.settings.max_skips:
                held_back = True

    def _start(self, job: Job, rq: int, events: list[JobEvent]) -> None:
        seq = job.sequences[0]
        seq.alloc = self.pages.allocate(seq.seq_id, seq.tokens, rq, self.settings.prefix_caching)
        seq.stored = seq.alloc.cached_tokens
        job.prefill_start = seq.stored
        job.wait_reason = ""
        job.state = JobState.PREFILL
        self.active.append(job)
        self._note_pages(job)
        if job.started is None:
            job.started = self.clock()
            job.cached_tokens = seq.alloc.cached_tokens
            events.append(_prefill_event(job, seq, EventKind.STARTED))

    # -- prefill (§7 step 2) ----------------------------------------------------------

    def prefill(self, events: list[JobEvent]) -> int:
        """One chunk per job with prompt left, while the step's token budget lasts (the
        first chunk always runs). Returns prompt tokens computed."""
        done = 0
        for job in [j for j in self.active if j.state is JobState.PREFILL]:
            seq = job.sequences[0]
            span = self._next_chunk(job, seq)
            if span is None:
                job.state = JobState.DECODE
                continue
            start, end = span
            if start == end:
                continue  # waiting for a shared page
            if done and done + end - start > self.settings.max_prefill_tokens:
                break
            try:
                self._forward_chunk(seq, start, end)
            except Exception as exc:  # noqa: BLE001 - the job ends, the loop goes on
                self._finish_job(job, StopReason.ERROR, events, f"prefill failed: {exc}")
                continue
            done += end - start
            if self._next_chunk(job, seq) is None:
                job.state = JobState.DECODE
            events.append(_prefill_event(job, seq, EventKind.PREFILL))
        return done

    def _next_chunk(self, job: Job, seq: Sequence) -> tuple[int, int] | None:
        """The next run of prompt tokens to compute: from `stored`, past pages another
        job has filled meanwhile, up to `max_chunk_size` and ending on a page boundary
        or before the next full page. The prompt's last token is left for decode."""
        ps = self.page_size
        end = len(seq.tokens) - 1
        table = seq.alloc.block_table
        pos = seq.stored
        while pos < end and self.pages.pages[table[pos // ps]].fill == ps:
            pos = min((pos // ps + 1) * ps, end)  # full already: its K/V are there
        if pos > seq.stored:
            self.pages.count_prefix_hit(pos - seq.stored)
            if job.requeues == 0:
                job.cached_tokens += pos - seq.stored  # filled by another job meanwhile
        seq.stored = pos
        if pos >= end:
            return None
        if self._filled_by_earlier_job(job, table[pos // ps]):
            return pos, pos  # wait: another job is computing this page right now
        limit = min(end, (pos // ps) * ps + self.settings.max_chunk_size // ps * ps)
        stop = pos // ps + 1
        while stop * ps < limit:
            page = table[stop]
            if self.pages.pages[page].fill == ps or self._filled_by_earlier_job(job, page):
                break
            stop += 1
        return pos, min(limit, stop * ps)

    def _filled_by_earlier_job(self, job: Job, page: int) -> bool:
        """A prompt page keyed to its content hash but not full is being computed by the
        job that keyed it; a job admitted later that shares it waits instead of doing
        the same work twice. Only earlier jobs are waited for, so no two jobs wait for
        each other."""
        rec = self.pages.pages[page]
        if not rec.has_content_hash or rec.fill == self.page_size or rec.ref_count < 2:
            return False
        for other in self.active:
            if other is job:
                return False
            if other.state is JobState.PREFILL and any(
                s.seq_id in rec.owners for s in other.sequences
            ):
                return True
        return False

    def _forward_chunk(self, seq: Sequence, start: int, end: int) -> None:
        ps = self.page_size
        for logical in range(start // ps, (end - 1) // ps + 1):
            self.pages.ensure_writable(seq.alloc, logical)
        batch = StepBatch.build([(seq.alloc.block_table, start, end - start)], ps)
        self.model.forward(torch.tensor(seq.tokens[start:end]), batch, self.cache)
        seq.stored = end
        for logical in range(start // ps, (end - 1) // ps + 1):
            fill = min(ps, end - logical * ps)
            self.pages.mark_filled(
                seq.alloc, logical, seq.tokens[logical * ps : logical * ps + fill], fill
            )

    # -- decode (§7 steps 3 and 4) ------------------------------------------------------

    def decode(self, events: list[JobEvent]) -> int:
        """One forward over every ready sequence, then sampling and stops.
        Returns the sequences decoded (one token each)."""
        jobs = [j for j in self.active if j.state is JobState.DECODE]
        rows = [(job, seq) for job in jobs for seq in job.live]
        if not rows:
            return 0
        ps = self.page_size
        try:
            for _, seq in rows:
                self.pages.ensure_writable(seq.alloc, seq.stored // ps)
            batch = StepBatch.build([(s.alloc.block_table, s.stored, 1) for _, s in rows], ps)
            tokens = torch.tensor([s.tokens[s.stored] for _, s in rows])
            logits = self.model.forward(tokens, batch, self.cache)
        except Exception as exc:  # noqa: BLE001 - these jobs end, the loop goes on
            for job in jobs:
                self._finish_job(job, StopReason.ERROR, events, f"decode failed: {exc}")
            return 0
        for _, seq in rows:
            seq.stored += 1
            logical = (seq.stored - 1) // ps
            fill = seq.stored - logical * ps
            self.pages.mark_filled(seq.alloc, logical, seq.tokens[logical * ps : seq.stored], fill)
        now = self.clock()
        row_of = {id(seq): i for i, (_, seq) in enumerate(rows)}
        sampled_jobs = [j for j in jobs if not j.beam]
        try:
            self._sample(sampled_jobs, logits, row_of, events)
        except Exception as exc:  # noqa: BLE001
            for job in sampled_jobs:
                self._finish_job(job, StopReason.ERROR, events, f"sampling failed: {exc}")
        for job in jobs:
            if job.beam and job.state is not JobState.DONE:
                try:
                    self._beam_step(job, logits, row_of, events)
                except Exception as exc:  # noqa: BLE001
                    self._finish_job(job, StopReason.ERROR, events, f"beam search failed: {exc}")
        for job in jobs:
            if job.first_token is None:
                job.first_token = now
            if job.state is JobState.DONE:
                continue
            self._note_pages(job)
            if not job.live:
                self._finish_job(job, None, events)
            elif job.width == 1 and self._round_full(job.sequences[0]):
                self._requeue(job)
        return len(rows)

    def _round_full(self, seq: Sequence) -> bool:
        return seq.stored >= len(seq.alloc.block_table) * self.page_size

    def _sample(
        self, jobs: list[Job], logits: torch.Tensor, row_of: dict[int, int], events: list[JobEvent]
    ) -> None:
        """Sample every sequence of plain and parallel-sampling jobs in one batch. A job
        with n > 1 that has not forked yet draws its n first tokens from one row."""
        picks: list[tuple[Job, Sequence, int]] = []  # (job, sequence, logits row)
        for job in jobs:
            if job.width > 1 and not job.forked:
                row = row_of[id(job.sequences[0])]
                self._fork_samples(job)
                picks.extend((job, s, row) for s in job.sequences)
            else:
                picks.extend((job, s, row_of[id(s)]) for s in job.live)
        if not picks:
            return
        index = torch.tensor([row for _, _, row in picks])
        chosen = self.sampler.sample(
            logits[index],
            [job.request.sampling for job, _, _ in picks],
            [seq.rng for _, seq, _ in picks],
            [job.prompt_ids for job, _, _ in picks],
            [seq.generated for _, seq, _ in picks],
        ).tolist()
        for (job, seq, _), token in zip(picks, chosen, strict=True):
            self._accept(job, seq, int(token), events)

    def _fork_samples(self, job: Job) -> None:
        """Parallel sampling: the prompt's pages (partial last page included) are shared
        by n sequences; each copies a shared page only when it writes to it (§8)."""
        first = job.sequences[0]
        for i in range(1, job.width):
            seq = self._new_sequence(job, i, list(first.tokens))
            seq.alloc = self.pages.fork(first.alloc, seq.seq_id)
            seq.stored = first.stored
            job.sequences.append(seq)
        job.forked = True

    def _accept(self, job: Job, seq: Sequence, token: int, events: list[JobEvent]) -> None:
        step = seq.stops.feed(token)
        seq.tokens.append(token)
        seq.generated.append(token)
        if step.finished is not None:
            seq.finished = str(step.finished)
            self._release_sequence(seq)
        if step.text or step.token_ids:
            events.append(
                JobEvent(
                    job.job_id,
                    EventKind.STREAMING,
                    index=seq.index,
                    text=step.text,
                    token_ids=list(step.token_ids),
                    finished=seq.finished,
                    tag=job.tag,
                )
            )

    # -- beam search (§8) --------------------------------------------------------------

    def _beam_step(
        self, job: Job, logits: torch.Tensor, row_of: dict[int, int], events: list[JobEvent]
    ) -> None:
        """Extend every live beam by its best continuations and keep the `width` best.
        A beam chosen twice forks (sharing pages, copy-on-write); a beam not chosen
        releases its pages at once. A continuation ending in a stop token, or reaching
        max_new_tokens, becomes a finished hypothesis."""
        width = job.request.beam_width
        beams = job.live if job.forked else [job.sequences[0]]
        rows = torch.tensor([row_of[id(b)] for b in beams])
        # Beams rank by the model's own log-probabilities: bias and penalties apply,
        # temperature and truncation (which would make greedy settings one-hot) do not.
        ranking = replace(job.request.sampling, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        scores = process_logits(
            logits[rows],
            [ranking] * len(beams),
            [job.prompt_ids] * len(beams),
            [b.generated for b in beams],
        )
        logp = torch.log_softmax(scores, dim=-1)
        total = logp + torch.tensor([b.score for b in beams])[:, None]
        flat = total.flatten()
        k = min(2 * width, int(torch.isfinite(flat).sum()))
        values, order = flat.topk(k)
        vocab = logp.shape[1]
        chosen: list[tuple[Sequence, int, float]] = []
        length = len(beams[0].generated) + 1
        lp = job.request.length_penalty
        for rank, (value, flat_index) in enumerate(
            zip(values.tolist(), order.tolist(), strict=True)
        ):
            parent, token = beams[flat_index // vocab], flat_index % vocab
            if token in job.stop_token_ids:
                if rank < width:
                    hyp = BeamHypothesis(
                        parent.generated + [token], value / length**lp, str(StopReason.STOP_TOKEN)
                    )
                    job.hypotheses.append(hyp)
                continue
            chosen.append((parent, token, value))
            if len(chosen) == width:
                break
        job.forked = True
        at_limit = length >= job.request.max_new_tokens
        if at_limit:
            for parent, token, value in chosen:
                hyp = BeamHypothesis(
                    parent.generated + [token], value / length**lp, str(StopReason.MAX_NEW_TOKENS)
                )
                job.hypotheses.append(hyp)
        if at_limit or len(job.hypotheses) >= width or not chosen:
            for b in job.live:
                b.finished = str(StopReason.MAX_NEW_TOKENS if at_limit else StopReason.STOP_TOKEN)
                self._release_sequence(b)
            return
        # New beams: the first continuation of a parent reuses it, the others fork it.
        used: set[int] = set()
        plans: list[tuple[Sequence, int, float]] = []
        for parent, token, value in chosen:
            if id(parent) in used:
                child = self._new_sequence(job, len(job.sequences), list(parent.tokens))
                child.generated = list(parent.generated)
                child.alloc = self.pages.fork(parent.alloc, child.seq_id)
                child.stored = parent.stored
                job.sequences.append(child)
                plans.append((child, token, value))
            else:
                used.add(id(parent))
                plans.append((parent, token, value))
        for beam in beams:
            if id(beam) not in used:
                self._release_sequence(beam)
                self.seq_jobs.pop(beam.seq_id, None)
                job.sequences.remove(beam)  # pruned: its pages are free now
        for beam, token, value in plans:
            beam.tokens.append(token)
            beam.generated.append(token)
            beam.score = value

    # -- ends ----------------------------------------------------------------------------

    def _requeue(self, job: Job) -> None:
        """The round's pages are full: give them back (their content stays cached) and
        go to the front of the queue with everything so far as the prompt (§7)."""
        seq = job.sequences[0]
        self._release_sequence(seq)
        self.active.remove(job)
        job.state = JobState.PENDING
        job.requeues += 1
        job.skips = 0
        self.pending.appendleft(job)

    def _release_sequence(self, seq: Sequence) -> None:
        if seq.alloc is not None:
            self.pages.release(seq.alloc)
            seq.alloc = None

    def _finish_job(
        self, job: Job, reason: StopReason | None, events: list[JobEvent], error: str = ""
    ) -> None:
        """End a job: every sequence still running ends with `reason` (cancel, error);
        pages are released now; the last event carries the result."""
        for seq in job.sequences:
            if not seq.finished and reason is not None:
                if seq.stops is not None:
                    step = seq.stops.finish(reason)
                    if step.text:
                        events.append(
                            JobEvent(
                                job.job_id, EventKind.STREAMING, seq.index, step.text, tag=job.tag
                            )
                        )
                seq.finished = str(reason)
            self._release_sequence(seq)
            self.seq_jobs.pop(seq.seq_id, None)
        if job in self.active:
            self.active.remove(job)
        if job in self.pending:
            self.pending.remove(job)
        job.state = JobState.DONE
        self.jobs.pop(job.job_id, None)
        result = self._result(job, reason, error)
        events.append(
            JobEvent(
                job.job_id,
                EventKind.DONE,
                eos=True,
                eos_reason=result.eos_reason,
                result=result,
                tag=job.tag,
            )
        )

    def _result(self, job: Job, reason: StopReason | None, error: str) -> JobResult:
        now = self.clock()
        tokenizer = self.tokenizer
        result = JobResult(
            prompt_tokens=len(job.prompt_ids),
            cached_tokens=job.cached_tokens,
            requeues=job.requeues,
            peak_pages=job.peak_pages,
            error=error,
        )
        if job.beam and job.hypotheses and reason is None:
            ranked = sorted(job.hypotheses, key=lambda h: h.score, reverse=True)[
                : job.request.beam_width
            ]
            for hyp in ranked:
                ids = [t for t in hyp.generated if t not in job.stop_token_ids]
                result.texts.append(_cut_at_stop(tokenizer.decode(ids), job.request.stop_strings))
                result.token_ids.append(hyp.generated)
                result.eos_reasons.append(hyp.reason)
                result.beam_scores.append(hyp.score)
        else:
            for seq in sorted(job.sequences, key=lambda s: s.index):
                if job.beam:
                    text = tokenizer.decode(
                        [t for t in seq.generated if t not in job.stop_token_ids]
                    )
                else:
                    text = seq.stops.text if seq.stops is not None else ""
                result.texts.append(text)
                result.token_ids.append(list(seq.generated))
                result.eos_reasons.append(seq.finished or (str(reason) if reason else ""))
        result.new_tokens = sum(len(ids) for ids in result.token_ids)
        result.eos_reason = (
            str(reason)
            if reason is not None
            else (result.eos_reasons[0] if result.eos_reasons else "")
        )
        if job.started is not None:
            result.time_queued = job.started - job.submitted
            first = job.first_token if job.first_token is not None else now
            result.time_prefill = first - job.started
            result.time_generate = now - first if job.first_token is not None else 0.0
        else:
            result.time_queued = now - job.submitted
        return result

    # -- bookkeeping -----------------------------------------------------------------------

    def _new_sequence(self, job: Job, index: int, tokens: list[int]) -> Sequence:
        seq_id = next(self._seq_ids)
        self.seq_jobs[seq_id] = job.job_id
        req = job.request
        seq = Sequence(seq_id, index, tokens)
        if not job.beam:
            seed = req.sampling.seed
            seq.rng = make_generator(None if seed is None else (seed + index) % 2**64)
            seq.stops = StopHandler(
                self.tokenizer,
                job.stop_token_ids,
                req.stop_strings,
                max_new_tokens=req.max_new_tokens,
            )
        return seq

    def _note_pages(self, job: Job) -> None:
        job.peak_pages = max(job.peak_pages, len(job.held_pages()))

    def _record(self, prefilled: int, decoded: int) -> None:
        stats = self.pages.stats()
        self.telemetry.record(
            # one token per decoded sequence: the batch size is the token count
            StepRecord.of(self.clock(), stats, prefilled, decoded, decoded, len(self.pending))
        )


class _NoText:
    """For models loaded without a tokenizer (tests): token ids only, no text."""

    has_chat_template = False
    eos_token_ids: tuple[int, ...] = ()

    class _Decoder:
        def feed(self, ids) -> str:
            return ""

        def flush(self) -> str:
            return ""

    def incremental_decoder(self) -> _Decoder:
        return self._Decoder()

    def decode(self, ids) -> str:
        return ""


def _prefill_event(job: Job, seq: Sequence, kind: EventKind) -> JobEvent:
    """A started or prefill-progress event: how much of the prompt is in the cache."""
    return JobEvent(job.job_id, kind, prefill_done=seq.stored, prefill_total=len(seq.tokens), tag=job.tag)


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cuts = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text
