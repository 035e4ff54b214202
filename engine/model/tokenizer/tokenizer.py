"""The tokenizer: encode/decode text and chats for one model, built from a GGUF file or a
Hugging Face folder."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from engine import paths
from engine.model.tokenizer import chat_template, disk_cache, gguf_vocab
from engine.model.tokenizer.decoder import IncrementalDecoder
from engine.model.tokenizer.errors import TokenizerError
from engine.model.tokenizer.special_tokens import SpecialTextMarker, eos_ids, finish_backend


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
        self._special_text: SpecialTextMarker | None = None  # made on first need (encode_chat)

    IncrementalDecoder = IncrementalDecoder  # also reachable as Tokenizer.IncrementalDecoder

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
    def supports_tools(self) -> bool:
        """The chat template (or its `tool_use` variant) renders a `tools` list."""
        return any(
            "tools" in chat_template.template_variables(t)
            for t in self.chat_templates.values()
            if t
        )

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
        recognised; ``add_special_tokens`` adds the model's BOS/EOS as the tokenizer declares.
        Raises ValueError for anything but valid text (a lone surrogate, say)."""
        _check_text(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        for text in texts:
            _check_text(text)
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
        return chat_template.render(
            self._pick_template(tools),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            variables=variables,
            source=self.source,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat, as ``apply_chat_template(tokenize=True)``: the template
        supplies BOS itself, so no special tokens are added. Without a template the plain text is
        encoded with the model's BOS/EOS.

        Unlike transformers, special-token text inside the messages (a user typing
        ``<|im_start|>``) is encoded as plain text, so a message cannot open a turn of its own;
        only the template's control tokens are special (``special_tokens.SpecialTextMarker``).
        A chat without such text encodes exactly as transformers encodes it."""
        if self._special_text is None:
            self._special_text = SpecialTextMarker(self.backend)
        marked, markers = self._special_text.mark(messages)
        text = self.render_chat(marked, add_generation_prompt, **kwargs)
        add_special_tokens = not self.has_chat_template
        if not markers:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return self._special_text.encode(text, markers, add_special_tokens)

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
            entry = disk_cache.entry_for(path, root)
            cached = disk_cache.read_entry(entry)
            if cached is not None:
                backend, info = cached
                return cls._from_info(backend, {**info, "source": str(path)})

        if metadata is None:
            metadata = gguf_vocab.read_gguf_tokenizer_metadata(path)
        backend, info = gguf_vocab.convert_vocab(dict(metadata), path)
        if entry is not None:
            disk_cache.write_entry(entry, backend, info)
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
        finish_backend(
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
        candidates = ((t.content, i) for i, t in added.items())
        primary = [id_of("eos_token", "eos_token_id")]
        for source in (generation_config, model_config):
            value = source.get("eos_token_id")
            primary.extend(value if isinstance(value, list) else [value])

        templates = _folder_chat_templates(folder, config)
        return cls(
            backend,
            bos_token=special["bos_token"],
            eos_token=special["eos_token"],
            unk_token=special["unk_token"],
            pad_token=special["pad_token"],
            bos_token_id=id_of("bos_token", "bos_token_id"),
            eos_token_ids=eos_ids(primary, candidates),
            pad_token_id=id_of("pad_token", "pad_token_id"),
            chat_template=templates,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            source=str(folder),
        )


def _folder_chat_templates(folder: Path, config: dict) -> str | dict[str, str] | None:
    """The folder's chat template: from ``chat_template.jinja``, ``chat_template.json`` or
    ``tokenizer_config.json`` (in that order), with the named ones in ``additional_chat_templates/``."""
    template: Any
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    else:
        template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}
    extra_dir = folder / "additional_chat_templates"
    if not extra_dir.is_dir():
        return template
    if isinstance(template, dict):
        templates = dict(template)
    else:
        templates = {"default": template} if template else {}
    for file in sorted(extra_dir.glob("*.jinja")):
        templates[file.stem] = file.read_text(encoding="utf-8")
    return templates


def _check_text(text: Any) -> None:
    if not isinstance(text, str):
        raise ValueError(f"can only encode text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text is not valid Unicode (a lone surrogate at character {exc.start}: "
            "undecodable bytes, perhaps)"
        ) from None


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
