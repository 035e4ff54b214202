"""Downloads and header reads against a hostile or unlucky server (hub_server.Behaviour).

No test waits on a real timeout: the ``fast`` fixture shrinks the stall window, the
read timeouts and the retry back-off to fractions of a second; a bound of a few seconds
on a thread's join only proves that nothing hangs.
"""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest

from engine.hub import remote, transfer
from engine.hub.downloads import DownloadManager
from engine.hub.errors import (
    DiskFullError,
    DownloadCancelled,
    HubError,
    HubUnreachableError,
    VerificationError,
)
from engine.hub.remote import list_repo_models, peek_gguf
from engine.hub.transfer import (
    CancelToken,
    DownloadRequest,
    DownloadState,
    download_model,
    pending_downloads,
)
from tests.engine.hub_server import Behaviour, FakeHub
from tests.engine.test_hub import tiny_gguf

REPO = "folio-test/Hostile-GGUF"
FILE = "m.Q8_0.gguf"
DATA = bytes(range(256)) * 16  # 4 KB: an "LFS" file, so its bytes come from the fake CDN


@pytest.fixture
def hub(tmp_path, monkeypatch):
    yield from FakeHub().serve_isolated(monkeypatch, tmp_path)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(transfer, "STALL_WINDOW_S", 0.3)
    monkeypatch.setattr(transfer, "STALL_MIN_BYTES", 1024)
    monkeypatch.setattr(transfer, "RETRY_BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 0.3)
    monkeypatch.setattr(remote, "RANGE_TIMEOUT_S", 0.3)


def serve(hub: FakeHub, behaviour: Behaviour | None = None, data: bytes = DATA, **kwargs):
    """REPO with FILE misbehaving as ``behaviour``; returns FILE's download candidate."""
    hub.add_repo(REPO, {FILE: data}, behaviour={FILE: behaviour} if behaviour else {}, **kwargs)
    return list_repo_models(REPO).candidate(FILE)


def models(tmp_path: Path) -> Path:
    return tmp_path / "models"


def leftovers(tmp_path: Path) -> list[str]:
    """What a download left in the models folder."""
    base = models(tmp_path)
    return sorted(str(p.relative_to(base)) for p in base.rglob("*")) if base.exists() else []


def in_thread(fn) -> tuple[threading.Thread, list]:
    """Run ``fn`` on a daemon thread; the list receives its result or exception."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def sent(hub: FakeHub, method: str) -> bool:
    """Whether the client sent ``method`` for FILE (HEAD: its metadata, GET: its bytes)."""
    with hub.lock:
        return any(m == method and p.endswith(FILE) for m, p, _ in hub.requests)


# --------------------------------------------------------------------------- size cap


@pytest.mark.parametrize("behaviour", [Behaviour.ENDLESS, Behaviour.NO_CONTENT_LENGTH])
def test_a_body_longer_than_listed_is_cut_at_the_listed_size(hub, monkeypatch, behaviour):
    candidate = serve(hub, behaviour)
    largest = [0]
    real_write = transfer._write_chunk

    def measured(fh, data):
        real_write(fh, data)
        largest[0] = max(largest[0], fh.tell())

    monkeypatch.setattr(transfer, "_write_chunk", measured)
    path = download_model(candidate)
    assert path.read_bytes() == DATA
    assert largest[0] == len(DATA), "nothing past the listed size reached the disk"
    assert hub.bytes_served[(REPO, FILE)] < hub.endless_bytes // 4


def test_endless_junk_on_a_small_disk_keeps_nothing(hub, tmp_path, monkeypatch):
    candidate = serve(hub, Behaviour.ENDLESS, wrong_sha256={FILE})  # the bytes are not the file
    real_write = transfer._write_chunk

    def small_disk(fh, data):
        if fh.tell() + len(data) > 64 * 1024:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fh, data)

    monkeypatch.setattr(transfer, "_write_chunk", small_disk)
    with pytest.raises(VerificationError, match="damaged.*deleted") as info:
        download_model(candidate)
    assert "\n" not in str(info.value)
    assert leftovers(tmp_path) == [] and pending_downloads() == []


def test_the_disk_full_message_never_says_a_negative_need(tmp_path):
    request = DownloadRequest(REPO, "main", "gguf", FILE, ())
    overshoot = transfer._disk_full(request, tmp_path, None, -8_000_000)
    assert isinstance(overshoot, DiskFullError)
    assert "about -" not in str(overshoot) and "more is needed" not in str(overshoot)
    short = transfer._disk_full(request, tmp_path, None, 5 * 10**6)
    assert "about 5 MB more is needed" in str(short)


# --------------------------------------------------------------------------- silence and trickles


@pytest.mark.parametrize("where", ["before the metadata", "before the response", "mid-body"])
def test_cancel_is_prompt_while_the_server_is_silent(hub, tmp_path, where):
    # Default timeouts (10 s metadata, 30 s reads) on purpose: the cancel must not wait for them.
    if where == "mid-body":
        candidate = serve(hub)
        hub.pause_at[(REPO, FILE)] = (len(DATA) // 2, threading.Event())  # never released
    elif where == "before the response":
        candidate = serve(hub, Behaviour.SILENT)
    else:
        candidate = serve(hub, Behaviour.SILENT_METADATA)
    token = CancelToken()
    thread, out = in_thread(lambda: download_model(candidate, cancel=token))
    asked = "HEAD" if where == "before the metadata" else "GET"
    deadline = time.monotonic() + 5
    while not sent(hub, asked) and time.monotonic() < deadline:
        time.sleep(0.01)
    if where == "mid-body":
        assert hub.paused.wait(5)
    time.sleep(0.2)  # the client is now blocked on a socket that says nothing
    token.cancel()
    thread.join(5)
    assert not thread.is_alive(), "cancel waited on the silent server"
    assert isinstance(out[0], DownloadCancelled) and "kept" in str(out[0])
    assert len(pending_downloads()) == 1  # a cancel is resumable


@pytest.mark.parametrize("behaviour", [Behaviour.TRICKLE, Behaviour.SILENT])
def test_a_stalled_server_is_given_up_and_frees_the_worker(hub, fast, behaviour):
    stalled = serve(hub, behaviour)
    hub.add_repo("folio-test/Fine-GGUF", {"ok.Q8_0.gguf": DATA})
    fine = list_repo_models("folio-test/Fine-GGUF").candidate("ok.Q8_0.gguf")
    manager = DownloadManager(retries=1)
    first, second = manager.enqueue(stalled), manager.enqueue(fine)
    try:
        failed = manager.wait(first, timeout=5)
        done = manager.wait(second, timeout=5)
    finally:
        manager.close()
    assert failed.state == DownloadState.FAILED and isinstance(failed.error, HubUnreachableError)
    assert "sent almost nothing" in failed.message and "resume" in failed.message
    assert done.state == DownloadState.DONE, done.message
    assert [r.repo_id for r in pending_downloads()] == [REPO]  # kept: it may resume later


# --------------------------------------------------------------------------- header peeks


def test_peek_reads_only_the_header_from_a_server_ignoring_range(hub, tmp_path, monkeypatch):
    padded = tiny_gguf(tmp_path / "t.gguf") + bytes(32 * 1024**2)
    serve(hub, Behaviour.IGNORE_RANGE, data=padded)
    monkeypatch.setattr(remote, "HEADER_READ_BYTES", 512)  # several reads, each from byte 0
    summary = peek_gguf(REPO, FILE)
    assert summary.architecture == "llama" and summary.tensor_types == {"F32": 2, "Q8_0": 6}
    assert hub.bytes_served[(REPO, FILE)] < len(padded), "less than one whole body in all"


@pytest.mark.parametrize("behaviour", [Behaviour.TRICKLE, Behaviour.SILENT])
def test_peek_gives_up_on_a_stalled_server(hub, tmp_path, fast, behaviour):
    serve(hub, behaviour, data=tiny_gguf(tmp_path / "t.gguf"))
    thread, out = in_thread(lambda: peek_gguf(REPO, FILE))
    thread.join(5)
    assert not thread.is_alive(), "the header read hung"
    assert isinstance(out[0], HubUnreachableError), out[0]
    assert "\n" not in str(out[0]) and "check your connection" in str(out[0])


# --------------------------------------------------------------------------- redirects


def test_a_redirect_loop_is_refused_in_plain_words(hub, tmp_path):
    candidate = serve(hub, Behaviour.REDIRECT_LOOP)
    for attempt in (lambda: download_model(candidate), lambda: peek_gguf(REPO, FILE)):
        with pytest.raises(HubError, match="redirects the request in a loop") as info:
            attempt()
        assert not isinstance(info.value, HubUnreachableError)
    assert leftovers(tmp_path) == [] and pending_downloads() == []


@pytest.mark.parametrize("behaviour", [Behaviour.REDIRECT_FILE_URL, Behaviour.RESOLVE_FILE_URL])
def test_a_file_url_redirect_is_refused_in_plain_words(hub, tmp_path, behaviour):
    candidate = serve(hub, behaviour)
    with pytest.raises(HubError, match=r"not a web address.*only over http\(s\)") as info:
        download_model(candidate, retries=1)
    assert "file://" in str(info.value) and "/etc/passwd" in str(info.value)
    assert not isinstance(info.value, HubUnreachableError)
    assert leftovers(tmp_path) == [] and pending_downloads() == []


# --------------------------------------------------------------------------- file names

UNSAFE_NAMES = [
    "../evil.gguf",
    "sub/../../evil.gguf",
    "/etc/evil.gguf",
    "\\evil.gguf",
    "sub\\..\\..\\evil.gguf",
    "C:evil.gguf",
    "C:\\evil.gguf",
    "C:/evil.gguf",
    "//server/share/evil.gguf",
    "sub//evil.gguf",
]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_an_unsafe_file_name_is_refused_and_leaves_nothing(hub, tmp_path, name):
    hub.add_repo(REPO, {name: DATA})
    candidate = list_repo_models(REPO).candidate(name)
    with pytest.raises(HubError, match="refusing to download.*nothing was written"):
        download_model(candidate)
    assert leftovers(tmp_path) == [] and pending_downloads() == []
    assert not list(tmp_path.rglob("evil.gguf")) and not list(Path("/etc").glob("evil.gguf"))
    assert not [r for r in hub.requests if "/resolve/" in r[1]], "nothing was asked of the Hub"


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_safe_relative_refuses_under_posix_and_windows_rules(name):
    for flavour in (PurePosixPath, PureWindowsPath):
        with pytest.raises(HubError, match="refusing"):
            transfer._safe_relative(name, flavour)


@pytest.mark.parametrize("name", ["model.gguf", "sub/dir/model.Q4_K_M.gguf", "a..b.gguf"])
def test_safe_relative_keeps_plain_names_inside_the_folder(name):
    # Why the Windows rules matter on every system: a drive-relative name replaces the folder.
    assert not (PureWindowsPath("D:/models/r") / "C:evil.gguf").is_relative_to("D:/models/r")
    for base in (PurePosixPath("/models/r"), PureWindowsPath("D:/models/r")):
        joined = base / transfer._safe_relative(name, type(base))
        assert joined.is_relative_to(base) and joined != base


@pytest.mark.parametrize("repo_id", ["C:/evil", "owner/..", "a\\b/c", "owner/"])
def test_a_repository_name_that_could_leave_the_folder_is_refused(repo_id):
    with pytest.raises(ValueError, match="not a repository id"):
        transfer.repo_folder(repo_id)
