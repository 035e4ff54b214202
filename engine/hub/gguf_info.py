"""What Folio needs to know about a GGUF model before (and after) it is downloaded.

Two sources give the same :class:`GGUFSummary`:

* :func:`summary_from_prefix` reads the first bytes of a remote file (an HTTP Range
  read): the metadata and tensor directory sit at the start of a GGUF file, so a few MB
  tell the architecture, layer and head counts and every tensor's type without
  downloading the weights. The loader's parser (:func:`engine.model.gguf_file.read_header`)
  reads them and says when the bytes end before the header does.
* :func:`summary_from_file` reads a local file with ``GGUFFile``.

The quantization named in a file name (``...Q4_K_M.gguf``) is parsed by
:func:`quant_from_filename`; the header's ``general.file_type`` confirms it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from engine.model.config import SUPPORTED_ARCHITECTURES
from engine.model.gguf_file import GGUFError, GGUFFile, TensorInfo, read_header
from engine.model.weight_modes import DEFAULT_WEIGHT_MODE

__all__ = [
    "GGUFSummary",
    "quant_from_filename",
    "quant_from_file_type",
    "summary_from_file",
    "summary_from_metadata",
    "summary_from_prefix",
]

# Longest names first inside each family so that Q4_K_M is not read as Q4_K.
_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])("
    r"IQ\d_(?:XXS|XS|NL|S|M)"
    r"|Q\d_K(?:_(?:XL|S|M|L))?"
    r"|Q\d_\d(?:_\d_\d)?"
    r"|TQ\d_\d|MXFP4(?:_MOE)?|BF16|FP16|F16|FP32|F32"
    r")(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)

# Bytes per value the loader keeps for a tensor it does not hold as int4: it
# dequantizes to the fp32 compute dtype (engine/model/loader.py).
_DENSE_BYTES = 4
# int4 repack (kernels/int4.py): 4-bit codes plus a bf16 scale and min per 32 values.
_INT4_BYTES_PER_VALUE = 0.5 + 4 / 32


def quant_from_filename(name: str) -> str | None:
    """``"SmolLM2-135M-Instruct.Q4_1.gguf"`` -> ``"Q4_1"``; None when the name carries none."""
    matches = _QUANT_RE.findall(Path(name).name)
    if not matches:
        return None
    quant = matches[-1].upper()  # the quant tag is conventionally last
    return {"FP16": "F16", "FP32": "F32"}.get(quant, quant)


def is_split_gguf(name: str) -> bool:
    """``model-00001-of-00003.gguf``: one shard of a split file, which Folio cannot load."""
    return bool(_SPLIT_RE.search(name))


def quant_from_file_type(file_type: Any) -> str | None:
    """``general.file_type`` (llama.cpp's LlamaFileType) -> ``"Q4_K_M"``."""
    try:
        name = LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        return None
    if name == "GUESSED":
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


@dataclass(frozen=True)
class GGUFSummary:
    """Architecture, sizes and types of one GGUF model; ``problem`` says why Folio cannot run it."""

    architecture: str
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    context_length: int | None
    file_type: str | None  # quantization from general.file_type, e.g. "Q4_K_M"
    # Tensor type name -> count; None when the header was longer than the bytes read.
    tensor_types: dict[str, int] | None = field(default=None, compare=False)
    # Estimated resident bytes of the weights once Folio has loaded them (int4 mode).
    weight_bytes: int | None = None
    problem: str | None = None
    vocab_size: int | None = None  # tokens of the vocabulary, where the header says

    @property
    def supported(self) -> bool:
        return self.problem is None


def summary_from_prefix(data: bytes, source: str) -> tuple[GGUFSummary, bool]:
    """Summary of a GGUF file from its first bytes; the flag is True when the whole header fit."""
    try:
        header = read_header(data, source)
    except GGUFError as exc:
        return _broken(str(exc)), True
    tensors = None if header.tensors is None else list(header.tensors.values())
    return summary_from_metadata(header.metadata, tensors, source), header.complete


def summary_from_file(path: str | Path) -> GGUFSummary:
    """Summary of a local GGUF file (raises GGUFError for a damaged or truncated file)."""
    gf = GGUFFile(path)
    try:
        return summary_from_metadata(gf.metadata, list(gf.tensors.values()), str(path))
    finally:
        gf.close()


def _broken(problem: str) -> GGUFSummary:
    return GGUFSummary("", None, None, None, None, None, problem=problem)


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def summary_from_metadata(
    meta: dict[str, Any], tensors: list[TensorInfo] | None, source: str
) -> GGUFSummary:
    arch = str(meta.get("general.architecture", ""))
    heads = _int(meta.get(f"{arch}.attention.head_count"))
    hidden = _int(meta.get(f"{arch}.embedding_length"))
    # Same head_dim rule as ModelConfig.from_gguf_metadata.
    head_dim = _int(meta.get(f"{arch}.attention.key_length")) or _int(
        meta.get(f"{arch}.rope.dimension_count")
    )
    if not head_dim and hidden and heads:
        head_dim = hidden // heads
    types: dict[str, int] | None = None
    weight_bytes = None
    problem = None
    if arch not in SUPPORTED_ARCHITECTURES:
        problem = f"architecture {arch or '(none)'!r} is not supported; Folio runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    if tensors is not None:
        types = {}
        for t in tensors:
            types[_type_name(t.qtype)] = types.get(_type_name(t.qtype), 0) + 1
        unsupported = sorted(set(types) - _supported_type_names())
        if unsupported and problem is None:
            problem = (
                f"tensor type {', '.join(unsupported)} is not supported; Folio reads "
                f"{', '.join(sorted(_supported_type_names()))}"
            )
        weight_bytes = estimate_weight_bytes(tensors)
    return GGUFSummary(
        architecture=arch,
        num_layers=_int(meta.get(f"{arch}.block_count")),
        num_kv_heads=_int(meta.get(f"{arch}.attention.head_count_kv")) or heads,
        head_dim=head_dim,
        context_length=_int(meta.get(f"{arch}.context_length")),
        file_type=quant_from_file_type(meta.get("general.file_type")),
        tensor_types=types,
        weight_bytes=weight_bytes,
        problem=problem,
        vocab_size=_vocab_size(meta, arch),
    )


def _vocab_size(meta: dict[str, Any], arch: str) -> int | None:
    """The vocabulary's size: ``{arch}.vocab_size``, else the tokenizer's token list."""
    size = _int(meta.get(f"{arch}.vocab_size"))
    if size:
        return size
    tokens = meta.get("tokenizer.ggml.tokens")
    try:
        return len(tokens) or None
    except TypeError:
        return None


def _type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


@functools.cache
def _supported_type_names() -> frozenset[str]:
    # The dequantizers are the single source of truth; importing them costs a torch import,
    # which only happens when a tensor directory is actually inspected.
    from kernels.dequant import SUPPORTED_TYPES

    return frozenset(t.name for t in SUPPORTED_TYPES)


@functools.cache
def _int4_type_ids() -> frozenset[int]:
    from kernels.int4 import INT4_TYPES

    return frozenset(int(t) for t in INT4_TYPES)


def estimate_weight_bytes(tensors: list[TensorInfo], weight_mode: str | None = None) -> int:
    """Resident bytes of the weights after Folio's loader (engine/model/loader.py) has run
    (``weight_mode``: the loader's default when None).

    In ``native`` mode every matrix stays as the file stores it, mapped: its bytes; the
    one-dimensional tensors (norms, biases) become fp32.

    Q4_0 / Q4_1 / Q4_K projections stay int4 in ``int4`` mode; everything else (the
    embedding, norms, other quant types) is dequantized to fp32. A tied output head gets
    a 4-bit scoring copy (kernels/head.py). Where the loader would keep bf16 copies for
    batched decode (kernels/bf16.py: AMX CPUs, small models), they count too. An
    estimate: a few percent either way.
    """
    weight_mode = weight_mode or DEFAULT_WEIGHT_MODE
    if weight_mode == "native":
        return sum(
            t.nbytes if len(t.shape) == 2 else int(np.prod(t.shape)) * _DENSE_BYTES for t in tensors
        )
    total = 0.0
    names = {t.name for t in tensors}
    batchable = 0  # values of the int4 projections and the head: what gets a bf16 copy
    for t in tensors:
        name, shape, qtype = t.name, t.shape, t.qtype
        n = int(np.prod(shape)) if shape else 1
        int4 = (
            weight_mode == "int4"
            and qtype in _int4_type_ids()
            and len(shape) == 2
            and shape[-1] % 32 == 0
            and name != "token_embd.weight"
        )
        total += n * (_INT4_BYTES_PER_VALUE if int4 else _DENSE_BYTES)
        tied_head = name == "token_embd.weight" and "output.weight" not in names
        if tied_head and weight_mode == "int4":
            total += n * _INT4_BYTES_PER_VALUE  # the head's quantized scoring copy
        if int4 or tied_head or name == "output.weight":
            batchable += n
    if weight_mode == "int4":
        from engine.model.loader import auto_keeps_batched_copies

        copies = 2 * batchable  # bf16
        total += copies if auto_keeps_batched_copies(copies) else 0
    return int(total)
