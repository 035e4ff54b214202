"""Constrained decoding: a job's grammar, and the mask it puts on that job's logits.

A `Grammar` (a JSON schema or a Lark grammar) rides on `JobRequest.grammar`. Each sequence
of such a job holds a `GrammarMatcher`, llguidance's parser over the model's vocabulary:
before a sequence samples, its matcher computes the bitmask of tokens that keep the output
inside the grammar (one bit per token id), the sampler sees -inf everywhere else, and the
sampled token advances the matcher. Once nothing but EOS can follow (`GrammarMatcher.stopped`:
the object's last brace), the sequence ends there, as at a stop token, without a step spent
on sampling the EOS; where the grammar could go on, the mask allows EOS beside the
continuations and the sequence ends on its stop token.

llguidance was chosen by measurement (`folio bench grammar`: a 150,000-token byte-level BPE
vocabulary, three JSON schemas walked token by token, one thread, best of 3 walks, on a
shared 2-core VM; ranges over the schemas and two runs). Per-token mask: llguidance 10-17 us
median, 14-62 us mean; xgrammar 2-41 us median, 13-48 us mean, about the same; outlines-core
85-265 us mean. What sets them apart is the wait before a new schema's first token:
llguidance builds a matcher in about 1 ms (its first mask 0.1-2 ms), xgrammar compiles each
new schema against the vocabulary for 25-75 ms, outlines-core for 0.7-6.4 s (and its regex
for a free JSON object could not nest as deep as the bench's document). llguidance also
takes Lark grammars with embedded JSON schemas (how a forced tool call is written), its
calls drop the GIL, and it needs no other package. Once per model it indexes the
vocabulary: about 4 s at 150k tokens.

Only grammar rows pay: `fill_bitmasks` computes the masks of the rows that have a matcher
(one call for all of them) and `apply_bitmask` writes -inf into those rows only, so a
job without a grammar in the same batch samples exactly what it would alone.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch

MAX_GRAMMAR_CHARS = 1 << 20  # a schema or Lark text longer than any real one
# llguidance's JSON options: fixed separators and no free whitespace, so a model (a random
# one included) cannot spend its tokens on blank space; the text reads like json.dumps.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHED_MATCHERS = 64  # compiled grammars kept per tokenizer, most recently used


class GrammarKind(StrEnum):
    JSON_SCHEMA = "json_schema"
    LARK = "lark"


@dataclass(frozen=True)
class Grammar:
    """What a job's output must match: `source` is a JSON schema as JSON text, or a Lark
    grammar (llguidance's dialect, which can embed JSON schemas with `%json {...}`)."""

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool) -> Grammar:
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, sort_keys=False))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls(GrammarKind.LARK, text)

    def compiled(self) -> str:
        """The grammar in llguidance's form; raises ValueError for a source that is not
        JSON where JSON is wanted."""
        import llguidance

        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar must be text of at most {MAX_GRAMMAR_CHARS:,} characters")
        if self.kind is GrammarKind.LARK:
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)

    def check(self) -> None:
        """Raise ValueError with llguidance's reason when the grammar cannot be built (an
        unknown type, a bad $ref, a regex that does not parse); no tokenizer needed."""
        import llguidance

        try:
            compiled = self.compiled()
        except ValueError as exc:
            raise ValueError(f"the grammar is not valid: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
        if is_error:
            raise ValueError(_first_line(messages[0] if messages else "not valid"))

    def validate(self) -> None:
        """The record's own shape (JobRequest.validate); `check` is the grammar's meaning."""
        if not isinstance(self.kind, GrammarKind):
            raise ValueError(f"grammar kind must be a GrammarKind, got {self.kind!r:.40}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("a grammar needs its source text")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"the grammar has {len(self.source):,} characters: at most "
                f"{MAX_GRAMMAR_CHARS:,} are allowed"
            )


def _first_line(message: str, limit: int = 400) -> str:
    """llguidance's message on one line (a regex error spans several), at most `limit` chars."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:limit]


class GrammarError(ValueError):
    """A sampled token the grammar refused (it was masked, so this means a bug or a token
    forced from outside), or a matcher in an error state."""


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any):
        self._matcher = matcher

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same place (a parallel sample, `n > 1`)."""
        return GrammarMatcher(self._matcher.deep_copy())

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete), or the matcher failed."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a whole match of the grammar."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class GrammarCompiler:
    """llguidance's view of one tokenizer (built once, on the first grammar: about 5 s at
    150k tokens on a 2-core VM) and the matchers of recent grammars, so a repeated schema
    compiles once. Thread-safe: the callers' threads compile (at submit), the engine thread
    copies; a compile runs outside the lock, so it never holds up the engine thread's copy."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self._source = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()  # the cache and the copies made from it
        self._tokenizer_lock = threading.Lock()
        self._llg_tokenizer: Any = None
        self._matchers: OrderedDict[Grammar, Any] = OrderedDict()

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; raises ValueError naming what is wrong
        with the grammar."""
        with self._lock:
            prototype = self._matchers.get(grammar)
            if prototype is not None:
                self._matchers.move_to_end(grammar)
                return GrammarMatcher(prototype.deep_copy())
        prototype = self._compile(grammar)
        with self._lock:
            self._matchers[grammar] = prototype
            while len(self._matchers) > _CACHED_MATCHERS:
                self._matchers.popitem(last=False)
            return GrammarMatcher(prototype.deep_copy())

    def _compile(self, grammar: Grammar) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar.compiled(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar is not valid: {_first_line(matcher.get_error())}")
        return matcher

    def _tokenizer(self) -> Any:
        import llguidance

        with self._tokenizer_lock:
            if self._llg_tokenizer is None:
                if not self.eos_token_ids:
                    raise ValueError("the model declares no EOS token: a grammar cannot end")
                self._llg_tokenizer = llguidance.LLTokenizer(
                    self._source.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids,
                )
            return self._llg_tokenizer


_compilers: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The one `GrammarCompiler` of a tokenizer (models loaded twice share nothing)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None or compiler.vocab_size < vocab_size:
            compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids)
            _compilers[tokenizer] = compiler
        return compiler


def fill_bitmasks(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """The next-token bitmask of each matcher, int32 [len(matchers), ceil(vocab / 32)], in
    one llguidance call (its threads, without the GIL)."""
    import llguidance.torch

    mask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask_par(
        _executor(), [(m._matcher, i) for i, m in enumerate(matchers)], mask
    )
    return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """-inf, in place, wherever a row's bitmask has a 0 bit (logits [rows, vocab], mask
    [rows, words], int32 on the CPU); ids past the mask's words are disallowed.

    The bits unpack with numpy (little-endian words: bit i of the row is token i), and
    `torch.where` writes the row back: a select without branches per token, about 0.15 ms
    for a 150k row where `masked_fill_` takes 0.25-0.6 ms (`folio bench grammar`)."""
    rows, vocab = logits.shape
    bits = np.unpackbits(
        mask.numpy().view(np.uint8), axis=1, bitorder="little", count=min(vocab, mask.shape[1] * 32)
    )
    allowed = torch.from_numpy(bits.view(np.bool_))
    if allowed.shape[1] < vocab:
        allowed = torch.cat(
            [allowed, torch.zeros(rows, vocab - allowed.shape[1], dtype=torch.bool)], 1
        )
    allowed = allowed.to(logits.device, non_blocking=True)
    torch.where(
        allowed,
        logits,
        torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device),
        out=logits,
    )


_executor_lock = threading.Lock()
_llg_executor: Any = None


def _executor() -> Any:
    global _llg_executor
    with _executor_lock:
        if _llg_executor is None:
            import llguidance

            _llg_executor = llguidance.LLExecutor()
        return _llg_executor
