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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

__all__ = ["StopHandler", "StopReason", "StopStep"]


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
        self.held += self._decoder.feed(token_id)
        cut = self._earliest_match()
        if cut is not None:
            return self._stop_at(cut, [token_id])
        keep = self._stop_prefix_len()
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
        self.held += new_text
        cut = self._earliest_match()
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

    def _earliest_match(self) -> int | None:
        """Start of the earliest stop-string match in the held text, or None.

        Searching only the held text is enough: any match's start was a stop-string prefix at
        the end of the output when it was produced, so it was held."""
        starts = [i for stop in self.stop_strings if (i := self.held.find(stop)) >= 0]
        return min(starts, default=None)

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of a stop string."""
        held = self.held
        best = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(held)), best, -1):
                if held.endswith(stop[:n]):
                    best = n
                    break
        return best
