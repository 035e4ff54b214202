"""What the prefix tree says in words: a page's text as a reader would write it, a
node's state, and why prompts that begin alike can share no page.

A page's tokens include the chat template's (``<|im_start|>``, ``<start_of_turn>``,
``<|eot_id|>``, the role header after each); they tell a reader nothing and crowd out the
words, so `readable_text` leaves them out, knowing them from the tokenizer's own list
of special tokens rather than from a list of templates. Qt-free, like the tree's model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.cache.page import PageState

MIN_PAGE_SIZE = 16  # the smallest page the settings offer (`CacheSettings`)

# A decoder that did not leave special tokens out shows them as text: the common
# "<|...|>" spelling is recognised as a marker too.
_MARKER = re.compile(r"<\|[^|>\s]{1,40}\|>")
# A role header: one lower-case word right after a marker, ending its line (ChatML,
# Gemma) or followed by the next marker (Llama 3's <|start_header_id|>user<|end_header_id|>).
_ROLE = re.compile(r"([a-z][a-z_-]{1,15})[ \t]*(?:\r?\n|$)")
_BLANK_LINES = re.compile(r"\s*\n\s*")


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids the tokenizer marks special (template markers, BOS, EOS): from a
    `tokenizers` backend's added tokens, or a transformers tokenizer's list."""
    ids: set[int] = set()
    added = getattr(getattr(tokenizer, "backend", None), "get_added_tokens_decoder", None)
    if callable(added):
        ids.update(i for i, token in added().items() if getattr(token, "special", False))
    ids.update(getattr(tokenizer, "all_special_ids", None) or ())
    ids.update(getattr(tokenizer, "eos_token_ids", None) or ())
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        ids.add(bos)
    return frozenset(int(i) for i in ids)


@dataclass(frozen=True)
class Readable:
    text: str  # turns on lines of their own, template tokens and role headers left out
    roles: tuple[str, ...]  # the role headers it held, in order ("system", "user")
    closes_turn: bool  # a marker follows text that is not a role header: a turn ended
    starts_turn: bool = False  # its first words come right after a marker


def readable_text(
    decode: Callable[[list[int]], str],
    ids: Sequence[int],
    special: frozenset[int],
    after_marker: bool = False,
) -> Readable:
    """``ids`` decoded without the chat template: each run of ordinary tokens decoded
    alone, a role header dropped (and noted) where a marker came just before it.
    ``after_marker``: the page before ended on a special token."""
    # (ids, right after a marker, right before one)
    segments: list[tuple[list[int], bool, bool]] = []
    start, after = 0, after_marker
    for i, token in enumerate(ids):
        if token in special:
            if i > start:
                segments.append((list(ids[start:i]), after, True))
            start, after = i + 1, True
    if start < len(ids):
        segments.append((list(ids[start:]), after, False))
    pieces: list[str] = []
    roles: list[str] = []
    closes = False
    starts: bool | None = None
    for seg, after, before in segments:
        try:
            text = decode(seg)
        except Exception:  # noqa: BLE001 - a label must never break drawing
            continue
        parts = _MARKER.split(text)
        for j, part in enumerate(parts):
            if after or j:
                role = _ROLE.match(part)
                if role is not None:
                    roles.append(role.group(1))
                    part = part[role.end() :]
            if part.strip():
                closes = closes or before or j < len(parts) - 1
                if starts is None:
                    starts = bool(after or j)
            pieces.append(part)
            pieces.append("\n")
    text = _BLANK_LINES.sub("\n", "".join(pieces)).strip()
    return Readable(text, tuple(roles), closes, bool(starts))


def one_line(text: str) -> str:
    """A label's text: every run of spaces and line breaks one space."""
    return " ".join(text.split())


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def state_in_words(
    state: int, chats: int, evict_next: bool, fill: int, page_size: int, after: int
) -> str:
    """A node's state as its tooltip says it. ``chats``: chats holding it; ``after``:
    the pages that continue it in the tree (tail-first eviction reuses those first)."""
    if state == PageState.REFERENCED:
        words = f"in use by {plural(chats, 'chat')}" if chats else "in use"
        if 0 < fill < page_size:
            words += f", being written ({fill} of {page_size} tokens)"
        return words
    if state == PageState.HOST:
        return "in host memory only: copied back to the GPU when a prompt needs it"
    if state == PageState.DISK:
        return "on disk only: read back when a prompt needs it"
    if evict_next:
        return "cached, reclaimable: evicted next when a new page is needed"
    if after:
        rest = "the page after it is" if after == 1 else f"the {after} pages after it are"
        return f"cached, reclaimable; kept because it is the head of a chain: {rest} reused first"
    return "cached, reclaimable: a prompt that begins the same way reuses it"


@dataclass(frozen=True)
class ShortPrefix:
    """Prompts that begin with the same tokens, fewer than a page: each first page holds
    that start plus its own continuation, so the pages differ and none is shared."""

    prompts: int
    tokens: int
    page_size: int
    roles: tuple[str, ...]

    def explain(self, brief: bool = False) -> str:
        """Why it is not shared and what would share it (``brief``: only why)."""
        what = "system prompt" if self.roles[:1] == ("system",) else "start of the prompts"
        text = (
            f"the shared {what} ({self.tokens} tokens) is shorter than one "
            f"{self.page_size}-token page, so it is not shared"
        )
        if brief:
            return text
        text += "; "
        if self.tokens < MIN_PAGE_SIZE:
            return text + f"even the smallest page ({MIN_PAGE_SIZE} tokens) is longer."
        smaller = 2 ** int(math.log2(self.tokens))
        if smaller == self.tokens:
            return text + f"{smaller}-token pages would share it."
        return text + f"{smaller}-token pages would share {smaller} of its tokens."
