"""Folio's tokenizer: a thin, fast wrapper around a Hugging Face `tokenizers.Tokenizer`.

Two sources are supported:

* ``Tokenizer.from_gguf(path)`` builds the tokenizer a GGUF file describes in its ``tokenizer.*``
  metadata (vocabulary, merges or scores, token types, special ids, add-BOS/EOS flags, pre-tokenizer
  by ``tokenizer.ggml.pre``) and caches the result on disk.
* ``Tokenizer.from_folder(folder)`` loads a Hugging Face folder: ``tokenizer.json`` plus
  ``tokenizer_config.json`` (and ``chat_template.jinja`` / ``chat_template.json``,
  ``generation_config.json``, ``config.json`` when present).

Speed
-----
``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)`` takes 5-20 s per load. Folio
builds the tokenizer once -- with transformers' own GGUF converter when it is importable (the
reference, so results match transformers exactly), otherwise with the small built-in port of it
below -- and caches it as ``tokenizer.json`` + ``folio_tokenizer.json`` under
``cache_dir/<stem>-<key>/``. The key hashes the model file's size, mtime_ns and first MiB, so a
changed file gets a fresh entry. A cached load reads two files and calls
``tokenizers.Tokenizer.from_file``; it never imports transformers (nor jinja2, until a chat
template is rendered). The remaining cost is the Rust-side construction of the BPE model, which
grows with the vocabulary: ~0.1 s for a 49k vocabulary, ~1 s for Gemma's 262k one on a slow CPU.

Encoding a chat
---------------
``render_chat`` renders the chat template exactly as transformers' ``apply_chat_template`` does
(same sandboxed Jinja environment and helpers, with ``bos_token``/``eos_token``/``unk_token``/
``pad_token`` as template variables), and ``encode_chat`` encodes that text with
``add_special_tokens=False`` -- what ``apply_chat_template(tokenize=True)`` does -- so a template
that writes ``{{ bos_token }}`` never gets a second BOS.

A model without a template (e.g. a base GGUF) has ``has_chat_template == False``. ``render_chat``
then falls back to the message contents joined with ``"\\n"`` (no roles, no generation prompt), and
``encode_chat`` encodes that with ``add_special_tokens=True``, so the model's BOS is still added.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from engine import paths

__all__ = [
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerError",
    "read_gguf_tokenizer_metadata",
]

logger = logging.getLogger(__name__)

#: Bump when the cached files' content or layout changes; old entries are then ignored.
CACHE_FORMAT_VERSION = 1
_CACHE_META_FILE = "folio_tokenizer.json"
_CACHE_TOKENIZER_FILE = "tokenizer.json"
_KEY_HEAD_BYTES = 1 << 20

# Token texts that end a turn, as llama.cpp's end-of-generation detection lists them (llama-vocab.cpp).
# They count as EOS ids when present in the vocabulary as control / added tokens.
_EOG_TOKEN_TEXTS = (
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

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class TokenizerError(ValueError):
    """The tokenizer cannot be built from the given file or folder."""


# --------------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------------

def _wanted_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.architecture"


def read_gguf_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``tokenizer.*`` keys and ``general.architecture`` of a GGUF file, as plain Python values
    (through Folio's fast header reader: ``gguf.GGUFReader`` takes seconds on a 262k vocabulary)."""
    from engine.model.gguf_file import GGUFError, GGUFFile

    try:
        gf = GGUFFile(path)
    except GGUFError as exc:
        raise TokenizerError(str(exc)) from exc
    try:
        return {key: _plain(value) for key, value in gf.metadata.items() if _wanted_key(key)}
    finally:
        gf.close()


def _plain(value: Any) -> Any:
    """Caller-supplied metadata values (numpy arrays, bytes, gguf field objects...) as plain Python."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _file_cache_key(path: Path) -> str:
    """Hash of the cache format, the file's size and mtime_ns, and its first MiB."""
    st = path.stat()
    digest = hashlib.sha256()
    digest.update(
        f"folio-tokenizer-v{CACHE_FORMAT_VERSION}|{st.st_size}|{st.st_mtime_ns}|".encode()
    )
    with open(path, "rb") as handle:
        digest.update(handle.read(_KEY_HEAD_BYTES))
    return digest.hexdigest()[:24]


# --------------------------------------------------------------------------------------------------
# GGUF -> tokenizers conversion (slow path, result cached)
# --------------------------------------------------------------------------------------------------

# transformers' GGUF_TOKENIZER_MAPPING["tokenizer"]: GGUF key suffix -> tokenizer_dict key
_GGUF_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}


def _gguf_tokenizer_dict(meta: Mapping[str, Any], path: Path) -> tuple[str, dict, dict]:
    """``(architecture, tokenizer_dict, config)`` in the shape transformers' converter expects.

    Mirrors ``transformers.integrations.gguf.get_gguf_tokenizer``.
    """
    tokenizer_type = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokenizer_type is None or not tokens:
        raise TokenizerError(
            f"{path.name}: the GGUF file has no tokenizer metadata "
            "(tokenizer.ggml.model / tokenizer.ggml.tokens missing); cannot build a tokenizer"
        )
    architecture = meta.get("general.architecture") or ""
    tokenizer_dict = {
        name: _plain(meta[f"tokenizer.{key}"])
        for key, name in _GGUF_TOKENIZER_KEYS.items()
        if f"tokenizer.{key}" in meta
    }
    config: dict[str, Any] = {}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = bool(meta[f"tokenizer.ggml.{key}"])
    if tokenizer_type == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        # transformers follows the reference tokenizer here: the template writes <bos> itself
        config["add_bos_token"] = False
    tokens = tokenizer_dict["tokens"]
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unk_token_id"),
        ("pad", "pad_token_id"),
    ):
        token_id = tokenizer_dict.get(key)
        config[f"{name}_token"] = (
            tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
        )
    return architecture, tokenizer_dict, config


def _convert_gguf_tokenizer(
    architecture: str, tokenizer_dict: dict, path: Path
) -> tuple[tokenizers.Tokenizer, str]:
    """The backend tokenizer (before the BOS/EOS post-processor) and the converter's name.

    Uses transformers' own converter when its (v5) API is importable, else the built-in port.
    """
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except Exception:  # not installed, or another major version with another private API
        convert_gguf_tokenizer = None
    if convert_gguf_tokenizer is not None:
        import transformers

        try:
            backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
        except ValueError as exc:
            raise TokenizerError(f"{path.name}: cannot build its tokenizer: {exc}") from exc
        return backend, f"transformers {transformers.__version__}"
    return _builtin_convert(architecture, tokenizer_dict, path), "folio-builtin"


# ---- built-in port of transformers' gguf_tokenizer_mapping (used when transformers is unavailable)


def _bytes_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def _generate_merges(
    vocab: dict[str, int], vocab_scores: dict[str, float] | None
) -> list[tuple[str, str]]:
    """transformers' ``generate_merges``: every split of a token into two tokens, best first."""
    reverse = vocab_scores is not None
    scores = dict(vocab_scores) if reverse else vocab
    merges = []
    for merge, piece_score in scores.items():
        local = []
        for index in range(1, len(merge)):
            left, right = merge[:index], merge[index:]
            if left in vocab and right in vocab:
                local.append((left, right, piece_score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda val: (val[2], len(val[0]), len(val[1])), reverse=reverse)
    return [(a, b) for a, b, _ in merges]


def _merges_of(
    tokenizer_dict: dict, vocab_scores: dict[str, float] | None = None
) -> list[tuple[str, str]]:
    if "merges" in tokenizer_dict:
        return [tuple(m.split(" ")) for m in tokenizer_dict["merges"]]
    tokens = tokenizer_dict["tokens"]
    if vocab_scores is None:
        vocab_scores = dict(zip(tokens, tokenizer_dict["scores"], strict=False))
    return _generate_merges({t: i for i, t in enumerate(tokens)}, vocab_scores)


def _gemma_backend(tokens: list[str], merges: list[tuple[str, str]]) -> tokenizers.Tokenizer:
    """transformers' ``GemmaTokenizer(vocab=..., merges=...)`` backend."""
    from tokenizers import decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    tk = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            unk_token="<unk>",
            dropout=None,
            byte_fallback=True,
        )
    )
    tk.pre_tokenizer = pre_tokenizers.Split(
        pattern=" ", behavior="merged_with_previous", invert=False
    )
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    return tk


def _spm_backend(tokenizer_dict: dict, style: str) -> tokenizers.Tokenizer:
    """A sentencepiece (``tokenizer.ggml.model == "llama"``) vocabulary as a byte-fallback BPE.

    ``style``: "gemma" (Gemma 1-3 GGUFs: space-only tokens respelled with U+2581 and merges ordered
    by file position), "phi3" (prefix space from a normalizer) or "llama" (``LlamaTokenizer``).
    """
    from tokenizers import decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if style == "gemma":
        tokens = [
            "\u2581" * len(t) if " " in t and not t.strip() else t for t in tokenizer_dict["tokens"]
        ]
        positions = {t: -i for i, t in enumerate(tokens)}
        return _gemma_backend(tokens, _merges_of(dict(tokenizer_dict, tokens=tokens), positions))
    vocab = {t: i for i, t in enumerate(tokenizer_dict["tokens"])}
    tk = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges_of(tokenizer_dict),
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    if style == "phi3":
        tk.normalizer = normalizers.Sequence(
            [
                normalizers.Prepend(prepend="\u2581"),
                normalizers.Replace(pattern=" ", content="\u2581"),
            ]
        )
        tk.pre_tokenizer = None
    else:
        tk.normalizer = None
        tk.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False
        )
    return tk


def _byte_level_backend(tokenizer_dict: dict) -> tokenizers.Tokenizer:
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token
        if set(token) <= alphabet
        else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokenizer_dict["tokens"])
    }
    tk = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges_of(tokenizer_dict),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return tk


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN35_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex (transformers' GGUF_PRE_TOKENIZER_SPLITS); others keep GPT-2's regex
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

_SPM_STYLE_BY_ARCH = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}


def _builtin_convert(architecture: str, tokenizer_dict: dict, path: Path) -> tokenizers.Tokenizer:
    from tokenizers import Regex, pre_tokenizers

    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "gpt2":
        tk = _byte_level_backend(tokenizer_dict)
    elif tokenizer_type == "llama":
        tk = _spm_backend(tokenizer_dict, _SPM_STYLE_BY_ARCH.get(architecture, "llama"))
    elif tokenizer_type == "gemma4":  # GemmaTokenizer, without the Gemma 1-3 respelling
        tk = _gemma_backend(tokenizer_dict["tokens"], _merges_of(tokenizer_dict))
    else:
        raise TokenizerError(
            f"{path.name}: unsupported tokenizer.ggml.model {tokenizer_type!r} "
            "(the built-in converter handles 'gpt2', 'llama' and 'gemma4'; install transformers for more)"
        )

    # control tokens -> special added tokens; user-defined ones -> plain added tokens
    byte_level = tokenizer_type == "gpt2"
    spelled = set(_bytes_to_unicode().values()) if byte_level else None
    token_types = tokenizer_dict.get("token_type") or ()
    tokens = tokenizer_dict["tokens"]
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == _TOKEN_TYPE_CONTROL and (spelled is None or set(token) <= spelled)
    ]
    if control:
        tk.add_special_tokens(control)
    vocab = tk.get_vocab(with_added_tokens=True)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        tk.add_tokens(user_defined)

    split = _PRE_TOKENIZER_SPLITS.get(tokenizer_dict.get("pre_tokenizer_type"))
    if split is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return tk


# ---- what transformers' TokenizersBackend.__init__ does on top of the converter


def _finish_backend(backend: tokenizers.Tokenizer, config: dict) -> None:
    """Add missing named special tokens and set the BOS/EOS post-processor, like transformers does."""
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


def _eos_ids(primary: Iterable[int | None], candidates: Iterable[tuple[str, int]]) -> list[int]:
    """Primary EOS ids first (in order), then the end-of-turn tokens found by text, ascending."""
    ids: list[int] = []
    for token_id in primary:
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    eog_texts = set(_EOG_TOKEN_TEXTS)
    ids.extend(sorted({i for text, i in candidates if text in eog_texts and i not in ids}))
    return ids


# --------------------------------------------------------------------------------------------------
# Chat templates (same environment as transformers' chat_template_utils)
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _jinja_env():
    import json as _json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' masks; render it as-is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return _json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@lru_cache(maxsize=16)
def _compile_template(template: str):
    return _jinja_env().from_string(template)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Drop None values and alias reasoning fields, like transformers does before rendering."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return "" if content is None else str(content)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode/decode text and chats for one model. Build with ``from_gguf`` or ``from_folder``.

    ``eos_token_ids`` lists every id that ends generation: the declared EOS first (GGUF
    ``tokenizer.ggml.eos_token_id`` / the folder's ``eos_token``), then GGUF ``eot``/``eom`` ids or
    the ``eos_token_id`` entries of ``generation_config.json`` / ``config.json``, then the
    control tokens llama.cpp treats as end-of-generation by their text (``<|im_end|>``,
    ``<end_of_turn>``, ``<|eot_id|>``, ``<|endoftext|>``, ...). ``eos_token_id`` is the first.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        chat_template: str | dict[str, str] | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        source: str | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.source = source
        if isinstance(chat_template, Mapping):
            self.chat_templates = dict(chat_template)
            self.chat_template = self.chat_templates.get("default")
        else:
            self.chat_templates = {"default": chat_template} if chat_template else {}
            self.chat_template = chat_template or None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    IncrementalDecoder: type[IncrementalDecoder]  # set below the class

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, chat_template={self.has_chat_template})"
        )

    # ---- properties -------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (the file's declared one), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- encode / decode --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are always
        recognised; ``add_special_tokens`` adds the model's BOS/EOS as the tokenizer declares."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        return [
            e.ids
            for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat -------------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat rendered to text, as transformers' ``apply_chat_template(tokenize=False)``.

        Without a chat template: the message contents joined with ``"\\n"`` (roles and
        ``add_generation_prompt`` are ignored).
        """
        if not messages:
            raise ValueError("cannot render an empty conversation")
        messages = _normalize_messages(messages)
        template = self._pick_template(tools)
        if template is None:
            return "\n".join(_content_text(m.get("content")) for m in messages)
        variables = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if value is not None
        }
        variables.update(template_kwargs)
        return _compile_template(template).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat, as ``apply_chat_template(tokenize=True)``: the template
        supplies BOS itself, so no special tokens are added. Without a template the plain text is
        encoded with the model's BOS/EOS."""
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=not self.has_chat_template)

    def _pick_template(self, tools: list | None) -> str | None:
        if tools and self.chat_templates.get("tool_use"):
            return self.chat_templates["tool_use"]
        return self.chat_template

    # ---- construction: GGUF -----------------------------------------------------------------------

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike,
        metadata: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike | None = None,
        *,
        use_cache: bool = True,
    ) -> Tokenizer:
        """The tokenizer described by a GGUF file's metadata.

        ``metadata``: the file's already-parsed metadata (``{key: value}``), if the caller has it;
        only read on a cache miss. ``cache_dir`` defaults to ``tokenizers`` in Folio's cache folder (``engine.paths``).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        entry = None
        if use_cache:
            root = Path(cache_dir) if cache_dir is not None else paths.cache_dir() / "tokenizers"
            key = _file_cache_key(path)
            entry = root / f"{_safe_stem(path)}-{key}"
            cached = cls._load_cache_entry(entry, key, path)
            if cached is not None:
                return cached

        meta = dict(metadata) if metadata is not None else read_gguf_tokenizer_metadata(path)
        architecture, tokenizer_dict, config = _gguf_tokenizer_dict(meta, path)
        backend, converter = _convert_gguf_tokenizer(architecture, tokenizer_dict, path)
        _finish_backend(backend, config)

        tokens = tokenizer_dict["tokens"]
        token_types = tokenizer_dict.get("token_type") or [None] * len(tokens)
        candidates = (
            (t, i)
            for i, (t, ty) in enumerate(zip(tokens, token_types, strict=False))
            if ty in (None, _TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED) and t in _EOG_TOKEN_TEXTS
        )
        primary = [
            tokenizer_dict.get("eos_token_id"),
            meta.get("tokenizer.ggml.eot_token_id"),
            meta.get("tokenizer.ggml.eom_token_id"),
        ]
        chat_templates = {"default": config["chat_template"]} if config.get("chat_template") else {}
        prefix = "tokenizer.chat_template."
        for k, v in meta.items():  # named templates, e.g. tokenizer.chat_template.tool_use
            if k.startswith(prefix) and isinstance(v, str):
                chat_templates[k[len(prefix) :]] = v
        info = {
            "format": CACHE_FORMAT_VERSION,
            "source": str(path.resolve()),
            "converter": converter,
            "architecture": architecture,
            "tokenizer_model": tokenizer_dict.get("tokenizer_type"),
            "pre_tokenizer": tokenizer_dict.get("pre_tokenizer_type"),
            "bos_token": config.get("bos_token"),
            "eos_token": config.get("eos_token"),
            "unk_token": config.get("unk_token"),
            "pad_token": config.get("pad_token"),
            "bos_token_id": tokenizer_dict.get("bos_token_id"),
            "eos_token_ids": _eos_ids(primary, candidates),
            "pad_token_id": tokenizer_dict.get("pad_token_id"),
            "add_bos_token": bool(config.get("add_bos_token", False))
            and config.get("bos_token") is not None,
            "add_eos_token": bool(config.get("add_eos_token", False))
            and config.get("eos_token") is not None,
            "chat_templates": chat_templates,
        }
        if entry is not None:
            info["key"] = entry.name.rsplit("-", 1)[1]
            _write_cache_entry(entry, backend, info)
        return cls._from_info(backend, info)

    @classmethod
    def _from_info(cls, backend: tokenizers.Tokenizer, info: dict) -> Tokenizer:
        return cls(
            backend,
            bos_token=info.get("bos_token"),
            eos_token=info.get("eos_token"),
            unk_token=info.get("unk_token"),
            pad_token=info.get("pad_token"),
            bos_token_id=info.get("bos_token_id"),
            eos_token_ids=info.get("eos_token_ids") or (),
            pad_token_id=info.get("pad_token_id"),
            chat_template=info.get("chat_templates") or None,
            add_bos_token=info.get("add_bos_token", False),
            add_eos_token=info.get("add_eos_token", False),
            source=info.get("source"),
        )

    @classmethod
    def _load_cache_entry(cls, entry: Path, key: str, path: Path) -> Tokenizer | None:
        meta_file = entry / _CACHE_META_FILE
        try:
            info = json.loads(meta_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable tokenizer cache entry %s: %s", entry, exc)
            return None
        if info.get("format") != CACHE_FORMAT_VERSION or info.get("key") != key:
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(entry / _CACHE_TOKENIZER_FILE))
        except Exception as exc:  # corrupt or from an incompatible tokenizers version
            logger.warning("ignoring broken tokenizer cache entry %s: %s", entry, exc)
            return None
        info["source"] = str(path)
        return cls._from_info(backend, info)

    # ---- construction: Hugging Face folder --------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        """A Hugging Face tokenizer folder: ``tokenizer.json`` + ``tokenizer_config.json``, with the chat
        template from ``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``
        (in that order) and extra EOS ids from ``generation_config.json`` / ``config.json``."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json in the folder")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerError(f"{tokenizer_file}: cannot load it: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        generation_config = _read_json(folder / "generation_config.json")

        special = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        # transformers only adds the named special tokens that tokenizer.json lacks
        _finish_backend(
            backend,
            {
                **special,
                **{k: config[k] for k in ("add_bos_token", "add_eos_token") if k in config},
            },
        )

        def id_of(name: str, config_key: str) -> int | None:
            token = special.get(name)
            token_id = backend.token_to_id(token) if token is not None else None
            if token_id is None:
                token_id = _first_int(
                    generation_config.get(config_key), model_config.get(config_key)
                )
            return token_id

        added = backend.get_added_tokens_decoder()
        candidates = (
            (t.content, i) for i, t in added.items() if t.special or t.content in _EOG_TOKEN_TEXTS
        )
        primary = [id_of("eos_token", "eos_token_id")]
        for source in (generation_config, model_config):
            value = source.get("eos_token_id")
            primary.extend(value if isinstance(value, list) else [value])

        chat_template: Any = None
        if (folder / "chat_template.jinja").is_file():
            chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif (folder / "chat_template.json").is_file():
            chat_template = _read_json(folder / "chat_template.json").get("chat_template")
        else:
            chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            chat_template = {t["name"]: t["template"] for t in chat_template}
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            templates = (
                dict(chat_template)
                if isinstance(chat_template, dict)
                else ({"default": chat_template} if chat_template else {})
            )
            for file in sorted(extra_dir.glob("*.jinja")):
                templates[file.stem] = file.read_text(encoding="utf-8")
            chat_template = templates

        return cls(
            backend,
            bos_token=special["bos_token"],
            eos_token=special["eos_token"],
            unk_token=special["unk_token"],
            pad_token=special["pad_token"],
            bos_token_id=id_of("bos_token", "bos_token_id"),
            eos_token_ids=_eos_ids(primary, candidates),
            pad_token_id=id_of("pad_token", "pad_token_id"),
            chat_template=chat_template,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            source=str(folder),
        )


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _safe_stem(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80] or "model"


def _write_cache_entry(entry: Path, backend: tokenizers.Tokenizer, info: dict) -> None:
    """Write tokenizer.json, then folio_tokenizer.json (the commit marker), each atomically.
    Older entries built from the same source file are removed. Failures only log."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        _atomic_write(entry / _CACHE_TOKENIZER_FILE, backend.to_str(pretty=False))
        _atomic_write(entry / _CACHE_META_FILE, json.dumps(info, ensure_ascii=False, indent=1))
    except OSError as exc:
        logger.warning("could not write the tokenizer cache %s: %s", entry, exc)
        return
    stem_prefix = entry.name.rsplit("-", 1)[0] + "-"
    for other in entry.parent.glob(stem_prefix + "*"):
        if other == entry or not other.is_dir():
            continue
        try:
            other_info = json.loads((other / _CACHE_META_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if other_info.get("source") == info.get("source"):
            shutil.rmtree(other, ignore_errors=True)


def _atomic_write(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerError(f"{path}: invalid JSON: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_int(*values: Any) -> int | None:
    for value in values:
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# --------------------------------------------------------------------------------------------------
# streaming decode
# --------------------------------------------------------------------------------------------------


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces.

    ``feed(ids)`` returns the text completed by these ids. Text whose decode ends in U+FFFD (an
    incomplete UTF-8 sequence, e.g. the first byte token of an emoji) is held back until the next
    ids complete it; ``flush()`` returns whatever is still held at the end of the stream.

    Works like text-generation-inference's decoder: the new text is the decode of a short window
    of recent ids minus the decode of the window's already-emitted prefix, so decoders that strip
    or merge across tokens (SentencePiece's leading space, byte-level BPE) stay exact.
    """

    def __init__(
        self, tokenizer: Tokenizer | tokenizers.Tokenizer, skip_special_tokens: bool = False
    ):
        self._backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # ids before this have been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add token id(s); return the newly completed text ("" while a character is incomplete)."""
        if isinstance(ids, int):
            self.ids.append(ids)
        else:
            self.ids.extend(ids)
        if len(self.ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    __call__ = feed

    def flush(self) -> str:
        """The held-back text at the end of the stream (may contain U+FFFD for truly invalid bytes)."""
        if self._read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def reset(self) -> None:
        self.ids.clear()
        self._prefix_offset = self._read_offset = 0
        self.text = ""


Tokenizer.IncrementalDecoder = IncrementalDecoder
