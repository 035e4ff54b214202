"""A fast, read-only view of a GGUF file.

`gguf.GGUFReader` builds a Python object for every element of every metadata array,
which takes ~4 s for SmolLM2's 49k-token vocabulary and ~11 s for Gemma 3's 262k.
Folio needs to load a model in a couple of seconds, so this reader parses the header
with `struct` and numpy in one pass and maps tensor data with `np.memmap`, while the
`gguf` package still supplies the format's constants (value and tensor types, block
sizes). Tests check this reader against `gguf.GGUFReader`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

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

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class GGUFFile:
    """Header, metadata and tensor directory of one GGUF file; tensor bytes are memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open the model file ({exc.strerror})") from exc
        self.file_size = self.path.stat().st_size
        if self.file_size < 24:
            self._fail("the file is too small to be a GGUF model (truncated or empty)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            if isinstance(exc, GGUFError):
                raise
            self._fail(f"the header is cut short or damaged ({exc}); the file is probably truncated: download it again")

    # -- parsing -------------------------------------------------------------------
    def _fail(self, problem: str) -> None:
        raise GGUFError(f"{self.path}: {problem}")

    def _read(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self._pos + size > self.file_size:
            self._fail("the header is cut short; the file is truncated: download it again")
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += size
        return value

    def _read_string(self) -> str:
        length = self._read("<Q")
        if self._pos + length > self.file_size:
            self._fail("the header is cut short; the file is truncated: download it again")
        raw = self._map[self._pos : self._pos + length]
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _read_value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self._read_string()
        if vtype == GGUFValueType.ARRAY:
            return self._read_array()
        return self._read(SCALAR_FORMATS[vtype])

    def _read_array(self) -> Any:
        etype = GGUFValueType(self._read("<I"))
        count = self._read("<Q")
        if etype in _NUMPY_DTYPES:
            dtype = _NUMPY_DTYPES[etype]
            end = self._pos + count * dtype.itemsize
            if end > self.file_size:
                self._fail("the header is cut short; the file is truncated: download it again")
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos = end
            return values
        if etype == GGUFValueType.STRING:
            return self._read_string_array(count)
        return [self._read_value(etype) for _ in range(count)]

    def _read_string_array(self, count: int) -> list[str]:
        buf, pos, size = self._map, self._pos, self.file_size
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                self._fail("the header is cut short; the file is truncated: download it again")
            (length,) = unpack(buf, pos)
            pos += 8
            out.append(buf[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        if pos > size:
            self._fail("the header is cut short; the file is truncated: download it again")
        self._pos = pos
        return out

    def _parse(self) -> None:
        if self._map[:4] != GGUF_MAGIC:
            self._fail("not a GGUF file (bad magic bytes); choose a .gguf model file")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            self._fail(f"GGUF version {self.version} is not supported (Folio reads versions 2 and 3)")
        n_tensors = self._read("<Q")
        n_kv = self._read("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            self._fail("the header is damaged (absurd tensor or key counts)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_string()
            self.metadata[key] = self._read_value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._read_string()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            qtype = self._read("<I")
            offset = self._read("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (self._pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            info = TensorInfo(name, shape, qtype, data_start + offset, _tensor_nbytes(shape, qtype))
            if info.offset + info.nbytes > self.file_size:
                self._fail(
                    f"the file is truncated: tensor {name!r} ends at byte {info.offset + info.nbytes:,} "
                    f"but the file has only {self.file_size:,} bytes; download it again"
                )
            self.tensors[name] = info

    # -- access --------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a read-only uint8 array backed by the file mapping."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def close(self) -> None:
        # Arrays handed out by tensor_bytes keep the mapping alive; closing would crash them.
        self._file.close()


def _tensor_nbytes(shape: tuple[int, ...], qtype: int) -> int:
    n = int(np.prod(shape)) if shape else 1
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return 0  # unknown type: size unknown; the loader reports the type by name
    return n // block * type_size
