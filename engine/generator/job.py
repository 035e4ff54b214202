"""A request's life in the generator (docs/ENGINE.md §7, §8).

`JobRequest` is what a caller asks for; `Job` is the generator's record of it: its
sequences on the cache, its place in the queues and its timings. A `Sequence` is one
stream of tokens with its own pages: a job has one, or n for parallel sampling, or up
to the beam width for beam search. What a job reports comes out as `JobEvent`s, and
the last one carries the `JobResult`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import torch

from engine.cache.page_table import Allocation, PageTable
from engine.generator.grammar import Grammar, GrammarMatcher
from engine.generator.sampler import SamplingSettings
from engine.generator.stops import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, StopHandler

# What one request may carry, at most. Requests come from other threads and other programs; these
# bound the work a request makes before the model says no (validating, encoding, matching stops).
# The model's context and vocabulary give the real limits at submit (`Generator.prepare`).
MAX_PROMPT_TOKENS = 1 << 20  # beyond any model's context
MAX_MESSAGES = 1 << 16
MAX_MESSAGE_CHARS = 1 << 23  # in all the messages' text: about 2M tokens, beyond any context
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


@dataclass(frozen=True)
class JobRequest:
    """One prompt to answer. Give `prompt` as token ids or `messages` as chat messages
    (rendered with the model's chat template), not both."""

    prompt: SequenceABC[int] | None = None
    messages: SequenceABC[Mapping[str, str]] | None = None
    sampling: SamplingSettings = SamplingSettings()
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: every EOS id the model declares
    n: int = 1  # parallel samples of the same prompt
    beam_width: int = 1  # > 1: beam search (greedy over summed log-probabilities)
    length_penalty: float = 1.0  # beam score = sum log p / length ** length_penalty
    logprobs: int | None = None  # k: each sampled token's log-probability and the k likeliest
    grammar: Grammar | None = None  # the output must match it (constrained decoding)
    tag: Any = None  # the caller's label (a conversation id, say), echoed in snapshots

    def validate(self) -> None:
        """Raise ValueError naming what is wrong (shapes the model does not matter here)."""
        if self.prompt is None and self.messages is None:
            raise ValueError("a job needs a prompt (token ids) or chat messages")
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give either prompt token ids or chat messages, not both")
        if self.prompt is not None:
            _check_token_ids("prompt", self.prompt, MAX_PROMPT_TOKENS, SequenceABC)
            if len(self.prompt) == 0:
                raise ValueError("the prompt is empty: give at least one token")
        if self.messages is not None:
            _check_messages(self.messages)
        if not _is_int(self.max_new_tokens):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r:.40}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        for name in ("n", "beam_width"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r:.40}")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError("choose parallel sampling (n) or beam search (beam_width), not both")
        lp = self.length_penalty
        if not (_is_real(lp) and math.isfinite(lp) and abs(lp) <= 100):
            raise ValueError(f"length_penalty must be a number in [-100, 100], got {lp!r:.40}")
        _check_logprobs(self.logprobs, self.beam_width)
        _check_grammar(self.grammar, self.beam_width)
        _check_stop_strings(self.stop_strings)
        if self.stop_token_ids is not None:
            _check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if not isinstance(self.sampling, SamplingSettings):
            raise ValueError(
                f"sampling must be SamplingSettings, got {type(self.sampling).__name__}"
            )
        self.sampling.validate()

    @property
    def width(self) -> int:
        """Sequences the job runs at once (batch slots it takes)."""
        return max(self.n, self.beam_width)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is not token 1


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_token_ids(name: str, ids: object, limit: int, kind: type = Collection) -> None:
    """Token ids are integers >= 0 in a list (the vocabulary's end is checked at submit);
    no coercion, so 1.7, "5" and True are refused rather than read as 1, 5 and 1."""
    if isinstance(ids, str | bytes | Mapping) or not isinstance(ids, kind):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    if len(ids) > limit:
        raise ValueError(f"{name} has {len(ids):,} token ids: at most {limit:,} are allowed")
    for token in ids:
        if not _is_int(token) or token < 0:
            raise ValueError(f"{name} must hold integer token ids >= 0, got {token!r:.40}")


def _check_logprobs(k: object, beam_width: int) -> None:
    if k is None:
        return
    if not _is_int(k) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(
            f"logprobs must be None or an integer from 0 to {MAX_LOGPROBS}, got {k!r:.40}"
        )
    if beam_width > 1:
        # Beams fork and are pruned every step and report only their final hypotheses, so
        # a beam's log-probabilities would need a history per hypothesis: not kept.
        raise ValueError(
            "logprobs are not available with beam search: leave logprobs or beam_width out"
        )


def _check_grammar(grammar: object, beam_width: int) -> None:
    if grammar is None:
        return
    if not isinstance(grammar, Grammar):
        raise ValueError(f"grammar must be a Grammar, got {type(grammar).__name__}")
    grammar.validate()
    if beam_width > 1:
        # Beams fork and are pruned every step; each would need its own matcher, copied and
        # dropped with it. Not done: constrained decoding samples (or is greedy).
        raise ValueError("a grammar is not available with beam search: leave one of them out")


def _check_stop_strings(stops: object) -> None:
    if isinstance(stops, str) or not isinstance(stops, Collection) or isinstance(stops, Mapping):
        raise ValueError(f"stop_strings must be a list of strings, got {type(stops).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(
            f"stop_strings has {len(stops):,} entries: at most {MAX_STOP_STRINGS} are allowed"
        )
    for stop in stops:
        if not isinstance(stop, str) or not stop:
            raise ValueError(f"stop strings must be non-empty text, got {stop!r:.40}")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"a stop string has {len(stop):,} characters: at most "
                f"{MAX_STOP_STRING_CHARS} are allowed"
            )


def _check_messages(messages: object) -> None:
    """The conversation's shape and size; each message's fields are the chat template's to
    check (`chat_template.render`), naming the message."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, SequenceABC):
        raise ValueError(f"messages must be a list of chat messages, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("the conversation is empty: give at least one message")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(
            f"the conversation has {len(messages):,} messages: at most {MAX_MESSAGES:,} are allowed"
        )
    chars = 0
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"chat message {index} must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        chars += _text_chars(message)
        if chars > MAX_MESSAGE_CHARS:
            raise ValueError(
                f"the conversation's text exceeds {MAX_MESSAGE_CHARS:,} characters "
                f"(at message {index})"
            )


def _text_chars(value: object, depth: int = 0) -> int:
    """Characters of text in a message (its strings, and those in its lists and dicts)."""
    if isinstance(value, str):
        return len(value)
    if depth > 8:  # real messages are a few levels deep; deeper text (or a cycle) is the
        return 0  # template's budget to bound
    if isinstance(value, Mapping):
        return sum(_text_chars(k, depth + 1) + _text_chars(v, depth + 1) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(_text_chars(v, depth + 1) for v in value)
    return 0


class JobState(StrEnum):
    PENDING = "pending"  # waiting for pages or a batch slot (or requeued)
    PREFILL = "prefill"  # its prompt is being written into the cache
    DECODE = "decode"  # generating
    DONE = "done"


class WaitKind(StrEnum):
    """Why a pending job waits (its `wait_reason` says it with the figures)."""

    NONE = ""  # nothing stops it: it starts at the next step
    BATCH = "batch"  # every batch slot is taken
    MEMORY = "memory"  # too few free pages in the cache
    HELD = "held"  # a job ahead of it was skipped too often and goes first
    DISK = "disk"  # its cached pages are being read back from the disk tier


class EventKind(StrEnum):
    STARTED = "started"
    PREFILL = "prefill"
    STREAMING = "streaming"
    DONE = "done"


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model, and the `k` likeliest tokens with
    theirs, best first (`JobRequest.logprobs`). The model's distribution, before logit bias,
    penalties, temperature or truncation reshape it (vLLM's default), so a greedy token's
    logprob is the best in `top` unless bias or penalties moved the argmax."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class JobResult:
    """What a finished job produced. Index i is sample i (parallel sampling) or the i-th
    best beam (beam search)."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    eos_reasons: list[str] = field(default_factory=list)
    beam_scores: list[float] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # per sample, when asked
    eos_reason: str = ""  # of sample 0 / the best beam; "cancelled" or "error" for the job
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the cache on admission
    disk_pages: int = 0  # of their pages, those read back from the disk tier
    disk_bytes: int = 0
    disk_seconds: float = 0.0
    new_tokens: int = 0  # over every sample / kept beam
    time_queued: float = 0.0
    time_prefill: float = 0.0  # admission to the first sampled token
    time_generate: float = 0.0  # first sampled token to the end
    requeues: int = 0
    peak_pages: int = 0  # distinct pages the job held at its largest

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["text"] = self.text
        return out


@dataclass
class JobEvent:
    """One thing a job reports. `index` names the sample (or 0)."""

    job_id: int
    kind: EventKind
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked
    prefill_done: int = 0  # prompt tokens in the cache so far (cached ones included)
    prefill_total: int = 0
    finished: str = ""  # this sample's end reason, on its last streaming event
    eos: bool = False  # the job's last event
    eos_reason: str = ""
    result: JobResult | None = None
    tag: Any = None


@dataclass
class Sequence:
    """One stream of tokens on the cache. `tokens` is prompt + generated; K/V of the
    first `stored` are in the cache, and the next one to feed is `tokens[stored]`."""

    seq_id: int  # the page table's job id for these pages
    index: int  # sample index (parallel sampling) or beam slot
    tokens: list[int]
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated, when asked
    stored: int = 0
    alloc: Allocation | None = None
    stops: StopHandler | None = None
    rng: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # where the output is in the job's grammar
    score: float = 0.0  # beam search: sum of log-probabilities
    finished: str = ""

    def release(self, pages: PageTable) -> None:
        """Give the sequence's pages back (what they hold stays cached)."""
        if self.alloc is not None:
            pages.release(self.alloc)
            self.alloc = None


@dataclass
class BeamHypothesis:
    generated: list[int]
    score: float  # normalized by length
    reason: str


@dataclass
class Job:
    job_id: int
    request: JobRequest
    prompt_ids: list[int]
    stop_token_ids: frozenset[int]
    submitted: float
    state: JobState = JobState.PENDING
    sequences: list[Sequence] = field(default_factory=list)
    skips: int = 0
    wait_reason: str = ""
    wait_kind: WaitKind = WaitKind.NONE
    started: float | None = None
    prefill_since: float | None = None  # when this round's prefill began (admission)
    first_token: float | None = None
    cached_tokens: int = 0
    disk_pages: int = 0  # context pages read back from the disk tier on admission
    disk_bytes: int = 0
    disk_seconds: float = 0.0
    prefill_start: int = 0  # tokens cached when this round's prefill began
    requeues: int = 0
    forked: bool = False  # parallel samples / beams created from the first logits
    peak_pages: int = 0
    hypotheses: list[BeamHypothesis] = field(default_factory=list)

    @property
    def width(self) -> int:
        return self.request.width

    @property
    def beam(self) -> bool:
        return self.request.beam_width > 1

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.finished]

    def held_pages(self) -> set[int]:
        """Distinct physical pages the job's sequences hold now (shared ones once)."""
        return {p for s in self.sequences if s.alloc is not None for p in s.alloc.block_table}

    def note_peak_pages(self) -> None:
        self.peak_pages = max(self.peak_pages, len(self.held_pages()))

    def wait(self, kind: WaitKind, reason: str) -> None:
        self.wait_kind = kind
        self.wait_reason = reason

    def prefill_event(self, kind: EventKind) -> JobEvent:
        """A started or prefill-progress event: how much of the prompt is in the cache."""
        seq = self.sequences[0]
        return JobEvent(
            self.job_id, kind, prefill_done=seq.stored, prefill_total=len(seq.tokens), tag=self.tag
        )

    @property
    def tag(self) -> Any:
        return self.request.tag
