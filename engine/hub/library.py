"""The models already on this machine: Folio's models folder, the Hugging Face cache, imports.

A model is a ``.gguf`` file or a folder holding ``config.json`` and ``*.safetensors``.
Listing reads only headers (GGUF metadata, the safetensors JSON header), never weights,
and remembers what it read per (path, size, mtime). Deleting reports the bytes freed.
Imported models stay where they are; Folio remembers their paths in
``<models dir>/.folio-imports.json`` after :func:`validate_model` has accepted them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine import paths
from engine.hub.errors import HubError, ModelValidationError
from engine.hub.gguf_info import quant_from_filename, summary_from_file
from engine.hub.transfer import FOLDER_MARKER, INCOMPLETE_SUFFIX, REQUEST_PREFIX, read_stamp
from engine.model.fetch import STAMP_SUFFIX
from engine.units import format_bytes

__all__ = [
    "DeleteResult",
    "LocalModel",
    "delete_model",
    "hf_cache_dir",
    "import_model",
    "list_local_models",
    "mark_used",
    "reveal_in_file_manager",
    "validate_model",
]

IMPORTS_FILE = ".folio-imports.json"
USAGE_FILE = ".folio-usage.json"
_DENSE_DTYPES = {"F16", "BF16", "F32"}


@dataclass(frozen=True)
class LocalModel:
    path: Path  # the .gguf file or the folder: what Engine.load takes
    name: str
    format: str  # "gguf" or "safetensors"
    source: str  # "folio" (models folder), "hf-cache" or "imported"
    size_bytes: int  # on disk
    repo_id: str | None = None
    quant: str | None = None
    architecture: str | None = None
    last_used: float | None = None  # seconds since the epoch
    verified: bool = False  # hash checked against the Hub (or the first-run fetch)
    problem: str | None = None  # why it cannot be loaded, in plain words

    @property
    def loadable(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class DeleteResult:
    freed_bytes: int
    message: str
    cache_freed_bytes: int = 0  # of the model's prompt cache on disk, deleted with it


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


# --------------------------------------------------------------------------- header reads

_summary_cache: dict[tuple[str, int, int], tuple[str | None, str | None, str | None]] = {}
_cache_lock = threading.Lock()


def _gguf_facts(path: Path) -> tuple[str | None, str | None, str | None]:
    """(architecture, quant, problem) of a GGUF file, remembered per size and mtime."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        if key in _summary_cache:
            return _summary_cache[key]
    try:
        s = summary_from_file(path)
        facts = (s.architecture or None, s.file_type or quant_from_filename(path.name), s.problem)
    except ValueError as exc:  # GGUFError: truncated or not a GGUF file
        facts = (None, quant_from_filename(path.name), str(exc))
    with _cache_lock:
        _summary_cache[key] = facts
    return facts


def _safetensors_dtypes(path: Path) -> set[str]:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > 100 * 1024**2:
            raise ValueError("header too large")
        header = json.loads(fh.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _folder_facts(folder: Path) -> tuple[str | None, str | None, str | None]:
    """(architecture, dtype, problem) of a safetensors folder."""
    from engine.model.config import ModelConfig, UnsupportedArchitecture

    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, None, f"config.json cannot be read ({exc})"
    arch = cfg.get("model_type") if isinstance(cfg, dict) else None
    problem = None
    try:
        arch = ModelConfig.from_hf_config(cfg, str(folder)).arch
    except UnsupportedArchitecture as exc:
        problem = str(exc)
    except (KeyError, TypeError, ValueError) as exc:
        problem = f"config.json lacks {exc}; it is not a complete model configuration"
    dtypes: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        try:
            dtypes |= _safetensors_dtypes(f)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            problem = problem or f"{f.name} is damaged ({exc}): download it again"
    if dtypes - _DENSE_DTYPES and problem is None:
        problem = f"weights stored as {', '.join(sorted(dtypes - _DENSE_DTYPES))}; Folio reads fp16, bf16 or fp32 safetensors"
    if problem is None and not any(
        (folder / t).exists() for t in ("tokenizer.json", "tokenizer.model")
    ):
        problem = "no tokenizer (tokenizer.json or tokenizer.model) in the folder"
    return arch, "/".join(sorted(dtypes)) or None, problem


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _dir_size(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size  # follows HF cache symlinks to their blobs
    return total


# --------------------------------------------------------------------------- usage, imports


def _read_json(path: Path, default):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default
    return data if isinstance(data, type(default)) else default


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


_state_lock = threading.Lock()


def mark_used(path: Path | str, models_dir: Path | str | None = None) -> None:
    """Record that a model was just loaded (shown as "last used")."""
    usage_path = paths.models_dir(models_dir) / USAGE_FILE
    with _state_lock:
        usage = _read_json(usage_path, {})
        usage[str(Path(path).absolute())] = time.time()
        _write_json(usage_path, usage)


# --------------------------------------------------------------------------- listing


def list_local_models(
    models_dir: Path | str | None = None,
    *,
    hf_cache: Path | str | None = None,
    include_hf_cache: bool = True,
) -> list[LocalModel]:
    """Every model on disk, newest use first, then by name."""
    base = paths.models_dir(models_dir)
    usage = _read_json(base / USAGE_FILE, {})
    found: dict[str, LocalModel] = {}

    def add(model: LocalModel) -> None:
        key = str(model.path.absolute())
        if key not in found:
            used = usage.get(key)
            found[key] = _with(model, last_used=used if isinstance(used, (int, float)) else None)

    if base.is_dir():
        for m in _scan_models_dir(base):
            add(m)
    for raw in _read_json(base / IMPORTS_FILE, []):
        add(_describe(Path(raw), "imported"))
    if include_hf_cache:
        for m in _scan_hf_cache(Path(hf_cache) if hf_cache is not None else hf_cache_dir()):
            add(m)
    return sorted(found.values(), key=lambda m: (-(m.last_used or 0), m.name.lower()))


def _with(model: LocalModel, **changes) -> LocalModel:
    from dataclasses import replace

    return replace(model, **changes)


def _scan_models_dir(base: Path) -> list[LocalModel]:
    out = []
    for path in sorted(base.rglob("*.gguf")):
        if any(part.startswith(".") for part in path.relative_to(base).parts):
            continue  # temporary files of the first-run fetch
        out.append(_describe(path, "folio"))
    for config in sorted(base.rglob("config.json")):
        folder = config.parent
        if any(
            part.startswith(".") for part in folder.relative_to(base).parts
        ) or not _is_model_folder(folder):
            continue
        if any(folder.glob(f"*{INCOMPLETE_SUFFIX}")) or _pending_folder_request(folder):
            continue  # still downloading: listed once complete
        out.append(_describe(folder, "folio"))
    return out


def _pending_folder_request(folder: Path) -> bool:
    for p in folder.glob(f"{REQUEST_PREFIX}*.json"):
        if _read_json(p, {}).get("kind") == "safetensors":
            return True
    return False


def _describe(path: Path, source: str, repo_id: str | None = None) -> LocalModel:
    if not path.exists():
        return LocalModel(path, path.name, "gguf" if path.suffix == ".gguf" else "safetensors", source, 0,
                          problem="the file or folder is gone (moved or deleted)")  # fmt: skip
    if path.is_dir():
        arch, dtype, problem = _folder_facts(path)
        marker = _read_json(path / FOLDER_MARKER, {})
        return LocalModel(
            path, repo_id.split("/")[-1] if repo_id else path.name, "safetensors", source, _dir_size(path),
            repo_id=repo_id or marker.get("repo_id"), quant=dtype, architecture=arch,
            verified=bool(marker), problem=problem,
        )  # fmt: skip
    arch, quant, problem = _gguf_facts(path)
    stamp = read_stamp(path)
    return LocalModel(
        path, path.stem, "gguf", source, path.stat().st_size,
        repo_id=repo_id or (stamp or {}).get("repo_id"), quant=quant, architecture=arch,
        verified=stamp is not None, problem=problem,
    )  # fmt: skip


def _scan_hf_cache(cache: Path) -> list[LocalModel]:
    if not cache.is_dir():
        return []
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache)
    except Exception:  # CacheNotFound, or a cache layout this version cannot read
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: -r.last_modified):
            snap = rev.snapshot_path
            for f in sorted(rev.files, key=lambda f: f.file_name):
                if f.file_name.endswith(".gguf"):
                    out.append(_describe(f.file_path, "hf-cache", repo.repo_id))
            if _is_model_folder(snap):
                out.append(_describe(snap, "hf-cache", repo.repo_id))
    return out


# --------------------------------------------------------------------------- import


def validate_model(path: Path | str) -> LocalModel:
    """Check that ``path`` is a model Folio can load; raise :class:`ModelValidationError` if not."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelValidationError(f"{path}: no such file or folder")
    if path.is_file():
        with path.open("rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelValidationError(
                f"{path}: not a GGUF model file; choose a .gguf file or a model folder"
            )
    elif not (path / "config.json").is_file():
        raise ModelValidationError(
            f"{path}: no config.json; a model folder needs config.json, a tokenizer and *.safetensors"
        )
    elif not any(path.glob("*.safetensors")):
        raise ModelValidationError(f"{path}: no *.safetensors weight files in the folder")
    model = _describe(path, "imported")
    if model.problem:
        raise ModelValidationError(
            f"{path}: {model.problem}" if str(path) not in model.problem else model.problem
        )
    return model


def import_model(path: Path | str, models_dir: Path | str | None = None) -> LocalModel:
    """Validate a local .gguf file or model folder and add it to the list (it is not copied)."""
    model = validate_model(path)
    base = paths.models_dir(models_dir)
    with _state_lock:
        imports = _read_json(base / IMPORTS_FILE, [])
        key = str(model.path.absolute())
        if key not in imports:
            imports.append(key)
            _write_json(base / IMPORTS_FILE, imports)
    return model


# --------------------------------------------------------------------------- delete


def delete_model(
    model: LocalModel,
    models_dir: Path | str | None = None,
    *,
    hf_cache: Path | str | None = None,
) -> DeleteResult:
    """Delete a listed model from disk (an imported one is only removed from the list),
    and its prompt cache on disk (docs/ENGINE.md §10) either way."""
    base = paths.models_dir(models_dir)
    path = model.path
    cache_freed = _delete_prompt_cache(path)
    cache_note = (
        f" and {format_bytes(cache_freed, 'MB')} of its prompt cache" if cache_freed else ""
    )
    tiles_freed = _delete_tiles(path)
    if tiles_freed:
        cache_note += f" and {format_bytes(tiles_freed, 'MB')} of its repacked weights"
    if model.source == "imported":
        with _state_lock:
            imports = [p for p in _read_json(base / IMPORTS_FILE, []) if p != str(path.absolute())]
            _write_json(base / IMPORTS_FILE, imports)
        return DeleteResult(
            0,
            f"removed {model.name} from the list{cache_note}; its files were left in {path.parent}",
            cache_freed,
        )
    if model.source == "hf-cache":
        freed = _delete_from_hf_cache(
            model, Path(hf_cache) if hf_cache is not None else hf_cache_dir()
        )
    else:
        if not path.absolute().is_relative_to(base.absolute()):
            raise HubError(f"{path} is not inside the models folder {base}; refusing to delete it")
        freed = _delete_folio(path)
    with _state_lock:
        usage = _read_json(base / USAGE_FILE, {})
        if usage.pop(str(path.absolute()), None) is not None:
            _write_json(base / USAGE_FILE, usage)
    return DeleteResult(
        freed,
        f"deleted {model.name}: {format_bytes(freed, 'MB')} freed{cache_note}",
        cache_freed,
    )


def _delete_prompt_cache(model_path: Path) -> int:
    """Bytes freed deleting the disk-tier stores of ``model_path`` (resolved before the
    model's files go: a Hugging Face snapshot link stops resolving once its blob is gone)."""
    from engine.cache.disk_tier import delete_stores

    try:
        freed, _busy = delete_stores(paths.kv_cache_dir(), model_path.resolve())
    except OSError:
        return 0  # the cache is rebuilt by prefilling; never a reason to keep the model
    return freed


def _delete_tiles(model_path: Path) -> int:
    """Bytes freed deleting the weights repacked from ``model_path`` and kept on disk
    (engine/model/tile_cache.py); rebuilt by loading it again."""
    from engine.model.tile_cache import delete_files

    try:
        return delete_files(model_path.resolve())
    except OSError:
        return 0


def _unlink_size(path: Path) -> int:
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


def _delete_folio(path: Path) -> int:
    freed = 0
    if path.is_dir():
        gguf_inside = any(path.glob("*.gguf"))
        if not gguf_inside:
            freed = _dir_size(path)
            shutil.rmtree(path)
            return freed
        # Quantized files of the same repository share the folder: remove the folder model only.
        for p in list(path.iterdir()):
            if p.is_file() and p.suffix != ".gguf" and not p.name.endswith(".gguf" + STAMP_SUFFIX):
                freed += _unlink_size(p)
        return freed
    freed += _unlink_size(path)
    for extra in (
        path.with_name(path.name + STAMP_SUFFIX),
        path.with_name(path.name + INCOMPLETE_SUFFIX),
    ):
        freed += _unlink_size(extra)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # a repository folder left empty
    return freed


def _delete_from_hf_cache(model: LocalModel, cache: Path) -> int:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache)
    for repo in info.repos:
        for rev in repo.revisions:
            if model.path == rev.snapshot_path:
                strategy = info.delete_revisions(rev.commit_hash)
                strategy.execute()
                return strategy.expected_freed_size
            for f in rev.files:
                if f.file_path == model.path:
                    return _delete_cached_file(f.file_path, f.blob_path, repo.repo_path)
    raise HubError(f"{model.path} is no longer in the Hugging Face cache")


def _delete_cached_file(link: Path, blob: Path, repo_path: Path) -> int:
    """Remove one snapshot entry, and its blob when no other snapshot points to it."""
    link.unlink(missing_ok=True)
    blob = blob.resolve()
    still_used = any(
        p.is_symlink() and p.resolve() == blob for p in (repo_path / "snapshots").rglob("*")
    )
    if still_used or not blob.exists():
        return 0
    return _unlink_size(blob)


# --------------------------------------------------------------------------- reveal


def reveal_in_file_manager(path: Path | str) -> None:
    """Open the system file manager at ``path`` (selecting it where the platform can)."""
    path = Path(path)
    if sys.platform == "win32":
        cmd = ["explorer", "/select,", str(path)]
    elif sys.platform == "darwin":
        cmd = ["open", "-R", str(path)]
    else:  # freedesktop: open the folder that holds it
        cmd = ["xdg-open", str(path if path.is_dir() else path.parent)]
    try:
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as exc:
        raise HubError(
            f"could not open the file manager ({cmd[0]}: {exc.strerror}); the model is at {path}"
        ) from exc
