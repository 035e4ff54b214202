"""Where numba keeps the compiled kernels of this package and of ``kernels`` above it,
and when that copy is stale.

numba's own cache trusts a function's cached machine code while *its* source file is
unchanged, but the kernels here inline code from other files of the package (the unpackers,
the SIMD intrinsic of :mod:`kernels.quant.simd`), and they are specialised for the host's
instruction set (:data:`~kernels.quant.simd.HOST_ISA`, which ``FOLIO_QUANT_ISA`` can lower
on the same CPU, so the CPU alone does not identify the code). This locator keys the cache
on both: the directory names the ISA, and the source stamp is a hash of every module of the
package and of ``kernels`` (whose decode attention and rope kernels inline the same
intrinsics), so editing any of them recompiles everything once.

Installed by :func:`install` (called on import of :mod:`kernels.quant`); it claims only
functions defined in those two folders and leaves numba's other locators as they are.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import caching

from kernels.quant.simd import HOST_ISA

# public names in numba 0.68, underscored in older releases
_CacheImpl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
InTreeCacheLocator = getattr(caching, "InTreeCacheLocator", None) or caching._InTreeCacheLocator
UserWideCacheLocator = (
    getattr(caching, "UserWideCacheLocator", None) or caching._UserWideCacheLocator
)
UserProvidedCacheLocator = (
    getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator
)

_PACKAGE = Path(__file__).resolve().parent
# the folders whose kernels are claimed: this package, and the one above, whose numba
# kernels (paged attention's decode kernel, rope) inline this package's SIMD intrinsics
# too, so that editing an intrinsic recompiles them as well (numba's own stamp, their
# own file's, kept a decode kernel compiled with the old intrinsic)
_FOLDERS = (_PACKAGE, _PACKAGE.parent)


def _package_stamp(folders: tuple[Path, ...] = _FOLDERS) -> str:
    h = hashlib.sha256(HOST_ISA.encode())
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            h.update(f"{folder.name}/{path.name}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


_STAMP = _package_stamp()


def _ours(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().parent in _FOLDERS
    except OSError:
        return False


class _OurLocator:
    """numba's locator, for this package's files only, in a folder per ISA, stamped with
    the whole package's hash (mixed in before one of numba's locator classes)."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        self._cache_path = os.path.join(self._cache_path, f"numba-{HOST_ISA}")

    def get_source_stamp(self):
        return _STAMP

    @classmethod
    def from_function(cls, py_func, py_file):
        return super().from_function(py_func, py_file) if _ours(py_file) else None


class _InTree(_OurLocator, InTreeCacheLocator):
    """``__pycache__/numba-<isa>/`` beside the kernel's file when its folder is writable."""


class _UserWide(_OurLocator, UserWideCacheLocator):
    """numba's per-user cache folder otherwise (read-only installs)."""


class _UserProvided(_OurLocator, UserProvidedCacheLocator):
    """``$NUMBA_CACHE_DIR`` when it is set, as numba's own locators do."""


def install() -> None:
    """Put this package's locators first in numba's list (idempotent)."""
    locators = _CacheImpl._locator_classes
    for cls in (_UserWide, _InTree, _UserProvided):
        if cls not in locators:
            locators.insert(0, cls)
