"""Special tokens shared by every tokenizer source: the BOS/EOS post-processor and the ids that end
generation."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

# Token texts that end a turn, as llama.cpp's end-of-generation detection lists them (llama-vocab.cpp).
# They count as EOS ids when present in the vocabulary as control / added tokens.
EOG_TOKEN_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    )
)


def eos_ids(primary: Iterable[int | None], candidates: Iterable[tuple[str, int]]) -> list[int]:
    """Primary EOS ids first (in order), then the candidates ``(text, id)`` whose text ends a turn,
    ascending."""
    ids: list[int] = []
    for token_id in primary:
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    ids.extend(sorted({i for text, i in candidates if text in EOG_TOKEN_TEXTS and i not in ids}))
    return ids


def finish_backend(backend: tokenizers.Tokenizer, config: dict) -> None:
    """Add missing named special tokens and set the BOS/EOS post-processor, as transformers'
    ``TokenizersBackend.__init__`` does on top of its converter."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [
        config[name]
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if config.get(name) is not None and config[name] not in added
    ]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(missing)])
    if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
        backend.post_processor = _bos_eos_processor(backend, config)


def _bos_eos_processor(
    backend: tokenizers.Tokenizer, config: dict
) -> processors.TemplateProcessing:
    """transformers' ``TokenizersBackend.update_post_processor``."""
    bos, eos = config.get("bos_token"), config.get("eos_token")
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special_tokens = []
    if add_bos:
        special_tokens.append((bos, backend.token_to_id(bos)))
    if add_eos:
        special_tokens.append((eos, backend.token_to_id(eos)))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


# ---- special-token text inside chat messages ---------------------------------------------------
#
# A tokenizer parses special-token text wherever it appears, so a user who types `<|im_start|>`
# in a message would get the real control token and could forge a system turn. Folio encodes
# such text inside messages as plain text: each occurrence is swapped for a marker character
# before the template renders (so templates that test or transform the content still work on a
# string), and after it the control tokens the template wrote are the only special tokens left.
# Between two of them, text with a marker is encoded as plain text with the typed text put back,
# text without one exactly as the tokenizer encodes it.

# Markers come from Unicode's plane 16, private use: no template writes them and no tokenizer
# gives them meaning; any a message already contains are skipped.
_MARKERS_START = 0x100000
_MARKERS_END = 0x10FFFE
_MARKER_CHARS = re.compile("[\U00100000-\U0010fffd]")
# An added token of the plain copy only: text encoded after it is not at the start of the
# input, as text after a control token is not (SentencePiece's "first" prefix space).
_AFTER_CONTROL = "\U000f0000\U000f0001"


class SpecialTextMarker:
    """Typed special-token text in chat messages: found and marked before the template
    renders (`mark`), encoded as plain text after it (`encode`)."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self._backend = backend
        self.special_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )
        specials = [backend.id_to_token(i) or "" for i in self.special_ids]
        # a text can only hold a special token if it holds the token's first character
        self._first_chars = frozenset(text[0] for text in specials if text)
        self._plain: tokenizers.Tokenizer | None = None  # made on first need

    def mark(self, messages: Sequence[Any]) -> tuple[list[Any], dict[str, str]]:
        """``messages`` with the special-token text in their strings replaced by markers, and
        marker -> the text it replaced. Messages without any come back as they were."""
        strings = [s for m in messages for s in _strings(m)]
        spans = {s: self._special_spans(s) for s in strings if self._may_hold_special(s)}
        spans = {s: found for s, found in spans.items() if found}
        if not spans:
            return list(messages), {}
        taken = {c for s in strings for c in _MARKER_CHARS.findall(s)}
        free = (chr(c) for c in range(_MARKERS_START, _MARKERS_END) if chr(c) not in taken)
        marker_of: dict[str, str] = {}

        def marked(text: str) -> str:
            found = spans.get(text)
            if not found:
                return text
            out, at = [], 0
            for start, end in found:
                special = text[start:end]
                if special not in marker_of:
                    marker_of[special] = next(free)
                out += [text[at:start], marker_of[special]]
                at = end
            return "".join([*out, text[at:]])

        return [_map_strings(m, marked) for m in messages], {m: t for t, m in marker_of.items()}

    def encode(self, text: str, markers: Mapping[str, str], add_special_tokens: bool) -> list[int]:
        """Token ids of the rendered ``text`` whose ``markers`` stand for typed special text."""
        restore = str.maketrans(dict(markers))
        if add_special_tokens:  # no template: every special-token text in it was typed
            return self._plain_ids(text.translate(restore), add_special_tokens=True)
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids, out = encoding.ids, []
        token_start = char_start = 0

        def run(end_char: int, end_token: int) -> list[int]:
            piece = text[char_start:end_char]
            if not any(marker in piece for marker in markers):
                return ids[token_start:end_token]
            return self._plain_ids(piece.translate(restore), after_control=char_start > 0)

        for index, (token, (start, end)) in enumerate(zip(ids, encoding.offsets, strict=True)):
            if token in self.special_ids:  # the template's: the typed ones are markers now
                out += [*run(start, index), token]
                token_start, char_start = index + 1, end
        return out + run(len(text), len(ids))

    def _plain_ids(
        self, text: str, after_control: bool = False, add_special_tokens: bool = False
    ) -> list[int]:
        if self._plain is None:
            plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            plain.add_tokens([AddedToken(_AFTER_CONTROL, normalized=False, special=False)])
            self._plain = plain
        if not after_control or _AFTER_CONTROL in text:
            return self._plain.encode(text, add_special_tokens=add_special_tokens).ids
        return self._plain.encode(_AFTER_CONTROL + text, add_special_tokens=False).ids[1:]

    def _may_hold_special(self, text: str) -> bool:
        if not any(c in text for c in self._first_chars):
            return False
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # not text: the chat template refuses it, naming the message
            return False
        return True

    def _special_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the special tokens the tokenizer finds in ``text``."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        return [
            span
            for token, span in zip(encoding.ids, encoding.offsets, strict=True)
            if token in self.special_ids
        ]


def _strings(value: Any, depth: int = 0):
    """Every string value inside a message (not the keys: templates look fields up by name)."""
    if isinstance(value, str):
        yield value
    elif depth < 8 and isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item, depth + 1)
    elif depth < 8 and isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item, depth + 1)


def _map_strings(value: Any, change, depth: int = 0) -> Any:
    if isinstance(value, str):
        return change(value)
    if depth < 8 and isinstance(value, Mapping):
        return {k: _map_strings(v, change, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, list | tuple):
        return type(value)(_map_strings(v, change, depth + 1) for v in value)
    return value
