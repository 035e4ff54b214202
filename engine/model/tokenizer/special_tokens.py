"""Special tokens shared by every tokenizer source: the BOS/EOS post-processor and the ids that end
generation."""

from __future__ import annotations

from collections.abc import Iterable

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
