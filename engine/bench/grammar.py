"""`folio bench grammar`: what constrained decoding costs per token at a 150k vocabulary,
for each constrained-decoding library installed (llguidance, xgrammar, outlines-core).
One JSON object per line.

The engine applies a grammar's token mask on its sampling path (engine/generator/grammar.py),
so the figure that matters is the time to compute one mask for the next token, per token,
at the vocabulary size of today's models (Qwen's 151,646, Llama 3's 128,256). No model hub
is reachable, so the vocabulary is built here: the 256 byte-level characters plus the
most frequent pre-tokens of Python's own standard library (words with and without their
leading space, numbers, punctuation runs) and their prefixes, ranked by frequency, up to
`--vocab` tokens, plus an EOS token: a byte-level BPE vocabulary of the shape real ones have
(subwords of code and prose, many tokens starting with a space or a quote).

Each library gets the same schemas and walks the same token sequence: a valid document for
each schema, tokenized by that vocabulary's BPE (so most steps consume a multi-character
token, as a model's output does). Per step: the mask computed into a bitmask (timed), then
the step's token consumed (timed apart). Reported per library and schema: grammar compile
time for the vocabulary, per-token mask time median / p90 / mean / max, consume time, and
the time to apply a bitmask to a [1, vocab] logits row (the same torch code for all).
Per-token figures are the best of `--rounds` walks, each with a new matcher; `cold_*` are
the first walk's compile and first mask: what a request with a schema new to the process
pays. Every library runs on one thread where it lets us choose (2-core machines; other
work runs beside).
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import sysconfig
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.generator.grammar import apply_bitmask
from engine.model.tokenizer.gguf_vocab import bytes_to_unicode

DEFAULT_VOCAB = 150_000
EOS = "<|endoftext|>"
# GPT-2's pre-tokenizer split, the one byte-level BPE vocabularies are learned within
_PRE_TOKEN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""
)
MAX_TOKEN_CHARS = 16

SCHEMAS: dict[str, dict] = {
    "json_object": {"type": "object"},
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "email", "tags", "address", "active"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search_web", "send_email"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "location": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["location", "unit", "days"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}
DOCUMENTS: dict[str, object] = {
    "json_object": {
        "title": "The quick brown fox",
        "items": [1, 2.5, -3, True, None, "jumps over the lazy dog"],
        "nested": {"depth": {"more": ["a", "b", {"c": "d"}]}, "count": 42},
    },
    "person": {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.org",
        "tags": ["mathematician", "writer", "analyst"],
        "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
        "active": True,
    },
    "tool_call": {
        "name": "get_weather",
        "arguments": {"location": "San Francisco, California", "unit": "celsius", "days": 5},
    },
}


@dataclass(frozen=True)
class BenchVocab:
    """A byte-level BPE vocabulary: `tokens[i]` is token i as the BPE model stores it (bytes
    as GPT-2's printable characters); the last id is EOS."""

    tokens: list[str]

    @property
    def eos_id(self) -> int:
        return len(self.tokens) - 1

    def decoded(self) -> list[bytes]:
        """Each token's bytes (EOS as its text)."""
        back = _byte_decoder()
        return [bytes(back[c] for c in t) for t in self.tokens[:-1]] + [EOS.encode()]

    def backend(self):
        """The vocabulary as a Hugging Face tokenizer: every token longer than one character
        is its prefix merged with its last character, ranked in vocabulary order (every
        prefix of a token ranks before it), so encoding is real BPE and a library that
        tokenizes forced text (llguidance) finds the tokens a model would produce."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(self.tokens[:-1])}
        merges = [(t[:-1], t[-1]) for t in self.tokens[:-1] if len(t) > 1]
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
        return backend


def build_vocab(size: int = DEFAULT_VOCAB) -> BenchVocab:
    """`size` tokens (EOS included) from the standard library's sources; see the module
    docstring. Deterministic for one Python version."""
    encoder = bytes_to_unicode()
    counts: collections.Counter[str] = collections.Counter()
    for text in _stdlib_texts():
        counts.update(_PRE_TOKEN.findall(text))
    scores: collections.Counter[str] = collections.Counter()
    for word, count in counts.items():
        encoded = "".join(encoder[b] for b in word.encode("utf-8"))
        for end in range(2, min(len(encoded), MAX_TOKEN_CHARS) + 1):
            scores[encoded[:end]] += count  # a prefix scores at least what its extensions do
    alphabet = sorted(encoder.values())
    taken = set(alphabet)
    tokens = list(alphabet)
    for token, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(tokens) >= size - 1:
            break
        if token not in taken:
            taken.add(token)
            tokens.append(token)
    return BenchVocab(tokens + [EOS])


def _stdlib_texts() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


# -- the libraries -----------------------------------------------------------------------


@dataclass
class Walker:
    """One library's matcher for one schema: `fill` writes the next token's mask into an
    int32 bitmask row, `consume` advances by a token."""

    fill: Callable[[torch.Tensor], None]
    consume: Callable[[int], bool]


Factory = Callable[[dict], Walker]


def llguidance_factory(vocab: BenchVocab) -> tuple[Factory, str]:
    import llguidance
    import llguidance.torch

    tokenizer = llguidance.LLTokenizer(vocab.backend().to_str(), eos_token=vocab.eos_id)

    def make(schema: dict) -> Walker:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())

        def fill(mask: torch.Tensor) -> None:
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)

        return Walker(fill, matcher.consume_token)

    return make, llguidance.__version__


def xgrammar_factory(vocab: BenchVocab) -> tuple[Factory, str]:
    from importlib.metadata import version

    import xgrammar

    info = xgrammar.TokenizerInfo(
        vocab.tokens[:-1] + [EOS],
        xgrammar.VocabType.BYTE_LEVEL,
        stop_token_ids=[vocab.eos_id],
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def make(schema: dict) -> Walker:
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        matcher = xgrammar.GrammarMatcher(compiled)

        def fill(mask: torch.Tensor) -> None:
            matcher.fill_next_token_bitmask(mask, 0)

        return Walker(fill, matcher.accept_token)

    return make, version("xgrammar")


def outlines_core_factory(vocab: BenchVocab) -> tuple[Factory, str]:
    from importlib.metadata import version

    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    pieces: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, token in enumerate(vocab.decoded()[:-1]):
        pieces[token].append(i)
    vocabulary = outlines_core.Vocabulary(vocab.eos_id, dict(pieces))

    def make(schema: dict) -> Walker:
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))

        def fill(mask: torch.Tensor) -> None:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

        def consume(token: int) -> bool:
            guide.advance(token)
            return True

        return Walker(fill, consume)

    return make, version("outlines_core")


LIBRARIES: dict[str, Callable[[BenchVocab], tuple[Factory, str]]] = {
    "llguidance": llguidance_factory,
    "xgrammar": xgrammar_factory,
    "outlines-core": outlines_core_factory,
}


# -- measuring -----------------------------------------------------------------------------


def walk(walker: Walker, tokens: list[int], vocab_size: int) -> dict[str, float]:
    """Per-token mask and consume times (microseconds) over one document's tokens; raises
    if a token the document needs is masked out (the libraries must agree on validity)."""
    mask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    mask_us: list[float] = []
    consume_us: list[float] = []
    for step, token in enumerate(tokens):
        t0 = time.perf_counter()
        walker.fill(mask)
        t1 = time.perf_counter()
        if not (int(mask[0, token // 32]) >> (token % 32)) & 1:
            raise ValueError(f"step {step}: the document's token {token} is masked out")
        if not walker.consume(token):
            raise ValueError(f"step {step}: token {token} was refused")
        t2 = time.perf_counter()
        mask_us.append((t1 - t0) * 1e6)
        consume_us.append((t2 - t1) * 1e6)
    ordered = sorted(mask_us)
    return {
        "tokens": len(tokens),
        "first_mask_us": round(mask_us[0], 1),
        "mask_us_median": round(statistics.median(mask_us), 1),
        "mask_us_p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
        "mask_us_mean": round(statistics.fmean(mask_us), 1),
        "mask_us_max": round(ordered[-1], 1),
        "consume_us_median": round(statistics.median(consume_us), 1),
    }


def apply_cost_us(vocab_size: int, rounds: int = 50) -> float:
    """Median time to apply one bitmask to a [1, vocab] float32 logits row. The mask is
    shaped as grammar masks are (runs of zero words, a few allowed tokens scattered):
    the cost of a select depends on how predictable its branches are."""
    logits = torch.randn(1, vocab_size)
    mask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    mask[0, ::97] = 0x0F0F0F0F
    times = []
    for _ in range(rounds):
        row = logits.clone()
        t0 = time.perf_counter()
        apply_bitmask(row, mask)
        times.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(times), 1)


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def run_grammar_bench(args: Namespace | None = None) -> list[dict]:
    """Every installed library on every schema; returns the records it printed."""
    torch.set_num_threads(1)
    size = getattr(args, "vocab", None) or DEFAULT_VOCAB
    rounds = getattr(args, "rounds", None) or 3
    chosen = getattr(args, "libraries", None) or list(LIBRARIES)
    t0 = time.perf_counter()
    vocab = build_vocab(size)
    records = [
        {
            "bench": "grammar",
            "what": "vocabulary",
            "vocab": len(vocab.tokens),
            "build_s": round(time.perf_counter() - t0, 2),
            "apply_bitmask_us": apply_cost_us(len(vocab.tokens)),
        }
    ]
    _emit(records[0])
    backend = vocab.backend()
    documents = {
        name: backend.encode(json.dumps(doc, separators=(",", ":"))).ids
        for name, doc in DOCUMENTS.items()
    }
    for library in chosen:
        records += _bench_library(library, vocab, documents, rounds)
    return records


def _bench_library(
    library: str, vocab: BenchVocab, documents: dict[str, list[int]], rounds: int
) -> list[dict]:
    base = {"bench": "grammar", "library": library, "vocab": len(vocab.tokens)}
    try:
        t0 = time.perf_counter()
        make, version = LIBRARIES[library](vocab)
        setup_s = time.perf_counter() - t0
    except ImportError as exc:
        record = {**base, "skipped": f"not installed: {exc}"}
        _emit(record)
        return [record]
    records = []
    for name, tokens in documents.items():
        record = {**base, "version": version, "schema": name, "setup_s": round(setup_s, 2)}
        try:
            best: dict | None = None
            cold: dict = {}
            for _ in range(rounds):
                t0 = time.perf_counter()
                walker = make(SCHEMAS[name])
                compile_s = time.perf_counter() - t0
                figures = walk(walker, tokens, len(vocab.tokens))
                # the first round is what a request with a schema new to the server pays
                cold = cold or {
                    "cold_compile_s": round(compile_s, 3),
                    "cold_first_mask_us": figures["first_mask_us"],
                }
                if best is None or figures["mask_us_median"] < best["mask_us_median"]:
                    best = {**figures, "compile_s": round(compile_s, 3)}
            record.update(**cold, **(best or {}))
        except Exception as exc:  # noqa: BLE001 - one library's failure is a figure too
            record["error"] = f"{type(exc).__name__}: {exc}"
        _emit(record)
        records.append(record)
    return records
