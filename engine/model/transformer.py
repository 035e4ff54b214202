"""The decoder-only transformer shared by every supported family, in the order data flows.

The model does not know how its weights are stored: every projection is a `Linear`
that holds either a dense tensor or an int4-packed weight (kernels/int4.py). Attention
reads and writes K/V through the paged cache (engine/cache/kv_cache.py), so which pages
are shared, cached or quantized stays out of the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.cache.kv_cache import KVCache, StepBatch
from engine.model.config import ModelConfig
from kernels.bf16 import BATCHED_FROM_ROWS, PackedBF16, bf16_linear, pack_bf16
from kernels.head import RescoredHead
from kernels.int4 import Int4Weight, int4_linear
from kernels.int8 import Int8Weight, int8_linear
from kernels.quant.device_linear import DeviceBlockEmbedding, DeviceBlockLinear, Uploads
from kernels.quant.linear import LANE_MIN_ROWS, BlockEmbedding, BlockLinear, prompt_rows
from kernels.quant.matmul import DECODE_MAX_ROWS
from kernels.rope import rope_and_store

# Rows of a long prompt's MLP at a time, where that costs nothing (Transformer._mlp)
MLP_ROWS = 128


class Linear:
    """y = x W^T (+ b), with W dense, int8- or int4-packed.

    An int4 weight also keeps a way back to its source (the memory-mapped GGUF bytes):
    torch's int4 kernel wins at small batches (decode), but it computes in bf16 and
    from `DENSE_FROM_ROWS` rows up (prefill) it is both faster and exact to dequantize
    the source to fp32 on the fly and run a dense matmul, without keeping a dense copy
    resident. Measured on SmolLM2, 512-token prefill: 600 tok/s this way, against
    ~100 tok/s through the int4 kernel.

    Optionally (`Transformer.add_batched_weights`) it also keeps a bf16 copy packed for
    oneDNN (kernels/bf16.py), which forwards of fewer than `DENSE_FROM_ROWS` rows take
    when asked to (`bf16`): batched decode and prefill chunks. Measured on SmolLM2 (AMX
    Xeon), one layer hot in cache at 16 rows: 0.33 ms against 0.78 ms through the int4
    kernel; at 4 rows the int4 kernel still wins.
    """

    __slots__ = ("weight", "bias", "source", "batched")

    DENSE_FROM_ROWS = 64

    def __init__(
        self,
        weight: torch.Tensor | Int4Weight,
        bias: torch.Tensor | None = None,
        source: Callable[[], torch.Tensor] | None = None,
    ):
        self.weight = weight
        self.bias = bias
        self.source = source  # returns the weight dense (fp32), for large batches
        self.batched: PackedBF16 | None = None  # bf16 copy for batched decode

    def __call__(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        """``bf16``: take the bf16 copy, when kept, below `DENSE_FROM_ROWS` rows (the
        model decides per forward: see `Transformer.forward`)."""
        w = self.weight
        if isinstance(w, Int4Weight):
            rows = x.numel() // x.shape[-1]
            if self.source is not None and rows >= self.DENSE_FROM_ROWS:
                y = F.linear(x, self.source().to(x.dtype))
            elif bf16 and self.batched is not None:
                y = bf16_linear(x, self.batched)
            else:
                y = int4_linear(x, w)
        elif isinstance(w, Int8Weight):
            y = int8_linear(x, w)
        elif w.dtype != x.dtype:
            y = F.linear(x.to(w.dtype), w).to(x.dtype)
        else:
            y = F.linear(x, w)
        if self.bias is not None:
            y = y + self.bias
        return y

    @property
    def out_features(self) -> int:
        w = self.weight
        return w.out_features if isinstance(w, (Int4Weight, Int8Weight)) else w.shape[0]

    def nbytes(self) -> int:
        w = self.weight
        n = w.nbytes() if isinstance(w, (Int4Weight, Int8Weight)) else w.numel() * w.element_size()
        if self.batched is not None:
            n += self.batched.nbytes()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def _wants_copy(self) -> bool:
        return (
            self.batched is None and isinstance(self.weight, Int4Weight) and self.source is not None
        )

    def add_batched(self) -> int:
        """Keep a packed bf16 copy of an int4 weight for batched rows; returns its bytes."""
        if not self._wants_copy():
            return 0
        self.batched = pack_bf16(self.source())
        return self.batched.nbytes()

    def batched_bytes(self) -> int:
        """What `add_batched` would keep, without building it."""
        return self.weight.out_features * self.weight.in_features * 2 if self._wants_copy() else 0


class Concat:
    """Projections whose outputs are concatenated, for weights that cannot share one
    matrix (different storage types): behaves like one fused Linear."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Linear]):
        self.parts = parts

    def __call__(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        return torch.cat([p(x, bf16) for p in self.parts], dim=-1)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (as transformers does), weight already offset for Gemma."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # fused; same fp32 arithmetic
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def normed_linear(
    lin,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    bf16: bool,
    residual: torch.Tensor | None = None,
):
    """``lin(rms_norm(x, weight, eps))``, after ``x += residual`` (in place) when given; a
    projection over file blocks at decode sizes does the sum and the norm in the numba
    call that quantizes its activations."""
    if isinstance(lin, BlockLinear) and lin.fuses(x):
        return lin.normed(x, weight, eps, residual)
    if residual is not None:
        x.add_(residual)
    return lin(rms_norm(x, weight, eps), bf16)


def gated_linear(lin, gate_up: torch.Tensor, hidden_act: str, bf16: bool):
    """``lin(act(gate) * up)`` for ``gate_up = [gate | up]``; a projection over file
    blocks at decode sizes does the gate in the numba call that quantizes its activations."""
    gelu = hidden_act == "gelu_tanh"
    if isinstance(lin, BlockLinear) and lin.fuses(gate_up):
        return lin.gated(gate_up, gelu)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return lin(gate.mul_(up), bf16)  # in place: the activation's output is its own


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear | Concat  # q, k, v projections fused along the output dim
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear | Concat  # gate and up projections fused
    down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    sliding: bool = False


@dataclass(frozen=True)
class _NormArrays:
    """A layer's norm weights as numpy arrays (`Transformer._host_layer`): before
    attention, before the MLP, and the q/k norms as ``rope_and_store`` takes them."""

    attn: np.ndarray
    mlp: np.ndarray
    qk: tuple[int, np.ndarray, np.ndarray, float] | None

    @classmethod
    def of(cls, layer: Layer, config: ModelConfig) -> _NormArrays:
        qk = None
        if layer.q_norm is not None:
            qk = (config.num_heads, layer.q_norm.numpy(), layer.k_norm.numpy(), config.rms_norm_eps)
        return cls(layer.attn_norm.numpy(), layer.mlp_norm.numpy(), qk)


class Rope:
    """cos/sin tables for rotate-half rotary embeddings, grown on demand."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict | None = None,
        freq_factors: torch.Tensor | None = None,
    ):
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float()
        elif scaling:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        self.inv_freq = inv_freq
        self.cos = torch.empty(0, head_dim)
        self.sin = torch.empty(0, head_dim)

    def to(self, device: torch.device) -> None:
        self.inv_freq, self.cos, self.sin = (
            t.to(device) for t in (self.inv_freq, self.cos, self.sin)
        )

    def tables(
        self, positions: torch.Tensor, need: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of ``positions``; ``need`` (when the caller knows it on the host):
        one more than the largest position, saving a read of ``positions``."""
        need = int(positions.max()) + 1 if need is None else need
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 256)
            steps = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
            freqs = torch.outer(steps, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
        return self.cos[positions], self.sin[positions]


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "default":
        return inv_freq
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        embedding: torch.Tensor | BlockEmbedding,
        layers: list[Layer],
        final_norm: torch.Tensor,
        lm_head: Linear | RescoredHead | BlockLinear | DeviceBlockLinear,
        rope_freq_factors: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.embedding = embedding
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.rope = Rope(config.head_dim, config.rope_theta, config.rope_scaling, rope_freq_factors)
        self._norms: list[_NormArrays] | None = None  # _norm_arrays
        self.rope_local = (
            Rope(config.head_dim, config.rope_local_theta)
            if config.rope_local_theta is not None
            else self.rope
        )

    @property
    def device(self) -> torch.device:
        """Where the weights are and the forward pass computes."""
        return self.final_norm.device

    def to(self, device: torch.device | str, triton: bool | None = None) -> Transformer:
        """Move the model to ``device`` in place (and return it). Block weights are
        uploaded as the file has them and multiplied by the Triton kernels
        (kernels/quant/device_linear.py); ``triton`` forces that on the CPU too (the
        tests run the CUDA path in Triton's interpreter). int4 / int8 weights are CPU
        formats and are refused."""
        device = torch.device(device)
        triton = device.type != "cpu" if triton is None else triton
        if device == self.device and not triton:
            return self
        uploads = Uploads(device)
        self._norms = None

        def move(lin):
            if isinstance(lin, BlockLinear):
                return DeviceBlockLinear.of(lin, uploads) if triton else lin
            if isinstance(lin, Concat):
                return Concat([move(p) for p in lin.parts])
            if isinstance(lin, Linear) and isinstance(lin.weight, torch.Tensor):
                return Linear(lin.weight.to(device), tensor(lin.bias))
            if isinstance(lin, DeviceBlockLinear):
                return lin
            raise ValueError(
                f"int4 / int8 weights are CPU formats and cannot run on {device}: "
                "load with native weights (the file's blocks) or bf16"
            )

        def tensor(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device) if t is not None else None

        table = self.embedding
        if isinstance(table, BlockEmbedding):
            self.embedding = DeviceBlockEmbedding.of(table, uploads) if triton else table
        elif isinstance(table, torch.Tensor):
            self.embedding = table.to(device)
        head_is_table = isinstance(self.lm_head, Linear) and self.lm_head.weight is table
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, move(getattr(layer, name)))
            for name in (
                "attn_norm",
                "mlp_norm",
                "q_norm",
                "k_norm",
                "post_attn_norm",
                "post_mlp_norm",
            ):
                setattr(layer, name, tensor(getattr(layer, name)))
        if head_is_table:  # a tied dense head stays one tensor with the table
            self.lm_head = Linear(self.embedding, tensor(self.lm_head.bias))
        else:
            self.lm_head = move(self.lm_head)
        self.final_norm = self.final_norm.to(device)
        for rope in {id(self.rope): self.rope, id(self.rope_local): self.rope_local}.values():
            rope.to(device)
        return self

    def key_rope(self, index: int) -> Rope:
        """The rotary embedding layer ``index`` applies to its keys (the local one on
        sliding layers): a quantized K cache stores keys relative to this rotation of
        their calibrated mean."""
        return self.rope_local if self.layers[index].sliding else self.rope

    def _batchable(self) -> list[Linear | RescoredHead]:
        """Every projection (Concat parts one by one) and the head: what may keep a copy."""
        linears: list[Linear | RescoredHead] = []
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                linears.extend(lin.parts if isinstance(lin, Concat) else [lin])
        if isinstance(self.lm_head, (Linear, RescoredHead)):
            linears.append(self.lm_head)
        return linears

    def batched_weights_needed(self) -> int:
        """Bytes `add_batched_weights` would add (0 when there is nothing to copy)."""
        return sum(lin.batched_bytes() for lin in self._batchable())

    def batched_weights_bytes(self) -> int:
        """Bytes of the bf16 copies kept now."""
        return sum(lin.batched.nbytes() for lin in self._batchable() if lin.batched is not None)

    def add_batched_weights(self) -> int:
        """Keep bf16 copies of the int4 projections and head for batches of
        `BATCHED_FROM_ROWS` rows and more (kernels/bf16.py); returns the bytes added."""
        return sum(lin.add_batched() for lin in self._batchable())

    def drop_batched_weights(self) -> None:
        for lin in self._batchable():
            lin.batched = None

    @property
    def has_batched_weights(self) -> bool:
        return any(lin.batched is not None for lin in self._batchable())

    def _head_is_embedding(self) -> bool:
        head, table = self.lm_head, self.embedding
        if isinstance(head, (BlockLinear, DeviceBlockLinear)) and isinstance(
            table, (BlockEmbedding, DeviceBlockEmbedding)
        ):
            return len(head.parts) == 1 and head.parts[0] is table.weight
        return isinstance(head, Linear) and head.weight is table

    def _layer_linears(self) -> list:
        return [
            lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]

    def rebind_tiles(self, views: dict[int, np.ndarray]) -> int:
        """Every projection and the head read their tiles from ``views`` where it holds
        them (:meth:`BlockLinear.rebind_tiles`: a tile file just written, mapped); how many
        weights moved."""
        linears = [*self._layer_linears(), self.lm_head]
        return sum(lin.rebind_tiles(views) for lin in linears if isinstance(lin, BlockLinear))

    def weight_bytes(self) -> int:
        table = self.embedding
        n = (
            table.nbytes()
            if isinstance(table, (BlockEmbedding, DeviceBlockEmbedding))
            else table.numel() * table.element_size()
        )
        if not self._head_is_embedding():
            n += self.lm_head.nbytes()  # a separate head, or the int8 copy of a tied one
        n += self.final_norm.numel() * self.final_norm.element_size()
        n += sum(lin.nbytes() for lin in self._layer_linears())
        for layer in self.layers:
            for t in (
                layer.attn_norm,
                layer.mlp_norm,
                layer.q_norm,
                layer.k_norm,
                layer.post_attn_norm,
                layer.post_mlp_norm,
            ):
                if t is not None:
                    n += t.numel() * t.element_size()
        return n

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """Run one step: `tokens` [T] are the new tokens of every sequence in `batch`,
        concatenated; their K/V are written into the paged cache. Returns logits
        [R, vocab] for the rows `batch.logits_rows` (usually each sequence's last)."""
        cfg = self.config
        device = self.device
        if tokens.device != device:
            tokens = tokens.to(device, non_blocking=True)
        batch = batch.to(device)
        table = self.embedding
        blocks = isinstance(table, (BlockEmbedding, DeviceBlockEmbedding))
        x = table(tokens) if blocks else F.embedding(tokens, table)
        x = x.to(self.dtype)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        # a decode step's positions are its sequences' lengths less one, known on the host
        need = int(batch.host[1].max()) if batch.host is not None else None
        rope = self.rope.tables(batch.positions, need)
        rope_local = (
            self.rope_local.tables(batch.positions, need)
            if self.rope_local is not self.rope
            else rope
        )
        # Which copy int4 projections read (kernels/bf16.py), chosen per forward so that a
        # token's result does not depend on what it is batched with: prefill forwards take
        # the bf16 copies at any row count (a prompt whose prefix was cached computes its
        # remainder as the uncached prompt computed those rows), decode forwards from
        # BATCHED_FROM_ROWS sequences up, below which torch's int4 kernel is faster.
        bf16 = not batch.decode_only or tokens.shape[0] >= BATCHED_FROM_ROWS
        # and which kernel file-block projections take: a prompt's rows the lane kernel
        # where the CPU has one, a decode step's the decode kernel at any batch size
        with prompt_rows(not batch.decode_only):
            return self._forward_layers(x, batch, cache, rope, rope_local, bf16)

    def _forward_layers(self, x, batch: StepBatch, cache: KVCache, rope, rope_local, bf16):
        cfg = self.config
        h = None
        if self._on_host_arrays(x, batch, cache):
            xs = x.numpy()  # the residual stream, x's memory
            rope, rope_local = ((cos.numpy(), sin.numpy()) for cos, sin in (rope, rope_local))
            for i, layer in enumerate(self.layers):
                h = self._host_layer(
                    layer, i, xs, h, batch, cache, rope_local if layer.sliding else rope
                )
            h = torch.from_numpy(h)
        else:
            for i, layer in enumerate(self.layers):
                h = self._layer(
                    layer, i, x, h, batch, cache, rope_local if layer.sliding else rope, bf16
                )
        x = x.add_(h)[batch.logits_rows]
        x = rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        logits = self.lm_head(x, bf16).float()
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _on_host_arrays(self, x: torch.Tensor, batch: StepBatch, cache: KVCache) -> bool:
        """Whether this step's layers run on numpy arrays (`_host_layer`): a decode step
        of at most DECODE_MAX_ROWS float32 rows on the CPU, over float32 pages, every
        projection over file blocks. Such a step is numba calls with a little Python
        between them, where a torch op or conversion costs about a microsecond of
        dispatch: SmolLM2 (1 thread, the matmul kernels replaced by no-ops) took 1.8 ms a
        token through the torch layers, 1.2 ms through these."""
        return (
            batch.host is not None
            and x.dtype == torch.float32
            and x.shape[0] <= DECODE_MAX_ROWS
            and cache.dense_pages(0) is not None
            and bool(self._norm_arrays())
            and not self._prompt_in_lanes(x, batch)
        )

    def _prompt_in_lanes(self, x: torch.Tensor, batch: StepBatch) -> bool:
        """Whether a projection takes this prompt forward's rows in the lane kernel
        (kernels/quant/lanes.py), which the torch layers call."""
        if batch.decode_only or x.shape[0] < LANE_MIN_ROWS:
            return False
        return any(
            isinstance(lin, BlockLinear) and lin.has_lanes
            for layer in self.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )

    def _norm_arrays(self) -> list[_NormArrays]:
        """Per layer, its norm weights as numpy arrays for `_host_layer` (converting a
        tensor costs half a microsecond), when every projection is over file blocks, else
        none; made on first use (`to` drops them)."""
        if self._norms is None:
            blocks = all(
                isinstance(lin, BlockLinear)
                for layer in self.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
            self._norms = (
                [_NormArrays.of(layer, self.config) for layer in self.layers] if blocks else []
            )
        return self._norms

    def _host_layer(
        self, layer: Layer, index: int, x: np.ndarray, h, batch: StepBatch, cache: KVCache, rope
    ) -> np.ndarray:
        """`_layer` on numpy arrays (`_on_host_arrays`): the same operations on the same
        bits, numpy from one numba call to the next."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        t = x.shape[0]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        norms = self._norms[index]
        qkv = layer.qkv.normed_rows(x, norms.attn, eps, h)
        qkv = qkv.reshape(t, heads + 2 * kv_heads, head_dim)
        rope_and_store(
            qkv, *rope, heads + kv_heads, cache.dense_pages(index), *batch.host_writes, norms.qk
        )
        window = cfg.sliding_window if layer.sliding else None
        out = cache.attend_dense(index, qkv[:, :heads], batch, cfg.softmax_scale, window)
        h = layer.o.rows(out.reshape(t, heads * head_dim))
        if layer.post_attn_norm is not None:
            h = rms_norm(torch.from_numpy(h), layer.post_attn_norm, eps).numpy()
        h = layer.gate_up.normed_rows(x, norms.mlp, eps, h)
        h = layer.down.gated_rows(h, cfg.hidden_act == "gelu_tanh")
        if layer.post_mlp_norm is not None:
            h = rms_norm(torch.from_numpy(h), layer.post_mlp_norm, eps).numpy()
        return h

    def _layer(
        self, layer: Layer, index: int, x, h, batch: StepBatch, cache: KVCache, rope, bf16: bool
    ):
        """Layer ``index`` on the residual stream ``x`` after the previous layer's output
        ``h`` (None before the first), each output added to ``x`` in place by the norm
        that reads the sum (in its numba call at decode sizes: a torch add costs about a
        microsecond of dispatch); returns the layer's output, not yet added."""
        cfg = self.config
        h = self._attention(layer, index, x, h, batch, cache, rope, bf16)
        if layer.post_attn_norm is not None:
            h = rms_norm(h, layer.post_attn_norm, cfg.rms_norm_eps)
        h = self._mlp(layer, x, h, bf16)
        if layer.post_mlp_norm is not None:
            h = rms_norm(h, layer.post_mlp_norm, cfg.rms_norm_eps)
        return h

    def _mlp(self, layer: Layer, x: torch.Tensor, h: torch.Tensor, bf16: bool) -> torch.Tensor:
        """The MLP of ``x`` plus ``h`` (added in place). A long prompt over super-block
        weights goes MLP_ROWS rows at a time (no chunk of DECODE_MAX_ROWS rows or fewer,
        which would take the decode path's fused norm where the weights are not all in
        tiles; in tiles every row count takes it, `BlockLinear.fuses`): the same values,
        and its ``[T, 2 * intermediate]`` products stop setting the peak RSS of a prefill
        (512 tokens at the 1B shape: 64 MB of them)."""
        cfg = self.config
        t = x.shape[0]
        if t <= MLP_ROWS or not (
            isinstance(layer.gate_up, BlockLinear)
            and isinstance(layer.down, BlockLinear)
            and layer.gate_up.prefills_in_row_chunks
            and layer.down.prefills_in_row_chunks
        ):
            g = normed_linear(layer.gate_up, x, layer.mlp_norm, cfg.rms_norm_eps, bf16, h)
            return gated_linear(layer.down, g, cfg.hidden_act, bf16)
        out = torch.empty((t, layer.down.out_features), dtype=torch.float32, device=x.device)
        first = 0
        while first < t:
            last = first + MLP_ROWS if t - first - MLP_ROWS > DECODE_MAX_ROWS else t
            rows = slice(first, last)
            g = normed_linear(
                layer.gate_up, x[rows], layer.mlp_norm, cfg.rms_norm_eps, bf16, h[rows]
            )
            out[rows] = gated_linear(layer.down, g, cfg.hidden_act, bf16)
            first = last
        return out

    def _attention(
        self, layer: Layer, index: int, x, h, batch: StepBatch, cache: KVCache, rope, bf16: bool
    ):
        """Attention of the layer's input ``x`` plus ``h`` (added in place, then normed
        here), through the paged cache."""
        cfg = self.config
        t = x.shape[0]
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        qkv = normed_linear(layer.qkv, x, layer.attn_norm, cfg.rms_norm_eps, bf16, h)
        pages = cache.dense_pages(index)
        window = cfg.sliding_window if layer.sliding else None
        # q/k norms in numba only with file-block weights (already off torch's bits by
        # their int8 activations): dense weights keep transformers' arithmetic
        norms = None
        if layer.q_norm is not None and isinstance(layer.qkv, BlockLinear):
            norms = (heads, layer.q_norm.numpy(), layer.k_norm.numpy(), cfg.rms_norm_eps)
        if (
            pages is not None
            and (layer.q_norm is None or norms is not None)
            and qkv.dtype == torch.float32
        ):
            # one numba call: q and k heads rotated in place, k and v stored (same bits)
            qkv = qkv.numpy().reshape(t, heads + 2 * kv_heads, cfg.head_dim)
            cos, sin = rope
            rope_and_store(
                qkv, cos.numpy(), sin.numpy(), heads + kv_heads, pages, *batch.host_writes, norms
            )
            q = torch.from_numpy(qkv[:, :heads])
        else:
            qkv = qkv.view(t, heads + 2 * kv_heads, cfg.head_dim)
            qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
            if layer.q_norm is not None:
                qk = torch.cat(
                    (
                        rms_norm(qk[:, :heads], layer.q_norm, cfg.rms_norm_eps),
                        rms_norm(qk[:, heads:], layer.k_norm, cfg.rms_norm_eps),
                    ),
                    dim=1,
                )
            qk = apply_rope(qk, *rope)  # q and k heads rotated in one go
            q, k = qk[:, :heads], qk[:, heads:]
            cache.write(index, k, v, batch)
        out = cache.attend(index, q, batch, cfg.softmax_scale, window)
        return layer.o(out.reshape(t, heads * cfg.head_dim), bf16)
