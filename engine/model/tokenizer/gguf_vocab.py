"""GGUF vocabulary conversion: a GGUF file's ``tokenizer.*`` metadata as a Hugging Face
``tokenizers.Tokenizer`` and the settings around it (special tokens, EOS ids, chat templates).

The metadata gives the vocabulary, merges or scores, token types, special ids, add-BOS/EOS flags
and the pre-tokenizer by ``tokenizer.ggml.pre``. Conversion uses transformers' own GGUF converter
when it is importable (the reference, so results match transformers exactly), otherwise the small
built-in port of it below. It is the slow path: ``disk_cache`` keeps its result.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from engine.model.tokenizer.errors import TokenizerError
from engine.model.tokenizer.special_tokens import eos_ids, finish_backend

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

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


# --------------------------------------------------------------------------------------------------
# GGUF -> tokenizers conversion
# --------------------------------------------------------------------------------------------------


def convert_vocab(
    meta: Mapping[str, Any], path: Path
) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The backend tokenizer a GGUF file's metadata describes, with its BOS/EOS post-processor,
    and the settings ``Tokenizer`` is built from (the ``info`` the disk cache stores)."""
    architecture, tokenizer_dict, config = _gguf_tokenizer_dict(meta, path)
    try:
        backend, converter = _convert_gguf_tokenizer(architecture, tokenizer_dict, path)
        finish_backend(backend, config)
    except TokenizerError:
        raise
    except BaseException as exc:  # the converter and `tokenizers` run on the file's values
        if not _conversion_failure(exc):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerError(f"{path}: cannot build its tokenizer: {message}") from exc

    tokens = tokenizer_dict["tokens"]
    token_types = tokenizer_dict.get("token_type") or [None] * len(tokens)
    candidates = (
        (t, i)
        for i, (t, ty) in enumerate(zip(tokens, token_types, strict=False))
        if ty in (None, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    )
    primary = [
        tokenizer_dict.get("eos_token_id"),
        _token_id(meta, "tokenizer.ggml.eot_token_id", path),
        _token_id(meta, "tokenizer.ggml.eom_token_id", path),
    ]
    chat_templates = {"default": config["chat_template"]} if config.get("chat_template") else {}
    prefix = "tokenizer.chat_template."
    for k, v in meta.items():  # named templates, e.g. tokenizer.chat_template.tool_use
        if k.startswith(prefix) and isinstance(v, str):
            chat_templates[k[len(prefix) :]] = v
    info = {
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
        "eos_token_ids": eos_ids(primary, candidates),
        "pad_token_id": tokenizer_dict.get("pad_token_id"),
        "add_bos_token": bool(config.get("add_bos_token", False))
        and config.get("bos_token") is not None,
        "add_eos_token": bool(config.get("add_eos_token", False))
        and config.get("eos_token") is not None,
        "chat_templates": chat_templates,
    }
    return backend, info


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
    tokens = _plain(meta.get("tokenizer.ggml.tokens"))
    if tokenizer_type is None or not tokens:
        raise TokenizerError(
            f"{path}: the GGUF file has no tokenizer metadata "
            "(tokenizer.ggml.model / tokenizer.ggml.tokens missing); cannot build a tokenizer"
        )
    architecture = meta.get("general.architecture")
    architecture = architecture if isinstance(architecture, str) else ""
    tokenizer_dict = {
        name: _plain(meta[f"tokenizer.{key}"])
        for key, name in _GGUF_TOKENIZER_KEYS.items()
        if f"tokenizer.{key}" in meta
    }
    _check_vocabulary(tokenizer_dict, path)
    config: dict[str, Any] = {}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
        if not isinstance(config["chat_template"], str):
            raise _damaged(path, "tokenizer.chat_template", "is not text")
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = bool(_plain(meta[f"tokenizer.ggml.{key}"]))
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


def _conversion_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a conversion failing on the file's values, not an interrupt. pyo3
    reports a panic in tokenizers' Rust as PanicException, a BaseException that cannot be
    imported before the first panic, so it is told by name."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def _check_vocabulary(tokenizer_dict: dict, path: Path) -> None:
    """The kinds of values the converters assume, so that a damaged file is refused naming
    the key rather than failing somewhere inside a converter."""

    def numbers_only(values: Any) -> bool:
        return isinstance(values, list) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        )

    key_of = {name: f"tokenizer.{key}" for key, name in _GGUF_TOKENIZER_KEYS.items()}
    for name in ("tokenizer_type", "pre_tokenizer_type"):
        if name in tokenizer_dict and not isinstance(tokenizer_dict[name], str):
            raise _damaged(path, key_of[name], "is not text")
    tokens = tokenizer_dict["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise _damaged(path, key_of["tokens"], "is not an array of strings")
    merges = tokenizer_dict.get("merges")
    if merges is not None:
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise _damaged(path, key_of["merges"], "is not an array of strings")
        # tokenizers' BPE panics on a merge whose result is not a token
        vocabulary = set(tokens)
        for merge in merges:
            pair = merge.split(" ")
            if len(pair) != 2 or not {*pair, "".join(pair)} <= vocabulary:
                raise _damaged(
                    path,
                    key_of["merges"],
                    f"holds {merge!r:.60}, not a pair of tokens that makes a token",
                )
    for name in ("scores", "token_type"):
        if name in tokenizer_dict and not numbers_only(tokenizer_dict[name]):
            raise _damaged(path, key_of[name], "is not an array of numbers")
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        if name in tokenizer_dict:
            _token_id(tokenizer_dict, name, path, key_of[name])


def _token_id(
    values: Mapping[str, Any], key: str, path: Path, name: str | None = None
) -> int | None:
    """``values[key]`` if it is an integer: an id outside the vocabulary (llama.cpp writes -1
    for none) is left to the caller, which ignores it."""
    value = values.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _damaged(path, name or key, f"is {value!r:.40}, not a token id")
    return value


def _damaged(path: Path, key: str, problem: str) -> TokenizerError:
    return TokenizerError(f"{path}: {key} {problem}; the file is damaged: download it again")


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

        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
        return backend, f"transformers {transformers.__version__}"
    return _builtin_convert(architecture, tokenizer_dict, path), "folio-builtin"


# --------------------------------------------------------------------------------------------------
# built-in port of transformers' gguf_tokenizer_mapping (used when transformers is unavailable)
# --------------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table of bytes to the printable characters byte-level vocabularies spell
    them with (also what `folio bench grammar` builds its vocabulary in)."""
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
    spelling = bytes_to_unicode()
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
    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "gpt2":
        tk = _byte_level_backend(tokenizer_dict)
    elif tokenizer_type == "llama":
        tk = _spm_backend(tokenizer_dict, _SPM_STYLE_BY_ARCH.get(architecture, "llama"))
    elif tokenizer_type == "gemma4":  # GemmaTokenizer, without the Gemma 1-3 respelling
        tk = _gemma_backend(tokenizer_dict["tokens"], _merges_of(tokenizer_dict))
    else:
        raise TokenizerError(
            f"{path}: unsupported tokenizer.ggml.model {tokenizer_type!r} "
            "(the built-in converter handles 'gpt2', 'llama' and 'gemma4'; install transformers for more)"
        )

    # control tokens -> special added tokens; user-defined ones -> plain added tokens
    byte_level = tokenizer_type == "gpt2"
    spelled = set(bytes_to_unicode().values()) if byte_level else None
    token_types = tokenizer_dict.get("token_type") or ()
    tokens = tokenizer_dict["tokens"]
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == TOKEN_TYPE_CONTROL and (spelled is None or set(token) <= spelled)
    ]
    if control:
        tk.add_special_tokens(control)
    vocab = tk.get_vocab(with_added_tokens=True)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == TOKEN_TYPE_USER_DEFINED and token in vocab
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
