"""Folio's tokenizer: a thin, fast wrapper around a Hugging Face `tokenizers.Tokenizer`.

Two sources are supported:

* ``Tokenizer.from_gguf(path)`` builds the tokenizer a GGUF file describes in its ``tokenizer.*``
  metadata (vocabulary, merges or scores, token types, special ids, add-BOS/EOS flags, pre-tokenizer
  by ``tokenizer.ggml.pre``) and caches the result on disk.
* ``Tokenizer.from_folder(folder)`` loads a Hugging Face folder: ``tokenizer.json`` plus
  ``tokenizer_config.json`` (and ``chat_template.jinja`` / ``chat_template.json``,
  ``generation_config.json``, ``config.json`` when present).

Modules: ``tokenizer`` (the ``Tokenizer``), ``gguf_vocab`` (GGUF metadata -> tokenizers backend),
``disk_cache`` (converted GGUF tokenizers kept on disk, and why), ``special_tokens`` (BOS/EOS
post-processor, end-of-generation ids), ``chat_template`` (rendering a conversation), ``decoder``
(the streaming ``IncrementalDecoder``), ``errors`` (``TokenizerError``).
"""

from engine.model.tokenizer.decoder import IncrementalDecoder
from engine.model.tokenizer.errors import TokenizerError
from engine.model.tokenizer.gguf_vocab import read_gguf_tokenizer_metadata
from engine.model.tokenizer.tokenizer import Tokenizer

__all__ = [
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerError",
    "read_gguf_tokenizer_metadata",
]
