"""Where Folio keeps its files on this computer: one function per folder.

Each folder is the platform's per-user place for Folio (``platformdirs``), unless an
environment variable points elsewhere (tests, portable installs). Standard library and
``platformdirs`` only, so that the installer's model check can import it in a fresh venv.
The launchers' log folder is computed by ``folio/platform_setup.py`` and the installer,
which run before this package can be imported.
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "folio"
DATA_DIR_VARIABLE = "FOLIO_DATA_DIR"  # named in messages that tell the user to move the data


def _from_env(variable: str) -> Path | None:
    value = os.environ.get(variable)
    return Path(value).expanduser() if value else None


def data_dir() -> Path:
    """``$FOLIO_DATA_DIR``, else the user data folder: chats and the app's settings."""
    import platformdirs

    return _from_env(DATA_DIR_VARIABLE) or Path(platformdirs.user_data_dir(APP_NAME))


def models_dir(folder: Path | str | None = None) -> Path:
    """``folder`` when a caller names one; else ``$FOLIO_MODELS_DIR``, else ``models`` in
    the user data folder (not moved by ``$FOLIO_DATA_DIR``, so a test's throw-away data
    folder still finds the models)."""
    if folder is not None:
        return Path(folder)
    import platformdirs

    return _from_env("FOLIO_MODELS_DIR") or Path(platformdirs.user_data_dir(APP_NAME)) / "models"


def config_dir() -> Path:
    """``$FOLIO_CONFIG_DIR``, else the user config folder: the Hub token's settings file."""
    import platformdirs

    return _from_env("FOLIO_CONFIG_DIR") or Path(platformdirs.user_config_dir(APP_NAME))


def cache_dir() -> Path:
    """The user cache folder: files Folio can rebuild (converted tokenizers)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME))


def kv_cache_dir() -> Path:
    """``$FOLIO_KV_CACHE_DIR``, else ``kv`` in the user cache folder: the disk tier of the
    prompt cache (a store per model and cache format, rebuilt by prefilling again)."""
    return _from_env("FOLIO_KV_CACHE_DIR") or cache_dir() / "kv"


def tiles_cache_dir() -> Path:
    """``$FOLIO_TILES_DIR``, else ``tiles`` in the user cache folder: weights repacked at
    load for this CPU's kernels, kept so the next load maps them (rebuilt by repacking)."""
    return _from_env("FOLIO_TILES_DIR") or cache_dir() / "tiles"
