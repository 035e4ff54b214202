"""Repacked weights on disk: a model's tiles (kernels/quant/tiles.py) written once, then
mapped by the next loads of the same file.

Repacking the Q4_K / Q6_K weights of a 7B Q4_K_M file (4.7 GB) takes 3.5-4.5 s on two
cores, about 1.3 s of it the kernel handing out 4.8 GB of fresh anonymous pages; mapping
tiles written by an earlier load takes the time their checksums take (CRC-32 at about
4 GB/s a thread, two threads), which also brings their pages in before the first token.

One file per model file (``<digest>.tiles`` in ``paths.tiles_cache_dir()``; the digest
names the model's path, size, modification time and the tile format):

- a header: magic, the index's length and CRC-32;
- the index (JSON): the model file and its identity, and per weight its key (the file
  offsets and shapes of the parts it was repacked from, its kind), its array's shape,
  where its bytes are and their CRC-32;
- each weight's tiles at a page-aligned offset.

Nothing read is trusted: a file whose header, index or identity does not match, that is
shorter than its index says, or one of whose weights fails its CRC is deleted, and the
load repacks (and writes it again). A load that repacked writes the file on a thread
after loading (the engine does not wait), to a temporary name renamed when whole and
synced, so a crash or a full disk never leaves a torn file under the real name; what
other processes left half-written is removed. The files together stay within a budget
(:func:`default_budget`: a few models' worth, at most a quarter of the free disk), the
least recently used deleted first; a file that does not fit is not written (the next load
repacks again). Writing a model's file deletes the model's other tile files (an earlier
tile format after an update, an earlier version of the model file): none would be mapped
again. Loading maps the file copy-on-write and never writes to it, so its pages
are the page cache's, shared by every process running the model.

Huge pages (Linux, a filesystem with large folios): the file is written in writes of 64
MB from multiples of 64 MB, so the page cache holds it in 2 MB folios, and mapped with
``MADV_HUGEPAGE``, so what is not cached is read in 2 MB folios; the load then reads its
tiles through huge pages (decode at the Llama-3.2-1B shape 23.7 tok/s from small folios,
27.5 from huge ones). The load that repacked reads its tiles from the file too once it is
written (:meth:`TileCache.save`'s ``then``: ``Transformer.rebind_tiles``), its repacked
copies, in small pages, then freed: the same shape's first session 25.2 tok/s before,
28.9 after, its anonymous memory 1.30 -> 0.41 GB.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine import paths
from kernels.quant.tiles import TILES_FORMAT, repack_parts

log = logging.getLogger(__name__)

MAGIC = b"FOLIOTIL"
_HEADER = struct.Struct("<8sQI")  # magic, index length, index CRC-32
PAGE = 4096  # each weight's bytes start on a page (a 64-byte-aligned array for the kernel)
SUFFIX = ".tiles"
PARTIAL = ".partial-"  # <digest>.tiles.partial-<pid>: being written by process <pid>
DEFAULT_BUDGET_CAP = 24 << 30  # default budget: this, or a quarter of the free disk if less
BUDGET_VARIABLE = "FOLIO_TILES_BUDGET_GB"  # overrides the default; 0 turns the cache off
SAVE_AT_EXIT_S = 60.0  # how long a process's exit waits for its tiles to be written
_CHUNK = 64 << 20  # bytes a CRC-32 call covers (numpy and zlib leave the GIL free), and a write
_WINDOW_PIECES = 256  # pieces one write gathers at most (the system's limit is 1,024)
_THREADS = max(1, min(4, os.cpu_count() or 1))

Key = tuple  # (kind name, ((file offset, rows, row bytes), ...))


@dataclass
class _Entry:
    key: Key
    shape: tuple[int, ...]
    offset: int = 0
    crc: int = 0


def default_budget(location: Path) -> int:
    """Bytes the tile files may take: ``$FOLIO_TILES_BUDGET_GB`` if set, else
    :data:`DEFAULT_BUDGET_CAP` or a quarter of the free disk there, whichever is less."""
    value = os.environ.get(BUDGET_VARIABLE)
    if value:
        try:
            return max(0, int(float(value) * (1 << 30)))
        except ValueError:
            log.warning("%s=%r is not a number of GB; using the default", BUDGET_VARIABLE, value)
    probe = location
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return 0
    return min(DEFAULT_BUDGET_CAP, free // 4)


def file_for(model_path: Path, directory: Path | None = None) -> Path:
    """Where the tiles of ``model_path`` (as it is now) go."""
    model_path = Path(model_path).resolve()
    st = model_path.stat()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{model_path}\0{st.st_size}\0{st.st_mtime_ns}\0{TILES_FORMAT}".encode())
    return Path(directory or paths.tiles_cache_dir()) / (h.hexdigest() + SUFFIX)


def _identity(model_path: Path) -> dict:
    """What says the model file is the one the tiles were made from: besides its path,
    size and times, a digest of its first and last MB (a file rewritten in place within
    one tick of the clock keeps its times)."""
    st = model_path.stat()
    h = hashlib.blake2b(digest_size=16)
    with open(model_path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return {
        "path": str(model_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "sample": h.hexdigest(),
        "format": TILES_FORMAT,
    }


class TileCache:
    """The tiles of one model file's weights: mapped from its file when an earlier load
    wrote it, else repacked (:meth:`tiles`) and written after the load (:meth:`save`).

    ``offset_of(array) -> int``: where a part's bytes are in the model file (the key of
    the weight; ``None`` for bytes not read in place)."""

    def __init__(
        self,
        model_path: Path | str,
        offset_of: Callable[[np.ndarray], int | None],
        directory: Path | str | None = None,
        budget: int | None = None,
    ):
        self.model_path = Path(model_path).resolve()
        self.directory = Path(directory) if directory is not None else paths.tiles_cache_dir()
        self.budget = default_budget(self.directory) if budget is None else budget
        self._offset_of = offset_of
        self.path = file_for(self.model_path, self.directory)
        self._model = _identity(self.model_path)  # as loaded: what a written file names
        self._mapped: dict[Key, np.ndarray] = {}
        self._made: list[tuple[_Entry, np.ndarray]] = []
        self.hits = 0
        self.status = ""  # one line on what happened to the file, for logs and the UI
        self._saver: threading.Thread | None = None
        self._clean_partials()
        if self.budget > 0:
            self._open()

    # -- reading -------------------------------------------------------------------------

    def _open(self) -> None:
        """Map the file and check every weight's CRC (on a few threads, which brings its
        pages in as prefaulting would); anything wrong deletes it."""
        try:
            entries, data = self._read()
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            self._drop(f"tile file {self.path.name} unreadable ({exc}); repacking")
            return
        if entries is None:
            return
        with ThreadPoolExecutor(_THREADS) as pool:
            bad = [
                e for e, ok in zip(entries, pool.map(lambda e: _crc(data, e), entries)) if not ok
            ]
        if bad:
            self._drop(f"tile file {self.path.name}: {len(bad)} weights fail their CRC; repacking")
            return
        self._mapped = {
            e.key: np.frombuffer(data, np.uint8, int(np.prod(e.shape)), e.offset).reshape(e.shape)
            for e in entries
        }
        try:
            os.utime(self.path)  # recency, for the budget
        except OSError:
            pass
        self.status = f"repacked weights mapped from {self.path.name}"

    def _read(self) -> tuple[list[_Entry] | None, mmap.mmap | None]:
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            magic, length, crc = _HEADER.unpack(f.read(_HEADER.size))
            if magic != MAGIC or _HEADER.size + length > size:
                raise ValueError("not a tile file, or cut short")
            raw = f.read(length)
            if zlib.crc32(raw) != crc:
                raise ValueError("index CRC mismatch")
            index = json.loads(raw)
            if index["model"] != self._model:
                return None, None  # another file at this name's digest: leave it
            entries = [
                _Entry(_key(e["key"]), tuple(e["shape"]), int(e["offset"]), int(e["crc"]))
                for e in index["weights"]
            ]
            if any(e.offset % PAGE or e.offset + _nbytes(e) > size for e in entries):
                raise ValueError("shorter than its index says")
            data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
                # what the page cache does not hold is read in 2 MB folios, mapped as huge
                # pages: one token's weight read 1.16x faster (Llama-3.2-1B shape decode,
                # 23.7 -> 27.5 tok/s) than from the small folios plain readahead makes
                data.madvise(mmap.MADV_HUGEPAGE)
            return entries, data

    def _drop(self, why: str) -> None:
        log.warning("%s", why)
        self.status = why
        self._mapped = {}
        try:
            self.path.unlink()
        except OSError:
            pass

    @property
    def mapped(self) -> bool:
        """Whether an earlier load's file was found whole and mapped."""
        return bool(self._mapped)

    # -- the loader's hook -----------------------------------------------------------------

    def key(
        self,
        parts: list[np.ndarray],
        kind_name: str,
        orders: list[np.ndarray | None] | None = None,
    ) -> Key | None:
        """Where the parts' bytes are in the model file, their type, and the order their
        rows were tiled in (``orders``: a digest of each part's, when any is given)."""
        where = []
        for p in parts:
            offset = self._offset_of(p)
            if offset is None:
                return None
            where.append((int(offset), int(p.shape[0]), int(p.shape[1])))
        if orders is not None and any(o is not None for o in orders):
            h = hashlib.blake2b(digest_size=8)
            for o in orders:
                h.update(b"-" if o is None else np.ascontiguousarray(o, np.int64).tobytes())
            kind_name = f"{kind_name}/rows-{h.hexdigest()}"
        return (kind_name, tuple(where))

    def tiles(
        self,
        parts: list[np.ndarray],
        kind_name: str,
        release: Callable[[list[np.ndarray]], None] | None = None,
        orders: list[np.ndarray | None] | None = None,
    ) -> np.ndarray:
        """The tiles of ``parts`` (:func:`~kernels.quant.tiles.repack_parts`, rows in
        ``orders``): from the file if it has them, else repacked now (and kept for
        :meth:`save`)."""
        key = self.key(parts, kind_name, orders)
        if key is not None and key in self._mapped:
            self.hits += 1
            return self._mapped[key]
        out = repack_parts(parts, kind_name, release, orders)
        if key is not None and self.budget > 0:
            self._made.append((_Entry(key, out.shape), out))
        return out

    # -- writing ---------------------------------------------------------------------------

    def save(
        self,
        wait: bool = False,
        then: Callable[[dict[int, np.ndarray]], object] | None = None,
    ) -> threading.Thread | None:
        """Write what :meth:`tiles` repacked (with anything mapped) on a thread; ``wait``:
        return once written. Nothing to write (every weight came from the file): None.
        ``then``, once the file is written, gets the file's copy of every repacked array
        (mapped as a later load maps it) keyed by the repacked array's address, for the
        model to read those instead (``Transformer.rebind_tiles``): in the page cache's 2
        MB folios, mapped as huge pages, where the repacked arrays are in small pages."""
        if not self._made:
            return None
        weights = [(e, a) for e, a in self._made]
        made = len(weights)
        known = {e.key for e, _ in weights}
        weights += [(_Entry(k, a.shape), a) for k, a in self._mapped.items() if k not in known]
        self._made = []
        self._saver = threading.Thread(
            target=self._write_then,
            args=(weights, made, then),
            name="folio-tile-cache",
            daemon=True,
        )
        self._saver.start()
        # a one-off command (`folio generate`) ends soon after loading: finish writing
        # then, within reason (a daemon thread stopped midway leaves a partial file)
        atexit.register(self._saver.join, SAVE_AT_EXIT_S)
        if wait:
            self._saver.join()
        return self._saver

    def wait(self) -> None:
        if self._saver is not None:
            self._saver.join()

    def _write_then(
        self,
        weights: list[tuple[_Entry, np.ndarray]],
        made: int,
        then: Callable[[dict[int, np.ndarray]], object] | None,
    ) -> None:
        """:meth:`_write`, then ``then`` with the file's copies of the first ``made`` (at
        the offsets :meth:`_write` gave them)."""
        if not self._write(weights) or then is None:
            return
        try:
            entries, data = self._read()
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            log.warning("tile file %s written but not mapped (%s)", self.path.name, exc)
            return
        if entries is None:
            return
        views = {
            a.ctypes.data: np.frombuffer(data, np.uint8, a.nbytes, e.offset).reshape(a.shape)
            for e, a in weights[:made]
        }
        moved = then(views)
        log.info("%s weights now read from %s", moved, self.path.name)

    def _write(self, weights: list[tuple[_Entry, np.ndarray]]) -> bool:
        """The file (to a temporary name, renamed when whole); whether it was written."""
        model = self._model
        at = -(-(_HEADER.size + _index_room(model, weights)) // PAGE) * PAGE
        for e, a in weights:
            e.offset = at
            at += -(-a.nbytes // PAGE) * PAGE
        total = at
        if not self._make_room(total):
            self.status = (
                f"repacked weights not kept on disk: {total / 1e9:.1f} GB do not fit the tile "
                f"cache's {self.budget / 1e9:.1f} GB budget (free disk space, or set "
                f"{BUDGET_VARIABLE})"
            )
            log.info("%s", self.status)
            return False
        tmp = self.path.with_name(self.path.name + PARTIAL + str(os.getpid()))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.truncate(total)
                _write_weights(f.fileno(), weights)
                index = _index(model, weights)
                f.seek(0)
                f.write(_HEADER.pack(MAGIC, len(index), zlib.crc32(index)) + index)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self.status = f"repacked weights kept on disk ({total / 1e9:.2f} GB, {self.path.name})"
            # the model's tiles from before: an earlier tile format (a Folio update) or an
            # earlier version of the file, never mapped again
            freed = delete_files(self._model["path"], self.directory, keep=self.path)
            if freed:
                log.info("deleted %.2f GB of this model's superseded tile files", freed / 1e9)
            log.info("%s", self.status)
            return True
        except OSError as exc:  # a full disk, an unwritable folder: run without the file
            self.status = f"repacked weights not kept on disk ({exc.strerror or exc}); the next load repacks again"
            log.warning("%s", self.status)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False

    def _make_room(self, nbytes: int) -> bool:
        """Delete the least recently used tile files until ``nbytes`` more fit the
        budget (and a quarter of the free disk). False if they cannot."""
        if nbytes > self.budget:
            return False
        files = sorted(_tile_files(self.directory), key=lambda p: _mtime(p))
        used = sum(_size(p) for p in files)
        for old in files:
            if used + nbytes <= self.budget:
                break
            if old == self.path:
                continue
            used -= _size(old)
            try:
                old.unlink()
            except OSError:
                pass
        try:
            probe = self.directory if self.directory.exists() else self.directory.parent
            free = shutil.disk_usage(probe).free
        except OSError:
            free = nbytes
        return used + nbytes <= self.budget and nbytes <= free * 3 // 4

    def _clean_partials(self) -> None:
        """Remove what processes that are gone left half-written."""
        try:
            partials = list(self.directory.glob("*" + SUFFIX + PARTIAL + "*"))
        except OSError:
            return
        for p in partials:
            pid = p.name.rsplit(PARTIAL, 1)[1]
            if pid.isdigit() and not _alive(int(pid), p):
                try:
                    p.unlink()
                except OSError:
                    pass


def delete_files(
    model_path: Path | str, directory: Path | str | None = None, keep: Path | None = None
) -> int:
    """Delete the tile files of ``model_path`` (any version of it, any tile format) but
    ``keep``; bytes freed."""
    want = str(Path(model_path).resolve())
    freed = 0
    for p in _tile_files(Path(directory) if directory is not None else paths.tiles_cache_dir()):
        if p == keep:
            continue
        try:
            with open(p, "rb") as f:
                _magic, length, _crc = _HEADER.unpack(f.read(_HEADER.size))
                model = json.loads(f.read(min(length, 1 << 24)))["model"]["path"]
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            continue
        if model == want:
            size = _size(p)
            try:
                p.unlink()
                freed += size
            except OSError:
                pass
    return freed


def _key(raw: list) -> Key:
    kind, where = raw
    return (kind, tuple(tuple(int(v) for v in w) for w in where))


def _nbytes(e: _Entry) -> int:
    return int(np.prod(e.shape))


def _index(model: dict, weights: list[tuple[_Entry, np.ndarray]]) -> bytes:
    return json.dumps(
        {
            "model": model,
            "weights": [
                {"key": e.key, "shape": list(e.shape), "offset": e.offset, "crc": e.crc}
                for e, _ in weights
            ],
        }
    ).encode()


def _index_room(model: dict, weights: list[tuple[_Entry, np.ndarray]]) -> int:
    """An upper bound on the index's bytes before offsets and CRCs are known."""
    widest = [(_Entry(e.key, e.shape, 1 << 62, 0xFFFFFFFF), a) for e, a in weights]
    return len(_index(model, widest))


def _crc(data: mmap.mmap, e: _Entry) -> bool:
    view = memoryview(data)[e.offset : e.offset + _nbytes(e)]
    crc = 0
    for at in range(0, len(view), _CHUNK):
        crc = zlib.crc32(view[at : at + _CHUNK], crc)
    view.release()
    return crc == e.crc


def _write_weights(fd: int, weights: list[tuple[_Entry, np.ndarray]]) -> None:
    """Each weight's bytes at its offset and zeros before and between them (the header's
    room too, written after), as writes of :data:`_CHUNK` bytes from multiples of it;
    sets each entry's CRC. Writes that start on 2 MB boundaries leave the file in the
    page cache in 2 MB folios, which the next load maps as huge pages (a write starting
    at each weight left the 2 MB around each start in small ones, a fifth of a
    Llama-3.2-1B shape's tiles)."""
    window: list[memoryview] = []
    pos = start = 0

    def put(piece: memoryview) -> None:
        nonlocal pos, start
        while len(piece):
            n = min(len(piece), _CHUNK - pos % _CHUNK)
            window.append(piece[:n])
            piece, pos = piece[n:], pos + n
            if pos % _CHUNK == 0 or len(window) >= _WINDOW_PIECES:
                _pwritev(fd, window, start)
                window.clear()
                start = pos

    for e, a in weights:
        if e.offset > pos:
            put(memoryview(bytes(e.offset - pos)))
        flat = a.reshape(-1)
        crc = 0
        for at in range(0, flat.size, _CHUNK):
            chunk = memoryview(flat[at : at + _CHUNK])
            crc = zlib.crc32(chunk, crc)
            put(chunk)
        e.crc = crc
    if window:
        _pwritev(fd, window, start)


def _pwritev(fd: int, pieces: list[memoryview], offset: int) -> None:
    """All of ``pieces``, one after the other, at ``offset`` of ``fd`` (in one call where
    the system has ``pwritev``)."""
    if not hasattr(os, "pwritev"):  # Windows
        for piece in pieces:
            os.lseek(fd, offset, os.SEEK_SET)
            while len(piece):
                n = os.write(fd, piece)
                piece, offset = piece[n:], offset + n
        return
    pieces = list(pieces)
    while pieces:
        n = os.pwritev(fd, pieces, offset)
        offset += n
        while pieces and n >= len(pieces[0]):
            n -= len(pieces.pop(0))
        if pieces:
            pieces[0] = pieces[0][n:]


def _tile_files(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.glob("*" + SUFFIX) if p.is_file()]
    except OSError:
        return []


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return time.time()


def _alive(pid: int, path: Path) -> bool:
    """Whether process ``pid`` may still be writing ``path`` (on Windows, where a
    signal 0 would end it: whether the file is younger than a day)."""
    if pid == os.getpid():
        return True
    if os.name == "nt":
        return time.time() - _mtime(path) < 86400
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
