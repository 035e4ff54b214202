"""Key calibration: the step that runs a model to find what a quantized K cache stores its
keys relative to (per layer, the mean pre-RoPE key; docs/KV_QUANT.md).

The cache only receives the result (`KVCache(..., calibration)`,
`KVCache.for_model(loaded, settings, calibration)`); computing it is one forward of about
1k tokens, done once per model and kept on the `LoadedModel`.
"""

from __future__ import annotations

import torch

from engine.cache.kv_cache import (
    DEFAULT_PAGE_SIZE,
    CacheSettings,
    KeyCalibration,
    KVCache,
    StepBatch,
)
from engine.model.loader import LoadedModel
from engine.reference_text import reference_text
from kernels.kvquant import rope_table

CALIBRATION_TOKENS = 1024


def calibration_ids(loaded: LoadedModel, count: int = CALIBRATION_TOKENS) -> tuple[list[int], str]:
    """``count`` token ids to calibrate on, and what they are.

    Text from the middle of ``pydoc_data.topics`` (shipped with Python; far from the
    perplexity windows, which start at its beginning), or, for a model without a
    tokenizer, seeded random ids: the key mean is mostly a property of the weights.
    Never more tokens than the model has positions.
    """
    count = min(count, loaded.config.max_position_embeddings)
    if loaded.tokenizer is not None:
        text = reference_text()
        start = text.index("\n\n", len(text) // 2) + 2
        # ~4 characters a token: 8 per token leaves room
        ids = loaded.tokenizer.encode(text[start : start + 8 * count], add_special_tokens=False)
        ids = ids[:count]
        if len(ids) == count:
            return ids, f"pydoc_data.topics from character {start}, {count} tokens"
    ids = torch.randint(
        0, loaded.config.vocab_size, (count,), generator=torch.Generator().manual_seed(0)
    )
    return ids.tolist(), f"{count} random token ids (seed 0)"


def calibrate_keys(loaded: LoadedModel, count: int = CALIBRATION_TOKENS) -> KeyCalibration:
    """One forward over the calibration tokens into an fp32 cache, then per layer the mean
    of the stored keys with their RoPE undone (``R(p)^-1 = R(-p)``)."""
    cfg, model = loaded.config, loaded.model
    ids, source = calibration_ids(loaded, count)
    settings = CacheSettings(
        page_size=DEFAULT_PAGE_SIZE, token_budget=len(ids), k_bits=32, v_bits=32
    )
    cache = KVCache(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        loaded.fingerprint,
        settings,
        device=model.device,
    )
    batch = StepBatch.build([(list(range(cache.num_pages)), 0, len(ids))], cache.page_size)
    model.forward(torch.tensor(ids), batch, cache)
    half = cfg.head_dim // 2
    means, freqs = [], []
    for layer in range(cfg.num_layers):
        inv_freq = model.key_rope(layer).inv_freq.cpu()
        table = rope_table(inv_freq, len(ids))
        cos = torch.cat((table[:, :half], table[:, :half]), -1).unsqueeze(-2)
        sin = torch.cat((table[:, half:], table[:, half:]), -1).unsqueeze(-2)
        k = cache.storage.k[layer]["data"].flatten(0, 1)[: len(ids)].float().cpu()
        rotated = torch.cat((-k[..., half:], k[..., :half]), -1)
        means.append((k * cos - rotated * sin).mean(0))
        freqs.append(inv_freq)
    return KeyCalibration.of(torch.stack(means), freqs, source)


def key_calibration(loaded: LoadedModel) -> KeyCalibration:
    """The model's key calibration, computed on first use and kept on the LoadedModel."""
    calibration = getattr(loaded, "key_calibration", None)
    if calibration is None:
        calibration = calibrate_keys(loaded)
        loaded.key_calibration = calibration
    return calibration


def calibration_for(loaded: LoadedModel, settings: CacheSettings) -> KeyCalibration | None:
    """What a cache with ``settings`` is handed: the model's key calibration when its K
    pages are quantized, else None (and nothing is computed)."""
    return key_calibration(loaded) if settings.k_quantized else None
