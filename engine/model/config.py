"""One configuration record for every supported decoder family.

Llama, Mistral, Qwen2, Qwen3 and Gemma 3 are one family with flags (gpt-fast style):
the differences are biases on q/k/v, per-head q/k norms, sliding-window layers,
scaled embeddings, sandwich norms and the MLP activation.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from engine.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

# Hugging Face `model_type` / `architectures` names that map onto a Folio family.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


# Sanity bounds on header fields, far above any real model (the largest have ~130
# layers and widths of tens of thousands), checked before anything is sized by them.
MAX_LAYERS = 4096
MAX_DIMENSION = 1 << 24
MAX_CONTEXT = 1 << 31


class InvalidConfig(ModelLoadError):
    """Configuration values no model can have (zero heads, widths that do not divide)."""


class UnsupportedArchitecture(ModelLoadError):
    def __init__(self, arch: str, source: str):
        super().__init__(
            f"{source}: architecture {arch!r} is not supported; "
            f"Folio runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
        self.arch = arch


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh"
    # Gemma: norms scale by (1 + w). GGUF files store w + 1 already, so the loader
    # sets this to 0 for them.
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False  # Gemma 3: post-attention and post-MLP norms
    query_scale: float | None = None  # softmax scale; None means 1/sqrt(head_dim)
    sliding_window: int | None = None
    # Per layer: "full" or "sliding".
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # rope base of sliding layers (Gemma 3)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)

    @property
    def softmax_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def kv_bytes_per_token(self, k_bits: int | None = None, v_bits: int | None = None) -> int:
        """Bytes one token's K and V take over all layers in a cache of these widths
        (None: the CPU's unquantized default), as the cache's formats price them."""
        # imported here: the hub reads configs without loading torch
        from engine.cache.formats import kv_bytes_per_token, kv_formats

        formats = kv_formats(k_bits, v_bits)
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, formats)

    # -- constructors ----------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str) -> ModelConfig:
        arch = str(meta.get("general.architecture", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(arch or "(none)", source)

        def bad(problem: str) -> InvalidConfig:
            return InvalidConfig(
                f"{source}: {problem}; the file is damaged or not a supported model: download it again"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise InvalidConfig(f"{source}: GGUF metadata lacks {arch}.{key}")
            return value

        def count(key: str, default: Any = None, limit: int = MAX_DIMENSION) -> int:
            """A positive integer field, checked before anything is sized by it."""
            value = get(key, default)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or not 0 < value <= limit
            ):
                raise bad(f"{arch}.{key} is {value!r}, not a whole number from 1 to {limit:,}")
            return int(value)

        def real(key: str, default: Any = None, positive: bool = False) -> float:
            """A finite number (above 0 where ``positive``): a NaN would load and then
            poison every forward."""
            value = get(key, default)
            least = "above 0" if positive else "0 or more"
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or not (value > 0 if positive else value >= 0)
            ):
                raise bad(f"{arch}.{key} is {value!r}, not a finite number {least}")
            return float(value)

        hidden = count("embedding_length")
        heads = count("attention.head_count")
        kv_heads = count("attention.head_count_kv", heads)
        if heads % kv_heads:
            raise bad(
                f"{arch}.attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}"
            )
        for key in ("attention.key_length", "rope.dimension_count"):
            if f"{arch}.{key}" in meta:
                head_dim = count(key)
                break
        else:
            if hidden % heads:
                raise bad(
                    f"{arch}.embedding_length {hidden} is not a multiple of head_count {heads}"
                )
            head_dim = hidden // heads
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is not None and not (
            isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)
        ):
            raise bad("tokenizer.ggml.tokens is not an array of strings")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(tokens or ())
        # 0 (neither given) is left to the loader, which matches it to token_embd's rows.
        if (
            isinstance(vocab, bool)
            or not isinstance(vocab, numbers.Integral)
            or not 0 <= vocab <= MAX_DIMENSION
        ):
            raise bad(f"the vocabulary size is {vocab!r}")
        if tokens is not None and len(tokens) > vocab:
            raise bad(
                f"tokenizer.ggml.tokens has {len(tokens):,} tokens but the model only {vocab:,}"
            )
        # Bounded here, before a per-layer tuple is built; the loader then matches it to
        # the blk.N tensors in the file.
        layers = count("block_count", limit=MAX_LAYERS)
        common = dict(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=count("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=real("attention.layer_norm_rms_epsilon"),
            max_position_embeddings=count("context_length", 4096, limit=MAX_CONTEXT),
            rope_theta=real("rope.freq_base", 10000.0, positive=True),
        )
        scaling = None
        kind = meta.get(f"{arch}.rope.scaling.type")
        if isinstance(kind, str) and kind == "linear" and f"{arch}.rope.scaling.factor" in meta:
            scaling = {"rope_type": "linear", "factor": real("rope.scaling.factor", positive=True)}
        if arch in ("llama", "mistral"):
            return cls(**common, rope_scaling=scaling)
        if arch == "qwen2":
            return cls(**common, attention_bias=True, rope_scaling=scaling)
        if arch == "qwen3":
            return cls(**common, qk_norm=True, rope_scaling=scaling)
        # gemma3
        # llama.cpp's defaults for Gemma 3: every 6th layer global; scale 1/sqrt(head_dim).
        window = (
            count("attention.sliding_window") if "gemma3.attention.sliding_window" in meta else None
        )
        pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, (list, tuple)) or hasattr(pattern, "shape"):
            if len(pattern) != layers:
                raise bad(
                    f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers"
                )
            sliding = tuple("sliding" if bool(p) else "full" for p in pattern)
        else:
            if (
                isinstance(pattern, bool)
                or not isinstance(pattern, numbers.Integral)
                or pattern <= 0
            ):
                raise bad(f"gemma3.attention.sliding_window_pattern is {pattern!r}")
            sliding = tuple("sliding" if (i + 1) % int(pattern) else "full" for i in range(layers))
        return cls(
            **common,
            qk_norm=True,
            hidden_act="gelu_tanh",
            tie_word_embeddings=True,
            norm_offset=0.0,
            embed_scale=math.sqrt(hidden),
            sandwich_norms=True,
            sliding_window=window,
            layer_types=sliding,
            rope_local_theta=10000.0,
            rope_scaling=scaling,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3" and "text_config" in cfg:
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise UnsupportedArchitecture(model_type or "(none)", source)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = _hf_rope(cfg)
        layers = cfg["num_hidden_layers"]
        common = dict(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        )
        if arch in ("llama", "mistral", "qwen2", "qwen3"):
            window = cfg.get("sliding_window") if arch == "mistral" else None
            if arch == "qwen2" and cfg.get("use_sliding_window"):
                window = cfg.get("sliding_window")
            return cls(
                **common,
                rope_theta=rope["full"]["rope_theta"],
                rope_scaling=rope["full"]
                if rope["full"].get("rope_type", "default") != "default"
                else None,
                attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
                qk_norm=arch == "qwen3",
                sliding_window=window,
                layer_types=tuple("sliding" if window else "full" for _ in range(layers)),
            )
        types = cfg.get("layer_types") or [
            "sliding_attention"
            if (i + 1) % cfg.get("sliding_window_pattern", 6)
            else "full_attention"
            for i in range(layers)
        ]
        return cls(
            **common,
            rope_theta=rope["full"]["rope_theta"],
            rope_scaling=rope["full"]
            if rope["full"].get("rope_type", "default") != "default"
            else None,
            rope_local_theta=rope["sliding"]["rope_theta"],
            qk_norm=True,
            hidden_act="gelu_tanh",
            norm_offset=1.0,
            embed_scale=math.sqrt(hidden),
            sandwich_norms=True,
            query_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
            sliding_window=cfg.get("sliding_window"),
            layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
            attention_bias=bool(cfg.get("attention_bias", False)),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


def _hf_rope(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rope parameters for full and sliding layers, from old (`rope_theta`/`rope_scaling`)
    or new (`rope_parameters`) style configs."""
    params = cfg.get("rope_parameters")
    if params and "full_attention" in params:
        full = dict(params["full_attention"])
        sliding = dict(params.get("sliding_attention", full))
    elif params:
        full = dict(params)
        sliding = dict(params)
    else:
        full = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
        full.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        sliding = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    full.setdefault(
        "rope_theta",
        cfg.get("rope_theta", 1_000_000.0 if "rope_local_base_freq" in cfg else 10000.0),
    )
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    if "type" in full and "rope_type" not in full:
        full["rope_type"] = full["type"]
    return {"full": full, "sliding": sliding}
