"""Random-weight GGUF files with the exact shapes and tensor types of real 1B-8B models.

A benchmark of prefill and decode speed measures memory traffic and arithmetic, which
depend on a model's shapes and tensor types, not on what its weights learned. So instead
of downloading 1-5 GB per model, :func:`make_shape_gguf` writes a file with a real model's
hyperparameters (from its Hugging Face ``config.json``), the tensor names, order and
types that llama.cpp's ``llama-quantize`` gives it, a real byte-level BPE vocabulary
(SmolLM2's, padded with unique filler tokens to the model's vocabulary size) and random
blocks whose fp16 scales are set so each matmul's output stays O(1): the forward pass
gives finite logits in llama.cpp and in Folio.

:func:`assign_types` is a port of ``llama_tensor_get_type`` (llama.cpp src/llama-quant.cpp)
for the mixes in :data:`QUANTS` and the dense architectures in :data:`SHAPES`, without an
importance matrix or overrides; :func:`tensor_mix` applies it to a shape without writing.

Files are cached under ``paths.cache_dir() / "bench-shapes"``, named with
:data:`MAKER_VERSION`, written to a temporary name and renamed when complete, and
streamed a few MiB at a time (the largest, qwen2-7b at Q4_K_M, is 4.7 GB).
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from engine import paths

Q = GGMLQuantizationType

# Bump when the bytes a shape's file holds change (layout, vocabulary, scales): the version
# is in the file name, so an old cached file is never mistaken for a new one.
MAKER_VERSION = 1
SEED = 20250101
_CHUNK_BYTES = 16 << 20  # bytes generated and written at a time
_FILLER = "<|folio_filler_{}|>"  # unique, and never produced by the BPE merges
_BIAS_STD = 0.02

#: ``progress(fraction, what)``: fraction of the tensor bytes written, the tensor being
#: written (as engine.model.loader's progress)
Progress = Callable[[float, str], None]


# -- shapes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.x ``rope_scaling`` (rope_type "llama3"); GGUF stores it as ``rope_freqs.weight``."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def factors(self, head_dim: int, theta: float) -> np.ndarray:
        """The per-frequency divisors, as convert_hf_to_gguf.py computes them."""
        freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
        wavelen = 2 * math.pi / freqs
        low = self.original_context / self.low_freq_factor
        high = self.original_context / self.high_freq_factor
        smooth = (self.original_context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        mid = 1.0 / ((1 - smooth) / self.factor + smooth)
        out = np.where(wavelen < high, 1.0, np.where(wavelen > low, self.factor, mid))
        return out.astype(np.float32)


@dataclass(frozen=True)
class ModelShape:
    name: str
    source: str  # the Hugging Face model whose config.json the numbers are from
    arch: str  # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context: int
    tied: bool  # no output.weight: the head reads token_embd
    qkv_bias: bool = False
    llama3_rope: Llama3Rope | None = None
    qk_norm: bool = False  # Gemma 3: attn_q_norm / attn_k_norm
    sandwich_norms: bool = False  # Gemma 3: post_attention_norm / post_ffw_norm
    sliding_window: int | None = None


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(
            "llama-3.2-1b", "meta-llama/Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192,
            128256, 500000.0, 1e-5, 131072, tied=True, llama3_rope=Llama3Rope(32.0),
        ),
        ModelShape(
            "qwen2.5-3b", "Qwen/Qwen2.5-3B", "qwen2", 2048, 36, 16, 2, 128, 11008,
            151936, 1000000.0, 1e-6, 32768, tied=True, qkv_bias=True,
        ),
        ModelShape(
            "qwen2-7b", "Qwen/Qwen2-7B-Instruct", "qwen2", 3584, 28, 28, 4, 128, 18944,
            152064, 1000000.0, 1e-6, 32768, tied=False, qkv_bias=True,
        ),
        ModelShape(
            "llama-3.1-8b", "meta-llama/Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14336,
            128256, 500000.0, 1e-5, 131072, tied=False, llama3_rope=Llama3Rope(8.0),
        ),
        # The Gemma 3 file the tests fetch: its 640-wide rows are not whole 256-blocks, so
        # it checks the fallbacks of the type rule against a real llama-quantize output.
        ModelShape(
            "gemma3-270m", "google/gemma-3-270m", "gemma3", 640, 18, 4, 1, 256, 2048,
            262144, 1000000.0, 1e-6, 32768, tied=True, qk_norm=True, sandwich_norms=True,
            sliding_window=512,
        ),
        # A few MB each, for tests: rows are whole 256-blocks, 8 and 6 layers so the
        # "more bits" layers are a proper subset.
        ModelShape(
            "tiny-llama", "(test shape)", "llama", 256, 8, 4, 2, 64, 768,
            8192, 500000.0, 1e-5, 2048, tied=True, llama3_rope=Llama3Rope(32.0),
        ),
        ModelShape(
            "tiny-qwen2", "(test shape)", "qwen2", 256, 6, 4, 2, 64, 512,
            8192, 1000000.0, 1e-6, 2048, tied=False, qkv_bias=True,
        ),
    )
}  # fmt: skip


# -- the quantizer's type rule ------------------------------------------------------------


@dataclass(frozen=True)
class QuantMix:
    name: str
    ftype: LlamaFileType  # general.file_type
    default: GGMLQuantizationType  # llama_ftype_get_default_type


QUANTS: dict[str, QuantMix] = {
    m.name: m
    for m in (
        QuantMix("q4_k_m", LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
        QuantMix("q4_0", LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
        QuantMix("q8_0", LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    )
}


class Category(Enum):
    """llama-quant.cpp's ``tensor_category``, for the tensors these shapes have."""

    TOKEN_EMBD = "token_embd"
    ATTENTION_V = "attn_v"
    FFN_DOWN = "ffn_down"
    OUTPUT = "output"
    OTHER = "other"


def _category(name: str) -> Category:
    if name == "output.weight":
        return Category.OUTPUT
    if name == "token_embd.weight":
        return Category.TOKEN_EMBD
    if "attn_v.weight" in name:
        return Category.ATTENTION_V
    if "ffn_down" in name:
        return Category.FFN_DOWN
    return Category.OTHER


def _allows_quantization(name: str, dims: tuple[int, ...]) -> bool:
    """``tensor_allows_quantization``: 2-D weights, not norms (the rest of its list names
    tensors these architectures do not have)."""
    return len(dims) >= 2 and name.endswith("weight") and "_norm.weight" not in name


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers whose attn_v and ffn_down Q4_K_M keeps at Q6_K."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def _block(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


# tensor_type_fallback: a row that is not whole blocks of the target type.
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0}


def _fallback(qtype: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
    if row % _block(qtype) == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if row % _block(qtype) == 0 else Q.F16


def quantize_order(name: str) -> tuple[int, str]:
    """llama-model-loader's ``weight_name_comparer``: by layer (-1 outside blocks), then name.
    llama-quantize writes tensors in this order, and its layer counters follow it."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # outermost first (torch order); shape[-1] is the row length
    qtype: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        assert self.shape[-1] % block == 0, (self.name, self.shape, self.qtype.name)
        return math.prod(self.shape) // block * size


def assign_types(
    tensors: Iterable[tuple[str, tuple[int, ...]]], quant: str, n_layers: int
) -> list[TensorSpec]:
    """The type llama-quantize gives each tensor (in torch-order ``shape``) for ``quant``,
    in the order it writes them. Source tensors are taken to be F32 (1-D) and F16 (2-D),
    as convert_hf_to_gguf.py leaves them; only quantizable ones change type.

    Of ``llama_tensor_get_type_impl`` only the branches that these ftypes reach for dense
    (no experts), non-Falcon, non-70B models are ported; no imatrix, no overrides.
    """
    mix = QUANTS[quant]
    ordered = sorted(tensors, key=lambda t: quantize_order(t[0]))
    tied = all(_category(name) != Category.OUTPUT for name, _ in ordered)
    n_attention_wv = sum(_category(name) == Category.ATTENTION_V for name, _ in ordered)
    i_attention_wv = i_ffn_down = 0
    k_quant_m = mix.ftype == LlamaFileType.MOSTLY_Q4_K_M
    specs = []
    for name, dims in ordered:
        dims = tuple(int(d) for d in dims)
        if not _allows_quantization(name, dims):
            specs.append(TensorSpec(name, dims, Q.F32 if len(dims) == 1 else Q.F16))
            continue
        qtype = mix.default
        category = _category(name)
        if category == Category.OUTPUT or (tied and category == Category.TOKEN_EMBD):
            if dims[-1] % _block(qtype):
                qtype = Q.Q8_0
            elif qtype != Q.Q8_0:
                qtype = Q.Q6_K
        elif category == Category.ATTENTION_V:
            if k_quant_m and use_more_bits(i_attention_wv, n_attention_wv):
                qtype = Q.Q6_K
            i_attention_wv += 1
        elif category == Category.FFN_DOWN:
            if k_quant_m and use_more_bits(i_ffn_down, n_layers):
                qtype = Q.Q6_K
            i_ffn_down += 1
        specs.append(TensorSpec(name, dims, _fallback(qtype, dims[-1])))
    return specs


def tensor_layout(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of ``shape``'s GGUF file and its torch-order shape."""
    h, d, ff, vocab = shape.hidden, shape.head_dim, shape.ffn, shape.vocab
    q, kv = shape.heads * d, shape.kv_heads * d
    out = [("token_embd.weight", (vocab, h)), ("output_norm.weight", (h,))]
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    if shape.llama3_rope is not None:
        out.append(("rope_freqs.weight", (d // 2,)))
    for i in range(shape.layers):
        layer = {
            "attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
            "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
            "ffn_gate.weight": (ff, h), "ffn_up.weight": (ff, h), "ffn_down.weight": (h, ff),
        }  # fmt: skip
        if shape.qkv_bias:
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if shape.qk_norm:
            layer.update({"attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)})
        if shape.sandwich_norms:
            layer.update({"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)})
        out += [(f"blk.{i}.{role}", dims) for role, dims in layer.items()]
    return out


def tensor_mix(name: str, quant: str) -> list[TensorSpec]:
    """The tensors, shapes and types of shape ``name`` at ``quant``, in file order."""
    shape = _shape(name)
    return assign_types(tensor_layout(shape), quant, shape.layers)


def mix_report(name: str, quant: str) -> dict:
    """What the bench prints beside its figures: tensor counts and bytes per type."""
    specs = tensor_mix(name, quant)
    shape = _shape(name)
    totals = type_totals((s.qtype.name, s.nbytes, s.shape) for s in specs)
    return {"shape": name, "source": shape.source, "quant": quant, **totals}


def type_totals(tensors: Iterable[tuple[str, int, tuple[int, ...]]]) -> dict:
    """Tensors given as (type name, bytes, shape): their count and bytes per type, all
    their bytes and their parameters."""
    counts, sizes, parameters = Counter(), Counter(), 0
    for type_name, nbytes, shape in tensors:
        counts[type_name] += 1
        sizes[type_name] += nbytes
        parameters += math.prod(shape)
    return {
        "tensors": dict(counts),
        "bytes_by_type": dict(sizes),
        "weight_bytes": sum(sizes.values()),
        "parameters": parameters,
    }


def _shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None


# -- random blocks -------------------------------------------------------------------------

# Where each block type keeps its fp16 scales, and each one's value as a multiple of d.
# Q4_K's dmin is 7.5 d: its 6-bit scales and mins are random, so on average d*sc*q (q in
# 0..15) and dmin*m cancel and the weights have mean ~0.
_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, float], ...]] = {
    Q.Q8_0: ((0, 1.0),),
    Q.Q4_0: ((0, 1.0),),
    Q.Q5_0: ((0, 1.0),),
    Q.Q4_K: ((0, 1.0), (2, 7.5)),
    Q.Q6_K: ((208, 1.0),),
}
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16}


def scale_fields(qtype: GGMLQuantizationType) -> tuple[tuple[int, float], ...]:
    """(byte offset in the block, multiple of d) of each fp16 scale of a block type."""
    return _SCALE_FIELDS[qtype]


def _set_scales(blocks: np.ndarray, qtype: GGMLQuantizationType, d: float) -> None:
    for offset, multiple in _SCALE_FIELDS[qtype]:
        value = np.float16(d * multiple)
        assert np.isfinite(value) and value > 0, (qtype.name, d)
        blocks[:, offset : offset + 2] = np.frombuffer(value.tobytes(), np.uint8)


@cache
def _unit_rms(qtype: GGMLQuantizationType) -> float:
    """RMS of a weight of random blocks of ``qtype`` with d = 1."""
    blocks = np.random.default_rng(SEED).integers(
        0, 256, (512, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8
    )
    _set_scales(blocks, qtype, 1.0)
    return float(np.sqrt(np.mean(gguf.quants.dequantize(blocks, qtype) ** 2)))


def weight_scale(qtype: GGMLQuantizationType, row: int) -> float:
    """d for random blocks whose matmul output has RMS ~1 on unit-RMS inputs of ``row``
    values (real files' d are as small: Q6_K's are often fp16 subnormals)."""
    return 1.0 / (_unit_rms(qtype) * math.sqrt(row))


def _seed(shape_name: str, tensor: str) -> list[int]:
    """Each tensor its own stream: a file's bytes do not depend on the order of writing."""
    return [SEED, zlib.crc32(f"{shape_name}/{tensor}".encode())]


def _tensor_chunks(shape_name: str, spec: TensorSpec, rope: np.ndarray | None):
    """The bytes of one tensor, a few MiB at a time."""
    if spec.name == "rope_freqs.weight":
        yield rope.astype(np.float32).view(np.uint8)
        return
    if len(spec.shape) == 1:
        if spec.name.endswith(".bias"):
            rng = np.random.default_rng(_seed(shape_name, spec.name))
            yield (rng.standard_normal(spec.shape[0]) * _BIAS_STD).astype(np.float32).view(np.uint8)
        else:  # a norm: unit gain
            assert spec.name.endswith("norm.weight"), spec.name
            yield np.ones(spec.shape[0], np.float32).view(np.uint8)
        return
    bit_gen = np.random.SFC64(_seed(shape_name, spec.name))
    row, rows = spec.shape[-1], math.prod(spec.shape[:-1])
    if spec.qtype in FLOAT_TYPES:
        rng = np.random.Generator(bit_gen)
        per_chunk = max(1, _CHUNK_BYTES // (row * 4))
        for start in range(0, rows, per_chunk):
            n = min(per_chunk, rows - start)
            values = rng.standard_normal((n, row), dtype=np.float32) / math.sqrt(row)
            yield values.astype(FLOAT_TYPES[spec.qtype]).view(np.uint8).reshape(-1)
        return
    block, size = GGML_QUANT_SIZES[spec.qtype]
    n_blocks = rows * row // block
    d = weight_scale(spec.qtype, row)
    per_chunk = max(1, _CHUNK_BYTES // size // 8 * 8)
    for start in range(0, n_blocks, per_chunk):
        n = min(per_chunk, n_blocks - start)
        raw = bit_gen.random_raw(-(-n * size // 8)).view(np.uint8)[: n * size]
        blocks = raw.reshape(n, size)
        _set_scales(blocks, spec.qtype, d)
        yield raw


# -- vocabulary ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos: int
    eos: int
    unk: int | None
    pad: int | None


@cache
def _smollm2_vocabulary(path: Path) -> Vocabulary:
    from engine.model.gguf_file import GGUFFile

    gf = GGUFFile(path)
    try:
        return Vocabulary(
            tokens=list(gf.get("tokenizer.ggml.tokens")),
            token_types=[int(t) for t in gf.get("tokenizer.ggml.token_type")],
            merges=list(gf.get("tokenizer.ggml.merges")),
            pre=str(gf.get("tokenizer.ggml.pre")),
            bos=int(gf.get("tokenizer.ggml.bos_token_id")),
            eos=int(gf.get("tokenizer.ggml.eos_token_id")),
            unk=gf.get("tokenizer.ggml.unknown_token_id"),
            pad=gf.get("tokenizer.ggml.padding_token_id"),
        )
    finally:
        gf.close()


def vocabulary(size: int, source: Path | None = None) -> Vocabulary:
    """SmolLM2's byte-level BPE vocabulary cut or padded to exactly ``size`` tokens.

    Cutting keeps the merges whose two parts and result are all kept (BPE vocabularies
    are in merge order, so the first tokens are a consistent smaller vocabulary); padding
    appends unique NORMAL tokens that no merge produces.
    """
    if source is None:
        from engine.model.fetch import ensure_default_model

        source = ensure_default_model()
    base = _smollm2_vocabulary(Path(source))
    if size < 512:
        raise ValueError(f"a vocabulary of {size} tokens is too small to hold the byte tokens")
    tokens = base.tokens[:size]
    types = base.token_types[:size]
    merges = base.merges
    if size < len(base.tokens):
        kept = set(tokens)
        merges = [
            m for m in merges if (parts := m.split(" ", 1)) and len(parts) == 2
            and parts[0] in kept and parts[1] in kept and parts[0] + parts[1] in kept
        ]  # fmt: skip
    filler = range(len(tokens), size)
    tokens = tokens + [_FILLER.format(i) for i in filler]
    types = types + [int(gguf.TokenType.NORMAL)] * len(filler)
    assert len(set(tokens)) == size
    return Vocabulary(tokens, types, merges, base.pre, base.bos, base.eos, base.unk, base.pad)


# -- the file --------------------------------------------------------------------------------


def default_folder() -> Path:
    return paths.cache_dir() / "bench-shapes"


def shape_file_name(name: str, quant: str) -> str:
    return f"{name}-{quant}-random-v{MAKER_VERSION}.gguf"


def make_shape_gguf(
    name: str,
    quant: str,
    folder: Path | str | None = None,
    progress: Progress | None = None,
    *,
    vocab_source: Path | str | None = None,
) -> Path:
    """The GGUF file of shape ``name`` at ``quant`` with random weights, written once and
    cached in ``folder`` (default :func:`default_folder`). ``vocab_source``: the SmolLM2
    GGUF to take the vocabulary from (default: Folio's fetched copy)."""
    shape = _shape(name)
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; known: {', '.join(QUANTS)}")
    specs = tensor_mix(name, quant)
    folder = Path(folder) if folder is not None else default_folder()
    path = folder / shape_file_name(name, quant)
    if is_complete(path, specs):
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{path.name}.{os.getpid()}.part"
    try:
        _write(tmp, shape, QUANTS[quant], specs, vocabulary(shape.vocab, vocab_source), progress)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def is_complete(path: Path, specs: Sequence[TensorSpec]) -> bool:
    """``path`` holds exactly ``specs`` (names, order, shapes, types) and all their bytes."""
    from engine.model.gguf_file import GGUFError, GGUFFile

    if not path.is_file():
        return False
    try:
        gf = GGUFFile(path)  # refuses a file whose tensors run past its end
    except GGUFError:
        return False
    try:
        found = [(t.name, t.shape, t.qtype) for t in gf.tensors.values()]
        return found == [(s.name, s.shape, int(s.qtype)) for s in specs]
    finally:
        gf.close()


def _write(
    path: Path,
    shape: ModelShape,
    mix: QuantMix,
    specs: Sequence[TensorSpec],
    vocab: Vocabulary,
    progress: Progress | None,
) -> None:
    writer = gguf.GGUFWriter(None, shape.arch)
    _add_metadata(writer, shape, mix, vocab)
    for spec in specs:
        writer.add_tensor_info(
            spec.name, spec.shape, np.dtype(np.float32), spec.nbytes, raw_dtype=spec.qtype
        )
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    rope = (
        shape.llama3_rope.factors(shape.head_dim, shape.rope_theta) if shape.llama3_rope else None
    )
    total = sum(s.nbytes for s in specs)
    done = 0
    writer.write_padding(out, out.tell())
    for spec in specs:
        for chunk in _tensor_chunks(shape.name, spec, rope):
            chunk.tofile(out)
            done += chunk.nbytes
            if progress is not None:
                progress(done / total, spec.name)
        writer.write_padding(out, spec.nbytes)
    out.flush()
    os.fsync(out.fileno())
    writer.close()


def add_vocabulary(w: gguf.GGUFWriter, vocab: Vocabulary) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if vocab.unk is not None:
        w.add_unk_token_id(int(vocab.unk))
    if vocab.pad is not None:
        w.add_pad_token_id(int(vocab.pad))


def write_vocabulary_gguf(path: Path, source: Path | None = None) -> None:
    """SmolLM2's tokenizer alone in a GGUF (no tensors, about 2 MB): the ``vocab_source``
    of :func:`make_shape_gguf` where the 98 MB model cannot be fetched or carried (the GPU
    machine of tools/device_check.py)."""
    if source is None:
        from engine.model.fetch import ensure_default_model

        source = ensure_default_model()
    w = gguf.GGUFWriter(str(path), "llama")
    add_vocabulary(w, _smollm2_vocabulary(Path(source)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def _add_metadata(w: gguf.GGUFWriter, shape: ModelShape, mix: QuantMix, vocab: Vocabulary) -> None:
    w.add_type("model")
    w.add_name(f"{shape.name} {mix.name} random weights")
    w.add_description(
        f"Random weights with the shapes of {shape.source} and llama-quantize's "
        f"{mix.name} tensor types, made by Folio (engine/bench/shapes.py v{MAKER_VERSION})"
    )
    w.add_string("folio.bench_shape", shape.name)
    w.add_uint32("folio.bench_shape_version", MAKER_VERSION)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    if shape.sliding_window is not None:
        w.add_sliding_window(shape.sliding_window)
    w.add_file_type(int(mix.ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocabulary(w, vocab)
    w.add_add_bos_token(False)
