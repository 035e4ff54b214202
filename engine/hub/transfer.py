"""One download from the Hub: resumable, verified, cancellable; the models folder's on-disk state.

:func:`download_model` fetches one :class:`DownloadRequest` (a GGUF file or a
safetensors folder) on the calling thread; engine/hub/downloads.py queues requests
and runs them on a worker thread.

Layout inside the models folder (``$FOLIO_MODELS_DIR`` or the user data folder)::

    <owner>--<repo>/<file>.gguf                 a verified GGUF model
    <owner>--<repo>/<file>.gguf.verified.json   its stamp: sha256, size, mtime, origin
    <owner>--<repo>/<file>.incomplete           bytes received so far (kept across restarts)
    <owner>--<repo>/.download-<name>.json       the request, so a restart can resume it
    <owner>--<repo>/config.json, *.safetensors  a safetensors folder (plus .folio-model.json)

Why not ``hf_hub_download``: the installed huggingface_hub writes each download to a
process-unique temporary file and deletes it on any failure (huggingface_hub PR 4228),
so a cancelled or interrupted download starts over, and it buffers 10 MB per write, so
cancel and progress are coarse. Folio keeps its own ``.incomplete`` file instead and
resumes it with an HTTP Range request, while still going through huggingface_hub for
everything else: the resolve URL and endpoint, the HEAD metadata (``X-Linked-Etag``,
``X-Linked-Size``, redirect location), its HTTP session, headers and error mapping.

A file is moved to its final name only after its SHA-256 (LFS files) or git blob hash
(small files) matches what the Hub lists; a mismatch deletes the bytes and says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from engine import paths
from engine.hub.errors import (
    DiskFullError,
    DownloadCancelled,
    HubError,
    HubUnreachableError,
    VerificationError,
    explain,
    is_disk_full,
    is_network_error,
)
from engine.hub.remote import HubFile, ModelCandidate, RemoteFile, request_headers, resolve_file
from engine.model.fetch import STAMP_SUFFIX
from engine.units import format_bytes

__all__ = [
    "CancelToken",
    "DownloadProgress",
    "DownloadRequest",
    "DownloadState",
    "ProgressCallback",
    "discard_partial",
    "download_model",
    "pending_downloads",
    "read_stamp",
    "repo_folder",
]

CHUNK = 1 << 20
INCOMPLETE_SUFFIX = ".incomplete"
REQUEST_PREFIX = ".download-"
FOLDER_MARKER = ".folio-model.json"
READ_TIMEOUT_S = 30.0
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def repo_folder(repo_id: str) -> str:
    """``"HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"`` -> ``"HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"``."""
    parts = repo_id.split("/")
    if not all(parts) or any(p in (".", "..") for p in parts):
        raise ValueError(f"not a repository id: {repo_id!r}")
    return "--".join(parts)


# --------------------------------------------------------------------------- records


class DownloadState(StrEnum):
    QUEUED = "queued"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (DownloadState.DONE, DownloadState.FAILED, DownloadState.CANCELLED)


@dataclass(frozen=True)
class DownloadRequest:
    """What to download: one GGUF file, or the files of a safetensors folder."""

    repo_id: str
    revision: str
    kind: str  # "gguf" or "safetensors"
    name: str
    files: tuple[HubFile, ...]

    @classmethod
    def from_candidate(cls, candidate: ModelCandidate) -> DownloadRequest:
        return cls(
            candidate.repo_id, candidate.revision, candidate.kind, candidate.name, candidate.files
        )

    @property
    def total_bytes(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if None in sizes else sum(sizes)  # type: ignore[arg-type]

    @property
    def key(self) -> tuple[str, str]:
        return self.repo_id, self.name

    def folder(self, base: Path) -> Path:
        return base / repo_folder(self.repo_id)

    def target(self, base: Path) -> Path:
        """The path to load once done: the .gguf file, or the folder."""
        folder = self.folder(base)
        return folder / self.files[0].path if self.kind == "gguf" else folder

    def to_json(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "kind": self.kind,
            "name": self.name,
            "files": [
                {"path": f.path, "size": f.size, "sha256": f.sha256, "blob_id": f.blob_id}
                for f in self.files
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> DownloadRequest:
        files = tuple(
            HubFile(f["path"], f.get("size"), f.get("sha256"), f.get("blob_id"))
            for f in data["files"]
        )
        return cls(data["repo_id"], data["revision"], data["kind"], data["name"], files)


@dataclass(frozen=True)
class DownloadProgress:
    """A snapshot of one download, as handed to progress callbacks (immutable, thread-safe)."""

    job_id: int
    state: DownloadState
    repo_id: str
    name: str
    file: str | None = None  # the file being transferred or verified
    done_bytes: int = 0  # of the whole request (all its files)
    total_bytes: int | None = None
    bytes_per_s: float | None = None
    eta_s: float | None = None
    resumed_bytes: int = 0  # found on disk when this run started (not fetched again)
    message: str = ""  # plain words for a status line; the error text when failed
    path: Path | None = None  # what to load, once done
    error: HubError | None = None

    @property
    def fraction(self) -> float | None:
        if not self.total_bytes:
            return None
        return min(1.0, self.done_bytes / self.total_bytes)


ProgressCallback = Callable[[DownloadProgress], None]


class CancelToken:
    """Set from any thread; the download stops at its next chunk, keeping the partial file."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` unless cancelled first (retry back-off that a cancel cuts short)."""
        if self._event.wait(seconds):
            self.check()

    def check(self) -> None:
        if self._event.is_set():
            raise DownloadCancelled(
                "download cancelled; the partial file is kept, so it can resume later"
            )


class _Meter:
    """Bytes done, speed (over a sliding window) and throttled progress reports."""

    def __init__(self, emit: Callable[..., None], total: int | None, interval_s: float):
        self.emit = emit
        self.total = total
        self.interval = interval_s
        self.done = 0
        self.samples: list[tuple[float, int]] = []
        self.last_emit = 0.0

    def speed(self) -> float | None:
        if len(self.samples) < 2 or self.samples[-1][0] <= self.samples[0][0]:
            return None
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return (b1 - b0) / (t1 - t0)

    def add(self, n: int, file: str) -> None:
        self.done += n
        now = time.monotonic()
        self.samples.append((now, self.done))
        while len(self.samples) > 2 and now - self.samples[0][0] > 3.0:
            self.samples.pop(0)
        if now - self.last_emit >= self.interval:
            self.report(DownloadState.DOWNLOADING, file)

    def report(self, state: DownloadState, file: str | None, **extra) -> None:
        self.last_emit = time.monotonic()
        speed = self.speed()
        eta = None
        if speed and self.total is not None and speed > 0:
            eta = max(0.0, (self.total - self.done) / speed)
        self.emit(
            state=state, file=file, done_bytes=self.done, bytes_per_s=speed, eta_s=eta, **extra
        )


# --------------------------------------------------------------------------- disk helpers


def _write_chunk(fh, data: bytes) -> None:
    """The single write path for downloaded bytes (tests patch it to simulate a full disk)."""
    fh.write(data)


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _safe_relative(path: str) -> Path:
    rel = Path(path)
    if rel.is_absolute() or any(p in ("..", "") for p in rel.parts):
        raise HubError(f"refusing to download {path!r}: not a plain path inside the repository")
    return rel


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_stamp(path: Path) -> dict | None:
    try:
        data = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
        st = path.stat()
    except (OSError, ValueError):
        return None
    if (
        not isinstance(data, dict)
        or data.get("size") != st.st_size
        or data.get("mtime_ns") != st.st_mtime_ns
    ):
        return None
    return data


def _already_verified(path: Path, f: HubFile) -> bool:
    stamp = read_stamp(path)
    if stamp is None:
        return False
    if f.sha256:
        return stamp.get("sha256") == f.sha256.lower()
    return f.blob_id is None or stamp.get("blob_id") == f.blob_id


def _request_path(folder: Path, request: DownloadRequest) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", request.name)
    return folder / f"{REQUEST_PREFIX}{slug}.json"


def _hash_file(
    path: Path, want_git: bool, on_bytes: Callable[[int], None], cancel: CancelToken
) -> tuple[str, str | None]:
    sha = hashlib.sha256()
    git = None
    if want_git:  # git blob id: sha1 over "blob <size>\0" + content
        git = hashlib.sha1(usedforsecurity=False)
        git.update(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            cancel.check()
            sha.update(chunk)
            if git is not None:
                git.update(chunk)
            on_bytes(len(chunk))
    return sha.hexdigest(), git.hexdigest() if git is not None else None


# --------------------------------------------------------------------------- one download


def download_model(
    request: DownloadRequest | ModelCandidate,
    *,
    models_dir: Path | str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    retries: int = 5,
    job_id: int = 0,
    progress_interval_s: float = 0.1,
) -> Path:
    """Download (or resume) ``request`` into the models folder; return the path to load.

    Blocks the calling thread: run it on a worker (see engine.hub.downloads.DownloadManager).
    ``progress`` receives :class:`DownloadProgress` snapshots on this thread. Raises
    :class:`DownloadCancelled` (partial kept), :class:`DiskFullError` (partial kept),
    :class:`VerificationError` (bytes deleted), :class:`HubUnreachableError` after
    ``retries`` failed reconnections (partial kept), or another :class:`HubError`.
    """
    if isinstance(request, ModelCandidate):
        request = DownloadRequest.from_candidate(request)
    base = paths.models_dir(models_dir)
    cancel = cancel or CancelToken()
    folder = request.folder(base)

    def emit(**fields) -> None:
        if progress is not None:
            progress(
                DownloadProgress(
                    job_id,
                    repo_id=request.repo_id,
                    name=request.name,
                    total_bytes=request.total_bytes,
                    **fields,
                )
            )

    meter = _Meter(emit, request.total_bytes, progress_interval_s)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(_request_path(folder, request), request.to_json())
        # Bytes already on disk (finished files and partials) count as done from the start.
        resumed = 0
        for f in request.files:
            final = folder / _safe_relative(f.path)
            if _already_verified(final, f):
                resumed += f.size or final.stat().st_size
            else:
                with contextlib.suppress(OSError):
                    resumed += final.with_name(final.name + INCOMPLETE_SUFFIX).stat().st_size
        meter.done = resumed
        meter.report(DownloadState.DOWNLOADING, None, resumed_bytes=resumed, message="starting")
        for f in request.files:
            final = folder / _safe_relative(f.path)
            if _already_verified(final, f):
                continue
            _download_file(request, f, final, meter, cancel, endpoint, token, retries)
            meter.report(DownloadState.DOWNLOADING, f.path, resumed_bytes=resumed)
        if request.kind == "safetensors":
            _write_json(
                folder / FOLDER_MARKER, {"repo_id": request.repo_id, "revision": request.revision}
            )
        _request_path(folder, request).unlink(missing_ok=True)
    except OSError as exc:
        if is_disk_full(exc):
            raise _disk_full(request, folder, None) from exc
        raise
    target = request.target(base)
    meter.report(
        DownloadState.DONE,
        None,
        resumed_bytes=resumed,
        message=f"downloaded and verified: {target}",
        path=target,
    )
    return target


def _disk_full(
    request: DownloadRequest, folder: Path, partial: Path | None, remaining: int | None = None
) -> DiskFullError:
    free = _free_bytes(folder)
    need = (
        f"; about {format_bytes(remaining, 'MB')} more is needed" if remaining is not None else ""
    )
    free_words = format_bytes(free, "MB", unknown="an unknown amount")
    return DiskFullError(
        f"the disk is full: {free_words} free in {folder}{need} to finish {request.name}. "
        f"The part already downloaded is kept: free some space, then resume the download",
        free,
        partial,
    )


def _download_file(
    request: DownloadRequest,
    f: HubFile,
    final: Path,
    meter: _Meter,
    cancel: CancelToken,
    endpoint: str | None,
    token: str | None,
    retries: int,
) -> None:
    cancel.check()
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + INCOMPLETE_SUFFIX)
    remote = resolve_file(
        request.repo_id, f.path, revision=request.revision, endpoint=endpoint, token=token
    )
    expected_size = f.size if f.size is not None else remote.size
    expected_sha = (f.sha256 or "").lower() or None
    if (
        expected_sha is None
        and f.blob_id is None
        and remote.etag
        and _SHA256_RE.match(remote.etag.lower())
    ):
        expected_sha = remote.etag.lower()  # X-Linked-Etag of an LFS file is its sha256
    have = partial.stat().st_size if partial.exists() else 0
    if expected_size is not None and have > expected_size:  # not the file we expect: start over
        partial.unlink()
        meter.done -= have
        have = 0
    free = _free_bytes(final.parent)
    if expected_size is not None and free is not None and free < expected_size - have:
        raise _disk_full(request, final.parent, partial if have else None, expected_size - have)

    failures = 0
    while expected_size is None or have < expected_size:
        cancel.check()
        before = have
        try:
            have = _fetch_into(partial, remote, have, expected_size, meter, f.path, cancel, token)
        except OSError as exc:
            if is_disk_full(exc):
                remaining = (
                    None if expected_size is None else expected_size - partial.stat().st_size
                )
                raise _disk_full(request, final.parent, partial, remaining) from exc
            if not is_network_error(exc):
                raise
            have = partial.stat().st_size if partial.exists() else 0
        except DownloadCancelled:
            raise
        except Exception as exc:
            if not is_network_error(exc):
                raise explain(exc, request.repo_id, f.path) from exc
            have = partial.stat().st_size if partial.exists() else 0
        else:
            if expected_size is None:
                break  # the server closed a response of unknown length: that is the end
            if have >= expected_size:
                break
        # A dropped connection: resume from the bytes on disk, giving up only after
        # `retries` attempts in a row that brought nothing new.
        failures = 0 if have > before else failures + 1
        if failures > retries:
            total = format_bytes(expected_size, "MB", unknown="an unknown amount")
            raise HubUnreachableError(
                f"the download of {f.path} stopped at {format_bytes(have, 'MB')} of {total}: "
                f"the Hub cannot be reached: check your connection. The part already downloaded "
                f"is kept; resume the download to continue"
            )
        meter.report(DownloadState.DOWNLOADING, f.path, message="connection lost; resuming")
        cancel.sleep(min(0.2 * 2**failures, 10.0))

    _verify_and_move(request, f, partial, final, expected_size, expected_sha, meter, cancel)


def _fetch_into(
    partial: Path,
    remote: RemoteFile,
    have: int,
    expected_size: int | None,
    meter: _Meter,
    name: str,
    cancel: CancelToken,
    token: str | None,
) -> int:
    """One GET (a Range request from ``have`` when resuming); returns the bytes now on disk."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    headers = request_headers(token, remote.same_origin)
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream(
        "GET", remote.url, headers=headers, follow_redirects=True, timeout=READ_TIMEOUT_S
    ) as response:
        if response.status_code == 416 and expected_size is not None and have == expected_size:
            return have  # already complete
        hf_raise_for_status(response)
        mode = "ab"
        if have and response.status_code != 206:
            # The server ignored Range and sends the whole file: start the partial over.
            meter.done -= have
            have, mode = 0, "wb"
        with partial.open(mode) as fh:
            try:
                for chunk in response.iter_bytes():
                    cancel.check()
                    _write_chunk(fh, chunk)
                    have += len(chunk)
                    meter.add(len(chunk), name)
            finally:
                fh.flush()
                with contextlib.suppress(OSError):
                    os.fsync(fh.fileno())
    return have


def _verify_and_move(
    request: DownloadRequest,
    f: HubFile,
    partial: Path,
    final: Path,
    expected_size: int | None,
    expected_sha: str | None,
    meter: _Meter,
    cancel: CancelToken,
) -> None:
    size = partial.stat().st_size
    if expected_size is not None and size != expected_size:
        partial.unlink()
        raise VerificationError(
            f"{f.path} from {request.repo_id} has {size:,} bytes instead of {expected_size:,}; "
            f"it was deleted: download it again"
        )
    verified = [0]

    def hashed(n: int) -> None:
        verified[0] += n
        if time.monotonic() - meter.last_emit >= meter.interval:
            meter.report(
                DownloadState.VERIFYING,
                f.path,
                message=f"verifying {f.path}: {verified[0] * 100 // max(size, 1)}%",
            )

    meter.report(DownloadState.VERIFYING, f.path, message=f"verifying {f.path}")
    sha256, git = _hash_file(
        partial, expected_sha is None and f.blob_id is not None, hashed, cancel
    )
    if expected_sha is not None and sha256 != expected_sha:
        partial.unlink()
        meter.done -= size
        raise VerificationError(
            f"{f.path} from {request.repo_id} is damaged: its SHA-256 is {sha256}, the Hub lists "
            f"{expected_sha}. The file was deleted; download it again"
        )
    if expected_sha is None and f.blob_id is not None and git != f.blob_id:
        partial.unlink()
        meter.done -= size
        raise VerificationError(
            f"{f.path} from {request.repo_id} does not match the Hub's checksum (git {f.blob_id}); "
            f"the file was deleted: download it again"
        )
    os.replace(partial, final)
    st = final.stat()
    _write_json(
        _stamp_path(final),
        {
            "file": final.name,
            "sha256": sha256,
            "blob_id": f.blob_id,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "repo_id": request.repo_id,
            "revision": request.revision,
            "path_in_repo": f.path,
        },
    )


# --------------------------------------------------------------------------- resume state


def pending_downloads(models_dir: Path | str | None = None) -> list[DownloadRequest]:
    """Downloads that were started and not finished (cancelled, failed, app closed)."""
    base = paths.models_dir(models_dir)
    out = []
    for path in sorted(base.glob(f"*/{REQUEST_PREFIX}*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            out.append(DownloadRequest.from_json(json.loads(path.read_text(encoding="utf-8"))))
    return out


def discard_partial(request: DownloadRequest, models_dir: Path | str | None = None) -> int:
    """Delete what an unfinished download left behind; returns the bytes freed."""
    base = paths.models_dir(models_dir)
    folder = request.folder(base)
    freed = 0
    for f in request.files:
        partial = folder / _safe_relative(f.path)
        partial = partial.with_name(partial.name + INCOMPLETE_SUFFIX)
        with contextlib.suppress(FileNotFoundError):
            freed += partial.stat().st_size
            partial.unlink()
    _request_path(folder, request).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # only if nothing else is in it
    return freed
