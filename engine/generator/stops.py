"""Per-sequence stop handling: when a generated sequence ends, and which text is safe to emit.

One ``StopHandler`` per sequence. The generator feeds it each sampled token id and emits the
``StopStep`` it returns; when ``step.finished`` is set the sequence is over.

Conditions (docs/ENGINE.md §7), checked for every token in this order:

1. Stop token: the id is in ``stop_token_ids``. It ends the sequence, is kept in ``token_ids``
   and adds no text.
2. Stop string: the text so far contains one of ``stop_strings``. The text before the earliest
   match is emitted, the match and everything after it are dropped. Matches are found across
   token boundaries and in the middle of a token's text. The sequence ends on the first token
   that completes any stop string; "earliest" chooses among the matches complete at that point,
   so with stop strings "bcd" and "c", text arriving as "b", "c" stops at "c" (output "b") and
   does not wait to see whether "bcd" would have completed.
3. ``max_new_tokens``: exactly that many tokens are accepted; the last one's text is emitted.

Stop strings come before ``max_new_tokens`` (docs/ENGINE.md §7 lists them in this order): when the last
allowed token completes a stop string the text is cut at the match, and the reason has to say
so -- "max_new_tokens" would claim the text is the decode of every token. (vLLM orders them the
same way.) A stop token on the last allowed step wins over ``max_new_tokens``, as §7 says.

Held text. Text that could be the start of a stop string (a suffix of the output that is a
proper prefix of some stop string) is held back until the next tokens decide it: it is dropped
if they complete the stop string and released as soon as they diverge. Bytes of an incomplete
UTF-8 character are held by the tokenizer's incremental decoder until the character is whole.
The decoder holds a token's whole text while it ends inside a character, so a stop string in
the complete characters before it is seen one token later (with several stop strings, a longer
one that started earlier and is complete by then wins, as the earliest match).

Ending without a stop string (stop token, ``max_new_tokens``, or ``finish()`` for cancel or
error) releases everything held: the held text (it never became a stop string) and any dangling
bytes, which decode to U+FFFD as ``Tokenizer.decode`` would give them. So in every case

    handler.text == cut(tokenizer.decode(ids without a final stop token))

where ``cut`` truncates at the earliest stop-string match, if any.

Cost. The handler runs on the engine thread for every sequence of every job, so its work per
token must not grow with what a caller asks for: the stop strings are one Aho-Corasick automaton
(``StopAutomaton``, built once per distinct list and shared), fed each new character once, so a
token costs the same whether there is one stop string or ``MAX_STOP_STRINGS``. The limits on the
list (checked at submit, ``JobRequest.validate``) bound the automaton's size and the held text.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Protocol

__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "StopAutomaton",
    "StopHandler",
    "StopReason",
    "StopStep",
]

# A request's stop strings, at most: far more than any chat format needs, few enough that the
# automaton (at most MAX_STOP_STRINGS * MAX_STOP_STRING_CHARS states) builds in milliseconds.
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 128


class StopReason(StrEnum):
    """Why a sequence ended (the ``eos_reason`` of its last event)."""

    STOP_TOKEN = "stop_token"
    MAX_NEW_TOKENS = "max_new_tokens"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class StopStep:
    """What one fed token (or ``finish()``) produced.

    ``text``: text that is final and safe to emit now (may be "" while text is held);
    ``token_ids``: the ids accepted this step (the fed id, or none for ``finish()``);
    ``finished``: the reason the sequence ended on this step, or None while it goes on.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    finished: StopReason | None = None


class _IncrementalDecoder(Protocol):
    def feed(self, ids: int | Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class _Tokenizer(Protocol):
    def incremental_decoder(self) -> _IncrementalDecoder: ...


class StopHandler:
    """Stop conditions and held-back text for one generated sequence.

    ``text``: everything emitted so far; ``token_ids``: every accepted id (a final stop token
    included); ``held``: text held back because it may start a stop string (bytes of an
    incomplete character are not text yet and are not in it); ``finished``: the reason, once
    the sequence has ended. Feeding a finished handler raises ``RuntimeError``.
    """

    def __init__(
        self,
        tokenizer: _Tokenizer,
        stop_token_ids: Iterable[int],
        stop_strings: Sequence[str] = (),
        *,
        max_new_tokens: int,
    ):
        if isinstance(stop_strings, str):
            raise TypeError(
                f"stop_strings must be a sequence of strings, not the string {stop_strings!r}"
            )
        stop_strings = tuple(stop_strings)
        for stop in stop_strings:
            if not isinstance(stop, str):
                raise TypeError(f"stop strings must be str, got {stop!r}")
            if not stop:
                raise ValueError("stop strings must not be empty: '' would match before any text")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(stop_strings))
        self.max_new_tokens = max_new_tokens
        self._automaton = StopAutomaton.for_stops(self.stop_strings)
        self._state = 0  # the automaton's state after all the text so far
        self._decoder = tokenizer.incremental_decoder()
        self.text = ""
        self.token_ids: list[int] = []
        self.held = ""
        self.finished: StopReason | None = None

    def feed(self, token_id: int) -> StopStep:
        """Accept one sampled token; return the text it makes safe and whether the sequence ended."""
        self._check_running()
        self.token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            return self._end([token_id], self._decoder.flush(), StopReason.STOP_TOKEN)
        if len(self.token_ids) >= self.max_new_tokens:
            # the last allowed token: its text and everything held is released (unless cut)
            new_text = self._decoder.feed(token_id) + self._decoder.flush()
            return self._end([token_id], new_text, StopReason.MAX_NEW_TOKENS)
        cut = self._hold(self._decoder.feed(token_id))
        if cut is not None:
            return self._stop_at(cut, [token_id])
        keep = self._automaton.depth[self._state]
        return self._emit(self._take(len(self.held) - keep), [token_id], None)

    def finish(self, reason: StopReason | str) -> StopStep:
        """End the sequence from outside (``CANCELLED``, ``ERROR``): release everything held.

        Held text is emitted because it did not become a stop string, and dangling bytes decode
        to U+FFFD, so ``text`` stays the decode of the accepted tokens (see the module doc).
        """
        self._check_running()
        return self._end([], self._decoder.flush(), StopReason(reason))

    # ---- steps ------------------------------------------------------------------------------------

    def _end(self, token_ids: list[int], new_text: str, reason: StopReason) -> StopStep:
        """Finish with ``reason`` unless the released text completes a stop string first."""
        cut = self._hold(new_text)
        # Only dangling bytes flushed as U+FFFD can complete a stop string here. The text is cut
        # all the same; a stop token keeps its reason because it comes first in §7.
        if cut is not None and reason is not StopReason.STOP_TOKEN:
            return self._stop_at(cut, token_ids)
        return self._emit(self._take(len(self.held) if cut is None else cut), token_ids, reason)

    def _stop_at(self, cut: int, token_ids: list[int]) -> StopStep:
        return self._emit(self._take(cut), token_ids, StopReason.STOP_STRING)

    def _emit(self, text: str, token_ids: list[int], finished: StopReason | None) -> StopStep:
        self.text += text
        if finished is not None:
            self.held = ""  # whatever is left lies at or after a stop string
            self.finished = finished
        return StopStep(text, token_ids, finished)

    def _take(self, n: int) -> str:
        """Remove and return the first ``n`` characters of the held text."""
        taken, self.held = self.held[:n], self.held[n:]
        return taken

    def _check_running(self) -> None:
        if self.finished is not None:
            raise RuntimeError(f"the sequence has already finished ({self.finished})")

    # ---- stop-string search -----------------------------------------------------------------------

    def _hold(self, text: str) -> int | None:
        """Append ``text`` to the held text; return the start of the earliest stop-string match
        in the held text, or None.

        The held text is always the automaton state's string (the longest suffix of the output
        that starts a stop string), so any match starts inside it: positions in the held text
        are the automaton's positions."""
        offset = len(self.held)
        self.held += text
        self._state, cut = self._automaton.advance(self._state, text, offset)
        return cut


class StopAutomaton:
    """Aho-Corasick automaton over a list of stop strings.

    State 0 is the empty string; every other state is a prefix of some stop string. After
    feeding a text the state is its longest suffix that is such a prefix (``depth`` is that
    suffix's length, so the text a handler must hold back). ``fail[s]`` is the state of the
    longest proper suffix of ``s``; ``longest[s]`` the length of the longest stop string that
    ends the text at ``s`` (0: none). Each character costs one transition plus fail steps, and
    fail steps never outnumber the characters fed (each one shortens the suffix by at least
    one character, each character lengthens it by at most one): the work per token does not
    depend on how many stop strings there are.
    """

    def __init__(self, stops: Sequence[str]):
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.longest = [0]
        for stop in stops:
            state = 0
            for char in stop:
                nxt = self.children[state].get(char)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[state][char] = nxt
                    self.children.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.longest.append(0)
                state = nxt
            self.longest[state] = len(stop)
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.fail = [0] * len(self.children)
        queue = deque(self.children[0].values())
        while queue:  # breadth first: a state's fail link is shallower, so already final
            state = queue.popleft()
            for char, child in self.children[state].items():
                queue.append(child)
                if state:
                    self.fail[child] = self._next(self.fail[state], char)
                self.longest[child] = self.longest[child] or self.longest[self.fail[child]]

    @staticmethod
    @lru_cache(maxsize=64)
    def for_stops(stops: tuple[str, ...]) -> StopAutomaton:
        """The automaton of ``stops``, shared by every sequence (and job) with the same list."""
        return StopAutomaton(stops)

    def _next(self, state: int, char: str) -> int:
        while True:
            nxt = self.children[state].get(char)
            if nxt is not None:
                return nxt
            if not state:
                return 0
            state = self.fail[state]

    def advance(self, state: int, text: str, offset: int = 0) -> tuple[int, int | None]:
        """Feed ``text`` from ``state``; return the new state and the start of the earliest
        stop-string match ending in ``text`` (counted from ``offset`` characters before the
        text's first character), or None. After a match the state is no longer meaningful."""
        earliest = None
        for i, char in enumerate(text, offset + 1):
            state = self._next(state, char)
            length = self.longest[state]
            if length and (earliest is None or i - length < earliest):
                earliest = i - length
            if earliest is not None and i - self.longest_stop >= earliest:
                break  # a match ending later cannot start earlier
        return state, earliest
