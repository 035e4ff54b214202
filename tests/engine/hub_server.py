"""A fake Hugging Face Hub on 127.0.0.1 that answers the endpoints engine.hub uses.

* ``GET /api/models`` — search (``search``, ``filter``, ``sort``, ``limit``)
* ``GET /api/models/<repo>[/revision/<rev>]`` — model info with file sizes, blob ids
  and LFS sha256 (``?blobs=true``), plus the ``gguf`` / ``config`` / ``safetensors`` fields
* ``HEAD|GET /<repo>/resolve/<rev>/<path>`` — like the Hub: small files answer directly
  (``ETag`` = git blob id); LFS files redirect to a "CDN" on another origin
  (``localhost`` instead of ``127.0.0.1``) with ``X-Linked-Etag`` (sha256),
  ``X-Linked-Size`` and ``X-Repo-Commit``
* ``HEAD|GET /cdn/<repo>/<path>`` — the bytes, with ``Range`` support

Faults a test can switch on: drop the connection after N bytes (once), advertise a
wrong sha256, require a token (401 ``GatedRepo``), pause at an offset until released,
and a hostile :class:`Behaviour` per file (``FakeRepo.behaviour``): no Content-Length,
an endless body, a trickle, Range ignored, redirect loops, redirects to ``file://``, a
server that never answers. File names are served as listed, so a repository can list
``../evil.gguf`` or ``C:evil.gguf``. Every body byte sent is counted per file, so tests
can prove a resume fetched only the missing bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_MIN_SIZE = 1024  # files at least this large are "LFS" files (redirected, sha256)


class Behaviour(StrEnum):
    """How the fake Hub misbehaves when a client GETs one file's bytes (HEAD stays honest
    except for SILENT_METADATA)."""

    NO_CONTENT_LENGTH = "no-content-length"  # the body ends when the connection closes
    ENDLESS = "endless"  # the file, then junk up to FakeHub.endless_bytes, no Content-Length
    TRICKLE = "trickle"  # one byte every FakeHub.trickle_interval_s
    SILENT = "silent"  # the request is never answered (held for FakeHub.silent_s)
    SILENT_METADATA = "silent-metadata"  # the same for the HEAD that asks for size and hash
    IGNORE_RANGE = "ignore-range"  # always 200 with the whole file
    REDIRECT_LOOP = "redirect-loop"  # the CDN redirects to itself
    REDIRECT_FILE_URL = "redirect-file-url"  # the CDN redirects to file:///etc/passwd
    RESOLVE_FILE_URL = "resolve-file-url"  # the resolve URL itself points to file:///etc/passwd


FILE_URL = "file:///etc/passwd"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    gated_token: str | None = None  # a token is required when set
    downloads: int = 0
    likes: int = 0
    last_modified: str = "2025-01-01T00:00:00.000Z"
    tags: tuple[str, ...] = ("gguf",)
    gguf: dict | None = None
    config: dict | None = None
    safetensors: dict | None = None
    wrong_sha256: set[str] = field(default_factory=set)  # files whose listed sha256 is wrong
    behaviour: dict[str, Behaviour] = field(default_factory=dict)  # path -> how GETs misbehave

    def is_lfs(self, path: str) -> bool:
        return len(self.files[path]) >= LFS_MIN_SIZE

    def sha256(self, path: str) -> str:
        if path in self.wrong_sha256:
            return hashlib.sha256(b"not the content").hexdigest()
        return hashlib.sha256(self.files[path]).hexdigest()

    def info(self) -> dict:
        siblings = []
        for path, data in self.files.items():
            s = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
            if self.is_lfs(path):
                s["lfs"] = {"size": len(data), "sha256": self.sha256(path), "pointerSize": 134}
            siblings.append(s)
        out = {
            "id": self.repo_id,
            "modelId": self.repo_id,
            "sha": COMMIT,
            "downloads": self.downloads,
            "likes": self.likes,
            "lastModified": self.last_modified,
            "tags": list(self.tags),
            "gated": "manual" if self.gated_token else False,
            "private": False,
            "siblings": siblings,
        }
        for key in ("gguf", "config", "safetensors"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.bytes_served: Counter[tuple[str, str]] = Counter()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.drop_after: dict[tuple[str, str], int] = {}  # one-shot: close after N body bytes
        self.pause_at: dict[tuple[str, str], tuple[int, threading.Event]] = {}
        self.paused = threading.Event()  # set when a transfer reached its pause offset
        self.stopping = threading.Event()  # ends held, trickling and endless answers
        self.endless_bytes = 64 * 1024**2
        self.trickle_interval_s = 0.05
        self.silent_s = 60.0
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def add_repo(self, repo_id: str, files: dict[str, bytes], **kwargs) -> FakeRepo:
        repo = FakeRepo(repo_id, dict(files), **kwargs)
        self.repos[repo_id] = repo
        return repo

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self.url

    def stop(self) -> None:
        self.stopping.set()
        for _, event in self.pause_at.values():
            event.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def serve_isolated(self, monkeypatch, tmp_path) -> Iterator[FakeHub]:
        """Start, point huggingface_hub and Folio's folders at this server and at
        ``tmp_path`` (nothing of the real user's cache, token or settings is seen), and
        stop when the generator closes: the body of a pytest fixture."""
        self.start()
        monkeypatch.setenv("HF_ENDPOINT", self.url)
        monkeypatch.setenv("FOLIO_MODELS_DIR", str(tmp_path / "models"))
        monkeypatch.setenv("FOLIO_CONFIG_DIR", str(tmp_path / "config"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield self
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/cdn/([^/]+/[^/]+)/(.+)$")
_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")
_SORT_KEYS = {"downloads": "downloads", "likes": "likes", "lastModified": "last_modified"}


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    # -- plumbing --------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data, status: int = 200) -> None:
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"})  # fmt: skip

    def _repo(self, repo_id: str) -> FakeRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated_token and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            self._error(
                401,
                "GatedRepo",
                "Access to model is restricted. You must have access to it and be authenticated.",
            )
            return None
        return repo

    # -- verbs -----------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        with self.hub.lock:
            self.hub.requests.append((self.command, path, self.headers.get("Range")))
        if path == "/api/models":
            return self._search(parse_qs(url.query))
        if m := _INFO.match(path):
            repo = self._repo(m.group(1))
            if repo is not None:
                self._json(repo.info())
            return None
        if m := _RESOLVE.match(path):
            return self._resolve(m.group(1), m.group(3))
        if m := _CDN.match(path):
            return self._serve_bytes(m.group(1), m.group(2))
        return self._error(404, "NotFound", "no such endpoint")

    def _search(self, q: dict[str, list[str]]) -> None:
        text = (q.get("search") or [""])[0].lower()
        filters = q.get("filter") or []
        repos = [
            r
            for r in self.hub.repos.values()
            if text in r.repo_id.lower() and all(f in r.tags for f in filters)
        ]
        key = _SORT_KEYS.get((q.get("sort") or ["downloads"])[0], "downloads")
        repos.sort(key=lambda r: getattr(r, key), reverse=True)
        limit = int((q.get("limit") or ["1000"])[0])
        items = []
        for r in repos[:limit]:
            info = r.info()
            items.append(
                {
                    k: info[k]
                    for k in (
                        "id",
                        "downloads",
                        "likes",
                        "lastModified",
                        "tags",
                        "gated",
                        "private",
                    )
                }
            )
        self._json(items)

    def _resolve(self, repo_id: str, file: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        if file not in repo.files:
            self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                                  "X-Repo-Commit": COMMIT})  # fmt: skip
            return
        data = repo.files[file]
        if repo.behaviour.get(file) == Behaviour.SILENT_METADATA and self.command == "HEAD":
            self.hub.stopping.wait(self.hub.silent_s)
            self.close_connection = True
            return
        if repo.behaviour.get(file) == Behaviour.RESOLVE_FILE_URL:
            self._send(302, b"", {"Location": FILE_URL, "X-Repo-Commit": COMMIT,
                                  "X-Linked-Size": str(len(data))})  # fmt: skip
            return
        if repo.is_lfs(file):
            cdn = f"http://localhost:{self.hub.port}/cdn/{repo_id}/{file}"
            self._send(302, b"", {
                "Location": cdn,
                "X-Repo-Commit": COMMIT,
                "X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"',
                "X-Linked-Size": str(len(data)),
                "ETag": f'"{git_blob_id(b"pointer " + data[:16])}"',
            })  # fmt: skip
            return
        self._serve_bytes(
            repo_id, file, {"ETag": f'"{git_blob_id(data)}"', "X-Repo-Commit": COMMIT}
        )

    def _serve_bytes(self, repo_id: str, file: str, extra: dict[str, str] | None = None) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or file not in repo.files:
            self._error(404, "EntryNotFound", "Entry not found")
            return
        data = repo.files[file]
        behaviour = repo.behaviour.get(file) if self.command == "GET" else None
        if behaviour in (Behaviour.REDIRECT_LOOP, Behaviour.REDIRECT_FILE_URL):
            here = f"http://{self.headers.get('Host')}{self.path}"
            to = here if behaviour == Behaviour.REDIRECT_LOOP else FILE_URL
            self._send(302, b"", {"Location": to})
            return
        if behaviour == Behaviour.SILENT:
            self.hub.stopping.wait(self.hub.silent_s)
            self.close_connection = True
            return
        start, end, status = 0, len(data) - 1, 200
        rng = None if behaviour == Behaviour.IGNORE_RANGE else self.headers.get("Range")
        if rng:
            m = re.match(r"bytes=(\d+)-(\d*)$", rng)
            start = int(m.group(1))
            end = min(int(m.group(2)), len(data) - 1) if m.group(2) else len(data) - 1
            if start >= len(data):
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            status = 206
        body = data[start : end + 1]
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        if behaviour in (Behaviour.NO_CONTENT_LENGTH, Behaviour.ENDLESS):
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        key = (repo_id, file)
        if behaviour in (Behaviour.ENDLESS, Behaviour.TRICKLE):
            return self._misbehave(key, body, behaviour)
        with self.hub.lock:
            drop = self.hub.drop_after.pop(key, None)
            pause = self.hub.pause_at.get(key)
        sent = 0
        step = 16 * 1024
        try:
            while sent < len(body):
                piece = body[sent : sent + step]
                if drop is not None and start + sent + len(piece) > drop:
                    piece = piece[: max(0, drop - start - sent)]
                    self._write(key, piece)
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(2)  # the "network" drops mid-transfer
                    return
                if (
                    pause is not None
                    and start + sent + len(piece) > pause[0]
                    and not pause[1].is_set()
                ):
                    cut = max(0, pause[0] - start - sent)
                    self._write(key, piece[:cut])
                    sent += cut
                    self.wfile.flush()
                    self.hub.paused.set()
                    pause[1].wait(10)
                    continue
                self._write(key, piece)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _misbehave(self, key: tuple[str, str], body: bytes, behaviour: Behaviour) -> None:
        try:
            if behaviour == Behaviour.TRICKLE:
                for i in range(len(body)):
                    if self.hub.stopping.wait(self.hub.trickle_interval_s):
                        break
                    self._write(key, body[i : i + 1])
                    self.wfile.flush()
                return
            self._write(key, body)
            junk = b"junk" * 4096
            sent = len(body)
            while sent < self.hub.endless_bytes and not self.hub.stopping.is_set():
                self._write(key, junk)
                sent += len(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _write(self, key: tuple[str, str], piece: bytes) -> None:
        self.wfile.write(piece)
        with self.hub.lock:
            self.hub.bytes_served[key] += len(piece)
