"""The streaming decoder: token ids in, finished text pieces out, as generation produces them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces.

    ``feed(ids)`` returns the text completed by these ids. Text whose decode ends in U+FFFD (an
    incomplete UTF-8 sequence, e.g. the first byte token of an emoji) is held back until the next
    ids complete it; ``flush()`` returns whatever is still held at the end of the stream.

    Works like text-generation-inference's decoder: the new text is the decode of a short window
    of recent ids minus the decode of the window's already-emitted prefix, so decoders that strip
    or merge across tokens (SentencePiece's leading space, byte-level BPE) stay exact.
    """

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = False):
        # a Folio Tokenizer decodes through its tokenizers.Tokenizer: call that one directly
        self._backend: _Decodes = getattr(tokenizer, "backend", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # ids before this have been emitted
        self.text = ""  # everything emitted so far

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add token id(s); return the newly completed text ("" while a character is incomplete)."""
        if isinstance(ids, int):
            self.ids.append(ids)
        else:
            self.ids.extend(ids)
        if len(self.ids) == self._read_offset:
            return ""
        delta = self._window_delta()
        if not delta or delta.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    __call__ = feed

    def flush(self) -> str:
        """The held-back text at the end of the stream (may contain U+FFFD for truly invalid bytes)."""
        if self._read_offset == len(self.ids):
            return ""
        delta = self._window_delta()
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def reset(self) -> None:
        self.ids.clear()
        self._prefix_offset = self._read_offset = 0
        self.text = ""

    def _window_delta(self) -> str:
        """The decode of the window past what the decode of its emitted prefix already gave."""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
