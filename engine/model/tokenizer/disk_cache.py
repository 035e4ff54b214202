"""The on-disk cache of tokenizers converted from GGUF files.

``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)`` takes 5-20 s per load. Folio
converts a GGUF vocabulary once (``gguf_vocab``) and caches the result as ``tokenizer.json`` +
``folio_tokenizer.json`` under ``cache_dir/<stem>-<key>/``. The key hashes the model file's size,
mtime_ns and first MiB, so a changed file gets a fresh entry. A cached load reads two files and
calls ``tokenizers.Tokenizer.from_file``; it never imports transformers (nor jinja2, until a chat
template is rendered). The remaining cost is the Rust-side construction of the BPE model, which
grows with the vocabulary: ~0.1 s for a 49k vocabulary, ~1 s for Gemma's 262k one on a slow CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import tokenizers

logger = logging.getLogger(__name__)

#: Bump when the cached files' content or layout changes; old entries are then ignored.
CACHE_FORMAT_VERSION = 1
_META_FILE = "folio_tokenizer.json"
_TOKENIZER_FILE = "tokenizer.json"
_KEY_HEAD_BYTES = 1 << 20


def entry_for(path: Path, root: Path) -> Path:
    """The cache entry (a folder under ``root``) for the current content of the file ``path``."""
    return root / f"{_safe_stem(path)}-{_file_key(path)}"


def read_entry(entry: Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]] | None:
    """The cached backend and settings, or None when the entry is missing, stale or broken."""
    try:
        info = json.loads((entry / _META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable tokenizer cache entry %s: %s", entry, exc)
        return None
    if info.get("format") != CACHE_FORMAT_VERSION or info.get("key") != _key_of(entry):
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(entry / _TOKENIZER_FILE))
    except Exception as exc:  # corrupt or from an incompatible tokenizers version
        logger.warning("ignoring broken tokenizer cache entry %s: %s", entry, exc)
        return None
    return backend, info


def write_entry(entry: Path, backend: tokenizers.Tokenizer, info: dict[str, Any]) -> None:
    """Write tokenizer.json, then folio_tokenizer.json (the commit marker), each atomically.
    Older entries built from the same source file are removed. Failures only log."""
    info = {"format": CACHE_FORMAT_VERSION, **info, "key": _key_of(entry)}
    try:
        entry.mkdir(parents=True, exist_ok=True)
        _atomic_write(entry / _TOKENIZER_FILE, backend.to_str(pretty=False))
        _atomic_write(entry / _META_FILE, json.dumps(info, ensure_ascii=False, indent=1))
    except OSError as exc:
        logger.warning("could not write the tokenizer cache %s: %s", entry, exc)
        return
    stem_prefix = entry.name.rsplit("-", 1)[0] + "-"
    for other in entry.parent.glob(stem_prefix + "*"):
        if other == entry or not other.is_dir():
            continue
        try:
            other_info = json.loads((other / _META_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if other_info.get("source") == info.get("source"):
            shutil.rmtree(other, ignore_errors=True)


def _file_key(path: Path) -> str:
    """Hash of the cache format, the file's size and mtime_ns, and its first MiB."""
    st = path.stat()
    digest = hashlib.sha256()
    digest.update(
        f"folio-tokenizer-v{CACHE_FORMAT_VERSION}|{st.st_size}|{st.st_mtime_ns}|".encode()
    )
    with open(path, "rb") as handle:
        digest.update(handle.read(_KEY_HEAD_BYTES))
    return digest.hexdigest()[:24]


def _key_of(entry: Path) -> str:
    return entry.name.rsplit("-", 1)[1]


def _safe_stem(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80] or "model"


def _atomic_write(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
