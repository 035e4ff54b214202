"""Load a model from a GGUF file or a Hugging Face safetensors folder.

Weights stay int4-packed where torch has a fast CPU kernel for them (Q4_0, Q4_1,
Q4_K in `int4` mode); everything else is dequantized once, at load, to the compute
dtype. Every failure names the file and the problem in words a user can act on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine import allocator
from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.gguf_file import GGUFError, GGUFFile
from engine.model.tile_cache import TileCache
from engine.model.transformer import Concat, Layer, Linear, Transformer
from engine.model.weight_modes import DEFAULT_WEIGHT_MODE, WEIGHT_MODES
from kernels.bf16 import packed_bf16_available, packed_bf16_supported
from kernels.dequant import SUPPORTED_TYPES, block_geometry, dequantize
from kernels.head import RescoredHead
from kernels.int4 import int4_from_gguf, int4_from_gguf_parts, int4_supported
from kernels.quant.float_rows import float_rows_supported
from kernels.quant.linear import BlockEmbedding, BlockLinear
from kernels.quant.tiles import Q6_K_INTEGER, TILES_ARITHMETIC, repack_parts, tiles_supported
from kernels.quant.weight import QuantWeight

_SUPPORTED_IDS = frozenset(int(t) for t in SUPPORTED_TYPES)
# bf16 copies of the int4 weights for batched decode (kernels/bf16.py): "auto" keeps them
# where the CPU has AMX bf16 and they cost at most BATCHED_AUTO_MAX_BYTES
BATCHED_WEIGHTS = ("auto", "on", "off")
BATCHED_AUTO_MAX_BYTES = 1 << 30

Progress = Callable[[float, str], None]


@dataclass
class LoadedModel:
    path: Path
    format: str  # "gguf" or "safetensors"
    config: ModelConfig
    model: Transformer
    weight_mode: str
    fingerprint: str  # identifies weights + architecture, mixed into cache root hashes
    load_seconds: float
    quant_types: dict[str, int] = field(default_factory=dict)  # type name -> tensor count
    tokenizer: object | None = None
    # engine.cache.kv_cache.KeyCalibration: the pre-RoPE key means of a quantized K cache,
    # computed for the first such cache (engine.model.calibration) and shared by later ones
    key_calibration: object | None = None
    # engine.model.tile_cache.TileCache: repacked weights kept on disk (native GGUF weights
    # on a CPU with the tile kernels); its ``status`` says what became of them
    tile_cache: object | None = None

    @property
    def batched_weights_bytes(self) -> int:
        """The bf16 copies kept for batched decode (kernels/bf16.py); 0 without them."""
        return self.model.batched_weights_bytes()

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    @property
    def device(self) -> torch.device:
        """Where the weights are; caches for this model are made there."""
        return self.model.device

    @property
    def name(self) -> str:
        return self.path.stem if self.format == "gguf" else self.path.name


def auto_keeps_batched_copies(copy_bytes: int) -> bool:
    """Whether "auto" keeps bf16 batch copies of this size: on a CPU where they were
    measured to win, and at most BATCHED_AUTO_MAX_BYTES."""
    return 0 < copy_bytes <= BATCHED_AUTO_MAX_BYTES and packed_bf16_available()


def _add_batched_weights(loaded: LoadedModel, mode: str, report: Progress) -> None:
    """Keep bf16 copies of the int4 weights for batched decode, as `mode` says."""
    model = loaded.model
    need = model.batched_weights_needed()
    if mode == "off" or need == 0:
        return
    if mode == "auto" and not auto_keeps_batched_copies(need):
        return
    if mode == "on" and not packed_bf16_supported():
        raise ModelLoadError(
            "batched bf16 weights need oneDNN with bf16 support, which this PyTorch build or CPU lacks; "
            "load with batched weights 'auto' or 'off'"
        )
    report(0.9, "bf16 copies for batched decode")
    try:
        model.add_batched_weights()
    except RuntimeError as exc:  # oneDNN refused to pack: run without the copies
        model.drop_batched_weights()
        if mode == "on":
            raise ModelLoadError(
                f"could not build bf16 batch copies ({exc}); load with batched weights 'auto' or 'off'"
            ) from exc


def load_model(
    path: str | Path,
    weight_mode: str = DEFAULT_WEIGHT_MODE,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    load_tokenizer: bool = True,
    head_bits: int = 4,
    batched_weights: str = "auto",
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """``device``: a resolved device (engine/device.py); on a GPU the weights are kept
    as the file has them (``native``) or in bf16 (``bf16``, ``dequant``), never int4."""
    path = Path(path)
    device = torch.device(device)
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(f"weight mode {weight_mode!r} is not one of {', '.join(WEIGHT_MODES)}")
    if batched_weights not in BATCHED_WEIGHTS:
        raise ValueError(
            f"batched weights {batched_weights!r} is not one of {', '.join(BATCHED_WEIGHTS)}"
        )
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model file or folder")
    start = time.perf_counter()
    report = progress or (lambda fraction, what: None)
    tokenizer = None
    if path.is_dir():
        loaded = _load_hf_folder(path, dtype, report)
    elif path.suffix.lower() == ".gguf" or _looks_like_gguf(path):
        if load_tokenizer:
            # First: parsing a large vocabulary (Gemma 3's 262,144 tokens) holds about
            # 240 MB for a moment, which on top of the loaded weights (and of the kernels'
            # code, loaded when weights are repacked) was the peak of the whole load. A
            # tokenizer error still comes after any error in the weights, as before.
            tokenizer = _early_tokenizer(path)
        loaded = _load_gguf(path, weight_mode, dtype, report, head_bits, device.type == "cpu")
    else:
        raise ModelLoadError(
            f"{path}: not a model Folio can read; choose a .gguf file or a folder with config.json and *.safetensors"
        )
    if device.type != "cpu":
        if loaded.weight_mode == "int4":
            raise ModelLoadError(
                f"{path}: int4 weights are a CPU format; on {device} load with native "
                "weights (the file's blocks) or bf16"
            )
        report(0.9, f"weights to {device}")
        try:
            loaded.model.to(device)
        except (RuntimeError, ValueError) as exc:  # out of device memory, a CPU-only format
            raise ModelLoadError(f"{path}: cannot put the weights on {device} ({exc})") from exc
        loaded.fingerprint = hashlib.blake2b(
            f"{loaded.fingerprint}:{device.type}".encode(), digest_size=16
        ).hexdigest()
    else:
        _add_batched_weights(loaded, batched_weights, report)
    if load_tokenizer:
        report(0.95, "tokenizer")
        if isinstance(tokenizer, ModelLoadError):
            raise tokenizer
        loaded.tokenizer = tokenizer or _tokenizer(loaded.path, loaded.format)
    allocator.release_free_memory()  # what parsing the header and the tokenizer left
    loaded.load_seconds = time.perf_counter() - start
    report(1.0, "ready")
    return loaded


def _looks_like_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _early_tokenizer(path: Path):
    """The GGUF file's tokenizer, or the error loading it gave (raised later), its
    transient memory handed back to the system."""
    try:
        return _tokenizer(path, "gguf")
    except ModelLoadError as exc:
        return exc
    except Exception:  # a damaged header: the weights' loading names the problem
        return None
    finally:
        allocator.release_free_memory()


def _tokenizer(path: Path, fmt: str):
    from engine.model.tokenizer import Tokenizer, TokenizerError

    try:
        if fmt == "gguf":
            return Tokenizer.from_gguf(path)
        return Tokenizer.from_folder(path)
    except TokenizerError as exc:
        raise ModelLoadError(_naming(path, str(exc))) from exc


def _naming(path: Path, message: str) -> str:
    """``message``, led by the path of the model unless it names it (or a file in it) already."""
    return message if message.startswith(str(path)) else f"{path}: {message}"


# -- GGUF --------------------------------------------------------------------------------


def _load_gguf(
    path: Path,
    weight_mode: str,
    dtype: torch.dtype,
    report: Progress,
    head_bits: int = 4,
    keep_tiles: bool = True,
) -> LoadedModel:
    """``keep_tiles``: weights repacked for this CPU's kernels are mapped from (or,
    after loading, written to) the tile cache (engine/model/tile_cache.py)."""
    try:
        gf = GGUFFile(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        config = ModelConfig.from_gguf_metadata(gf.metadata, str(path))
    except KeyError as exc:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {exc}") from exc
    except ModelLoadError:
        raise
    except (TypeError, ValueError) as exc:  # a value of the wrong kind
        raise ModelLoadError(f"{path}: GGUF metadata is damaged ({exc})") from exc
    for info in gf.tensors.values():
        if info.qtype not in _SUPPORTED_IDS:
            raise ModelLoadError(
                f"{path}: tensor {info.name!r} uses {info.type_name}, which Folio cannot read; "
                f"supported types: {', '.join(t.name for t in SUPPORTED_TYPES)}"
            )
    _check_gguf_shapes(gf, config, path)
    counts: dict[str, int] = {}
    for info in gf.tensors.values():
        counts[info.type_name] = counts.get(info.type_name, 0) + 1

    def raw(name: str) -> tuple[torch.Tensor, int, tuple[int, ...]]:
        info = gf.tensors[name]
        return _as_tensor(gf, name), info.qtype, info.shape

    def required(name: str) -> str:
        if name not in gf.tensors:
            raise ModelLoadError(
                f"{path}: tensor {name!r} is missing; the file is incomplete or not a {config.arch} model"
            )
        return name

    def dense(name: str) -> torch.Tensor:
        # Every tensor's type was checked above, so dequantize cannot meet an unknown one.
        data, qtype, shape = raw(required(name))
        return dequantize(data, qtype, shape, dtype=dtype)

    def norm(name: str) -> torch.Tensor:
        # GGUF stores Gemma's norms as (1 + w) already: no offset here.
        return dense(name).float()

    permute_qk = config.arch == "llama"

    def part(name: str, heads: int | None) -> tuple[torch.Tensor, int, tuple[int, ...]]:
        data, qtype, shape = raw(required(name + ".weight"))
        if heads is not None and permute_qk:
            data = _unpermute_rows(data.view(shape[0], -1), heads).reshape(-1)
        return data, qtype, shape

    def int4_able(qtype: int, shape: tuple[int, ...]) -> bool:
        return weight_mode == "int4" and int4_supported(qtype) and shape[-1] % 32 == 0

    def dense_weight(data, qtype, shape) -> torch.Tensor:
        return dequantize(
            data, qtype, shape, dtype=torch.bfloat16 if weight_mode == "bf16" else dtype
        )

    tile_cache = None
    if weight_mode == "native" and keep_tiles and _has_tiles(gf):
        report(0.02, "weights repacked for this CPU: checking those kept on disk")
        tile_cache = TileCache(path, gf.offset_of)
        if not tile_cache.mapped:  # a first load: say why it takes longer than the next
            report = _repacking(report, tile_cache.budget > 0)
    repack = functools.partial(
        tile_cache.tiles if tile_cache is not None else repack_parts, release=gf.release
    )

    def block_weight(name: str) -> QuantWeight:
        info = gf.tensors[required(name)]
        return QuantWeight.from_raw(gf.tensor_bytes(name), info.qtype, info.shape)

    def block_linear(
        names: tuple[str, ...], heads: tuple[int | None, ...], fused_bias: torch.Tensor | None
    ) -> BlockLinear:
        """The file's bytes untouched: llama's q/k row order is undone on the outputs."""
        parts = [block_weight(n + ".weight") for n in names]
        perms, offset = [], 0
        for p, h in zip(parts, heads):
            rows = torch.arange(p.out_features)
            if h is not None and permute_qk:
                rows = _unpermute_rows(rows.view(-1, 1), h).reshape(-1)
            perms.append(rows + offset)
            offset += p.out_features
        perm = torch.cat(perms)
        if bool((perm == torch.arange(offset)).all()):
            perm = None
        return tiled(BlockLinear(parts, fused_bias, perm, repack=repack))

    repacked: list[np.ndarray] = []  # the file bytes of parts repacked into tiles

    def tiled(lin: BlockLinear) -> BlockLinear:
        """``lin``, whose parts repacked into tiles (their file pages, read once to
        repack, left the resident set as they were done: ``release``) are recorded."""
        repacked.extend(p.data for p in lin.repacked())
        return lin

    def linear(*names: str, heads: tuple[int | None, ...] = ()) -> Linear | Concat | BlockLinear:
        """One projection, or several fused along the output dim (q/k/v, gate/up)."""
        heads = heads or (None,) * len(names)
        shapes = [gf.tensors[required(n + ".weight")].shape for n in names]
        biases = [bias(n, s, h) for n, s, h in zip(names, shapes, heads)]
        fused_bias = None
        if any(b is not None for b in biases):
            fused_bias = torch.cat(
                [b if b is not None else torch.zeros(s[0]) for b, s in zip(biases, shapes)]
            )
        if weight_mode == "native":
            return block_linear(names, heads, fused_bias)
        parts = [part(n, h) for n, h in zip(names, heads)]
        if all(int4_able(q, s) for _, q, s in parts):
            weight = int4_from_gguf_parts(parts) if len(parts) > 1 else int4_from_gguf(*parts[0])
            return Linear(weight, fused_bias, functools.partial(_dense_parts, parts))
        if weight_mode == "int4" and len(parts) > 1 and any(int4_able(q, s) for _, q, s in parts):
            return Concat([linear(n, heads=(h,)) for n, h in zip(names, heads)])
        return Linear(torch.cat([dense_weight(*p) for p in parts]), fused_bias)

    def bias(name: str, shape: tuple[int, ...], heads: int | None) -> torch.Tensor | None:
        if name + ".bias" not in gf.tensors:
            return None
        b = dense(name + ".bias")
        if heads is not None and permute_qk:
            b = _unpermute_rows(b.view(shape[0], 1), heads).reshape(-1)
        return b

    names = GGUF_GEMMA_NAMES if config.arch == "gemma3" else GGUF_NAMES
    layers = _build_layers(config, names, norm, linear, report)
    if weight_mode == "native":
        table = block_weight("token_embd.weight")
        embedding = BlockEmbedding(table, gf.row_reader(table.data))
        lm_head = (
            linear("output")
            if "output.weight" in gf.tensors
            else tiled(BlockLinear([embedding.weight], repack=repack))
        )
        # the weights are read in place: their pages mapped on a thread, not by the first
        # token (GGUFFile.prefault), except those repacked into tiles and a table whose
        # rows are read from the file
        head_reads_table = "output.weight" not in gf.tensors and not lm_head.repacked()
        by_rows = embedding.read is not None and not head_reads_table
        skip = (*repacked, *([table.data] if by_rows else []))
        threading.Thread(
            target=gf.prefault, kwargs={"skip": skip}, name="folio-prefault", daemon=True
        ).start()
    else:
        embedding, lm_head = _dense_embedding_and_head(dense, linear, gf, weight_mode, head_bits)
    factors = dense("rope_freqs.weight").float() if "rope_freqs.weight" in gf.tensors else None
    model = Transformer(
        config, embedding, layers, norm("output_norm.weight"), lm_head, factors, dtype
    )
    if tile_cache is not None:
        # on a thread: what was repacked, for the next load; once written, this model reads
        # its tiles from the file too (huge pages, the page cache's copy) and the repacked
        # copies are freed
        tile_cache.save(then=model.rebind_tiles)
    gf.drop_arrays()  # the file stays open for the embedding's rows, its vocabulary need not
    return LoadedModel(
        path=path,
        format="gguf",
        config=config,
        model=model,
        weight_mode=weight_mode,
        fingerprint=_fingerprint(
            path, config, f"{weight_mode}:{dtype}{_kernels(weight_mode, _has_float_rows(gf))}"
        ),
        load_seconds=0.0,
        quant_types=counts,
        tile_cache=tile_cache,
    )


def _repacking(report: Progress, kept: bool) -> Progress:
    """``report`` whose steps say that weights are being repacked (and kept)."""
    note = " (once: kept on disk)" if kept else ""  # gui.models.loading shows it

    def repacking(fraction: float, what: str) -> None:
        report(fraction, f"{what}, repacking weights for this CPU{note}")

    return repacking


def _has_tiles(gf: GGUFFile) -> bool:
    """Whether any of the file's weights would be repacked into tiles on this CPU."""
    return any(tiles_supported(info.type_name) for info in gf.tensors.values())


def _has_float_rows(gf: GGUFFile) -> bool:
    """Whether any of the file's weights is F16 / BF16 that kernels/quant/float_rows.py
    multiplies on this CPU."""
    return any(float_rows_supported(info.qtype) for info in gf.tensors.values())


def _kernels(weight_mode: str, float_rows: bool = False) -> str:
    """What else decides the K/V bits of native weights: k-quants as tiles on this CPU
    (kernels/quant/tiles.py) compute other last bits than the file-block kernels, and
    Q6_K tiles others again where AMX serves them (their scales in integers), so pages
    cached on disk before (or on a CPU without them) are not reused with them; with
    tiles, a prompt's norms and gates are the decode step's (``BlockLinear.fuses``:
    ``pn``), since 2026-12-06; ``float_rows``: F16 / BF16 weights at decode sizes by
    their own kernel (kernels/quant/float_rows.py: ``fr``, not torch's GEMM), since
    2026-12-07."""
    if weight_mode != "native":
        return ""
    rows = ":fr" if float_rows else ""
    if not tiles_supported("Q4_K"):
        return rows
    return f":{TILES_ARITHMETIC}:q4k-l16:pn" + (":q6k-int" if Q6_K_INTEGER else "") + rows


def _dense_embedding_and_head(dense, linear, gf: GGUFFile, weight_mode: str, head_bits: int):
    """The fp32 embedding table and the head of the dense / int4 modes: in int4 mode an
    fp32 head is scored with a quantized copy, the leading logits recomputed exactly
    (kernels/head.py): it is the largest matrix read at every decode step."""
    embedding = dense("token_embd.weight")
    lm_head = linear("output") if "output.weight" in gf.tensors else Linear(embedding)
    if (
        weight_mode == "int4"
        and isinstance(lm_head, Linear)
        and lm_head.bias is None
        and lm_head.weight.dtype == torch.float32
    ):
        lm_head = RescoredHead(lm_head.weight, bits=head_bits)
    return embedding, lm_head


_BLOCK_RE = re.compile(r"blk\.(\d+)\.")


def _check_gguf_shapes(gf: GGUFFile, config: ModelConfig, path: Path) -> None:
    """The header's sizes agree with every tensor the loader reads, and each tensor's rows
    are whole blocks of its type, before any weight is read."""

    def damaged(problem: str) -> ModelLoadError:
        return ModelLoadError(
            f"{path}: {problem}; the file is damaged or not a supported model: download it again"
        )

    blocks = {int(m.group(1)) for name in gf.tensors if (m := _BLOCK_RE.match(name))}
    if blocks != set(range(config.num_layers)):
        raise damaged(
            f"block_count is {config.num_layers:,} but the file has tensors for "
            f"{len(blocks):,} layer(s) numbered {min(blocks, default=0)} to {max(blocks, default=-1)}"
        )
    for name, shape in _expected_gguf_shapes(config).items():
        info = gf.tensors.get(name)
        if info is not None and info.shape != shape:
            raise damaged(
                f"tensor {name!r} has shape {info.shape}, but the header's sizes give {shape}"
            )
    for info in gf.tensors.values():
        block, _ = block_geometry(info.qtype)  # every type was checked to be supported
        if info.shape[-1] % block:
            raise damaged(
                f"tensor {info.name!r} has rows of {info.shape[-1]:,} values, "
                f"not whole blocks of {block} as {info.type_name} stores them"
            )
    tokens = gf.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != config.vocab_size:
        raise damaged(f"{len(tokens):,} tokens for an embedding of {config.vocab_size:,} rows")


def _expected_gguf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every GGUF tensor the loader may read, from the header's sizes."""
    h, d, ff = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    vocab = config.vocab_size
    expected = {
        "token_embd.weight": (vocab, h), "output.weight": (vocab, h), "output.bias": (vocab,),
        "output_norm.weight": (h,), "rope_freqs.weight": (len(range(0, d, 2)),),
    }  # fmt: skip
    weights = {
        "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
        "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff),
    }  # fmt: skip
    norms = {
        "attn_norm": (h,), "ffn_norm": (h,), "post_attention_norm": (h,), "post_ffw_norm": (h,),
        "attn_q_norm": (d,), "attn_k_norm": (d,),
    }  # fmt: skip
    for i in range(config.num_layers):
        for role, shape in weights.items():
            expected[f"blk.{i}.{role}.weight"] = shape
            expected[f"blk.{i}.{role}.bias"] = shape[:1]
        for role, shape in norms.items():
            expected[f"blk.{i}.{role}.weight"] = shape
    return expected


@dataclass(frozen=True)
class LayerNames:
    """Where each per-layer tensor lives in a checkpoint ({i} = layer index)."""

    attn_norm: str
    q: str
    k: str
    v: str
    o: str
    mlp_norm: str
    gate: str
    up: str
    down: str
    q_norm: str
    k_norm: str
    post_attn_norm: str | None = None  # Gemma 3's sandwich norms
    post_mlp_norm: str | None = None


GGUF_NAMES = LayerNames(
    "blk.{i}.attn_norm.weight", "blk.{i}.attn_q", "blk.{i}.attn_k", "blk.{i}.attn_v", "blk.{i}.attn_output",
    "blk.{i}.ffn_norm.weight", "blk.{i}.ffn_gate", "blk.{i}.ffn_up", "blk.{i}.ffn_down",
    "blk.{i}.attn_q_norm.weight", "blk.{i}.attn_k_norm.weight",
)  # fmt: skip
GGUF_GEMMA_NAMES = dataclasses.replace(
    GGUF_NAMES,
    post_attn_norm="blk.{i}.post_attention_norm.weight",
    post_mlp_norm="blk.{i}.post_ffw_norm.weight",
)
HF_NAMES = LayerNames(
    "layers.{i}.input_layernorm.weight", "layers.{i}.self_attn.q_proj", "layers.{i}.self_attn.k_proj",
    "layers.{i}.self_attn.v_proj", "layers.{i}.self_attn.o_proj", "layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_proj", "layers.{i}.mlp.up_proj", "layers.{i}.mlp.down_proj",
    "layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.k_norm.weight",
)  # fmt: skip
# Gemma 3 names its pre-MLP norm differently and adds norms after attention and MLP.
HF_GEMMA_NAMES = dataclasses.replace(
    HF_NAMES,
    mlp_norm="layers.{i}.pre_feedforward_layernorm.weight",
    post_attn_norm="layers.{i}.post_attention_layernorm.weight",
    post_mlp_norm="layers.{i}.post_feedforward_layernorm.weight",
)


def _build_layers(
    config: ModelConfig, names: LayerNames, norm, linear, report: Progress
) -> list[Layer]:
    """Layers from a checkpoint through its `norm(name)` and `linear(*names, heads=())`
    readers (several names: projections fused along the output dim)."""
    layers = []
    for i in range(config.num_layers):
        report(0.05 + 0.85 * i / config.num_layers, f"layer {i + 1}/{config.num_layers}")
        layers.append(_build_layer(config, names, i, norm, linear))
    return layers


def _build_layer(config: ModelConfig, names: LayerNames, i: int, norm, linear) -> Layer:
    def name(template: str) -> str:
        return template.format(i=i)

    def optional_norm(template: str | None, present: bool = True) -> torch.Tensor | None:
        return norm(name(template)) if template is not None and present else None

    return Layer(
        attn_norm=norm(name(names.attn_norm)),
        # heads: llama.cpp permutes q/k rows per head in `llama` GGUFs; the reader undoes it.
        qkv=linear(
            name(names.q),
            name(names.k),
            name(names.v),
            heads=(config.num_heads, config.num_kv_heads, None),
        ),
        o=linear(name(names.o)),
        mlp_norm=norm(name(names.mlp_norm)),
        gate_up=linear(name(names.gate), name(names.up)),
        down=linear(name(names.down)),
        q_norm=optional_norm(names.q_norm, config.qk_norm),
        k_norm=optional_norm(names.k_norm, config.qk_norm),
        post_attn_norm=optional_norm(names.post_attn_norm),
        post_mlp_norm=optional_norm(names.post_mlp_norm),
        sliding=config.layer_types[i] == "sliding",
    )


def _dense_parts(parts: list[tuple[torch.Tensor, int, tuple[int, ...]]]) -> torch.Tensor:
    dense = [dequantize(data, qtype, shape) for data, qtype, shape in parts]
    return dense[0] if len(dense) == 1 else torch.cat(dense)


def _as_tensor(gf: GGUFFile, name: str) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memmap: we never write to it
        return torch.from_numpy(gf.tensor_bytes(name))


def _unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (rope pairs interleaved -> rotate-half halves)."""
    n = rows.shape[0]
    dim = n // n_head // 2
    return rows.reshape(n_head, dim, 2, -1).transpose(1, 2).reshape(n, -1)


def _fingerprint(path: Path, config: ModelConfig, numerics: str) -> str:
    """Weights, architecture and how they are computed with (``numerics``: the weight
    mode and activation dtype, which change K/V in the last bits): pages cached under one
    fingerprint, on disk too, are only reused under the same."""
    st = path.stat()
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(config).encode())
    h.update(numerics.encode())
    h.update(f"{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()


# -- Hugging Face safetensors folders ------------------------------------------------------


def _load_hf_folder(folder: Path, dtype: torch.dtype, report: Progress) -> LoadedModel:
    from safetensors import SafetensorError, safe_open

    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelLoadError(
            f"{folder}: no config.json; a Hugging Face model folder needs config.json, tokenizer.json and *.safetensors"
        )
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    config = ModelConfig.from_hf_config(hf_config, str(folder))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    index: dict[str, Path] = {}
    handles = {}
    for f in files:
        try:
            handles[f] = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, Exception) as exc:  # safetensors raises several types
            raise ModelLoadError(
                f"{f}: cannot read the weights ({exc}); the file is damaged: download it again"
            ) from exc
        for key in handles[f].keys():
            index[_strip_prefix(key)] = f

    def get(name: str) -> torch.Tensor:
        if name not in index:
            raise ModelLoadError(f"{folder}: tensor {name!r} is missing from the safetensors files")
        return handles[index[name]].get_tensor(_full_key(handles[index[name]], name)).to(dtype)

    def maybe(name: str) -> torch.Tensor | None:
        return get(name) if name in index else None

    def norm(name: str) -> torch.Tensor:
        return get(name).float() + config.norm_offset

    def linear(*names: str, heads: tuple[int | None, ...] = ()) -> Linear:
        """One projection, or several fused along the output dim (q/k/v, gate/up);
        safetensors weights are stored unpermuted, so `heads` is not needed here."""
        weights = [get(n + ".weight") for n in names]
        biases = [maybe(n + ".bias") for n in names]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b if b is not None else torch.zeros(w.shape[0], dtype=dtype)
                    for b, w in zip(biases, weights)
                ]
            )
        return Linear(torch.cat(weights) if len(weights) > 1 else weights[0], bias)

    names = HF_GEMMA_NAMES if config.arch == "gemma3" else HF_NAMES
    layers = _build_layers(config, names, norm, linear, report)
    embedding = get("embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in index:
        lm_head = Linear(embedding)
    else:
        lm_head = Linear(get("lm_head.weight"))
    model = Transformer(config, embedding, layers, norm("norm.weight"), lm_head, None, dtype)
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(config).encode())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    counts: dict[str, int] = {}
    for handle in handles.values():
        for key in handle.keys():
            dt = str(handle.get_slice(key).get_dtype())
            counts[dt] = counts.get(dt, 0) + 1
    return LoadedModel(
        path=folder,
        format="safetensors",
        config=config,
        model=model,
        weight_mode="dequant",
        fingerprint=h.hexdigest(),
        load_seconds=0.0,
        quant_types=counts,
    )


_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def _strip_prefix(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _full_key(handle, short: str) -> str:
    keys = handle.keys()
    if short in keys:
        return short
    for prefix in _PREFIXES:
        if prefix + short in keys:
            return prefix + short
    raise KeyError(short)
