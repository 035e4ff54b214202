"""The Hugging Face access token for gated and private repositories.

Stored in the OS keyring when the ``keyring`` package is installed and has a working
backend; otherwise in Folio's settings file (``settings.json`` in
``$FOLIO_CONFIG_DIR`` or the user config folder), readable only by the user, and the
caller gets a warning to show. Without a stored token, huggingface_hub's own (the
``HF_TOKEN`` variable or ``hf auth login``) is used.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine import paths

__all__ = ["TokenSaved", "clear_token", "load_token", "save_token", "settings_path"]

_SERVICE = "folio"
_USER = "huggingface-token"
_KEY = "hf_token"


@dataclass(frozen=True)
class TokenSaved:
    where: str  # "keyring" or the settings file path
    warning: str | None  # show it to the user when set


def settings_path() -> Path:
    return paths.config_dir() / "settings.json"


def _keyring():
    """The keyring module when it has a usable backend, else None."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    with contextlib.suppress(Exception):  # a broken backend config must not break Folio
        if not isinstance(keyring.get_keyring(), fail.Keyring):
            return keyring
    return None


def _read_settings() -> dict:
    try:
        data = json.loads(settings_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_settings(data: dict) -> None:
    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    # Created 0600 from the start: the token must never be world-readable, even briefly.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def save_token(token: str) -> TokenSaved:
    token = token.strip()
    if not token:
        raise ValueError("the token is empty")
    kr = _keyring()
    if kr is not None:
        try:
            kr.set_password(_SERVICE, _USER, token)
            data = _read_settings()
            if data.pop(_KEY, None) is not None:  # an older plain-text copy
                _write_settings(data)
            return TokenSaved("keyring", None)
        except Exception:  # any backend failure falls back to the file
            pass
    data = _read_settings()
    data[_KEY] = token
    _write_settings(data)
    path = settings_path()
    return TokenSaved(
        str(path),
        f"no system keyring is available, so the token is stored in plain text in {path} "
        f"(readable only by you); install the 'keyring' package to keep it in the system keyring",
    )


def load_token() -> str | None:
    """The stored token, or None (huggingface_hub then falls back to its own)."""
    kr = _keyring()
    if kr is not None:
        with contextlib.suppress(Exception):
            token = kr.get_password(_SERVICE, _USER)
            if token:
                return token
    token = _read_settings().get(_KEY)
    return token if isinstance(token, str) and token else None


def clear_token() -> None:
    kr = _keyring()
    if kr is not None:
        with contextlib.suppress(Exception):
            kr.delete_password(_SERVICE, _USER)
    data = _read_settings()
    if data.pop(_KEY, None) is not None:
        _write_settings(data)
