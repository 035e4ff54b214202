"""The paged KV cache a model runs on: storage, page table and host tier behind one
object, plus `StepBatch`, the description of one forward step over several sequences.

The model writes each new token's K/V at its (page, slot) and attends through block
tables; it never sees which pages are shared, cached or restored.

A quantized K cache stores each key relative to its layer's calibrated mean, rotated to the
key's position: ``k - R(p) mu`` (``KeyCalibration``, docs/KV_QUANT.md).  SmolLM2's keys are
mostly that constant offset, which would otherwise set every quantization scale; attention
adds ``q . R(p) mu`` back exactly (``kernels.kvquant.KeyOffset``).  The means are data the
cache is given: engine/model/calibration.py runs the model to compute them.  Quantized K and
V use the asymmetric min/max grid (``engine.cache.formats.kv_formats``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.cache.disk_tier import DiskTier, store_dir
from engine.cache.formats import default_dense, format_bits, kv_formats
from engine.cache.host_tier import HostTier
from engine.cache.page import CacheFingerprint
from engine.cache.page_table import PageTable
from engine.cache.storage import PagedKVStorage, kvformat_allocator
from kernels.kvquant import KeyOffset, quantize_into, rope_table
from kernels.layer_kv import LayerKV
from kernels.paged_attention import (
    decode_numba_arrays,
    decode_numba_unchecked,
    numba_stores,
    numba_supported,
    paged_attention,
)

DEFAULT_PAGE_SIZE = 256
DEFAULT_TOKEN_BUDGET = 16384


@dataclass(frozen=True)
class CacheSettings:
    page_size: int = DEFAULT_PAGE_SIZE
    token_budget: int | None = DEFAULT_TOKEN_BUDGET  # pages = budget / page_size
    byte_budget: int | None = None  # wins over token_budget when set
    # 2..8: quantized (kernels/kvquant.py); 16 / 32: fp16 / fp32 pages; None: fp16, or
    # fp32 on a CPU whose kernels cannot read halves (engine.cache.formats.default_dense)
    k_bits: int | None = None
    v_bits: int | None = None
    host_bytes: int = 0  # host-tier budget; 0 disables the tier
    eviction: str = "tail_first"
    disk_dir: str | None = None  # disk-tier location (a store per model under it); None: off
    disk_bytes: int | None = None  # disk-tier budget; None: a few GB or 10% of the free disk

    def __post_init__(self) -> None:
        ps = self.page_size
        if ps < 16 or ps > 1024 or ps & (ps - 1):
            raise ValueError(f"page size must be a power of two from 16 to 1024, not {ps}")
        for name in ("k_bits", "v_bits"):
            bits = getattr(self, name)
            if bits is not None and bits not in (2, 3, 4, 5, 6, 7, 8, 16, 32):
                raise ValueError(
                    f"{name} must be 2..8 (quantized), 16 or 32 (fp16 / fp32), not {bits}"
                )

    @property
    def k_quantized(self) -> bool:
        """Whether K is stored quantized (then relative to the model's key means)."""
        return self.k_bits is not None and self.k_bits <= 8


@dataclass
class StepBatch:
    """One forward step: sequence b brings q_lens[b] new tokens at the end of its
    seq_lens[b]-token context. Rows of every per-token tensor are the new tokens of all
    sequences, concatenated in batch order."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    write_pages: torch.Tensor  # [T] physical page each new token's K/V goes to
    write_slots: torch.Tensor  # [T] row inside that page
    block_tables: torch.Tensor  # [B, max_pages], -1 padded
    seq_lens: torch.Tensor  # [B]
    q_lens: torch.Tensor  # [B]
    logits_rows: torch.Tensor  # [R] rows whose logits are wanted
    decode_only: bool = False  # every sequence brings exactly one token
    host: tuple[np.ndarray, np.ndarray] | None = (
        None  # int64 block tables, seq lens for CPU kernels
    )

    @functools.cached_property
    def host_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """``write_pages`` and ``write_slots`` as numpy arrays (a CPU batch), made once for
        the kernels of every layer that store K/V (``kernels.rope.rope_and_store``)."""
        return self.write_pages.numpy(), self.write_slots.numpy()

    def to(self, device: torch.device) -> StepBatch:
        """This batch with its tensors on ``device`` (itself when they are there); the
        host arrays stay."""
        if self.positions.device == device:
            return self
        fields = ("positions", "write_pages", "write_slots", "block_tables", "seq_lens")
        moved = {f: getattr(self, f).to(device, non_blocking=True) for f in fields}
        moved |= {f: getattr(self, f).to(device) for f in ("q_lens", "logits_rows")}
        return dataclasses.replace(self, **moved)

    @classmethod
    def build(
        cls,
        sequences: Sequence[tuple[Sequence[int], int, int]],
        page_size: int,
        all_logits: bool = False,
    ) -> StepBatch:
        """`sequences`: (block table, tokens already in the cache, new tokens) each."""
        positions, pages, slots = [], [], []
        width = max(len(table) for table, _, _ in sequences)
        tables = torch.full((len(sequences), width), -1, dtype=torch.int64)
        for b, (table, start, count) in enumerate(sequences):
            if start + count > len(table) * page_size:
                raise ValueError(
                    f"sequence {b}: {start + count} tokens exceed its {len(table)} pages"
                )
            table_t = torch.as_tensor(table, dtype=torch.int64)
            tables[b, : len(table)] = table_t
            pos = torch.arange(start, start + count)
            positions.append(pos)
            pages.append(table_t[pos // page_size])
            slots.append(pos % page_size)
        q_lens = torch.tensor([count for _, _, count in sequences])
        seq_lens = torch.tensor([start + count for _, start, count in sequences])
        total = int(q_lens.sum())
        rows = torch.arange(total) if all_logits else torch.cumsum(q_lens, 0) - 1
        decode_only = total == len(sequences)
        host = (tables.numpy(), seq_lens.numpy()) if decode_only else None
        return cls(
            torch.cat(positions),
            torch.cat(pages),
            torch.cat(slots),
            tables,
            seq_lens,
            q_lens,
            rows,
            decode_only,
            host,
        )


def _longest_context(batch: StepBatch) -> int:
    """The longest context of ``batch``, from its host copy where it has one (a decode
    step: no device round trip, so a CUDA graph can capture the step)."""
    return int(batch.host[1].max()) if batch.host is not None else int(batch.seq_lens.max())


@dataclass(frozen=True)
class KeyCalibration:
    """Per layer, the mean pre-RoPE key (after k_norm where the model has one) over a fixed
    calibration text: what a quantized K cache stores its keys relative to."""

    means: torch.Tensor  # [layers, kv_heads, head_dim] float32
    inv_freq: tuple[torch.Tensor, ...]  # per layer, the RoPE frequencies applied to its keys
    source: str  # what the means were computed over
    digest: str  # of the means and frequencies: part of the cache fingerprint

    @classmethod
    def of(
        cls, means: torch.Tensor, inv_freq: Sequence[torch.Tensor], source: str
    ) -> KeyCalibration:
        h = hashlib.blake2b(digest_size=8)
        for t in (means, *inv_freq):
            h.update(t.float().contiguous().numpy().tobytes())
        return cls(means.float(), tuple(f.float() for f in inv_freq), source, h.hexdigest())


def _host_view(data: torch.Tensor) -> np.ndarray:
    """CPU pages as numpy: float32 as they are, fp16 as their uint16 bit patterns."""
    if data.dtype == torch.float16:
        return data.view(torch.int16).numpy().view(np.uint16)
    return data.numpy()


class KVCache:
    """Paged K/V for every layer of one model, with the page table that owns the pages.

    ``calibration`` (used only when K is quantized): the key means the K pages are stored
    relative to (``engine.model.calibration.calibration_for`` computes a model's)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        fingerprint: str,
        settings: CacheSettings,
        calibration: KeyCalibration | None = None,
        disk_label: dict[str, str] | None = None,
        device: torch.device | str = "cpu",
    ):
        self.settings = settings
        self.page_size = settings.page_size
        self.device = torch.device(device)
        # Unquantized pages: fp16 unless asked for fp32 (half the bytes; the Triton kernel
        # reads them natively, the CPU's numba kernels through F16C's conversions)
        dense = default_dense(self.device.type)
        self.fmt_k, self.fmt_v = kv_formats(settings.k_bits, settings.v_bits, dense)
        k_alloc = kvformat_allocator(self.fmt_k, kv_heads, head_dim, self.device)
        v_alloc = kvformat_allocator(self.fmt_v, kv_heads, head_dim, self.device)
        if settings.byte_budget is not None:
            self.storage = PagedKVStorage.from_byte_budget(
                num_layers, settings.byte_budget, self.page_size, k_alloc, v_alloc
            )
        else:
            tokens = settings.token_budget or DEFAULT_TOKEN_BUDGET
            self.storage = PagedKVStorage.from_token_budget(
                num_layers, tokens, self.page_size, k_alloc, v_alloc
            )
        host = HostTier(settings.host_bytes, self.storage) if settings.host_bytes else None
        self.calibration = calibration if self.fmt_k.quantized else None
        if self.calibration is not None and tuple(self.calibration.means.shape) != (
            num_layers,
            kv_heads,
            head_dim,
        ):
            raise ValueError(
                f"key calibration of shape {tuple(self.calibration.means.shape)} for a {num_layers} x {kv_heads} x {head_dim} cache"
            )
        self.fingerprint = CacheFingerprint(
            fingerprint,
            self.page_size,
            format_bits(self.fmt_k),
            format_bits(self.fmt_v),
            self.calibration.digest if self.calibration is not None else "",
        )
        # what attention reads per layer; with a key offset, rebuilt when its tables grow
        self._layers = [
            LayerKV(self.storage.k[i], self.storage.v[i], self.fmt_k, self.fmt_v)
            for i in range(num_layers)
        ]
        self._covered: StepBatch | None = None  # the last batch the offset tables cover
        self._offsets_fixed = False  # reserve_key_offsets: the tables never move again
        self.disk = (
            DiskTier(
                store_dir(settings.disk_dir, self.fingerprint),
                self.fingerprint,
                self.storage,
                settings.disk_bytes,
                label=disk_label,
            )
            if settings.disk_dir is not None
            else None
        )
        self.pages = PageTable(
            self.storage.num_pages,
            self.page_size,
            self.fingerprint,
            self.storage,
            host,
            settings.eviction,
            disk_tier=self.disk,
        )
        probe = torch.empty(1, 1, head_dim, device=self.device)
        self.numba_decode = numba_supported(probe, self.fmt_k, self.fmt_v)
        # the pages as the numba decode kernel reads them, per layer (they never move)
        self._numba_stores = (
            [numba_stores(kv) for kv in self._layers] if self.numba_decode else None
        )
        # unquantized pages on the CPU as numpy views (fp16 as their bit patterns), which
        # kernels.rope writes in place, where the numba kernels read them
        unquantized = not (self.fmt_k.quantized or self.fmt_v.quantized)
        self._dense_pages = (
            [
                (_host_view(self.storage.k[i]["data"]), _host_view(self.storage.v[i]["data"]))
                for i in range(num_layers)
            ]
            if unquantized and self.numba_decode and self.fmt_k.dtype == self.fmt_v.dtype
            else None
        )

    @classmethod
    def for_model(
        cls,
        loaded,
        settings: CacheSettings | None = None,
        calibration: KeyCalibration | None = None,
    ) -> KVCache:
        """The cache for a loaded model (its config's shape and its fingerprint). A quantized
        K cache needs the model's key calibration: ``calibration_for(loaded, settings)``
        (engine/model/calibration.py)."""
        cfg = loaded.config
        settings = settings or CacheSettings()
        if settings.k_quantized and calibration is None:
            raise ValueError(
                "a quantized K cache stores keys relative to the model's key means: pass "
                "engine.model.calibration.calibration_for(loaded, settings)"
            )
        return cls(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            loaded.fingerprint,
            settings,
            calibration,
            {"model": loaded.name, "path": str(Path(loaded.path).resolve())},
            loaded.model.device,
        )

    def close(self) -> None:
        """Write every full page the disk tier lacks and close it (nothing without one):
        what the engine does at shutdown, so the next process finds this one's pages."""
        if self.disk is not None:
            self.pages.write_through()
            self.disk.close()

    @property
    def num_pages(self) -> int:
        return self.storage.num_pages

    def nbytes(self) -> int:
        return self.storage.nbytes()

    def _layer_kv(self, layer: int, batch: StepBatch) -> LayerKV:
        """Layer ``layer``'s pages for attention, the key offset's table (if any) covering
        every position of ``batch``."""
        copies = self.storage.copies
        if copies is not None and copies.pending:
            self.await_copies(batch)
        if self.calibration is not None and batch is not self._covered:
            need = _longest_context(batch)
            have = self.key_offset_positions
            if need > have:
                # grown like the model's rope tables: doubling, so a long generation
                # rebuilds them a logarithmic number of times
                self._grow_offsets(need, max(need, 2 * have, 256))
            self._covered = batch
        return self._layers[layer]

    def await_copies(self, batch: StepBatch) -> None:
        """Before a forward over ``batch``: the compute stream waits for the host tier's
        copies (on a CUDA pool, engine/cache/tier_copies.py) of the pages the batch reads or
        writes, those in its host block tables; without them (a prefill), for every copy.
        Others keep running beside the forward. Nothing to do on the CPU."""
        copies = self.storage.copies
        if copies is None or not copies.pending:
            return
        if batch.host is None:
            copies.await_pages(None)
            return
        tables = batch.host[0]
        copies.await_pages(np.unique(tables[tables >= 0]).tolist())

    @property
    def key_offset_positions(self) -> int:
        """Positions the key offset tables cover now (0 without a key offset)."""
        offset = self._layers[0].k_offset
        return 0 if offset is None else offset.table.shape[0]

    def reserve_key_offsets(self, positions: int) -> None:
        """Build the key offset tables for ``positions`` now, and never again: a CUDA graph
        (engine/model/decode_graphs.py) reads them where they were when it was captured,
        so a longer context is then an error, not a reallocation. Nothing without a key
        offset (K unquantized)."""
        if self.calibration is None:
            return
        if positions > self.key_offset_positions:
            self._grow_offsets(positions, positions)
        self._offsets_fixed = True

    def _grow_offsets(self, need: int, positions: int) -> None:
        if self._offsets_fixed:
            raise ValueError(
                f"a context of {need} positions is beyond the {self.key_offset_positions} "
                "the key offsets were reserved for (CUDA graphs read them in place)"
            )
        offsets = self._build_offsets(positions)
        self._layers = [dataclasses.replace(kv, k_offset=o) for kv, o in zip(self._layers, offsets)]

    def _build_offsets(self, positions: int) -> list[KeyOffset]:
        tables: list[tuple[torch.Tensor, torch.Tensor]] = []  # (inv_freq, table): one per rope
        offsets = []
        for mean, inv_freq in zip(self.calibration.means, self.calibration.inv_freq):
            table = next((t for f, t in tables if torch.equal(f, inv_freq)), None)
            if table is None:
                table = rope_table(inv_freq, positions)
                tables.append((inv_freq, table))
            offsets.append(KeyOffset(mean.to(self.device), table.to(self.device)))
        return offsets

    def dense_pages(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Layer ``layer``'s K and V pages as numpy arrays ``[P, S, kv_heads, head_dim]``
        when they are unquantized on the CPU (float32, or fp16 as uint16 bit patterns),
        for kernels that write a step's rows in place (``kernels.rope.rope_and_store``);
        else None."""
        return self._dense_pages[layer] if self._dense_pages is not None else None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: StepBatch) -> None:
        """Store the new tokens' K and V ([T, kv_heads, head_dim]) at their slots."""
        offset = self._layer_kv(layer, batch).k_offset
        if offset is not None:
            k = k.float() - offset.at(batch.positions)
        quantize_into(self.fmt_k, self.storage.k[layer], batch.write_pages, batch.write_slots, k)
        quantize_into(self.fmt_v, self.storage.v[layer], batch.write_pages, batch.write_slots, v)

    def attend_dense(
        self,
        layer: int,
        q: np.ndarray,
        batch: StepBatch,
        scale: float,
        sliding_window: int | None,
    ) -> np.ndarray:
        """`attend` for a decode step (``batch.host``) on unquantized pages (those
        `dense_pages` returns), numpy in and out: the numba kernel alone, no torch op."""
        kv = self._layer_kv(layer, batch)
        return decode_numba_arrays(
            q, kv, *batch.host, scale, sliding_window, self._numba_stores[layer]
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        batch: StepBatch,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attention of the new tokens' queries [T, heads, head_dim] over their contexts."""
        kv = self._layer_kv(layer, batch)
        if batch.host is not None and self.numba_decode:
            # A decode step, validated once by StepBatch.build for all layers.
            return decode_numba_unchecked(
                q, kv, *batch.host, scale, sliding_window, self._numba_stores[layer]
            )
        if batch.decode_only and q.is_cuda:
            from kernels.triton_paged_attention import triton_paged_attention

            return triton_paged_attention(
                q,
                kv,
                batch.block_tables,
                batch.seq_lens,
                batch.q_lens,
                scale,
                sliding_window,
                decode=True,
                longest=_longest_context(batch),
            )
        return paged_attention(
            q, kv, batch.block_tables, batch.seq_lens, batch.q_lens, scale, sliding_window
        )
