"""Paged attention as a Triton kernel (docs/ENGINE.md §9, CUDA path).

Same calling convention and semantics as
:func:`kernels.paged_attention.paged_attention_reference` (which it is tested against, on
CPU through ``TRITON_INTERPRET=1``): prefill chunks and decode steps mixed in one launch,
GQA, sliding window, and K/V pages in any :class:`~kernels.kvquant.KVFormat`.

One program computes a few query rows of one sequence for all the query heads of one KV
head (``BLOCK_M`` tile rows = rows x GQA group, so a decode step of SmolLM2 fills 3 of
16 rows and each K/V tile is read once per KV head, not once per query head), walking
the keys in tiles of ``BLOCK_N`` positions (a tile never straddles a page) with an online
softmax.  Each tile's physical page comes from the block table, so pages are read in place,
never gathered.  Quantized pages are decoded in the kernel into the rotated domain; the
rotation itself is applied to ``q`` before and to the output after the kernel, as on every
path (``LayerKV.query_for_pages`` and ``LayerKV.output_from_pages``).
With a key offset (keys stored as ``k - R(j) mu``) each score gains ``z . t_j``: ``z`` per
query row from :meth:`~kernels.kvquant.KeyOffset.query_terms`, ``t_j`` the offset table's row
for key position ``j``, one more ``tl.dot`` per tile.

Import cost: triton is imported here, not in :mod:`kernels.paged_attention`.  Whether the
interpreter is used is decided by ``TRITON_INTERPRET`` when this module is imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kvquant import GROUP_SIZE, KVFormat
from kernels.layer_kv import LayerKV

__all__ = ["INTERPRETED", "triton_paged_attention"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
MAX_BLOCK_N = 64


@triton.jit
def _load_kv_tile(
    data_ptr,
    scale_ptr,
    zero_ptr,
    page,
    slots,
    kv_head,
    dims,
    valid,
    s_page,
    s_slot,
    s_head,
    s_group,
    s_word,
    t_page,
    t_slot,
    t_head,
    t_group,
    BITS: tl.constexpr,
    ASYMMETRIC: tl.constexpr,
):
    """A ``[BLOCK_N, BLOCK_D]`` float32 tile of K or V for positions ``slots`` of ``page``.

    Unquantized (BITS == 0): ``data_ptr`` is ``[P, S, kv_heads, head_dim]``.  Quantized:
    ``data_ptr`` is the int32 codes ``[P, S, kv_heads, Gh, BITS]`` and ``scale_ptr`` the fp16
    scales ``[P, S, kv_heads, Gh]`` (with ASYMMETRIC, the steps; ``zero_ptr`` then holds the
    group minima, same layout); the tile comes back in the rotated domain.
    """
    row = page * s_page + slots[:, None].to(tl.int64) * s_slot + kv_head * s_head
    if BITS == 0:
        x = tl.load(data_ptr + row + dims[None, :] * s_group, mask=valid, other=0.0)
        return x.to(tl.float32)
    group = dims // 32
    start = (dims % 32) * BITS
    w_lo = start // 32
    offset = start % 32
    straddles = offset + BITS > 32
    w_hi = tl.where(straddles, w_lo + 1, w_lo)
    base = data_ptr + row + group[None, :] * s_group
    lo = tl.load(base + w_lo[None, :] * s_word, mask=valid, other=0).to(tl.uint32, bitcast=True)
    hi = tl.load(base + w_hi[None, :] * s_word, mask=valid, other=0).to(tl.uint32, bitcast=True)
    # shift amounts stay in 0..31: the high part only exists when offset > 0
    hi_shift = tl.where(straddles, 32 - offset, 0).to(tl.uint32)
    lo_part = lo >> offset[None, :].to(tl.uint32)
    hi_part = tl.where(straddles[None, :], hi << hi_shift[None, :], 0)
    code = ((lo_part | hi_part) & ((1 << BITS) - 1)).to(tl.float32)
    srow = page * t_page + slots[:, None].to(tl.int64) * t_slot + kv_head * t_head
    scale = tl.load(scale_ptr + srow + group[None, :] * t_group, mask=valid, other=0.0)
    if ASYMMETRIC:
        zero = tl.load(zero_ptr + srow + group[None, :] * t_group, mask=valid, other=0.0)
        return code * scale.to(tl.float32) + zero.to(tl.float32)
    half_range: tl.constexpr = 1 << (BITS - 1)
    return (code - (half_range - 0.5)) * (scale.to(tl.float32) / half_range)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    k_scale_ptr,
    k_zero_ptr,
    v_ptr,
    v_scale_ptr,
    v_zero_ptr,
    z_ptr,
    table_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    q_lens_ptr,
    q_starts_ptr,
    item_seq_ptr,
    item_block_ptr,
    sm_scale,
    window,
    head_dim,
    s_q_row,
    s_q_head,
    s_o_row,
    s_o_head,
    s_z_row,
    s_z_head,
    s_table,
    s_bt,
    ks_page,
    ks_slot,
    ks_head,
    ks_group,
    ks_word,
    kt_page,
    kt_slot,
    kt_head,
    kt_group,
    vs_page,
    vs_slot,
    vs_head,
    vs_group,
    vs_word,
    vt_page,
    vt_slot,
    vt_head,
    vt_group,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_ASYMMETRIC: tl.constexpr,
    V_ASYMMETRIC: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(item_seq_ptr + item)
    block = tl.load(item_block_ptr + item)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    q_start = tl.load(q_starts_ptr + seq)

    # tile row r is query row block * ROWS + r // GROUP of query head kv_head * GROUP + r % GROUP:
    # the query heads sharing a KV head share each K/V tile read
    r = tl.arange(0, BLOCK_M)
    rows = block * ROWS + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_ok = (r < ROWS * GROUP) & (rows < q_len)
    pos = seq_len - q_len + rows  # absolute position of each query row
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    io_ok = row_ok[:, None] & dim_ok[None, :]
    q_off = (q_start + rows[:, None]).to(tl.int64) * s_q_row + heads[:, None] * s_q_head
    q = tl.load(q_ptr + q_off + dims[None, :], mask=io_ok, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        z_off = (q_start + rows[:, None]).to(tl.int64) * s_z_row + heads[:, None] * s_z_head
        zq = tl.load(z_ptr + z_off + dims[None, :], mask=io_ok, other=0.0)

    chunk_start = seq_len - q_len + block * ROWS  # position of the block's first query row
    last = tl.minimum(chunk_start + ROWS, seq_len)  # past the last key any row sees
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(chunk_start - window + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for key0 in range(first, last, BLOCK_N):
        page = tl.load(block_tables_ptr + seq * s_bt + key0 // PAGE_SIZE).to(tl.int64)
        keys = key0 + tl.arange(0, BLOCK_N)
        slots = key0 % PAGE_SIZE + tl.arange(0, BLOCK_N)
        tile_ok = (keys < seq_len)[:, None] & dim_ok[None, :]
        k = _load_kv_tile(
            k_ptr, k_scale_ptr, k_zero_ptr, page, slots, kv_head, dims, tile_ok,
            ks_page, ks_slot, ks_head, ks_group, ks_word, kt_page, kt_slot, kt_head, kt_group,
            K_BITS, K_ASYMMETRIC,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        if HAS_OFFSET:
            # q . R(j) mu, the part of each key the cache does not store
            t = tl.load(
                table_ptr + keys[:, None].to(tl.int64) * s_table + dims[None, :],
                mask=tile_ok,
                other=0.0,
            )
            scores += tl.dot(zq, tl.trans(t), input_precision="ieee")
        scores = scores * sm_scale
        seen = (keys[None, :] <= pos[:, None]) & (keys < seq_len)[None, :]
        if HAS_WINDOW:
            seen = seen & (pos[:, None] - keys[None, :] < window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(
            v_ptr, v_scale_ptr, v_zero_ptr, page, slots, kv_head, dims, tile_ok,
            vs_page, vs_slot, vs_head, vs_group, vs_word, vt_page, vt_slot, vt_head, vt_group,
            V_BITS, V_ASYMMETRIC,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + rows[:, None]).to(tl.int64) * s_o_row + heads[:, None] * s_o_head
    tl.store(out_ptr + o_off + dims[None, :], out, mask=io_ok)


def _store_args(fmt: KVFormat, store: dict[str, torch.Tensor], head_dim: int):
    """(data, scales, zeros, 5 data strides, 4 scale strides, bits, asymmetric) for the kernel."""
    if fmt.bits is None:
        data = store["data"]
        s = data.stride()
        # for unquantized pages the "group" stride walks head_dim
        return data, data, data, (s[0], s[1], s[2], s[3], 0), (0, 0, 0, 0), 0, False
    codes, scales = store["codes"], store["scales"]
    if head_dim % GROUP_SIZE:
        raise ValueError(f"quantized pages need head_dim % {GROUP_SIZE} == 0")
    # the zeros share the scales' layout (allocate_pages), so the scale strides serve both
    zeros = store["zeros"] if fmt.asymmetric else scales
    return codes, scales, zeros, codes.stride(), scales.stride(), fmt.bits, fmt.asymmetric


def _work_items(q_lens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row block) of every block of ``rows`` query rows."""
    blocks = (q_lens + rows - 1) // rows
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), blocks)
    first_item = torch.cumsum(blocks, 0) - blocks
    block = torch.arange(len(seq), device=q_lens.device) - first_item[seq]
    return seq.to(torch.int32), block.to(torch.int32)


def triton_paged_attention(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    decode: bool = False,
    longest: int | None = None,
) -> torch.Tensor:
    """Paged attention in one Triton launch; see the module docstring. ``decode``: the
    caller knows every ``q_lens`` is 1, so the work list (one item per sequence) is made
    without reading ``q_lens`` back: no host round trip, and capturable in a CUDA graph.
    ``longest``: ``seq_lens.max()`` when the caller knows it on the host (the key offset
    table is checked against it without reading ``seq_lens`` back, the same reason)."""
    total_q, n_heads, head_dim = q.shape
    device = q.device
    k_offset = kv.k_offset
    k_data, k_scales, k_zeros, ks, kt, k_bits, k_asym = _store_args(kv.fmt_k, kv.k, head_dim)
    v_data, v_scales, v_zeros, vs, vt, v_bits, v_asym = _store_args(kv.fmt_v, kv.v, head_dim)
    kv_heads, page_size = kv.kv_heads, kv.page_size
    if n_heads % kv_heads:
        raise ValueError(f"n_heads {n_heads} is not a multiple of kv_heads {kv_heads}")

    qf = kv.query_for_pages(q).contiguous()
    if k_offset is None:
        zq, table = qf, qf  # not read: HAS_OFFSET is off
    else:
        if k_offset.table.shape[0] < (int(seq_lens.max()) if longest is None else longest):
            raise ValueError("the key offset table does not cover the longest context")
        zq = k_offset.query_terms(q).to(device).contiguous()
        table = k_offset.table.to(device=device, dtype=torch.float32).contiguous()
    out = torch.empty(total_q, n_heads, head_dim, dtype=torch.float32, device=device)
    q_lens = q_lens.to(device=device, dtype=torch.int32)
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    q_starts = (torch.cumsum(q_lens, 0) - q_lens).to(torch.int32)
    group = n_heads // kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    rows = block_m // group
    if decode:
        item_seq = torch.arange(len(q_lens), dtype=torch.int32, device=device)
        item_block = torch.zeros_like(item_seq)
    else:
        item_seq, item_block = _work_items(q_lens, rows)
    block_tables = block_tables.to(device).contiguous()
    if len(item_seq) == 0:
        return out.to(q.dtype)

    block_n = min(MAX_BLOCK_N, page_size)
    grid = (len(item_seq), kv_heads)
    _paged_attention_kernel[grid](
        qf, out, k_data, k_scales, k_zeros, v_data, v_scales, v_zeros, zq, table,
        block_tables, seq_lens, q_lens, q_starts, item_seq, item_block,
        scale, sliding_window or 0, head_dim,
        qf.stride(0), qf.stride(1), out.stride(0), out.stride(1),
        zq.stride(0), zq.stride(1), table.stride(0), block_tables.stride(0),
        *ks, *kt, *vs, *vt,
        GROUP=group,
        ROWS=rows,
        PAGE_SIZE=page_size,
        K_BITS=k_bits,
        V_BITS=v_bits,
        K_ASYMMETRIC=k_asym,
        V_ASYMMETRIC=v_asym,
        HAS_OFFSET=k_offset is not None,
        HAS_WINDOW=sliding_window is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )  # fmt: skip
    return kv.output_from_pages(out, q.dtype)
