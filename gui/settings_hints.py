"""What each engine setting means in plain words, and what the values chosen now cost.

The settings dialog shows these lines under its fields and updates them as the user
types; nothing here knows Qt, so every rule is a unit test away:

- `budget_figures` prices the KV cache the way the engine allocates it: whole pages, each
  token priced by the cache's own formats (`engine.hub.fit.kv_bytes_per_token`, which
  asks `engine.cache.formats`), so the MB shown is the MB the cache takes.
- `kv_quality_hint` gives the perplexity change of a K/V format as `folio bench kv-quant`
  measured it (`engine.bench.kv_quant_measured`, a recorded run), never an estimate.
- `PromptLengths` is the running record of prompt lengths this install has seen, and
  `suggest_page_size` turns it into a page size.
- `work_lost` says what applying new settings would throw away (running replies, cached
  pages), so the app asks for confirmation only when something would be lost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Protocol

from engine.units import format_bytes

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot


class EngineSettings(Protocol):
    """What the hints read of the dialog's settings (gui.settings_dialog.EngineSettings,
    which imports this module)."""

    page_size: int
    budget_unit: str
    budget: int
    k_bits: int | None
    v_bits: int | None
    disk_cache: bool

    def disk_location(self) -> Path: ...

    def needs_rebuild(self, other: EngineSettings) -> bool: ...

    def needs_reload(self, other: EngineSettings) -> bool: ...


MB = 1 << 20
SMALLEST_PAGE, LARGEST_PAGE = 16, 1024  # the dialog's page sizes
LONG_PROMPT = 256  # from here on a quarter of the prompt is at least 64 tokens
PROMPT_RECORD_SIZE = 200  # prompt lengths kept: the recent use of this install

BUDGET_TIP = (
    "How many tokens of K/V (the model's memory of what it has read) the engine keeps. "
    "It is one pool shared by all chats, not a context per chat."
)
PAGE_TIP = (
    "The cache is cut into pages of this many tokens. Chats share a cached prompt only in "
    "whole pages, so smaller pages share more of a common prefix; larger pages waste more "
    "of each chat's last, partly filled page and leave fewer pages to manage."
)
KV_BITS_TIP = (
    "How precisely keys (K) and values (V) are stored. Fewer bits hold more tokens in the "
    "same memory and cost some quality: the line below gives the perplexity change "
    "`folio bench kv-quant` measured."
)
HOST_TIP = (
    "Memory for pages pushed out of the cache: a chat that comes back restores them "
    "instead of reading its prompt again. 0: off."
)
BATCH_TIP = "How many replies the engine writes at once; more wait in the queue."
CHUNK_TIP = (
    "Prompt tokens one job reads per step (rounded to whole pages): smaller chunks let "
    "other chats' replies go on between the steps of a long prompt."
)
THREADS_TIP = "CPU threads for the model's arithmetic; automatic: torch's choice."


@dataclass(frozen=True)
class BudgetFigures:
    """The cache a budget buys: whole pages, and their bytes in the chosen formats."""

    pages: int
    page_size: int
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def budget_figures(
    settings: EngineSettings, kv_shape: tuple[int, int, int]
) -> BudgetFigures | None:
    """Pages, tokens and bytes of the cache `settings` build for a model whose K/V are
    ``kv_shape`` = (layers, KV heads, head size), rounded as the engine rounds
    (`PagedKVStorage.from_token_budget` / `from_byte_budget`). None when the model's head
    size cannot use the chosen quantized format."""
    from engine.hub.fit import kv_bytes_per_token

    try:
        per_token = kv_bytes_per_token(*kv_shape, settings.k_bits, settings.v_bits)
    except ValueError:
        return None
    page = settings.page_size
    if settings.budget_unit == "MB":
        pages = settings.budget * MB // (per_token * page)
    else:
        pages = max(1, -(-settings.budget // page))
    return BudgetFigures(pages, page, per_token)


@dataclass(frozen=True)
class Hint:
    """A field's consequence: one line shown under it, the rest in its tooltip."""

    line: str
    detail: str = ""

    @property
    def tooltip(self) -> str:
        return f"{self.line}\n\n{self.detail}" if self.detail else self.line


def budget_hint(
    settings: EngineSettings,
    kv_shape: tuple[int, int, int] | None,
    model_name: str = "",
    context_length: int | None = None,
) -> Hint:
    """The budget in the other unit, and what it means for a chat."""
    shared = "One pool shared by all chats, not a context per chat."
    if kv_shape is None:
        return Hint(f"{shared} Its size in MB depends on the model: load one to see it.")
    figures = budget_figures(settings, kv_shape)
    if figures is None:
        return Hint("This model's head size cannot use a quantized cache: choose full precision.")
    if figures.pages < 1:
        page_bytes = settings.page_size * figures.bytes_per_token
        return Hint(
            f"{settings.budget} MB holds no whole page of {settings.page_size} tokens "
            f"({format_bytes(page_bytes, 'MB', binary=True)} a page): give more."
        )
    per_chat, limit = figures.tokens, ""
    if context_length and context_length < per_chat:
        per_chat, limit = context_length, f" (the model reads at most {context_length:,})"
    line = (
        f"{figures.tokens:,} tokens = {format_bytes(figures.bytes, 'MB', binary=True)}, one pool shared by "
        f"all chats: a chat alone holds up to {per_chat:,} tokens{limit}."
    )
    model = f"for {model_name} " if model_name else ""
    detail = (
        f"{figures.pages:,} pages of {figures.page_size} tokens at "
        f"{figures.bytes_per_token:,} bytes a token {model}(K and V, every layer). {shared} "
        f"A chat's history and its reply are held together; chats answering at once "
        f"share the pool (two at once: about {figures.tokens // 2:,} tokens each), and "
        "pages they share count once."
    )
    return Hint(line, detail)


def kv_format_name(k_bits: int | None, v_bits: int | None) -> str:
    """The name of a K/V format: fp16 or fp32 for unquantized K and V alike, else like
    K8/V4 (16 or 32 for an unquantized one)."""
    from engine.cache.formats import resolved_bits

    k, v = resolved_bits(k_bits), resolved_bits(v_bits)
    if k == v and k in (16, 32):
        return f"fp{k}"
    return f"K{k}/V{v}"


def kv_quality_hint(k_bits: int | None, v_bits: int | None) -> Hint:
    """The measured perplexity change of this K/V format, or the measured ones when this
    combination was not measured."""
    from engine.bench.kv_quant_measured import MEASURED_ON, measured_formats

    measured = measured_formats()
    listing = "; ".join(
        f"{kv_format_name(k, v)} {_percent(r.vs_fp32)}"
        for (k, v), r in sorted(measured.items(), key=lambda kv: kv[1].vs_fp32)
        if (k, v) != (32, 32)
    )
    detail = (
        f"Perplexity against fp32 ({MEASURED_ON}): {listing}. Lower perplexity "
        "means the model predicts text better; other models may differ."
    )
    from engine.cache.formats import resolved_bits

    name = kv_format_name(k_bits, v_bits)
    key = (resolved_bits(k_bits), resolved_bits(v_bits))
    if key == (32, 32):
        return Hint("fp32: the model's own arithmetic, twice fp16's memory.", detail)
    record = measured.get(key)
    if record is None:
        return Hint(f"{name} was not measured; measured: {listing}.", detail)
    share = record.kv_bytes_per_token / record.fp32_bytes_per_token
    return Hint(
        f"{name}: perplexity {_percent(record.vs_fp32)} against fp32, in "
        f"{share:.0%} of its memory (SmolLM2-135M).",
        detail,
    )


def _percent(change: float) -> str:
    value = change * 100
    return f"{value:+.2f}%" if abs(value) < 10 else f"{value:+.0f}%"


# -- page size ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptLengths:
    """The prompt lengths (tokens) of the last `PROMPT_RECORD_SIZE` jobs, oldest first."""

    lengths: tuple[int, ...] = ()

    def add(self, tokens: int) -> PromptLengths:
        if tokens <= 0:
            return self
        return PromptLengths((*self.lengths, int(tokens))[-PROMPT_RECORD_SIZE:])

    @classmethod
    def parse(cls, data: object) -> PromptLengths:
        """A stored list; anything else (an old or hand-edited setting) is no record."""
        if not isinstance(data, list):
            return cls()
        kept = [int(n) for n in data if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        return cls(tuple(kept[-PROMPT_RECORD_SIZE:]))


def suggest_page_size(lengths: Sequence[int]) -> int | None:
    """A page size for prompts of these lengths; None without any.

    A quarter of the average prompt, rounded down to a power of two: the average prompt
    then spans about four pages, so at most about a quarter of it sits in its last,
    partly filled page (which is not shared). For long prompts (256 tokens and more on
    average) that is 2^floor(log2(avg/4)), never under 64. Short prompts follow the same
    rule below 64, down to 16 tokens: a shared prefix shorter than one page is not
    shared at all, and short prompts mostly share short system prompts. Never over 1024.
    """
    if not lengths:
        return None
    average = fmean(lengths)
    size = 2 ** math.floor(math.log2(max(average / 4, 1)))
    if average >= LONG_PROMPT:
        size = max(64, size)
    return min(max(size, SMALLEST_PAGE), LARGEST_PAGE)


def shared_prefix_tokens(
    encode_chat: Callable[[list[dict[str, str]]], list[int]], system_prompt: str
) -> int:
    """Tokens every chat with this system prompt begins with: the template's start and
    the system turn, as the model's tokenizer renders them (`Tokenizer.encode_chat`),
    up to where the first user message begins. The chat sends no system turn for a blank
    prompt (`gui.chat.controller`), and neither does this."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    one = encode_chat([*head, {"role": "user", "content": "A"}])
    two = encode_chat([*head, {"role": "user", "content": "B"}])
    n = 0
    while n < min(len(one), len(two)) and one[n] == two[n]:
        n += 1
    return n


def page_size_hint(
    page_size: int, lengths: Sequence[int], shared_prefix: int | None = None
) -> Hint:
    """The size this install's prompts suggest, and why pages shorter than a shared
    prefix share and longer ones do not: with ``shared_prefix`` (`shared_prefix_tokens`
    of the chat open now) in its own figures."""
    why = (
        "Chats share cached pages only whole: the start they have in common (a system "
        "prompt) is held once up to its last whole page, and the rest of it is copied into "
        "each chat's own page, which saves reading it again but not memory. A common start "
        "shorter than a page shares no page at all. Smaller pages share more of it; larger "
        "ones waste more of each chat's last, partly filled page. Suggested: a quarter of "
        "your average prompt, as a power of two (16 to 1024)."
    )
    share = "Chats share cached prompts only in whole pages."
    if shared_prefix:
        pages, rest = divmod(shared_prefix, page_size)
        same = f"Chats with this system prompt begin with the same {shared_prefix} tokens"
        if pages:
            share = f"{same}: {pages} page{'s' if pages != 1 else ''} of {page_size} shared"
            share += f", {rest} tokens copied to each chat." if rest else "."
        else:
            share = f"{same}, less than one {page_size}-token page: no page shared (copied)."
    suggested = suggest_page_size(lengths)
    if suggested is None:
        return Hint(f"{share} A size is suggested after your first chats.", why)
    n = len(lengths)
    verdict = "the size chosen" if suggested == page_size else f"{suggested} tokens"
    line = (
        f"Your last {n} prompt{'s' if n != 1 else ''} averaged {fmean(lengths):,.0f} tokens: "
        f"suggested {verdict}. {share}"
    )
    return Hint(line, why)


# -- what applying costs -----------------------------------------------------------------


@dataclass(frozen=True)
class LostWork:
    """What a cache rebuild or model reload would throw away."""

    jobs: int = 0  # replies in progress or waiting: they stop
    pages: int = 0  # pages holding prompts and replies that the new cache does not keep
    tokens: int = 0

    @property
    def any(self) -> bool:
        return bool(self.jobs or self.pages)

    def text(self) -> str:
        """One sentence: what is lost, or that nothing is."""
        if not self.any:
            return "Nothing is lost: no reply is running and the cache holds nothing to keep."
        parts = []
        if self.jobs == 1:
            parts.append("1 reply in progress stops")
        elif self.jobs:
            parts.append(f"{self.jobs} replies in progress stop")
        if self.pages:
            parts.append(
                f"{self.pages:,} cached page{'s' if self.pages != 1 else ''} "
                f"({self.tokens:,} tokens) {'are' if self.pages != 1 else 'is'} dropped, so "
                "those chats read their prompts again"
            )
        return " and ".join(parts) + "."


def pages_survive(old: EngineSettings, new: EngineSettings) -> bool:
    """Whether cached pages outlive the rebuild: the old cache writes its full pages to
    the disk tier when it closes, and the new one reads them back only from a store of the
    same format at the same place (`CacheFingerprint`: page size and K/V widths)."""
    return (
        old.disk_cache
        and new.disk_cache
        and old.disk_location() == new.disk_location()
        and (old.page_size, old.k_bits, old.v_bits) == (new.page_size, new.k_bits, new.v_bits)
        and not new.needs_reload(old)
    )


def work_lost(
    snapshot: EngineSnapshot | None, old: EngineSettings, new: EngineSettings
) -> LostWork:
    """What applying `new` over `old` drops, read from the engine's latest snapshot (None:
    no engine, nothing to lose). Nothing when neither a rebuild nor a reload is needed."""
    from engine.cache.page import PageState

    if snapshot is None or not (new.needs_rebuild(old) or new.needs_reload(old)):
        return LostWork()
    pages = tokens = 0
    if not pages_survive(old, new):
        cache = snapshot.cache
        held = cache.state != PageState.FREE
        pages = int(held.sum())
        tokens = int(cache.fill[held].sum())
    return LostWork(len(snapshot.jobs), pages, tokens)
