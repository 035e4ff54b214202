"""Tiny random models made with transformers, saved as safetensors folders or GGUF files.

The reference logits always come from transformers' own forward pass. For GGUF files
the reference weights are what the `gguf` package's dequantizer makes of the bytes we
write, so Folio's dequantizers, loader and forward are all checked at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

# Small, but with GQA, two+ layers, and dims that K-quants (256-element blocks) accept.
_DIMS = dict(
    vocab_size=384,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)


def make_hf_model(family: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    dims = {**_DIMS, **overrides}
    if family == "llama":
        dims.setdefault("tie_word_embeddings", False)
        cfg = transformers.LlamaConfig(**dims, rope_theta=10000.0)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**dims, rope_theta=10000.0, sliding_window=dims.pop("sliding_window", None))
    elif family == "qwen2":
        dims.setdefault("tie_word_embeddings", True)
        cfg = transformers.Qwen2Config(**dims, rope_theta=1e6)
    elif family == "qwen3":
        dims.setdefault("tie_word_embeddings", True)
        cfg = transformers.Qwen3Config(**dims, rope_theta=1e6)
    elif family == "gemma3":
        # llama.cpp's Gemma 3 layout: every 6th layer global, softmax scale 1/sqrt(head_dim).
        dims.setdefault("sliding_window", 8)
        dims["num_hidden_layers"] = 6
        cfg = transformers.Gemma3TextConfig(**dims, query_pre_attn_scalar=dims["head_dim"], sliding_window_pattern=6)
    else:
        raise ValueError(family)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Random init leaves norms at exactly 1 (0 for Gemma); perturb them so norm bugs show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    return model


def save_hf_folder(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# -- GGUF ---------------------------------------------------------------------------------


def random_quant_bytes(qtype: Q, shape: tuple[int, int], rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Valid bytes of a quantized tensor [rows, row_bytes]: quantize random weights where
    the gguf package can, else random codes with sane fp16 scales (K-quants)."""
    rows, cols = shape
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        w = rng.normal(0, scale, size=(rows, cols)).astype(np.float32)
        if qtype == Q.F32:
            return w
        if qtype == Q.F16:
            return w.astype(np.float16)
        return gguf.quants.quantize(w, qtype)
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=n_blocks) * scale / 8).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    dmin = (rng.uniform(0.5, 1.5, size=n_blocks) * scale / 8).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.Q2_K:  # scales[16] qs[64] d dmin
        raw[:, 80:82], raw[:, 82:84] = d, dmin
    elif qtype == Q.Q3_K:  # hmask[32] qs[64] scales[12] d
        raw[:, 108:110] = d
    elif qtype in (Q.Q4_K, Q.Q5_K):  # d dmin scales[12] ...
        raw[:, 0:2], raw[:, 2:4] = d, dmin
    elif qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[:, 208:210] = d
    else:
        raise ValueError(qtype)
    return raw.reshape(rows, cols // block * type_size)


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py), applied to rows of bytes."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, qtypes: dict[str, Q], default: Q = Q.Q8_0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the model's architecture to `path` with every linear weight stored in a
    quantized type (by role: q, k, v, o, gate, up, down, embd, output); return the state
    dict transformers must use to be the reference (the dequantized weights)."""
    rng = np.random.default_rng(seed)
    cfg = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    theta = cfg.rope_parameters["full_attention"]["rope_theta"] if arch == "gemma3" else cfg.rope_parameters["rope_theta"]
    w.add_rope_freq_base(theta)
    if arch == "gemma3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_dimension_count(cfg.head_dim)

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = dict(state)
    gemma = arch == "gemma3"

    def put_quant(gguf_name: str, hf_name: str, role: str, permute_heads: int | None = None):
        weight = state[hf_name]
        qtype = qtypes.get(role, default)
        data = random_quant_bytes(qtype, tuple(weight.shape), rng)
        deq = gguf.quants.dequantize(data, qtype) if qtype not in (Q.F32,) else data
        deq = np.asarray(deq, dtype=np.float32).reshape(weight.shape)
        if permute_heads is not None and arch == "llama":
            data = _permute_for_gguf(data, permute_heads)
        w.add_tensor(gguf_name, data, raw_dtype=qtype)
        ref[hf_name] = torch.from_numpy(deq.copy())

    def put_f32(gguf_name: str, hf_name: str):
        t = state[hf_name].float().numpy()
        if gemma and "norm" in hf_name:
            t = t + 1.0  # llama.cpp stores Gemma norms as 1 + w
        w.add_tensor(gguf_name, np.ascontiguousarray(t, dtype=np.float32))

    put_quant("token_embd.weight", "model.embed_tokens.weight", "embd")
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        put_quant("output.weight", "lm_head.weight", "output")
    put_f32("output_norm.weight", "model.norm.weight")
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put_f32(b + "attn_norm.weight", p + "input_layernorm.weight")
        put_quant(b + "attn_q.weight", p + "self_attn.q_proj.weight", "q", cfg.num_attention_heads)
        put_quant(b + "attn_k.weight", p + "self_attn.k_proj.weight", "k", cfg.num_key_value_heads)
        put_quant(b + "attn_v.weight", p + "self_attn.v_proj.weight", "v")
        put_quant(b + "attn_output.weight", p + "self_attn.o_proj.weight", "o")
        for proj in ("q", "k", "v"):
            if p + f"self_attn.{proj}_proj.bias" in state:
                put_f32(b + f"attn_{proj}.bias", p + f"self_attn.{proj}_proj.bias")
        if p + "self_attn.q_norm.weight" in state:
            put_f32(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight")
            put_f32(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight")
        if gemma:
            put_f32(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight")
            put_f32(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight")
            put_f32(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight")
        else:
            put_f32(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        put_quant(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", "gate")
        put_quant(b + "ffn_up.weight", p + "mlp.up_proj.weight", "up")
        put_quant(b + "ffn_down.weight", p + "mlp.down_proj.weight", "down")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cfg.tie_word_embeddings and "lm_head.weight" in ref:
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    return ref


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML with tools the way Qwen 2.5 / Hermes templates render them (shortened): the tools
# in the system turn, calls as <tool_call>{"name", "arguments"}</tool_call>, results as
# <tool_response> in a user turn.
HERMES_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m.content %}{{ m.content }}\n{% endif %}"
    "{%- for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)




def write_chat_model(
    folder: Path, template: str | None = CHATML, context: int = 64, seed: int = 3
) -> Path:
    """A tiny Qwen3 folder whose tokenizer is every byte plus ChatML's control tokens (ids
    256..258, the model's whole vocabulary), with `template` as its chat template: a real
    template, every text encodable, a forward of about a millisecond."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS]
    backend.add_special_tokens(specials)
    model = make_hf_model(
        "qwen3", seed=seed, vocab_size=backend.get_vocab_size(), max_position_embeddings=context
    )
    save_hf_folder(model, folder)
    backend.save(str(folder / "tokenizer.json"))
    config: dict = {"eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
