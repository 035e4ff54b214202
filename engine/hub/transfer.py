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

What a server sends is not trusted: no more than the listed size is ever written (a
body without Content-Length, or an endless one, is cut off there and the hash decides),
a server that stalls or trickles is given up on after :data:`STALL_WINDOW_S`, a cancel
takes effect within :data:`POLL_S` even while the server is silent (the socket is read
on a helper thread, see :class:`_Body`), and a file name that could land outside the
models folder under POSIX or Windows rules is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import TypeVar

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
from engine.hub.remote import (
    HubFile,
    ModelCandidate,
    RemoteFile,
    http_timeout,
    request_headers,
    resolve_file,
)
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
# An attempt that brings fewer than STALL_MIN_BYTES within STALL_WINDOW_S (the response
# included) is given up: a server trickling a byte every few seconds never trips a read
# timeout. Such an attempt counts as a failed one, so a stalled server ends in an error
# after `retries` attempts instead of holding the single download worker for ever.
STALL_WINDOW_S = 30.0
STALL_MIN_BYTES = 64 * 1024
POLL_S = 0.1  # the longest a cancel waits while the server is silent
RETRY_BACKOFF_S = 0.2  # the wait after a failed attempt, doubled per failure in a row
RETRY_BACKOFF_MAX_S = 10.0
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# What the Hub allows in an owner or repository name; anything else (a drive "C:", a
# backslash) could name a folder outside the models folder on some system.
_REPO_PART_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_T = TypeVar("_T")


def repo_folder(repo_id: str) -> str:
    """``"HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"`` -> ``"HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"``."""
    parts = repo_id.split("/")
    if any(p in (".", "..") or not _REPO_PART_RE.match(p) for p in parts):
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


SPAN = 2 << 20  # downloaded bytes reach the disk in writes that end on multiples of this


class _SpanWriter:
    """Downloaded bytes written to ``fh`` (a file at offset ``at``) in writes that end on
    multiples of :data:`SPAN` (2 MB), all but the first starting on one, the rest at
    :meth:`flush`. Linux's page cache then holds the file in 2 MB folios (a write's folios
    follow its start and length; the network's chunks, at most 64 KB, left small ones), which
    it maps as huge pages: on CPUs without Folio's tiles the weights are read in place
    from the mapped file, at batch 1 1.17x faster from huge pages (Llama-3.2-1B shape
    Q4_K_M, the AVX2 kernels: decode 18.1-18.3 against 21.2-21.5 tok/s)."""

    def __init__(self, fh, at: int):
        self._fh, self._at, self._pending = fh, at, bytearray()

    def write(self, data: bytes) -> None:
        self._pending += data
        end = (self._at + len(self._pending)) // SPAN * SPAN
        if end > self._at:
            n = end - self._at
            _write_chunk(self._fh, bytes(self._pending[:n]))
            del self._pending[:n]
            self._at = end

    def flush(self) -> None:
        if self._pending:
            _write_chunk(self._fh, bytes(self._pending))
            self._at += len(self._pending)
            self._pending.clear()


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _safe_relative(path: str, flavour: type[PurePath] = Path) -> PurePath:
    """``path`` (a file name from the Hub) as a path relative to the repository folder.

    Checked under both POSIX and Windows rules whatever the system, since
    ``PureWindowsPath("D:/models") / "C:evil.gguf"`` is ``C:evil.gguf``: a name with a
    drive, a root, a ``..`` or an empty part is refused.
    """
    windows = PureWindowsPath(path)
    parts = path.replace("\\", "/").split("/")
    if not (windows.drive or windows.root or PurePosixPath(path).root) and all(
        p not in ("", ".", "..") for p in parts
    ):
        return flavour(path)
    raise HubError(
        f"refusing to download {path!r}: the repository lists a file name that could point "
        f"outside its folder; nothing was written. Report the repository to its owner"
    )


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
    # Every name is checked before the folder or the request file is written: a refused
    # download leaves nothing behind, least of all a pending download to "resume".
    try:
        folder = request.folder(base)
    except ValueError as exc:
        raise HubError(
            f"refusing to download from {request.repo_id!r}: not a Hub repository name"
        ) from exc
    finals = [folder / _safe_relative(f.path) for f in request.files]

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
        for f, final in zip(request.files, finals, strict=True):
            if _already_verified(final, f):
                resumed += f.size or final.stat().st_size
            else:
                with contextlib.suppress(OSError):
                    resumed += _partial_path(final).stat().st_size
        meter.done = resumed
        meter.report(DownloadState.DOWNLOADING, None, resumed_bytes=resumed, message="starting")
        for f, final in zip(request.files, finals, strict=True):
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
    except (DownloadCancelled, DiskFullError, HubUnreachableError):
        raise  # worth resuming: the request file stays
    except HubError:
        _forget_if_nothing_kept(request, folder, finals)
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


def _forget_if_nothing_kept(request: DownloadRequest, folder: Path, finals: list[Path]) -> None:
    """After a refusal (bad hash, bad redirect, ...): no pending download unless bytes are kept."""
    kept = any(
        _partial_path(final).exists() or _already_verified(final, f)
        for f, final in zip(request.files, finals, strict=True)
    )
    if not kept:
        _request_path(folder, request).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if nothing else is in it


def _partial_path(final: Path) -> Path:
    return final.with_name(final.name + INCOMPLETE_SUFFIX)


def _disk_full(
    request: DownloadRequest, folder: Path, partial: Path | None, remaining: int | None = None
) -> DiskFullError:
    free = _free_bytes(folder)
    # A partial larger than the file (which the size cap now prevents) once gave "about
    # -8 MB more is needed": only a positive need is worth saying.
    need = (
        f"; about {format_bytes(remaining, 'MB' if remaining >= 10**6 else None)} more is needed"
        if remaining is not None and remaining > 0
        else ""
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
    partial = _partial_path(final)
    remote = _call_cancellable(
        cancel,
        lambda: resolve_file(
            request.repo_id, f.path, revision=request.revision, endpoint=endpoint, token=token
        ),
    )
    expected_size = f.size if f.size is not None else remote.size
    if expected_size is None:
        # Without a size there is nothing to cap the transfer at: an endless body would
        # fill the disk before the hash could say it is not the file.
        raise HubError(
            f"the Hub does not say how large {f.path} from {request.repo_id} is, so its "
            f"download cannot be checked; nothing was downloaded. Try again later"
        )
    expected_sha = (f.sha256 or "").lower() or None
    if (
        expected_sha is None
        and f.blob_id is None
        and remote.etag
        and _SHA256_RE.match(remote.etag.lower())
    ):
        expected_sha = remote.etag.lower()  # X-Linked-Etag of an LFS file is its sha256
    have = partial.stat().st_size if partial.exists() else 0
    if have > expected_size:  # not the file we expect: start over
        partial.unlink()
        meter.done -= have
        have = 0
    free = _free_bytes(final.parent)
    if free is not None and free < expected_size - have:
        raise _disk_full(request, final.parent, partial if have else None, expected_size - have)

    failures = 0
    while have < expected_size:
        cancel.check()
        before, stalled = have, False
        try:
            have = _fetch_into(partial, remote, have, expected_size, meter, f.path, cancel, token)
        except OSError as exc:
            if is_disk_full(exc):
                remaining = expected_size - partial.stat().st_size
                raise _disk_full(request, final.parent, partial, remaining) from exc
            if not is_network_error(exc):
                raise
            stalled = isinstance(exc, _Stalled)
            have = partial.stat().st_size if partial.exists() else 0
        except DownloadCancelled:
            raise
        except Exception as exc:
            if not is_network_error(exc):
                raise explain(exc, request.repo_id, f.path) from exc
            have = partial.stat().st_size if partial.exists() else 0
        else:
            if have >= expected_size:
                break
        # A dropped, stalled or short connection: resume from the bytes on disk, giving up
        # after `retries` attempts in a row that brought less than a stall window's worth.
        failures = 0 if have - before >= STALL_MIN_BYTES else failures + 1
        if failures > retries:
            total = format_bytes(expected_size, "MB")
            why = (
                f"the server sent almost nothing for {STALL_WINDOW_S:g} s"
                if stalled
                else "the Hub cannot be reached"
            )
            raise HubUnreachableError(
                f"the download of {f.path} stopped at {format_bytes(have, 'MB')} of {total}: "
                f"{why}: check your connection or try again later. The part already "
                f"downloaded is kept; resume the download to continue"
            )
        meter.report(DownloadState.DOWNLOADING, f.path, message="connection lost; resuming")
        cancel.sleep(min(RETRY_BACKOFF_S * 2**failures, RETRY_BACKOFF_MAX_S))

    _verify_and_move(request, f, partial, final, expected_size, expected_sha, meter, cancel)


class _Stalled(TimeoutError):
    """Less than STALL_MIN_BYTES came within STALL_WINDOW_S (a network error: retried)."""


def _call_cancellable(cancel: CancelToken, fn: Callable[[], _T]) -> _T:
    """``fn()`` on a helper thread, so that a cancel is not held up by a server that never answers."""
    done = threading.Event()
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="folio-download-resolve", daemon=True).start()
    while not done.wait(POLL_S):
        cancel.check()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class _Body:
    """One GET whose socket is read on a helper thread; the download thread takes chunks from a queue.

    A socket read blocked in one thread cannot be interrupted from another, so the
    download thread never makes one: waiting on the queue, it notices a cancel or a
    stall within POLL_S and walks away. Leaving shuts the socket down, which wakes the
    helper; it then ends (and at the latest at the read timeout of :func:`http_timeout`).
    """

    _END = object()

    def __init__(self, url: str, headers: dict[str, str]):
        self._items: queue.Queue = queue.Queue(maxsize=16)
        self._left = threading.Event()
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        threading.Thread(
            target=self._read, args=(url, headers), name="folio-download-read", daemon=True
        ).start()

    def __enter__(self) -> _Body:
        return self

    def __exit__(self, *exc_info) -> None:
        self._left.set()
        with self._lock:
            if self._socket is not None:
                with contextlib.suppress(OSError):
                    self._socket.shutdown(socket.SHUT_RDWR)

    def next(self, cancel: CancelToken, deadline: float):
        """The response first, then its chunks, then None; raises what the helper hit.

        Raises :class:`_Stalled` when nothing comes before ``deadline`` (monotonic time)
        and :class:`DownloadCancelled` once ``cancel`` is set.
        """
        while True:
            cancel.check()
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise _Stalled("the server stopped sending")
            try:
                item = self._items.get(timeout=min(POLL_S, wait))
            except queue.Empty:
                continue
            if item is self._END:
                return None
            if isinstance(item, BaseException):
                raise item
            return item

    def _read(self, url: str, headers: dict[str, str]) -> None:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        try:
            with get_session().stream(
                "GET", url, headers=headers, follow_redirects=True, timeout=http_timeout()
            ) as response:
                with self._lock:
                    self._socket = _socket_of(response)
                if response.status_code != 416:  # the download thread decides what 416 means
                    hf_raise_for_status(response)
                if not self._put(response):
                    return
                if response.status_code != 416:
                    for chunk in response.iter_bytes():
                        if not self._put(chunk):
                            return
                with self._lock:
                    self._socket = None  # the connection may go back to the pool now
            self._put(self._END)
        except Exception as exc:
            if _is_read_timeout(exc):
                # Connected, then nothing within the read timeout: the same as a stall
                # (which of the two timers fires first is a race).
                stalled = _Stalled("the server stopped sending")
                stalled.__cause__ = exc
                exc = stalled
            self._put(exc)
        finally:
            with self._lock:
                self._socket = None

    def _put(self, item) -> bool:
        while not self._left.is_set():
            with contextlib.suppress(queue.Full):
                self._items.put(item, timeout=POLL_S)
                return True
        return False


def _is_read_timeout(exc: BaseException) -> bool:
    import httpx

    return isinstance(exc, httpx.ReadTimeout | socket.timeout)


def _socket_of(response) -> socket.socket | None:
    stream = response.extensions.get("network_stream")
    return stream.get_extra_info("socket") if stream is not None else None


def _fetch_into(
    partial: Path,
    remote: RemoteFile,
    have: int,
    expected_size: int,
    meter: _Meter,
    name: str,
    cancel: CancelToken,
    token: str | None,
) -> int:
    """One GET (a Range request from ``have`` when resuming); returns the bytes now on disk.

    Writes no byte past ``expected_size``: a longer body (no Content-Length, an endless
    one) is cut off there, and the hash decides whether what came is the file.
    """
    headers = request_headers(token, remote.same_origin)
    if have:
        headers["Range"] = f"bytes={have}-"
    deadline = time.monotonic() + STALL_WINDOW_S
    with _Body(remote.url, headers) as body:
        response = body.next(cancel, deadline)
        if response.status_code == 416:
            if have == expected_size:
                return have  # already complete
            # The server's file is shorter than the partial: not the same bytes, start over.
            partial.unlink(missing_ok=True)
            meter.done -= have
            return 0
        mode = "ab"
        if have and response.status_code != 206:
            # The server ignored Range and sends the whole file: start the partial over.
            meter.done -= have
            have, mode = 0, "wb"
        window = 0  # bytes since the deadline was last moved
        with partial.open(mode) as fh:
            out = _SpanWriter(fh, have)
            try:
                while have < expected_size and (chunk := body.next(cancel, deadline)) is not None:
                    chunk = chunk[: expected_size - have]
                    out.write(chunk)
                    have += len(chunk)
                    meter.add(len(chunk), name)
                    window += len(chunk)
                    if window >= STALL_MIN_BYTES:
                        deadline, window = time.monotonic() + STALL_WINDOW_S, 0
            finally:
                out.flush()  # a cancel or a stall keeps every byte that came
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
    try:
        folder = request.folder(base)
    except ValueError:
        return 0  # refused before anything was written
    freed = 0
    for f in request.files:
        try:
            partial = _partial_path(folder / _safe_relative(f.path))
        except HubError:
            continue  # refused before anything was written
        with contextlib.suppress(FileNotFoundError):
            freed += partial.stat().st_size
            partial.unlink()
    _request_path(folder, request).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # only if nothing else is in it
    return freed
