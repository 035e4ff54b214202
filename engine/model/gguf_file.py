"""A fast, read-only view of a GGUF file, and the header parser behind it.

`gguf.GGUFReader` builds a Python object for every element of every metadata array,
which takes ~4 s for SmolLM2's 49k-token vocabulary and ~11 s for Gemma 3's 262k.
Folio needs to load a model in a couple of seconds, so :func:`read_header` parses the
header with `struct` and numpy in one pass and :class:`GGUFFile` maps tensor data with
`mmap`, while the `gguf` package still supplies the format's constants (value and tensor
types, block sizes). Tests check this reader against `gguf.GGUFReader`.

:func:`read_header` works over any bytes-like buffer: a local file's mapping, or the
first bytes of a remote file fetched with HTTP Range reads (engine/hub/remote.py). Where
the buffer ends before the header does it says so (``GGUFHeader.complete`` is False)
instead of failing: for a prefix that means "read more bytes", for a whole file that the
file is truncated.
"""

from __future__ import annotations

import codecs
import math
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFError", "GGUFFile", "GGUFHeader", "TensorInfo", "read_header"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Magic, version and the two counts: a file shorter than this cannot be a model.
MIN_HEADER_BYTES = 24
# ggml's GGML_MAX_DIMS (the gguf package does not export it): a tensor has at most 4 dims.
GGML_MAX_DIMS = 4
# The GGUF spec's limits on names: a key is at most 65,535 bytes, a tensor name shorter than
# ggml's GGML_MAX_NAME of 64 (its NUL included). llama.cpp refuses longer ones.
MAX_KEY_BYTES = (1 << 16) - 1
MAX_TENSOR_NAME_BYTES = 63
# A string up to this long is decoded leniently (a vocabulary may hold a token that is a
# piece of a UTF-8 sequence); a longer one must be UTF-8. Decoding replaces each bad byte
# with U+FFFD, which widens the whole string to 2 or 4 bytes a character: a length gone
# wrong that takes the rest of the file as one string would cost several times its size.
MAX_LENIENT_STRING_BYTES = 1 << 20
_CHECK_PIECE_BYTES = 1 << 16

SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[GGUFValueType, np.dtype] = {
    vt: np.dtype(fmt) for vt, fmt in SCALAR_FORMATS.items()
}
# The fewest bytes one array element of each type takes: a string is at least its
# 8-byte length, an array its 4-byte type and 8-byte count. An array claiming more
# elements than the rest of the buffer can hold is refused before anything is allocated.
_MIN_ELEMENT_BYTES: dict[GGUFValueType, int] = {
    **{vt: dt.itemsize for vt, dt in _NUMPY_DTYPES.items()},
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# A buffer read_header accepts: slicing gives bytes (mmap, bytes) or bytearray.
Buffer = bytes | bytearray | mmap.mmap


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with a message naming the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: outermost first (GGUF stores innermost first)
    qtype: int  # GGMLQuantizationType value; may be a type this gguf release does not know
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"unknown type {self.qtype}"


@dataclass(frozen=True)
class GGUFHeader:
    """What the start of a GGUF file says: format version, metadata, tensor directory.

    ``tensors`` is None when the buffer ended before the tensor directory did; then
    ``metadata`` holds the keys read up to that point (``version`` is None when the
    buffer ended even before it).
    """

    version: int | None
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] | None

    @property
    def complete(self) -> bool:
        return self.tensors is not None


class _OutOfBytes(Exception):
    """The buffer ends before the header does."""


class _HeaderReader:
    """Reads GGUF values from ``buf`` at ``pos``; raises _OutOfBytes where ``buf`` ends."""

    def __init__(self, buf: Buffer, pos: int = 0):
        self.buf = buf
        self.size = len(buf)
        self.pos = pos

    def _need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise _OutOfBytes

    def u32(self) -> int:
        self._need(4)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        self._need(8)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, limit: int | None = None, what: str = "a string") -> str:
        """A string; ``limit``: the most bytes it may have (a ValueError beyond)."""
        length = self.u64()
        if limit is not None and length > limit:
            raise ValueError(
                f"{what} of {length:,} bytes at byte {self.pos - 8:,}; at most {limit:,} are allowed"
            )
        self._need(length)  # before slicing: a bogus length must not copy the rest of the file
        if length > MAX_LENIENT_STRING_BYTES:
            text = _decode_long(self.buf, self.pos, length)
        else:
            text = self.buf[self.pos : self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(SCALAR_FORMATS[vtype])

    def array(self) -> Any:
        etype = GGUFValueType(self.u32())
        count = self.u64()
        self._need(count * _MIN_ELEMENT_BYTES[etype])
        if etype in _NUMPY_DTYPES:
            dtype = _NUMPY_DTYPES[etype]
            self._need(count * dtype.itemsize)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return values
        if etype == GGUFValueType.STRING:
            return self.string_array(count)
        return [self.value(etype) for _ in range(count)]

    def string_array(self, count: int) -> list[str]:
        # The vocabulary: tens of thousands of strings, so the loop keeps to locals.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                raise _OutOfBytes
            (length,) = unpack(buf, pos)
            pos += 8
            if pos + length > size:
                raise _OutOfBytes
            if length > MAX_LENIENT_STRING_BYTES:
                out.append(_decode_long(buf, pos, length))
            else:
                out.append(buf[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out


def _decode_long(buf: Buffer, start: int, length: int) -> str:
    view = memoryview(buf)[start : start + length]  # no copy of the bytes before decoding
    # Checked a piece at a time first: a failed decode holds a copy of all it was given, and
    # a whole-string decode sizes its output by the input before it finds the first bad byte.
    check = codecs.getincrementaldecoder("utf-8")()
    for at in range(0, length, _CHECK_PIECE_BYTES):
        try:
            check.decode(
                view[at : at + _CHECK_PIECE_BYTES], final=at + _CHECK_PIECE_BYTES >= length
            )
        except UnicodeDecodeError:
            break
    else:
        return str(view, "utf-8")
    raise ValueError(f"a string of {length:,} bytes at byte {start - 8:,} is not UTF-8 text")


def read_header(buf: Buffer, source: str) -> GGUFHeader:
    """Parse the header at the start of ``buf``: a whole file's mapping or a downloaded prefix.

    Raises :class:`GGUFError` naming ``source`` for a buffer that is not a usable GGUF
    header (bad magic, unsupported version, damaged values); a buffer that merely ends
    too soon gives an incomplete :class:`GGUFHeader`.
    """

    def fail(problem: str) -> GGUFError:
        return GGUFError(f"{source}: {problem}")

    def damaged(what: str) -> GGUFError:
        return fail(
            f"the header is damaged ({what}); the file is damaged or not a supported model: download it again"
        )

    if bytes(buf[:4]) != GGUF_MAGIC:
        raise fail("not a GGUF file (bad magic bytes); choose a .gguf model file")
    r = _HeaderReader(buf, 4)
    version = None
    metadata: dict[str, Any] = {}
    try:
        version = r.u32()
        if version not in (2, 3):
            raise fail(f"GGUF version {version} is not supported (Folio reads versions 2 and 3)")
        n_tensors = r.u64()
        n_kv = r.u64()
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise damaged(f"{n_tensors:,} tensors and {n_kv:,} keys")
        for _ in range(n_kv):
            key = r.string(MAX_KEY_BYTES, "a key")
            if key in metadata:
                raise damaged(f"key {key!r} appears twice")
            metadata[key] = r.value(r.u32())
        directory = []
        names = set()
        for _ in range(n_tensors):
            name = r.string(MAX_TENSOR_NAME_BYTES, "a tensor name")
            if name in names:
                raise damaged(f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = r.u32()
            if n_dims > GGML_MAX_DIMS:
                raise damaged(
                    f"tensor {name!r} has {n_dims:,} dimensions; GGUF allows at most {GGML_MAX_DIMS}"
                )
            dims = [r.u64() for _ in range(n_dims)]
            if 0 in dims:
                raise damaged(
                    f"tensor {name!r} has a dimension of 0 in shape {tuple(reversed(dims))}"
                )
            qtype = r.u32()
            directory.append((name, tuple(reversed(dims)), qtype, r.u64()))
    except _OutOfBytes:
        return GGUFHeader(version, metadata, None)
    except ValueError as exc:  # a value or array type that GGUF does not define
        if isinstance(exc, GGUFError):
            raise
        raise damaged(str(exc)) from exc
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int | np.integer)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise damaged(f"general.alignment is {alignment!r}, not a positive power of two")
    alignment = int(alignment)
    data_start = (r.pos + alignment - 1) // alignment * alignment
    tensors = {
        name: TensorInfo(name, shape, qtype, data_start + offset, _tensor_nbytes(shape, qtype))
        for name, shape, qtype, offset in directory
    }
    return GGUFHeader(version, metadata, tensors)


class GGUFFile:
    """Header, metadata and tensor directory of one GGUF file; tensor bytes are memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open the model file ({exc.strerror})") from exc
        try:
            self.file_size = self.path.stat().st_size
            if self.file_size < MIN_HEADER_BYTES:
                self._fail("the file is too small to be a GGUF model (truncated or empty)")
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            header = read_header(self._map, str(self.path))
            if header.tensors is None:
                self._fail(
                    "the header runs past the end of the file (a count or length in it is "
                    "wrong); the file is truncated or damaged: download it again"
                )
            for info in header.tensors.values():
                if info.offset + info.nbytes > self.file_size:
                    # A bogus shape can make a size of any magnitude: the shape and type
                    # are named so the reader can tell a cut file from a damaged header.
                    self._fail(
                        f"tensor {info.name!r} (shape {info.shape}, {info.type_name}: "
                        f"{info.nbytes:,} bytes) ends at byte {info.offset + info.nbytes:,} "
                        f"but the file has only {self.file_size:,} bytes; the file is truncated "
                        "or its header damaged: download it again"
                    )
        except BaseException:
            self._file.close()
            raise
        self.version: int = header.version
        self.metadata: dict[str, Any] = header.metadata
        self.tensors: dict[str, TensorInfo] = header.tensors

    def _fail(self, problem: str) -> None:
        raise GGUFError(f"{self.path}: {problem}")

    # -- access --------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def drop_arrays(self) -> None:
        """Forget the metadata's arrays (the vocabulary, its scores and merges: 15 MB of
        Python strings for a 128k vocabulary) once loading has read them: a loaded model
        keeps its file open to read embedding rows, and nothing reads its arrays after."""
        self.metadata = {
            k: v for k, v in self.metadata.items() if not isinstance(v, (list, np.ndarray))
        }

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a read-only uint8 array backed by the file mapping."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def prefault(self, chunk: int = 64 << 20, skip: tuple[np.ndarray, ...] = ()) -> None:
        """Map every page of the file into this process (and ask the kernel to read ahead
        what is not in the page cache): weights read in place fault each page in on first
        use, which made a model's first token the slowest (Llama-3.2-1B shape, one
        thread: 1.27-1.57 s against 0.86-1.13 s for the next ones; with this run first,
        the first one like the rest). Reads one byte per page, a chunk at a time, with
        numpy (which leaves the GIL free), so it can run on a thread after loading.
        ``skip``: views of the mapping (:meth:`tensor_bytes`) whose pages are never read
        again (weights repacked at load), left out."""
        page = mmap.PAGESIZE
        holes = sorted(self._pages_of(a) for a in skip)
        at = 0
        for start, end in [*holes, (self.file_size, self.file_size)]:
            if start > at and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: what is read in place (the
                    # weights on CPUs without tiles) read from the disk in 2 MB folios,
                    # mapped as huge pages (a weight read at batch 1 about 1.16x faster)
                    self._map.madvise(mmap.MADV_HUGEPAGE, at, start - at)
                self._map.madvise(mmap.MADV_WILLNEED, at, start - at)
            for c in range(at, start, chunk):
                n = min(chunk, start - c)
                np.frombuffer(self._map, np.uint8, count=n, offset=c)[::page].sum()
            at = max(at, end)
        # the kernel maps the cached pages around each one touched (fault-around): the
        # skipped views' ends came back, 54 of the 800 MB at the Llama-3.2-1B shape
        self.release(list(skip))

    def release(self, arrays: list[np.ndarray]) -> None:
        """Unmap the pages wholly inside these views of the mapping (weights repacked at
        load, whose file bytes are never read again) from this process: they stay in the
        page cache, out of its resident set, and a later read faults them back in."""
        if not hasattr(self._map, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        for a in arrays:
            start, end = self._pages_of(a)
            if end > start:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def row_reader(self, a: np.ndarray) -> Callable[[np.ndarray], np.ndarray] | None:
        """A function reading rows ``index`` of view ``a`` (uint8 ``[rows, row bytes]``,
        :meth:`tensor_bytes`) with ``preadv``, no page of the file mapped: a large table
        looked up a few rows at a time (the token embedding) then stays out of the
        process's resident set, where each lookup through the mapping brought 64 KB
        (the kernel maps the cached pages around each page read). None where the
        system has no ``preadv`` (Windows)."""
        offset = self.offset_of(a)
        if offset is None or a.ndim != 2 or not hasattr(os, "preadv"):
            return None
        rows, width = a.shape
        file = self._file  # kept open by the reader as long as the reader lives

        def read(index: np.ndarray) -> np.ndarray:
            out = np.empty((len(index), width), np.uint8)
            for j, i in enumerate(index.tolist()):
                if not 0 <= i < rows:
                    raise IndexError(f"row {i} of a table of {rows:,}")
                if os.preadv(file.fileno(), [out[j]], offset + i * width) != width:
                    raise OSError(f"{self.path}: the file became shorter while in use")
            return out

        return read

    def offset_of(self, a: np.ndarray) -> int | None:
        """Where view ``a`` of the mapping (:meth:`tensor_bytes`) starts in the file;
        None for an array that is not one."""
        base = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
        offset = a.ctypes.data - base
        return offset if 0 <= offset <= self.file_size - a.nbytes else None

    def _pages_of(self, a: np.ndarray) -> tuple[int, int]:
        """The byte range of whole pages of the mapping inside view ``a``."""
        offset = self.offset_of(a)
        if offset is None:
            raise ValueError("not a view of this file's mapping")
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        end = (offset + a.nbytes) // page * page
        return start, max(start, end)

    def close(self) -> None:
        # Arrays handed out by tensor_bytes keep the mapping alive; closing would crash them.
        self._file.close()


def _tensor_nbytes(shape: tuple[int, ...], qtype: int) -> int:
    n = math.prod(shape)  # Python ints: a bogus shape cannot overflow into a small size
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return 0  # unknown type: size unknown; the loader reports the type by name
    return n // block * type_size
