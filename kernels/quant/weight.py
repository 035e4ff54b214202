"""A weight as the GGUF file stores it: a view of the mapped bytes, its type, its shape."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kernels.quant.registry import FLOAT_TYPES, QUANT_TYPES, QuantType, quant_type


def _byte_view(raw) -> np.ndarray:
    """Flat uint8 numpy view of ``raw`` (numpy array / memmap or CPU torch tensor), no copy."""
    if isinstance(raw, torch.Tensor):
        if raw.device.type != "cpu" or not raw.is_contiguous():
            raise ValueError("QuantWeight needs a contiguous CPU tensor of the file's bytes")
        raw = raw.reshape(-1).view(torch.uint8).numpy()
    arr = np.asarray(raw)
    if not arr.flags.c_contiguous:
        raise ValueError("QuantWeight needs contiguous bytes (a view of the mapped file)")
    return arr.reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class QuantWeight:
    """A linear weight ``[out_features N, in_features K]`` in its file format.

    ``data`` is uint8 ``[N, row_bytes]`` for block types, and the weight itself
    (``[N, K]`` float32 / float16 / bf16 bits as uint16) for the float types; either way a
    view of the bytes it was made from.
    """

    data: np.ndarray
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @classmethod
    def from_raw(cls, raw, qtype: int | GGMLQuantizationType, shape) -> QuantWeight:
        """Wrap the raw bytes of a 2-D GGUF tensor (torch shape order ``[N, K]``)."""
        qt = GGMLQuantizationType(int(qtype))
        n, k = (int(s) for s in shape)
        flat = _byte_view(raw)
        if qt in FLOAT_TYPES:
            dtype = FLOAT_TYPES[qt]
            need = n * k * dtype.itemsize
            data = flat.view(dtype).reshape(n, k) if flat.size == need else None
        else:
            need = n * quant_type(qt).row_bytes(k)
            data = flat.reshape(n, -1) if flat.size == need else None
        if data is None:
            raise ValueError(
                f"{qt.name} weight of shape {(n, k)} needs {need} bytes, got {flat.size}"
            )
        # Always read-only (the mapped file is): one numba specialisation serves every caller.
        data = data.view()
        data.flags.writeable = False
        return cls(data, qt, (n, k))

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_TYPES

    @property
    def kind(self) -> QuantType:
        """The registry entry (block types only)."""
        return QUANT_TYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def float_tensor(self) -> torch.Tensor:
        """The float types' weight as a torch tensor view (no copy)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes: never written
            t = torch.from_numpy(self.data)
        return t.view(torch.bfloat16) if self.qtype == GGMLQuantizationType.BF16 else t
