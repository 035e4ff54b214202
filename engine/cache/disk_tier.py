"""Disk tier: a third tier of full pages in files, so the prompt cache survives a restart.

A store is one folder per model and cache format (`store_dir`: the fingerprint's root
digest names it, the same digest every chained hash starts from):

- ``seg-NNNNNNNN.kv``: a handful of large append-only segment files. Each starts with a
  header (format version, fingerprint digest, page-format digest, CRC) and holds page
  records: a record header (its chained hash, its parent's, the payload length, the
  payload's CRC-32 and the header's own CRC-32) then the page's bytes in the pool's format.
- ``index.bin``: where each record is, with its recency; replaced atomically. When missing,
  torn, from another format or behind its segments, it is rebuilt (or completed) by
  scanning the segment files.
- ``lock``: ``fcntl.flock``-ed by the one process that writes; others only read.
- ``store.json``: which model the store is for (its name and file), written by the
  writer; what `folio cache stats` lists and what deleting a model looks stores up by.

Nothing read from disk is trusted: a record is used only when its header and payload
CRCs, its hash and its length all check out, else it is dropped and the page recomputed.
Writes run on a background thread fed by a bounded queue, so the engine step never waits
for the disk (a page the queue has no room for is simply not written). Over its byte
budget the writer drops whole chain tails first (`eviction_order`), a segment's worth at a
time, then compacts: segments holding dropped records have their live records copied
forward and are deleted, so the store never exceeds the budget. Any OS error (full disk,
read-only or unwritable folder) turns the tier off with a one-line `status`; the engine
then simply runs without it.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.cache.eviction import eviction_order
from engine.cache.page import DIGEST_SIZE, CacheFingerprint
from engine.cache.storage import PagedKVStorage

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_BUDGET_CAP = 4 << 30  # default budget: this, or 10% of the free disk if less
MAX_SEGMENT_BYTES = 256 << 20
SEGMENT_FRACTION = 16  # segments are about 1/16 of the budget (a handful of files)
INDEX_INTERVAL_S = 2.0  # the writer rewrites the index at most this often (and at close)
SNAPSHOT_INTERVAL_S = 0.5  # `snapshot` is rebuilt at most this often

_SEG_MAGIC = b"FOLIOSEG"
_REC_MAGIC = b"FKVP"
_IDX_MAGIC = b"FOLIOIDX"
# magic, version, fingerprint root digest, page-format digest, crc32 of the rest
_SEG_HEADER = struct.Struct("<8sI16s16sI")
# magic, hash, parent hash, has parent, payload length, payload crc32, header crc32
_REC_HEADER = struct.Struct("<4s16s16sBQII")
_IDX_HEADER = struct.Struct("<8sI16s16sII")  # magic, version, root, format, segments, entries
_IDX_SEGMENT = struct.Struct("<IQ")  # segment id, bytes scanned
_IDX_ENTRY = struct.Struct("<16s16sBIQQQ")  # hash, parent, has parent, seg, offset, len, serial
_CRC = struct.Struct("<I")
_NO_PARENT = bytes(DIGEST_SIZE)
_SCAN_CHUNK = 1 << 20
_READ_SPAN = 64 << 20  # the most one read_chain call reads at once
_IOV_MAX = 512  # buffers per preadv call (POSIX guarantees 16, Linux takes 1024)
_MAX_READS_AHEAD = 4  # chains read ahead and not yet taken (each up to its chain's size)


def store_dir(location: Path | str, fingerprint: CacheFingerprint) -> Path:
    """The store of one model and cache format under ``location``."""
    return Path(location) / fingerprint.root_digest().hex()


@dataclass(frozen=True)
class StoreInfo:
    """One store under a location, read from its files (no tier opened)."""

    directory: Path
    model: str  # the model's name, "" when the store has no readable store.json
    model_path: str
    bytes: int  # of its files
    in_use: bool  # a process holds its writer lock
    pages: int | None  # as its index last counted them; None without a readable index


def list_stores(location: Path | str) -> list[StoreInfo]:
    """Every store under ``location`` (none when it does not exist)."""
    root = Path(location)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            label = json.loads((d / "store.json").read_text())
            model, model_path = str(label.get("model", "")), str(label.get("path", ""))
        except (OSError, ValueError, AttributeError):
            model = model_path = ""
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        out.append(StoreInfo(d, model, model_path, size, _locked(d), _indexed_pages(d)))
    return out


def _indexed_pages(directory: Path) -> int | None:
    try:
        with open(directory / "index.bin", "rb") as f:
            raw = f.read(_IDX_HEADER.size)
    except OSError:
        return None
    if len(raw) < _IDX_HEADER.size:
        return None
    magic, version, *_, entries = _IDX_HEADER.unpack(raw)
    return entries if (magic, version) == (_IDX_MAGIC, FORMAT_VERSION) else None


def _locked(directory: Path) -> bool:
    try:
        fd = os.open(directory / "lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


def delete_stores(location: Path | str, model_path: Path | str | None = None) -> tuple[int, int]:
    """Delete the stores under ``location`` (only ``model_path``'s, when given) that no
    process is writing. Returns (bytes freed, stores left because they are in use)."""
    want = str(Path(model_path).resolve()) if model_path is not None else None
    freed = busy = 0
    for store in list_stores(location):
        if want is not None and store.model_path != want:
            continue
        if store.in_use:
            busy += 1
            continue
        shutil.rmtree(store.directory, ignore_errors=True)
        if not store.directory.exists():
            freed += store.bytes
    return freed, busy


def default_budget(location: Path | str) -> int:
    """A few GB, or 10% of the free space where the store goes if that is less."""
    probe = Path(location)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return DEFAULT_BUDGET_CAP
    return min(DEFAULT_BUDGET_CAP, free // 10)


def page_format_digest(layout: PagedKVStorage) -> bytes:
    """Digest of the page format: every tensor's per-page shape and dtype, in the order
    ``PagedKVStorage.read_page`` lays them out."""
    text = "|".join(f"{tuple(t.shape[1:])}:{t.dtype}" for t in layout.page_tensors())
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()


@dataclass(eq=False)
class DiskEntry:
    """One record on disk. ``index`` is a unique id for the eviction order; ``fill`` and
    ``ref_count`` are there for it too (records are full and never referenced)."""

    index: int
    hash: bytes
    parent_hash: bytes | None
    segment: int
    offset: int  # of the record header
    length: int  # payload bytes
    access_serial: int
    fill: int = 1
    ref_count: int = 0

    @property
    def record_bytes(self) -> int:
        return _REC_HEADER.size + self.length


@dataclass
class _Segment:
    id: int
    size: int  # bytes in the file that the store accounts for (header included)
    live: int = 0  # bytes of records in the index

    @property
    def name(self) -> str:
        return segment_name(self.id)


def segment_name(segment_id: int) -> str:
    return f"seg-{segment_id:08d}.kv"


@dataclass(frozen=True)
class DiskTierStats:
    pages: int = 0
    bytes: int = 0  # on disk, segment files
    budget: int = 0
    writes: int = 0  # records appended by this process
    hits: int = 0  # pages read back
    hit_bytes: int = 0
    dropped: int = 0  # records found corrupt, torn or foreign and dropped
    evictions: int = 0
    skipped_writes: int = 0  # pages not queued: the queue was full
    writable: bool = False
    status: str = ""  # "" while on; otherwise why it is off or read-only


@dataclass(frozen=True)
class DiskTierSnapshot:
    """The store's records as other threads see them, one row each, oldest use first.
    Prefixes are a hash's first 8 bytes (little-endian), as the page table's snapshot
    gives them; a root's parent is 0."""

    hash_prefix: np.ndarray  # uint64
    parent_prefix: np.ndarray  # uint64
    access_serial: np.ndarray  # int64
    changes: int = 0  # the tier's `changes` it shows


def encode_record(h: bytes, parent: bytes | None, payload: bytes) -> bytes:
    head = _REC_HEADER.pack(
        _REC_MAGIC,
        h,
        parent or _NO_PARENT,
        parent is not None,
        len(payload),
        zlib.crc32(payload),
        0,
    )[: -_CRC.size]
    return head + _CRC.pack(zlib.crc32(head)) + payload


def _decode_header(
    raw: bytes | bytearray | memoryview,
) -> tuple[bytes, bytes | None, int, int] | None:
    """(hash, parent, payload length, payload crc) of a record header, None if it is bad."""
    if len(raw) < _REC_HEADER.size:
        return None
    magic, h, parent, has_parent, length, payload_crc, crc = _REC_HEADER.unpack_from(raw)
    if magic != _REC_MAGIC or zlib.crc32(raw[: _REC_HEADER.size - _CRC.size]) != crc:
        return None
    return h, (parent if has_parent else None), length, payload_crc


def _checked(entry: DiskEntry, raw: memoryview) -> memoryview | None:
    """``raw``'s payload when it is ``entry``'s record, whole and intact; else None."""
    payload = raw[_REC_HEADER.size :]
    return payload if _payload_ok(entry, raw[: _REC_HEADER.size], [payload]) else None


def _payload_ok(
    entry: DiskEntry, head: bytes | bytearray | memoryview, buffers: Sequence[memoryview]
) -> bool:
    """Whether a record read as its header ``head`` and its payload in ``buffers`` (end to
    end: one view of a read buffer, or views of a pool page's arrays) is ``entry``'s,
    whole and intact: header CRC, hash, length, payload CRC."""
    decoded = _decode_header(head)
    if decoded is None or decoded[0] != entry.hash or decoded[2] != entry.length:
        return False
    if sum(b.nbytes for b in buffers) != entry.length:
        return False
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc == decoded[3]


def _prefixes(hashes: Iterator[bytes]) -> np.ndarray:
    """The first 8 bytes of each hash as one little-endian uint64."""
    return np.frombuffer(b"".join(h[:8] for h in hashes), dtype="<u8").astype(np.uint64)


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd`` (the one place records and the index are written:
    the crash tests cut writes here)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class DiskTier:
    def __init__(
        self,
        directory: Path | str,
        fingerprint: CacheFingerprint,
        layout: PagedKVStorage,
        byte_budget: int | None = None,
        segment_bytes: int | None = None,
        max_pending_bytes: int = 256 << 20,
        label: dict[str, str] | None = None,
    ):
        """The store in ``directory`` for pages of ``layout``'s format under
        ``fingerprint``; ``label`` (the model's ``model`` name and file ``path``) goes
        into ``store.json``. Never raises for the disk's sake: a store it cannot use leaves
        the tier off, with the reason in ``status``."""
        self.directory = Path(directory)
        self.page_bytes = layout.bytes_per_page
        self._root = fingerprint.root_digest()
        self._format = page_format_digest(layout)
        self.budget = default_budget(self.directory) if byte_budget is None else byte_budget
        record = _REC_HEADER.size + self.page_bytes
        self.segment_bytes = segment_bytes or max(
            record + _SEG_HEADER.size, min(MAX_SEGMENT_BYTES, self.budget // SEGMENT_FRACTION)
        )
        self.max_pending_bytes = max_pending_bytes
        self.label = label or {}
        self.entries: dict[bytes, DiskEntry] = {}
        self.segments: dict[int, _Segment] = {}
        self._lock = threading.RLock()
        self._fds: dict[int, int] = {}
        # head hash -> (the chain asked for, its read on the reader thread)
        self._ahead: dict[bytes, tuple[list[bytes], Future]] = {}
        self._reader: ThreadPoolExecutor | None = None
        self._active: int | None = None  # segment the writer appends to
        self._ids = 0  # the newest segment's id
        self._entry_ids = itertools.count()
        self._clock = 0
        self._queue: queue.Queue = queue.Queue()
        self._pending: dict[bytes, int] = {}  # queued hash -> payload bytes
        self._pending_bytes = 0
        self._thread: threading.Thread | None = None
        self._lock_fd: int | None = None
        self._index_dirty = False
        self._index_written = 0.0
        # Moves whenever a record comes, goes or is read (its recency): `snapshot` is
        # rebuilt only then, and the engine publishes a snapshot when it moved.
        self.changes = 0
        self._snapshot: DiskTierSnapshot | None = None
        self._snapshot_at = 0.0
        self.enabled = False
        self.writable = False
        self.status = ""
        self.writes = self.hits = self.hit_bytes = self.dropped = 0
        self.evictions = self.skipped_writes = 0
        if record + _SEG_HEADER.size > self.budget:
            self._turn_off(f"budget of {self.budget} B holds no page of {self.page_bytes} B")
            return
        try:
            self._open()
        except OSError as exc:
            self._turn_off(f"cannot use {self.directory}: {exc}")

    # -- opening ---------------------------------------------------------------------

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        lock_path = self.directory / "lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            fd = os.open(lock_path, os.O_RDONLY)  # a read-only store: read what is there
        self._lock_fd = fd
        self.enabled = True
        self._try_become_writer()
        self._load()
        if self.writable:
            self._write_label()
            self._make_room(0)
            self._start_writer()
        elif not self.status:
            self.status = "reading only: another Folio process writes this store"

    def _write_label(self) -> None:
        if not self.label:
            return
        tmp = self.directory / "store.json.tmp"
        tmp.write_text(json.dumps(self.label))
        os.replace(tmp, self.directory / "store.json")

    def _try_become_writer(self) -> bool:
        assert self._lock_fd is not None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not os.access(self.directory, os.W_OK):
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            self.status = f"reading only: {self.directory} is not writable"
            return False
        self.writable = True
        self.status = ""
        return True

    def _load(self) -> None:
        """Segments and entries from the index where it is good, completed (or replaced)
        by scanning what the index does not cover. The writer also truncates torn tails
        and deletes segments of another format."""
        with self._lock:
            scanned = self._read_index()
            for seg_id, path in self._segment_files():
                self._ids = max(self._ids, seg_id)
                self._add_segment(seg_id, path, scanned.get(seg_id))
            for h in [h for h, e in self.entries.items() if e.segment not in self.segments]:
                del self.entries[h]  # indexed in a segment that is gone
                self.changes += 1
            if self.writable:
                for stale in self.directory.glob("*.tmp"):
                    stale.unlink(missing_ok=True)
                self._write_index()

    def _segment_files(self) -> Iterator[tuple[int, Path]]:
        for path in sorted(self.directory.glob("seg-*.kv")):
            try:
                yield int(path.stem[4:]), path
            except ValueError:
                continue

    def _read_index(self) -> dict[int, int]:
        """Load ``index.bin`` into ``entries``; returns bytes covered per segment (empty
        when the index is missing or bad: everything is scanned then)."""
        path = self.directory / "index.bin"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        body, crc = raw[: -_CRC.size], raw[-_CRC.size :]
        if len(raw) < _IDX_HEADER.size + _CRC.size or zlib.crc32(body) != _CRC.unpack(crc)[0]:
            log.warning("disk cache index %s is damaged: rebuilding it from the segments", path)
            return {}
        magic, version, root, fmt, n_seg, n_ent = _IDX_HEADER.unpack_from(body)
        want = _IDX_HEADER.size + n_seg * _IDX_SEGMENT.size + n_ent * _IDX_ENTRY.size
        if (magic, version, root, fmt) != (_IDX_MAGIC, FORMAT_VERSION, self._root, self._format):
            return {}
        if len(body) != want:
            return {}
        pos = _IDX_HEADER.size
        scanned: dict[int, int] = {}
        for _ in range(n_seg):
            seg_id, end = _IDX_SEGMENT.unpack_from(body, pos)
            scanned[seg_id] = end
            pos += _IDX_SEGMENT.size
        for _ in range(n_ent):
            h, parent, has_parent, seg, offset, length, serial = _IDX_ENTRY.unpack_from(body, pos)
            pos += _IDX_ENTRY.size
            if seg in scanned and length == self.page_bytes:
                self._put_entry(h, parent if has_parent else None, seg, offset, length, serial)
        return scanned

    def _add_segment(self, seg_id: int, path: Path, covered: int | None) -> None:
        """Take segment ``seg_id`` into the store: its indexed entries are checked against
        the file's size, and the part the index does not cover is scanned."""
        size = path.stat().st_size
        if not self._header_ok(path):
            self._drop_segment_entries(seg_id)
            if size:
                self.dropped += 1
                log.warning("disk cache: %s is not this model's or format's: dropped", path.name)
            if self.writable:
                path.unlink(missing_ok=True)
            return
        mine = [e for e in self.entries.values() if e.segment == seg_id]
        if covered is None or covered > size or any(e.offset + e.record_bytes > size for e in mine):
            self.dropped += sum(1 for e in mine if e.offset + e.record_bytes > size)
            self._drop_segment_entries(seg_id)
            covered = _SEG_HEADER.size
        seg = _Segment(seg_id, size, sum(e.record_bytes for e in mine if e.hash in self.entries))
        self.segments[seg_id] = seg
        end = self._scan(seg, path, covered, size)
        if end < size and self.writable:
            os.truncate(path, end)  # a torn tail: the next append starts on a clean record
            seg.size = end

    def _header_ok(self, path: Path) -> bool:
        with open(path, "rb") as f:
            raw = f.read(_SEG_HEADER.size)
        if len(raw) < _SEG_HEADER.size:
            return False
        magic, version, root, fmt, crc = _SEG_HEADER.unpack(raw)
        return (magic, version, root, fmt) == (
            _SEG_MAGIC,
            FORMAT_VERSION,
            self._root,
            self._format,
        ) and zlib.crc32(raw[: -_CRC.size]) == crc

    def _scan(self, seg: _Segment, path: Path, start: int, size: int) -> int:
        """Index the records of ``path`` from ``start``; returns where its last good
        record ends. A bad header is skipped to the next record magic; payloads are
        checked when read."""
        pos, good_end = start, start
        with open(path, "rb") as f:
            while pos + _REC_HEADER.size <= size:
                f.seek(pos)
                head = _decode_header(f.read(_REC_HEADER.size))
                if head is None or pos + _REC_HEADER.size + head[2] > size:
                    nxt = self._next_magic(f, pos + 1, size)
                    if head is not None and nxt is None:
                        break  # a torn last record
                    self.dropped += 1
                    if nxt is None:
                        break
                    pos = nxt
                    continue
                h, parent, length, _ = head
                if length == self.page_bytes:
                    self._clock += 1
                    old = self.entries.get(h)
                    if old is not None and old.segment in self.segments:
                        self.segments[old.segment].live -= old.record_bytes
                    self._put_entry(h, parent, seg.id, pos, length, self._clock)
                    seg.live += _REC_HEADER.size + length
                pos += _REC_HEADER.size + length
                good_end = pos
        return good_end

    @staticmethod
    def _next_magic(f, start: int, size: int) -> int | None:
        pos = start
        while pos < size:
            f.seek(pos)
            chunk = f.read(_SCAN_CHUNK + len(_REC_MAGIC))
            found = chunk.find(_REC_MAGIC)
            if found >= 0:
                return pos + found
            pos += _SCAN_CHUNK
        return None

    def _put_entry(
        self, h: bytes, parent: bytes | None, seg: int, offset: int, length: int, serial: int
    ) -> None:
        old = self.entries.get(h)
        index = old.index if old is not None else next(self._entry_ids)
        self.entries[h] = DiskEntry(index, h, parent, seg, offset, length, serial)
        self._clock = max(self._clock, serial)
        self.changes += 1

    def _drop_segment_entries(self, seg_id: int) -> None:
        for h in [h for h, e in self.entries.items() if e.segment == seg_id]:
            del self.entries[h]
            self.changes += 1

    # -- what the page table asks -----------------------------------------------------

    def __contains__(self, h: bytes) -> bool:
        return self.enabled and (h in self.entries or h in self._pending)

    def __len__(self) -> int:
        return len(self.entries)

    def nbytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def writing(self) -> bool:
        """Pages are queued or being written."""
        return bool(self._pending)

    def put(self, h: bytes, parent: bytes | None, payload: bytes, wait: bool = False) -> bool:
        """Queue a full page for writing. False when the tier cannot take it (off, read
        only, already there, or the queue is full and ``wait`` is off)."""
        if not (self.enabled and self.writable) or h in self:
            return False
        if len(payload) != self.page_bytes:
            raise ValueError(f"page of {len(payload)} B for a store of {self.page_bytes} B pages")
        if not wait and self._pending_bytes + len(payload) > self.max_pending_bytes:
            self.skipped_writes += 1
            return False
        with self._lock:
            self._pending[h] = len(payload)
            self._pending_bytes += len(payload)
        self._queue.put((h, parent, payload))
        return True

    def read(self, h: bytes) -> bytes | None:
        """The payload of page ``h``, verified; None (and the record dropped) when it is
        missing, torn or corrupt."""
        found = self.read_chain([h])
        return bytes(found[0]) if found else None

    def read_chain(self, hashes: Sequence[bytes]) -> list[memoryview]:
        """The verified payloads of the longest leading run of ``hashes`` the store has
        good copies of (a damaged record is dropped and ends the run). Records that lie
        back to back in a segment, as a chain written in order does, are read with one
        call into one buffer. What a `read_ahead` of the same head has read is taken from
        it (waiting for it if it still runs)."""
        if not hashes:
            return []
        with self._lock:
            ahead = self._ahead.pop(hashes[0], None)
        if ahead is None:
            return self._read_chain(hashes)
        asked, pending = ahead
        by_hash = dict(zip(asked, pending.result()))
        out: list[memoryview] = []
        for i, h in enumerate(hashes):
            payload = by_hash.get(h)
            if payload is None:
                return out + self._read_chain(hashes[i:])  # asked for more than was read
            out.append(payload)
        return out

    def read_ahead(self, hashes: Sequence[bytes]) -> bool:
        """Start reading the chain ``hashes`` on the reader thread (ENGINE.md §10: the
        engine thread steps other jobs meanwhile); True while that read runs, False once
        it is done (the next `read_chain` of that head takes its pages) or when the store
        has not even the head."""
        if not self.enabled or not hashes:
            return False
        with self._lock:
            ahead = self._ahead.get(hashes[0])
            if ahead is None:
                if hashes[0] not in self.entries:
                    return False
                while len(self._ahead) >= _MAX_READS_AHEAD:
                    self._ahead.pop(next(iter(self._ahead)))  # a job that went: its read is dropped
                if self._reader is None:
                    self._reader = ThreadPoolExecutor(1, thread_name_prefix="folio-disk-read")
                asked = list(hashes)
                ahead = (asked, self._reader.submit(self._read_chain, asked))
                self._ahead[hashes[0]] = ahead
        return not ahead[1].done()

    def _read_chain(self, hashes: Sequence[bytes]) -> list[memoryview]:
        """read_chain's work. The lock is held only to plan the reads and to settle what
        they found, not across the reads and checks, so the engine thread is never held
        up by a read ahead: each read goes through a duplicate of its segment's file
        descriptor (a compaction that moves records and deletes the segment meanwhile
        leaves it readable), and a record the writer moved meanwhile is used if its bytes
        check out, and never dropped for a read that raced the move."""
        out: list[memoryview] = []
        if not self.enabled:
            return out
        with self._lock:
            planned: list[tuple[DiskEntry, int, int]] = []
            for h in hashes:
                entry = self.entries.get(h)
                if entry is None:
                    break
                planned.append((entry, entry.segment, entry.offset))
            fds = {seg: os.dup(self._fd(seg)) for seg in {seg for _, seg, _ in planned}}
        try:
            i = 0
            while i < len(planned):
                entry, seg, first = planned[i]
                j = i + 1
                while (
                    j < len(planned)
                    and planned[j][1] == seg
                    and planned[j][2] == planned[j - 1][2] + planned[j - 1][0].record_bytes
                    and planned[j][2] + planned[j][0].record_bytes - first <= _READ_SPAN
                ):
                    j += 1
                last_entry, _, last = planned[j - 1]
                buf = bytearray(last + last_entry.record_bytes - first)
                try:
                    got = os.preadv(fds[seg], [buf], first)
                except OSError:
                    got = 0
                view = memoryview(buf)[:got]
                for entry, _, offset in planned[i:j]:
                    at = offset - first
                    payload = _checked(entry, view[at : at + entry.record_bytes])
                    if not self._settle(entry, seg, offset, payload is not None):
                        return out
                    assert payload is not None
                    out.append(payload)
                i = j
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def has_read_ahead(self, head: bytes) -> bool:
        """Whether a `read_ahead` of the chain starting at ``head`` is held (done or not)."""
        with self._lock:
            return head in self._ahead

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """Ask the kernel to start reading the records of ``hashes`` (those the store
        has, up to the first it lacks) into the page cache, so that a cold chain's disk
        reads run ahead of `read_into`, page by page, as it checks and copies."""
        if not self.enabled:
            return
        with self._lock:
            spans: dict[int, list[tuple[int, int]]] = {}
            for h in hashes:
                entry = self.entries.get(h)
                if entry is None:
                    break
                runs = spans.setdefault(entry.segment, [])
                if runs and runs[-1][0] + runs[-1][1] == entry.offset:
                    runs[-1] = (runs[-1][0], runs[-1][1] + entry.record_bytes)
                else:
                    runs.append((entry.offset, entry.record_bytes))
            fds = {seg: os.dup(self._fd(seg)) for seg in spans}
        for seg, runs in spans.items():
            try:
                for offset, length in runs:
                    os.posix_fadvise(fds[seg], offset, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only advice
            finally:
                os.close(fds[seg])

    def read_into(self, h: bytes, buffers: Sequence[np.ndarray]) -> bool:
        """Read ``h``'s record straight into ``buffers`` (writable uint8 arrays laid end to
        end as its payload: a pool page's own memory, `PagedKVStorage.page_buffers`), with
        one ``preadv``, and check it as `read_chain` does. True when the page is whole and
        intact; False when the store lacks it or it was damaged (then dropped), and the
        buffers hold garbage the caller must not use."""
        if not self.enabled:
            return False
        with self._lock:
            entry = self.entries.get(h)
            if entry is None:
                return False
            seg, offset = entry.segment, entry.offset
            fd = os.dup(self._fd(seg))
        head = bytearray(_REC_HEADER.size)
        views = [memoryview(head), *(memoryview(b) for b in buffers)]
        got = 0
        try:
            for i in range(0, len(views), _IOV_MAX):
                part = views[i : i + _IOV_MAX]
                n = os.preadv(fd, part, offset + got)
                got += n
                if n < sum(v.nbytes for v in part):
                    break  # the file ends inside the record
        except OSError:
            got = 0
        finally:
            os.close(fd)
        ok = got == entry.record_bytes and _payload_ok(entry, head, views[1:])
        return self._settle(entry, seg, offset, ok)

    def _settle(self, entry: DiskEntry, seg: int, offset: int, ok: bool) -> bool:
        """Count a record read at (``seg``, ``offset``), or drop it when it was damaged
        there and still lies there; False when the run ends at it."""
        with self._lock:
            still_there = self.entries.get(entry.hash) is entry and (
                entry.segment,
                entry.offset,
            ) == (seg, offset)
            if not ok:
                if still_there:
                    log.warning(
                        "disk cache: page %s is damaged: dropped, it will be recomputed",
                        entry.hash.hex(),
                    )
                    self._drop(entry)
                    self.dropped += 1
                return False
            if self.entries.get(entry.hash) is entry:
                self._clock += 1
                entry.access_serial = self._clock
                self._index_dirty = True
                self.changes += 1
            self.hits += 1
            self.hit_bytes += entry.length
            return True

    def refresh(self) -> None:
        """A reader picks up what the writer appended since (and becomes the writer if
        that process has gone)."""
        if not self.enabled or self.writable:
            return
        with self._lock:
            if self._try_become_writer():
                self._load()
                self._start_writer()
                return
            present = dict(self._segment_files())
            for seg_id in [s for s in self.segments if s not in present]:
                self._forget_segment(seg_id)
            for seg_id, path in present.items():
                seg = self.segments.get(seg_id)
                try:
                    size = path.stat().st_size
                    if seg is None:
                        self._add_segment(seg_id, path, None)
                    elif size > seg.size:
                        seg.size = self._scan(seg, path, seg.size, size)
                except OSError:
                    continue

    # -- the writer thread ---------------------------------------------------------------

    def _start_writer(self) -> None:
        self._thread = threading.Thread(
            target=self._write_loop, name="folio-disk-tier", daemon=True
        )
        self._thread.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if callable(item):
                    item()
                    continue
                h, parent, payload = item
                if self.enabled:
                    self._append(h, parent, payload)
            except OSError as exc:
                self._turn_off(f"cannot write {self.directory}: {exc}")
            finally:
                if item is not None and not callable(item):
                    with self._lock:
                        self._pending_bytes -= self._pending.pop(item[0], 0)
                self._queue.task_done()
                if self._queue.empty() and self.enabled and self._index_dirty:
                    if time.monotonic() - self._index_written >= INDEX_INTERVAL_S:
                        self._write_index_safely()

    def _append(self, h: bytes, parent: bytes | None, payload: bytes) -> None:
        if h in self.entries:
            return
        record = encode_record(h, parent, payload)
        self._make_room(len(record))
        with self._lock:
            seg = self._active_segment(len(record))
            offset = seg.size
            _write_all(self._fd(seg.id), record)
            seg.size += len(record)
            seg.live += len(record)
            self._clock += 1
            self._put_entry(h, parent, seg.id, offset, len(payload), self._clock)
            self.writes += 1
            self._index_dirty = True

    def _active_segment(self, record_bytes: int) -> _Segment:
        seg = self.segments.get(self._active) if self._active is not None else None
        if seg is None or seg.size + record_bytes > self.segment_bytes:
            last = max(self.segments.values(), key=lambda s: s.id, default=None)
            if seg is None and last is not None and last.size + record_bytes <= self.segment_bytes:
                seg = last  # carry on the newest segment left by an earlier run
            else:
                seg = self._new_segment()
            self._active = seg.id
        return seg

    def _new_segment(self) -> _Segment:
        self._ids += 1
        path = self.directory / segment_name(self._ids)
        header = _SEG_HEADER.pack(_SEG_MAGIC, FORMAT_VERSION, self._root, self._format, 0)
        header = header[: -_CRC.size] + _CRC.pack(zlib.crc32(header[: -_CRC.size]))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._fds[self._ids] = fd
        _write_all(fd, header)
        seg = _Segment(self._ids, len(header))
        self.segments[seg.id] = seg
        return seg

    def _fd(self, seg_id: int) -> int:
        fd = self._fds.get(seg_id)
        if fd is None:
            flags = os.O_RDWR | os.O_APPEND if self.writable else os.O_RDONLY
            fd = os.open(self.directory / segment_name(seg_id), flags)
            self._fds[seg_id] = fd
        return fd

    # -- budget -----------------------------------------------------------------------

    def _make_room(self, incoming: int) -> None:
        """Before appending ``incoming`` bytes: over budget, drop chain tails first until
        a segment's worth is free, then compact the segments that held them."""
        with self._lock:
            if self.nbytes() + incoming <= self.budget:
                return
            live = sum(e.record_bytes for e in self.entries.values())
            target = max(0, self.budget - self.segment_bytes - incoming)
            by_id = {e.index: e for e in self.entries.values()}
            for idx in eviction_order(by_id.values()):
                if live <= target:
                    break
                entry = by_id[idx]
                live -= entry.record_bytes
                self._drop(entry)
                self.evictions += 1
            active = self.segments.get(self._active) if self._active is not None else None
            if active is not None and active.live < active.size - _SEG_HEADER.size:
                self._active = None  # it holds dropped records: compact it too
            for seg in sorted(self.segments.values(), key=lambda s: s.live - s.size):
                if self.nbytes() + incoming <= self.budget:
                    break
                if seg.id != self._active and seg.live < seg.size - _SEG_HEADER.size:
                    self._compact(seg)

    def _compact(self, seg: _Segment) -> None:
        """Copy ``seg``'s live records to the active segment and delete it."""
        for entry in sorted(
            (e for e in self.entries.values() if e.segment == seg.id), key=lambda e: e.offset
        ):
            raw = os.pread(self._fd(seg.id), entry.record_bytes, entry.offset)
            if _checked(entry, memoryview(raw)) is None:
                self._drop(entry)
                self.dropped += 1
                continue
            target = self._active_segment(len(raw))
            offset = target.size
            _write_all(self._fd(target.id), raw)
            target.size += len(raw)
            target.live += len(raw)
            seg.live -= len(raw)
            entry.segment, entry.offset = target.id, offset
        self._forget_segment(seg.id)
        (self.directory / seg.name).unlink(missing_ok=True)
        self._index_dirty = True

    def _forget_segment(self, seg_id: int) -> None:
        self._drop_segment_entries(seg_id)
        self.segments.pop(seg_id, None)
        fd = self._fds.pop(seg_id, None)
        if fd is not None:
            os.close(fd)
        if self._active == seg_id:
            self._active = None

    def _drop(self, entry: DiskEntry) -> None:
        if self.entries.get(entry.hash) is entry:
            del self.entries[entry.hash]
            self.changes += 1
            seg = self.segments.get(entry.segment)
            if seg is not None:
                seg.live -= entry.record_bytes
            self._index_dirty = True

    # -- index -----------------------------------------------------------------------

    def _write_index(self) -> None:
        with self._lock:
            entries = sorted(self.entries.values(), key=lambda e: (e.segment, e.offset))
            parts = [
                _IDX_HEADER.pack(
                    _IDX_MAGIC,
                    FORMAT_VERSION,
                    self._root,
                    self._format,
                    len(self.segments),
                    len(entries),
                )
            ]
            parts += [_IDX_SEGMENT.pack(s.id, s.size) for s in self.segments.values()]
            parts += [
                _IDX_ENTRY.pack(
                    e.hash,
                    e.parent_hash or _NO_PARENT,
                    e.parent_hash is not None,
                    e.segment,
                    e.offset,
                    e.length,
                    e.access_serial,
                )
                for e in entries
            ]
            body = b"".join(parts)
            tmp = self.directory / "index.bin.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, body + _CRC.pack(zlib.crc32(body)))
            finally:
                os.close(fd)
            os.replace(tmp, self.directory / "index.bin")
            self._index_dirty = False
            self._index_written = time.monotonic()

    def _write_index_safely(self) -> None:
        try:
            self._write_index()
        except OSError as exc:
            self._turn_off(f"cannot write {self.directory}: {exc}")

    # -- life cycle ----------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued page is written, then write the index."""
        if self._thread is None:
            return
        self._queue.join()
        if self.enabled and self.writable and self._index_dirty:
            self._write_index_safely()

    def close(self) -> None:
        """Write what is queued and the index; let go of the files and the lock."""
        self.flush()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._ahead.clear()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None
        self.enabled = self.writable = False

    def clear(self) -> int:
        """Delete every page of this store; returns the bytes freed."""
        if not (self.enabled and self.writable):
            return 0
        self.flush()
        with self._lock:
            freed = self.nbytes()
            for seg_id in list(self.segments):
                self._forget_segment(seg_id)
                (self.directory / segment_name(seg_id)).unlink(missing_ok=True)
            self.entries.clear()
            self.changes += 1
            self._write_index_safely()
        return freed

    def _turn_off(self, message: str) -> None:
        if self.status.startswith("off"):
            return
        self.status = f"off: {message}"
        log.warning("disk cache %s", self.status)
        self.enabled = self.writable = False
        with self._lock:
            self.entries.clear()
            self.changes += 1
            self._pending.clear()
            self._pending_bytes = 0

    # -- inspection ----------------------------------------------------------------------

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                pages=len(self.entries),
                bytes=self.nbytes(),
                budget=self.budget,
                writes=self.writes,
                hits=self.hits,
                hit_bytes=self.hit_bytes,
                dropped=self.dropped,
                evictions=self.evictions,
                skipped_writes=self.skipped_writes,
                writable=self.writable,
                status=self.status,
            )

    def snapshot(self) -> DiskTierSnapshot:
        """Every record's hash, parent and recency. The engine asks at every snapshot
        it publishes; this is rebuilt only when `changes` moved, and at most every
        `SNAPSHOT_INTERVAL_S` (0.3 µs a record: 16 ms for 50,000 records), so it may lag
        the tier by that much: its own `changes` says which state it shows."""
        with self._lock:
            old = self._snapshot
            now = time.monotonic()
            if old is not None and (
                old.changes == self.changes or now - self._snapshot_at < SNAPSHOT_INTERVAL_S
            ):
                return old
            entries = sorted(self.entries.values(), key=lambda e: e.access_serial)
            self._snapshot = DiskTierSnapshot(
                _prefixes(e.hash for e in entries),
                _prefixes(e.parent_hash or _NO_PARENT for e in entries),
                np.fromiter((e.access_serial for e in entries), np.int64, len(entries)),
                self.changes,
            )
            self._snapshot_at = now
            return self._snapshot

    def validate(self) -> None:
        with self._lock:
            for h, e in self.entries.items():
                assert e.hash == h, f"disk entry keyed {h.hex()} holds {e.hash.hex()}"
                seg = self.segments.get(e.segment)
                assert seg is not None, f"disk entry {h.hex()} in missing segment {e.segment}"
                assert e.offset + e.record_bytes <= seg.size, f"disk entry {h.hex()} past its end"
            for seg in self.segments.values():
                live = sum(e.record_bytes for e in self.entries.values() if e.segment == seg.id)
                assert seg.live == live, f"segment {seg.id} live {seg.live} != {live}"
            if self.writable:
                assert self.nbytes() <= self.budget + self.segment_bytes, "store over budget"
