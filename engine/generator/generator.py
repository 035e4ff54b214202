"""The continuous-batching loop (docs/ENGINE.md §3, §7, §8).

`Generator.iterate()` is one step: start the pending jobs that fit (`Scheduler`), run
one prefill chunk per job with prompt left, run one batched decode forward over every
sequence whose prompt is in the cache, then sample (or extend beams,
`beam_search.py`), apply stop conditions and report events. Pages change hands only
through the page table; the generator and its scheduler decide *when*.

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

import torch

from engine.cache.kv_cache import KVCache, StepBatch
from engine.generator.beam_search import Continuation, best_hypotheses, select_continuations
from engine.generator.grammar import (
    Grammar,
    GrammarCompiler,
    GrammarMatcher,
    apply_bitmask,
    compiler_for,
    fill_bitmasks,
)
from engine.generator.job import (
    EventKind,
    Job,
    JobEvent,
    JobRequest,
    JobResult,
    JobState,
    Sequence,
    TokenLogprob,
)
from engine.generator.sampler import (
    NOTHING_LEFT,
    NothingToSample,
    Sampler,
    make_generator,
    model_logprobs,
)
from engine.generator.scheduler import Scheduler
from engine.generator.settings import GeneratorSettings
from engine.generator.stops import StopAutomaton, StopHandler, StopReason, StopStep
from engine.model.decode_graphs import DecodeGraphs
from engine.model.loader import LoadedModel
from engine.telemetry import StepRecord, Telemetry

__all__ = ["Generator", "GeneratorSettings"]

GRAMMAR_BLOCKED = (
    "the grammar allows no token here that logit_bias / penalties leave: nothing to sample"
)
# A drawn token: its job, its sequence, the id, and the logits row it was drawn from.
Drawn = tuple[Job, Sequence, int, int]


class Generator:
    """Owns every job's sequences; call `iterate()` until `idle`."""

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
        self.scheduler = Scheduler(self.pages, self.settings, clock)
        self.jobs: dict[int, Job] = {}
        self._job_ids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self.seq_jobs: dict[int, int] = {}  # live sequence id -> job id
        self.steps = 0
        self._grammars: GrammarCompiler | None = None
        self.graphs: DecodeGraphs | None = None  # made on the first decode step

    # -- the public surface ----------------------------------------------------------

    @property
    def pending(self) -> deque[Job]:
        """Jobs waiting to start, in the order they will be tried."""
        return self.scheduler.pending

    @property
    def active(self) -> list[Job]:
        """Jobs prefilling or decoding."""
        return self.scheduler.active

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
            prompt = list(request.prompt)  # type: ignore[arg-type]
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
        vocab = self.loaded.config.vocab_size
        stops = request.stop_token_ids
        for name, ids in (
            ("prompt token id", prompt),
            ("stop token id", stops or ()),
            ("logit_bias token id", [token for token, _ in request.sampling.logit_bias]),
        ):
            if ids and max(ids) >= vocab:
                raise ValueError(f"{name} {max(ids)} is outside the vocabulary (0..{vocab - 1})")
        self.scheduler.check_fits(request, len(prompt))
        if request.grammar is not None:
            self.grammar_matcher(request.grammar)  # compiled here, in the caller's thread
        stop_ids = frozenset(tokenizer.eos_token_ids if stops is None else stops)
        # built here, in the caller's thread, so the engine thread finds it made (stops.py)
        StopAutomaton.for_stops(tuple(dict.fromkeys(request.stop_strings)))
        return prompt, stop_ids

    def grammar_matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A matcher at the start of `grammar` for this model's vocabulary; raises
        ValueError naming what is wrong with the grammar (compiled ones are cached)."""
        if self._grammars is None:
            if not hasattr(self.tokenizer, "backend"):
                raise ValueError("this model has no tokenizer: a grammar needs one")
            self._grammars = compiler_for(self.tokenizer, self.loaded.config.vocab_size)
        return self._grammars.matcher(grammar)

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

    # -- the loop ----------------------------------------------------------------------

    def iterate(self) -> list[JobEvent]:
        """One step; returns the events of every job, in order."""
        return self.admit() + self.advance()

    def admit(self) -> list[JobEvent]:
        """A step's first half: start the pending jobs that fit (their "started"
        events). The engine publishes what started before `advance` runs the forwards."""
        events: list[JobEvent] = []
        self.start_pending_jobs(events)
        return events

    def advance(self) -> list[JobEvent]:
        """A step's second half: one prefill chunk per job, one decode forward, stops."""
        events: list[JobEvent] = []
        prefilled = self.prefill(events)
        decoded = self.decode(events)
        self._defrag_when_drained()
        self.steps += 1
        if self.telemetry is not None:
            self._record(prefilled, decoded)
        return events

    def start_pending_jobs(self, events: list[JobEvent]) -> None:
        """Admission (§3): the scheduler starts the pending jobs that fit; one that can
        never start ends here with the scheduler's reason."""
        for job, reason in self.scheduler.start_pending_jobs(events):
            self._finish_job(job, StopReason.ERROR, events, reason)

    def _defrag_when_drained(self) -> None:
        if self.idle and not self.pages.referenced:
            # Pages of finished jobs go to the disk tier now, not only when evicted: a
            # quit or a crash keeps them (the writes run on the tier's own thread).
            self.pages.write_through()
            if self.settings.defrag:
                self.pages.defrag()

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
            events.append(job.prefill_event(EventKind.PREFILL))
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
        rows = [seq for job in jobs for seq in job.live]
        if not rows:
            return 0
        try:
            logits = self._decode_forward(rows)
        except Exception:  # noqa: BLE001 - find the jobs it concerns, the others go on
            jobs, logits = self._decode_each_job(jobs, events)
            rows = [seq for job in jobs for seq in job.live]
            if not rows:
                return 0
        self._mark_decoded(rows)
        now = self.clock()
        row_of = {id(seq): i for i, seq in enumerate(rows)}
        self._choose_tokens(jobs, logits, row_of, events)
        self._end_or_requeue(jobs, now, events)
        return len(rows)

    def _decode_forward(self, rows: list[Sequence]) -> torch.Tensor:
        """Each row's next token through the model in one batch; logits [rows, vocab]."""
        ps = self.page_size
        for seq in rows:
            self.pages.ensure_writable(seq.alloc, seq.stored // ps)
        batch = StepBatch.build([(s.alloc.block_table, s.stored, 1) for s in rows], ps)
        tokens = torch.tensor([s.tokens[s.stored] for s in rows])
        if self.settings.cuda_graphs and DecodeGraphs.supports(self.cache):
            if self.graphs is None:
                self.graphs = DecodeGraphs(self.model, self.cache)
            return self.graphs.forward(tokens, batch)
        return self.model.forward(tokens, batch, self.cache)

    def _decode_each_job(
        self, jobs: list[Job], events: list[JobEvent]
    ) -> tuple[list[Job], torch.Tensor]:
        """After a failed batched forward: each job's rows through the model on their own
        (rewriting a cache slot with the same values is harmless); a job that fails again
        ends, the others keep their logits, in order. Returns (surviving jobs, logits)."""
        survivors: list[Job] = []
        parts: list[torch.Tensor] = []
        for job in jobs:
            try:
                parts.append(self._decode_forward(job.live))
            except Exception as exc:  # noqa: BLE001 - this job ends, the loop goes on
                self._finish_job(job, StopReason.ERROR, events, f"decode failed: {exc}")
            else:
                survivors.append(job)
        return survivors, (torch.cat(parts) if parts else torch.empty(0))

    def _mark_decoded(self, rows: list[Sequence]) -> None:
        ps = self.page_size
        for seq in rows:
            seq.stored += 1
            logical = (seq.stored - 1) // ps
            fill = seq.stored - logical * ps
            self.pages.mark_filled(seq.alloc, logical, seq.tokens[logical * ps : seq.stored], fill)

    def _choose_tokens(
        self, jobs: list[Job], logits: torch.Tensor, row_of: dict[int, int], events: list[JobEvent]
    ) -> None:
        """Sample the plain and parallel-sampling jobs in one batch, then extend each beam
        search; a failure ends the job it concerns."""
        sampled_jobs = [j for j in jobs if not j.beam]
        self._sample(sampled_jobs, logits, row_of, events)
        for job in jobs:
            if job.beam and job.state is not JobState.DONE:
                try:
                    self._beam_step(job, logits, row_of)
                except Exception as exc:  # noqa: BLE001
                    self._finish_job(job, StopReason.ERROR, events, f"beam search failed: {exc}")

    def _end_or_requeue(self, jobs: list[Job], now: float, events: list[JobEvent]) -> None:
        """After a decode step: a job with no live sequence ends, a job whose round's
        pages are full goes back to the queue."""
        for job in jobs:
            if job.first_token is None:
                job.first_token = now
            if job.state is JobState.DONE:
                continue
            job.note_peak_pages()
            if not job.live:
                self._finish_job(job, None, events)
            elif job.width == 1 and self._round_full(job.sequences[0]):
                self.scheduler.requeue(job)

    def _round_full(self, seq: Sequence) -> bool:
        return seq.stored >= len(seq.alloc.block_table) * self.page_size

    def _sample(
        self, jobs: list[Job], logits: torch.Tensor, row_of: dict[int, int], events: list[JobEvent]
    ) -> None:
        """Sample every sequence of plain and parallel-sampling jobs in one batch. A job
        with n > 1 that has not forked yet draws its n first tokens from one row. A
        failure in one job's part ends that job only."""
        picks: list[tuple[Job, Sequence, int]] = []  # (job, sequence, logits row)
        for job in jobs:
            try:
                if job.width > 1 and not job.forked:
                    row = row_of[id(job.sequences[0])]
                    self._fork_samples(job)
                    picks.extend((job, s, row) for s in job.sequences)
                else:
                    picks.extend((job, s, row_of[id(s)]) for s in job.live)
            except Exception as exc:  # noqa: BLE001
                self._finish_job(job, StopReason.ERROR, events, f"sampling failed: {exc}")
        picks = [p for p in picks if p[0].state is not JobState.DONE]
        drawn = self._draw(picks, logits, events)
        logprobs = self._logprobs(drawn, logits, events)
        for (job, seq, token, _), logprob in zip(drawn, logprobs, strict=True):
            if job.state is JobState.DONE:
                continue
            try:
                self._accept(job, seq, token, logprob, events)
            except Exception as exc:  # noqa: BLE001
                self._finish_job(job, StopReason.ERROR, events, f"stop handling failed: {exc}")

    def _draw(
        self, picks: list[tuple[Job, Sequence, int]], logits: torch.Tensor, events: list[JobEvent]
    ) -> list[Drawn]:
        """One token per pick, in one sampler call. If that call fails, each job draws on
        its own: the sampler checks and processes every row before any row draws, and rows
        never depend on each other, so a job picks what it would have picked in the batch;
        a job that fails on its own ends."""
        try:
            return self._draw_batch(picks, logits, events)
        except Exception:  # noqa: BLE001 - find the jobs it concerns, the others go on
            drawn: list[Drawn] = []
            for job in {id(job): job for job, _, _ in picks}.values():
                try:
                    drawn += self._draw_batch([p for p in picks if p[0] is job], logits, events)
                except Exception as exc:  # noqa: BLE001
                    self._finish_job(job, StopReason.ERROR, events, f"sampling failed: {exc}")
            return drawn

    def _draw_batch(
        self, picks: list[tuple[Job, Sequence, int]], logits: torch.Tensor, events: list[JobEvent]
    ) -> list[Drawn]:
        """One sampler call over the picks; a job whose row has no token left ends."""
        while picks:
            index = torch.tensor([row for _, _, row in picks])
            rows = logits[index]  # a copy: the grammar masks below touch only it
            try:
                self._mask_grammar_rows(rows, picks)
                chosen = self.sampler.sample(
                    rows,
                    [job.request.sampling for job, _, _ in picks],
                    [seq.rng for _, seq, _ in picks],
                    [job.prompt_ids for job, _, _ in picks],
                    [seq.generated for _, seq, _ in picks],
                ).tolist()
            except NothingToSample as exc:
                # No row has drawn yet, so the others sample again exactly as they would have.
                empty = {id(picks[row][0]): picks[row][0] for row in exc.rows}
                for job in empty.values():
                    why = NOTHING_LEFT if job.request.grammar is None else GRAMMAR_BLOCKED
                    self._finish_job(job, StopReason.ERROR, events, why)
                picks = [p for p in picks if id(p[0]) not in empty]
                continue
            return [
                (job, seq, int(t), row) for (job, seq, row), t in zip(picks, chosen, strict=True)
            ]
        return []

    def _mask_grammar_rows(
        self, rows: torch.Tensor, picks: list[tuple[Job, Sequence, int]]
    ) -> None:
        """-inf in the rows of sequences with a grammar wherever it allows no token; the
        other rows are not touched, so their tokens are what they would be alone. Raises
        NothingToSample for rows whose grammar allows nothing (a failed matcher)."""
        constrained = [i for i, (_, seq, _) in enumerate(picks) if seq.grammar is not None]
        if not constrained:
            return
        masks = fill_bitmasks([picks[i][1].grammar for i in constrained], rows.shape[1])
        part = rows[constrained]
        apply_bitmask(part, masks)
        rows[constrained] = part
        empty = torch.isneginf(part).all(dim=-1).nonzero().flatten().tolist()
        if empty:
            raise NothingToSample([constrained[i] for i in empty])

    def _logprobs(
        self, drawn: list[Drawn], logits: torch.Tensor, events: list[JobEvent]
    ) -> list[TokenLogprob | None]:
        """The drawn tokens' log-probabilities where the job asks (`JobRequest.logprobs`),
        from the logits rows they were drawn from; None elsewhere, and no work when no job
        asks. After the draw, not in it: `_draw` redraws when its batch fails, and a
        failure here must not make a job draw twice from its generator; it ends the jobs
        that asked."""
        asking = [
            i
            for i, (job, _, _, _) in enumerate(drawn)
            if job.request.logprobs is not None and job.state is not JobState.DONE
        ]
        out: list[TokenLogprob | None] = [None] * len(drawn)
        if not asking:
            return out
        ks = [drawn[i][0].request.logprobs for i in asking]
        tokens = [drawn[i][2] for i in asking]
        try:
            rows = logits[torch.tensor([drawn[i][3] for i in asking])]
            picked, top_ids, top_logp = model_logprobs(rows, torch.tensor(tokens), max(ks))
        except Exception as exc:  # noqa: BLE001 - the jobs that asked end, the others go on
            for job in {id(drawn[i][0]): drawn[i][0] for i in asking}.values():
                self._finish_job(job, StopReason.ERROR, events, f"logprobs failed: {exc}")
            return out
        for i, k, token, lp, ids, lps in zip(
            asking, ks, tokens, picked, top_ids, top_logp, strict=True
        ):
            out[i] = TokenLogprob(token, lp, tuple(zip(ids[:k], lps[:k], strict=True)))
        return out

    def _fork_samples(self, job: Job) -> None:
        """Parallel sampling: the prompt's pages (partial last page included) are shared
        by n sequences; each copies a shared page only when it writes to it (§8)."""
        first = job.sequences[0]
        for i in range(1, job.width):
            seq = self._new_sequence(job, i, list(first.tokens))
            seq.alloc = self.pages.fork(first.alloc, seq.seq_id)
            seq.stored = first.stored
            seq.grammar = first.grammar.fork() if first.grammar is not None else None
            job.sequences.append(seq)
        job.forked = True

    def _accept(
        self,
        job: Job,
        seq: Sequence,
        token: int,
        logprob: TokenLogprob | None,
        events: list[JobEvent],
    ) -> None:
        step = seq.stops.feed(token)
        if seq.grammar is not None and step.finished is None:
            step = self._advance_grammar(seq, token, step)
        seq.tokens.append(token)
        seq.generated.append(token)
        # Stop handling holds back text, never ids: the fed token is in this step's ids
        # (a stop token and a token that completes a stop string included), so its
        # logprob goes out with it and `seq.logprobs` stays aligned with `seq.generated`.
        logprobs = [logprob] if logprob is not None else []
        seq.logprobs += logprobs
        if step.finished is not None:
            seq.finished = str(step.finished)
            seq.release(self.pages)
        if step.text or step.token_ids:
            events.append(
                JobEvent(
                    job.job_id,
                    EventKind.STREAMING,
                    index=seq.index,
                    text=step.text,
                    token_ids=list(step.token_ids),
                    logprobs=logprobs,
                    finished=seq.finished,
                    tag=job.tag,
                )
            )

    def _advance_grammar(self, seq: Sequence, token: int, step: StopStep) -> StopStep:
        """Feed the token to the sequence's grammar (GrammarError if refused). Once nothing
        but EOS can follow, the sequence ends here, as at a stop token: no step is spent on
        sampling the EOS, and a job that ignores EOS (its own stop ids) ends all the same."""
        seq.grammar.accept(token)
        if not seq.grammar.stopped:
            return step
        end = seq.stops.finish(StopReason.STOP_TOKEN)
        return StopStep(step.text + end.text, step.token_ids, StopReason.STOP_TOKEN)

    # -- beam search on the cache (§8) ---------------------------------------------------

    def _beam_step(self, job: Job, logits: torch.Tensor, row_of: dict[int, int]) -> None:
        """Extend the job's beams by the continuations `select_continuations` keeps; when
        the search ends, every live beam ends and releases its pages."""
        beams = job.live if job.forked else [job.sequences[0]]
        rows = torch.tensor([row_of[id(b)] for b in beams])
        step = select_continuations(job, beams, logits[rows])
        job.forked = True
        if step.finished is not None:
            for b in job.live:
                b.finished = str(step.finished)
                b.release(self.pages)
            return
        self._extend_beams(job, beams, step.keep)

    def _extend_beams(self, job: Job, beams: list[Sequence], keep: list[Continuation]) -> None:
        """The first continuation of a parent reuses it, the others fork it (sharing its
        pages, copy-on-write); a beam with no continuation is pruned and its pages are
        free at once."""
        used: set[int] = set()
        plans: list[tuple[Sequence, Continuation]] = []
        for c in keep:
            parent = c.parent
            if id(parent) in used:
                child = self._new_sequence(job, len(job.sequences), list(parent.tokens))
                child.generated = list(parent.generated)
                child.alloc = self.pages.fork(parent.alloc, child.seq_id)
                child.stored = parent.stored
                job.sequences.append(child)
                plans.append((child, c))
            else:
                used.add(id(parent))
                plans.append((parent, c))
        for beam in beams:
            if id(beam) not in used:
                beam.release(self.pages)
                self.seq_jobs.pop(beam.seq_id, None)
                job.sequences.remove(beam)
        for beam, c in plans:
            beam.tokens.append(c.token)
            beam.generated.append(c.token)
            beam.score = c.score

    # -- ends ----------------------------------------------------------------------------

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
            seq.release(self.pages)
            self.seq_jobs.pop(seq.seq_id, None)
        self.scheduler.remove(job)
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
            disk_pages=job.disk_pages,
            disk_bytes=job.disk_bytes,
            disk_seconds=job.disk_seconds,
            requeues=job.requeues,
            peak_pages=job.peak_pages,
            error=error,
        )
        if job.beam and job.hypotheses and reason is None:
            for hyp in best_hypotheses(job):
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
                if job.request.logprobs is not None:
                    result.logprobs.append(list(seq.logprobs))
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
        if index == 0 and req.grammar is not None:
            seq.grammar = self.grammar_matcher(req.grammar)
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


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cuts = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text
