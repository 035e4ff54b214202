"""Attention over the paged KV cache (docs/ENGINE.md §9): the entry point and the CPU paths.

All entry points share one calling convention:

* ``q [total_q, n_heads, head_dim]``: the new tokens of all sequences, concatenated in
  batch order; sequence ``b`` owns ``q_lens[b]`` rows.
* ``kv`` (:class:`~kernels.layer_kv.LayerKV`): one layer's K and V page stores
  (:mod:`kernels.kvquant` layout), their formats and the key offset; the new tokens' K/V
  are already written.
* ``block_tables [B, max_pages]``: physical page of each logical page, ``-1`` padding.
* ``seq_lens [B]``: context length including the new tokens, which are its last
  ``q_lens[b]`` positions.  Attention is causal within the new chunk and full over the
  cached prefix; with ``sliding_window`` a query at position ``i`` sees keys ``j`` with
  ``i - j < sliding_window``.  GQA: ``n_heads`` is a multiple of ``kv_heads``.
* ``kv.k_offset`` (optional, :class:`~kernels.kvquant.KeyOffset`): the keys are stored as
  ``k - R(j) mu``; every path attends to the full key ``stored + R(j) mu``, exactly.

:func:`paged_attention` is the entry point: it picks the Triton kernel for CUDA tensors and
the fastest applicable CPU path otherwise.  :func:`paged_attention_reference` gathers pages
and calls ``scaled_dot_product_attention``; it is the reference for every other path.  For
steps where every sequence brings one token there are two faster CPU paths:
:func:`paged_decode` (torch: gathers only the live tokens, works in the rotated domain of
quantized caches) and :func:`paged_decode_numba` (an optional numba kernel reading the pages
in place through the block table).

Decode, SmolLM2 shapes (9/3 heads, head dim 64, 256-token pages), ms per layer on the 2-core
dev machine (torch and numba with 2 threads, best of 3 x 15 runs on a quiet machine;
multiply by 30 layers for a step):

    B x context   cache   reference         paged_decode   paged_decode_numba
    1 x 512       fp32    0.25              0.15           0.08
    1 x 512       8-bit   0.48              0.27           0.14
    1 x 512       4-bit   0.67              0.45           0.16
    16 x 160      fp32    0.89              0.44           0.24
    16 x 160      8-bit   1.72              0.72           0.38
    16 x 160      4-bit   2.40              1.02           0.49
    16 x 640      fp32    2.24              1.26           0.85
    16 x 640      8-bit   4.23              1.94           1.33
    16 x 640      4-bit   5.61              3.07           1.69

Since then the numba kernel gives a task all the KV heads of one sequence when the batch
keeps every thread busy (a sequence's rows are then read front to back, instead of one
head's 256 bytes out of every 768): fp32, 30 layers with cold caches, 16 x 160 went from
17.0 to 11.9 ms, 16 x 640 from 63.6 to 42.0 ms, 4 x 300 from 8.5 to 5.8 ms; single
sequences keep a task per head (1 x 512: 3.2 ms either way).

Since 2026-12-05 unquantized pages are fp16 by default (widened by ``vcvtph2ps`` as they
are read), and the kernel's arithmetic was the bound, not the pages' bytes: each query
head's maximum over a page was a scalar chain of compares (``simd.float_max`` now), and
the values were added slot by slot into accumulators loaded and stored per slot (now
`simd.weighted_rows`: per KV head the page's slots in one call, four query heads'
accumulators in registers). Llama-3.2-1B shapes (32 / 8 heads of 64), one layer, warm,
2 threads, before -> after: 16 x 144 fp16 0.61 -> 0.40 ms (fp32 0.62 -> 0.46), 16 x 600
2.24 -> 1.45 ms, 1 x 3,000 1.04 -> 0.56 ms; Qwen2-7B's (28 / 4 of 128), 16 x 300: 1.38
-> 1.03 ms.

Since 2026-12-07 unquantized keys are scored 16 slots a call (`simd.key_scores`: per slot
the same 16-lane multiply-adds, then sixteen slots' lane sums taken together in the same
order as before, so the same bits), and each group's exponentials and their sum are one
vector pass (`simd.shifted_exps`, the bits of `exp_into` and the four partial sums).
Llama-3.2-1B shape, 256-slot fp16 pages, 540 tokens, one sequence, 16 layers' pages in
turn, 2 threads (AMD EPYC Zen 4): 116-121 -> 68-76 us a layer; in a real decode step (the
pages cold after the weights streamed by) 150 -> 110 us.

Quantized pages are still slower than fp32 here: decoding the codes costs more compute than
the bytes saved, at these sizes.  (Measured with the §6 midpoint grid and no key offset; the
engine's quantized caches now add a key offset, one more dot product per key and query head,
and read one more fp16 per group: not re-measured.)
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F

from kernels.kvquant import KVFormat, decode, dequantize_pages
from kernels.layer_kv import LayerKV

__all__ = [
    "HAS_NUMBA",
    "numba_supported",
    "paged_attention",
    "paged_attention_reference",
    "paged_decode",
    "paged_decode_numba",
]


def _check_call(q, kv: LayerKV, block_tables, seq_lens, q_lens, decode_path: str = "") -> None:
    """The calling convention's shapes and lengths (module docstring); ``decode_path``
    names a path that takes only decode steps (every ``q_lens[b] == 1``)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, n_heads, head_dim], got {tuple(q.shape)}")
    batch = block_tables.shape[0]
    if seq_lens.shape != (batch,) or q_lens.shape != (batch,):
        raise ValueError("seq_lens and q_lens must be [B] with B = block_tables.shape[0]")
    if int(q_lens.sum()) != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but q_lens sums to {int(q_lens.sum())}")
    if bool((q_lens > seq_lens).any()) or bool((q_lens < 0).any()):
        raise ValueError("need 0 <= q_lens <= seq_lens")
    if decode_path and bool((q_lens != 1).any()):
        raise ValueError(f"{decode_path} needs q_lens == 1 for every sequence")
    k_offset = kv.k_offset
    if k_offset is None:
        return
    kv_heads, head_dim = kv.kv_heads, q.shape[2]
    if tuple(k_offset.mean.shape) != (kv_heads, head_dim) or k_offset.table.shape[1] != head_dim:
        raise ValueError(
            f"key offset shapes {tuple(k_offset.mean.shape)} / {tuple(k_offset.table.shape)} "
            f"do not fit {kv_heads} kv heads x {head_dim}"
        )
    if len(seq_lens) and k_offset.table.shape[0] < int(seq_lens.max()):
        raise ValueError(
            f"key offset table covers {k_offset.table.shape[0]} positions, "
            f"contexts reach {int(seq_lens.max())}"
        )


def _gather_context(
    fmt: KVFormat, store: dict[str, torch.Tensor], tables: torch.Tensor, context: int
) -> torch.Tensor:
    """float32 ``[n, context, kv_heads, head_dim]`` through the block tables ``[n, pages]``."""
    n, pages = tables.shape
    flat = dequantize_pages(fmt, store, tables.clamp(min=0).reshape(-1))
    return flat.reshape(n, pages * flat.shape[1], *flat.shape[2:])[:, :context]


def _attend(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    q_lens: list[int],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention of a few sequences padded to a common length: q ``[n, max_q, n_heads, d]``."""
    device = q.device
    context = max(seq_lens)
    pages = -(-context // kv.page_size)
    tables = block_tables[:, :pages].to(device=device, dtype=torch.long)
    k = _gather_context(kv.fmt_k, kv.k, tables, context)
    if kv.k_offset is not None:
        # the keys as the model computed them: stored residual plus R(j) mu at position j
        k = k + kv.k_offset.at(torch.arange(context)).to(device)
    k = k.transpose(1, 2)
    v = _gather_context(kv.fmt_v, kv.v, tables, context).transpose(1, 2)

    if (
        len(seq_lens) == 1
        and seq_lens[0] == q_lens[0] == q.shape[1]
        and (sliding_window is None or sliding_window >= context)
    ):
        # a prompt from its first token: the causal mask itself, whose blocks above the
        # diagonal SDPA skips (2,048 tokens, 32 heads: 135 against 247 ms with the mask
        # as a tensor; the same bits)
        out = F.scaled_dot_product_attention(
            q.float().transpose(1, 2), k, v, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)
    lens = torch.tensor(seq_lens, device=device)[:, None, None]
    qlens = torch.tensor(q_lens, device=device)[:, None, None]
    rows = torch.arange(q.shape[1], device=device)[None, :, None]
    keys = torch.arange(context, device=device)[None, None, :]
    pos = lens - qlens + rows  # absolute position of each query row
    allowed = (keys <= pos) & (keys < lens)
    if sliding_window is not None:
        allowed &= pos - keys < sliding_window
    allowed |= rows >= qlens  # padding rows: attend anywhere rather than produce NaN
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k,
        v,
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def paged_attention_reference(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Reference paged attention: gather (and dequantize) pages, then SDPA.

    Single-token sequences are batched together, padded to their longest context and
    masked; each longer chunk (prefill) runs on its own so no sequence pays for another's
    chunk length.  Returns ``[total_q, n_heads, head_dim]`` in ``q.dtype``.
    """
    _check_call(q, kv, block_tables, seq_lens, q_lens)
    seq_list = seq_lens.tolist()
    q_list = q_lens.tolist()
    if len(q_list) == 1 and q_list[0] > 1:
        # one prompt chunk (a prefill): its rows as they are, without the gathers and
        # the scatter below (three copies of q's size: 12 MB of a 512-token prefill's
        # peak at the 1B shape)
        res = _attend(q[None], kv, block_tables, seq_list, q_list, scale, sliding_window)
        return res[0].to(q.dtype)
    starts = [0]
    for n in q_list:
        starts.append(starts[-1] + n)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)

    def run(batch: list[int]) -> None:
        max_q = max(q_list[b] for b in batch)
        first = torch.tensor([starts[b] for b in batch], device=q.device)[:, None]
        count = torch.tensor([q_list[b] for b in batch], device=q.device)[:, None]
        offset = torch.arange(max_q, device=q.device)[None, :]
        index = first + offset.minimum(count - 1)  # padding rows repeat the last row
        res = _attend(
            q[index],
            kv,
            block_tables[batch],
            [seq_list[b] for b in batch],
            [q_list[b] for b in batch],
            scale,
            sliding_window,
        )
        valid = offset < count
        out[index[valid]] = res[valid]

    decode = [b for b, n in enumerate(q_list) if n == 1]
    if decode:
        run(decode)
    for b, n in enumerate(q_list):
        if n > 1:
            run([b])
    return out.to(q.dtype)


def _token_index(block_tables: torch.Tensor, context: int, page_size: int) -> torch.Tensor:
    """Flat slot ``page * page_size + slot`` of every position ``< context``: ``[B, context]``."""
    t = torch.arange(context, device=block_tables.device)
    pages = block_tables[:, : -(-context // page_size)].long().clamp(min=0)
    return pages[:, t // page_size] * page_size + t % page_size


def _gather_tokens(fmt: KVFormat, store: dict[str, torch.Tensor], index: torch.Tensor):
    """Tokens at flat slots ``index [B, T]``: float32 ``[B, T, kv_heads, head_dim]``, in the
    rotated domain for quantized formats."""
    flat = index.reshape(-1)
    rows = {name: t.flatten(0, 1).index_select(0, flat) for name, t in store.items()}
    out = decode(fmt, rows, rotated=True)
    return out.reshape(*index.shape, *out.shape[1:])


def paged_decode(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode step (every ``q_lens[b] == 1``) without SDPA or whole-page copies.

    Gathers only the live tokens (padded to the longest context) straight from the page
    pool into ``[B, T, kv_heads, d]`` and hands SDPA strided views of it, with the query
    heads of one KV head as that head's query rows (no GQA expansion).  For quantized
    formats the cache is never rotated back: since the group rotation
    ``H`` is orthogonal and symmetric, ``q . (y H) = (q H) . y`` and ``sum_j p_j (y_j H) =
    (sum_j p_j y_j) H``, so only ``q`` and the output are rotated.  A key offset enters as an
    additive score bias ``z . t_j`` (:meth:`~kernels.kvquant.KeyOffset.query_terms`).
    """
    _check_call(q, kv, block_tables, seq_lens, q_lens, decode_path="paged_decode")
    batch, n_heads, head_dim = q.shape
    context = int(seq_lens.max())
    index = _token_index(block_tables, context, kv.page_size)
    k = _gather_tokens(kv.fmt_k, kv.k, index)  # [B, T, kvh, d]
    v = _gather_tokens(kv.fmt_v, kv.v, index)
    kv_heads = k.shape[2]
    group = n_heads // kv_heads

    qf = kv.query_for_pages(q)
    # one query per sequence: the query heads sharing a KV head become that head's rows
    qg = qf.reshape(batch, kv_heads, group, head_dim)
    t = torch.arange(context, device=q.device)[None, :]
    lens = seq_lens.to(q.device)[:, None]
    allowed = t < lens
    if sliding_window is not None:
        allowed &= lens - 1 - t < sliding_window
    mask = allowed[:, None, None, :]
    if kv.k_offset is not None:
        # SDPA adds a float mask to the scaled scores: the bias is scale * q . R(j) mu
        z = kv.k_offset.query_terms(q).reshape(batch, kv_heads, group, head_dim)
        bias = (z @ kv.k_offset.table[:context].to(q.device).T) * scale
        mask = bias.masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return kv.output_from_pages(out.reshape(batch, n_heads, head_dim), q.dtype)


# ---- numba decode kernel: reads the pages in place through the block table ---------------
#
# Optional: numba (LLVM, no C compiler needed at run time) compiles this on first use and
# caches the machine code next to this file.  Without numba the torch paths are used.

try:
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

HAS_NUMBA = numba is not None
_LITTLE_ENDIAN = sys.byteorder == "little"

if HAS_NUMBA:
    from kernels.quant.simd import (
        HAS_F16C,
        float_dot,
        float_dots4,
        float_max,
        halves_to_floats,
        key_scores,
        prefetch,
        shifted_exps,
        weighted_rows,
    )

    # Unquantized pages come to the kernel as ``bits`` 0 (float32) or 16 (fp16, as the
    # float32 view of their bytes: [P, S, kv_heads, head_dim / 2], the same byte strides;
    # a row is widened into the task's float32 scratch row before its dot products).
    #
    # Unquantized pages: each task asks this many slots ahead of the one it reads into L2. A
    # task reads one KV head's rows, 256 bytes every kv_heads * 256, which crosses a 4 KB
    # page every few slots, where the hardware's stream prefetch stops (Llama-3.2-1B
    # shapes, 3,000 tokens, 16 layers' pages cold, 2 threads: 0.95 -> 0.79 ms a layer)
    _SLOTS_AHEAD = 8
    # Slots whose scores are made before one online-softmax rescale (whole pages: 4 of 16
    # slots), where a rescale per 16-slot page (its max, exp, sum and the accumulators
    # scaled, per query head) cost a seventh of the kernel (Llama-3.2-1B shape, 513
    # tokens, fp16 pages, 2 threads, warm, processes in turns: medians 133 us a layer
    # rescaling per page, 114 per 64 slots; 128 and 256 no faster)
    _SPAN_SLOTS = 64

    # No fast-math flags (as kernels/quant/simd.py): with reassociation or contraction
    # allowed, numba's JIT and its on-disk cache compiled this kernel to other last bits
    # (measured: a decode step's attention on 256-token pages differed by an ulp between a
    # process that compiled it and one that loaded it), so the same seed could give
    # another reply after the kernels were compiled again. The sums that vectorised under
    # reassociation are four partial sums in a fixed order instead.
    @numba.njit(cache=True, inline="always")
    def _load_row(data, codes, scales, zeros, asym, half_table, bits, page, slot, head, row):
        """One token's head vector into ``row`` (rotated domain when quantized; ``codes`` is
        the byte view ``[P, S, kv_heads, Gh, 4 * bits]`` of the packed words; ``scales`` and,
        for the asymmetric grid, ``zeros`` the fp16 bit patterns, decoded through
        ``half_table`` as numba has no float16).  Either grid decodes as code * step + base."""
        if bits == 0:
            for d in range(row.shape[0]):
                row[d] = data[page, slot, head, d]
            return
        half = 1 << (bits - 1)
        mask = (1 << bits) - 1
        for grp in range(scales.shape[3]):
            # float32 throughout: numba would promote float32 / int64 to float64
            if asym:
                step = half_table[scales[page, slot, head, grp]]
                base = half_table[zeros[page, slot, head, grp]]
            else:
                step = half_table[scales[page, slot, head, grp]] / np.float32(half)
                base = np.float32((0.5 - half) * step)
            at = grp * 32
            if bits == 8:
                for i in range(32):
                    row[at + i] = codes[page, slot, head, grp, i] * step + base
            elif bits == 4:
                for j in range(16):
                    byte = np.int32(codes[page, slot, head, grp, j])
                    row[at + 2 * j] = (byte & 15) * step + base
                    row[at + 2 * j + 1] = (byte >> 4) * step + base
            elif bits == 2:
                for j in range(8):
                    byte = np.int32(codes[page, slot, head, grp, j])
                    row[at + 4 * j] = (byte & 3) * step + base
                    row[at + 4 * j + 1] = ((byte >> 2) & 3) * step + base
                    row[at + 4 * j + 2] = ((byte >> 4) & 3) * step + base
                    row[at + 4 * j + 3] = (byte >> 6) * step + base
            else:
                for i in range(32):
                    start = i * bits
                    j = start >> 3
                    code = np.int32(codes[page, slot, head, grp, j])
                    if (start & 7) + bits > 8:
                        code |= np.int32(codes[page, slot, head, grp, j + 1]) << 8
                    row[at + i] = ((code >> (start & 7)) & mask) * step + base

    @numba.njit(cache=True, inline="always")
    def _weigh_values(acc, scores, first_row, count, first, n, v_row, v_step, half):
        """``acc`` rows ``first_row ..`` (``count`` query heads of one KV head) plus their
        probabilities (``scores``, slots from ``first``) times the ``n`` value rows at
        ``v_row`` (``v_step`` bytes apart): `weighted_rows` four heads at a time."""
        acc_step, w_step = acc.strides[0], scores.strides[0]
        acc_at = acc.ctypes.data + first_row * acc_step
        w_at = scores.ctypes.data + first_row * w_step + first * 4
        width = acc.shape[1]
        r = 0
        while r + 4 <= count:
            weighted_rows(acc_at + r * acc_step, acc_step, w_at + r * w_step, w_step,
                          v_row, v_step, n, width, 4, half)  # fmt: skip
            r += 4
        left = count - r
        acc_at, w_at = acc_at + r * acc_step, w_at + r * w_step
        if left == 3:
            weighted_rows(acc_at, acc_step, w_at, w_step, v_row, v_step, n, width, 3, half)
        elif left == 2:
            weighted_rows(acc_at, acc_step, w_at, w_step, v_row, v_step, n, width, 2, half)
        elif left == 1:
            weighted_rows(acc_at, acc_step, w_at, w_step, v_row, v_step, n, width, 1, half)

    @numba.njit(cache=True, inline="always")
    def _score_keys(qs, first_row, count, k_row, k_step, n, scores, first, lanes, half):
        """``scores`` rows ``first_row ..`` (``count`` query heads of one KV head), columns
        ``first .. first + n``: the scaled queries ``qs`` dotted with the ``n`` (at most 16)
        key rows at ``k_row`` (``k_step`` bytes apart): `key_scores` four heads at a time."""
        q_step, s_step = qs.strides[0], scores.strides[0]
        q_at = qs.ctypes.data + first_row * q_step
        s_at = scores.ctypes.data + first_row * s_step + first * 4
        width, lanes_at = qs.shape[1], lanes.ctypes.data
        r = 0
        while r + 4 <= count:
            key_scores(q_at + r * q_step, q_step, k_row, k_step, n, width,
                       s_at + r * s_step, s_step, lanes_at, 4, half)  # fmt: skip
            r += 4
        left = count - r
        q_at, s_at = q_at + r * q_step, s_at + r * s_step
        if left == 3:
            key_scores(q_at, q_step, k_row, k_step, n, width, s_at, s_step, lanes_at, 3, half)
        elif left == 2:
            key_scores(q_at, q_step, k_row, k_step, n, width, s_at, s_step, lanes_at, 2, half)
        elif left == 1:
            key_scores(q_at, q_step, k_row, k_step, n, width, s_at, s_step, lanes_at, 1, half)

    @numba.njit(cache=True, inline="always")
    def _page_slots(table, logical, g0, page_size, lo, context):
        """Logical page ``logical`` of a group that starts at ``g0``: (its page in the pool,
        its first slot's column in the group's scores, its live slots ``first .. last``)."""
        first = max(logical * page_size, lo) - logical * page_size
        last = min((logical + 1) * page_size, context) - logical * page_size
        return table[logical], (logical - g0) * page_size, first, last

    @numba.njit(cache=True, parallel=True)
    def _decode_kernel(
        q, scale, tables, seq_lens, window, group, page_size, kd, kc, ks, kz, kasym, kbits,
        vd, vc, vs, vz, vasym, vbits, zq, offset_table, has_offset, half_table, heads_per_task, out,
    ):  # fmt: skip
        batch, n_heads, head_dim = q.shape
        kv_heads = n_heads // group
        tasks_per_seq = kv_heads // heads_per_task
        rows = heads_per_task * group  # query heads of one task
        for task in numba.prange(batch * tasks_per_seq):
            b = task // tasks_per_seq
            h0 = (task % tasks_per_seq) * heads_per_task
            context = seq_lens[b]
            lo = max(0, context - window) if window > 0 else 0
            best = np.full(rows, -1.0e30, dtype=np.float32)
            total = np.zeros(rows, dtype=np.float32)
            acc = np.zeros((rows, head_dim), dtype=np.float32)
            row = np.empty(head_dim, dtype=np.float32)
            # the scores of ``span`` pages at a time (SPAN_SLOTS slots or one page), one
            # online-softmax rescale per such group rather than per page
            span = max(1, _SPAN_SLOTS // page_size)
            scores = np.empty((rows, span * page_size), dtype=np.float32)
            k_rows, v_rows = kd.strides[1], vd.strides[1]  # bytes from a slot to the next
            k_ahead = (2 if kbits == 16 else 4) * head_dim * heads_per_task  # a slot's bytes
            v_ahead = (2 if vbits == 16 else 4) * head_dim * heads_per_task
            # the task's queries times the softmax scale (float32 products: torch's q * scale)
            qs = np.empty((rows, head_dim), dtype=np.float32)
            q_step, k_head, v_head = qs.strides[0], kd.strides[2], vd.strides[2]
            four = np.empty(4, dtype=np.float32)
            # unquantized keys go to `key_scores` (16 lanes a chunk), the rest slot by slot
            keys_in_runs = (kbits == 0 or kbits == 16) and head_dim % 16 == 0
            key_lanes = np.zeros(4 * 16 * 16, dtype=np.float32)  # key_scores' scratch
            for j in range(rows):
                for d in range(head_dim):
                    qs[j, d] = q[b, h0 * group + j, d] * scale
            first_page = lo // page_size
            end_page = (context + page_size - 1) // page_size
            for g0 in range(first_page, end_page, span):
                g1 = min(g0 + span, end_page)
                # the group's slots lie at (logical - g0) * page_size + slot in ``scores``;
                # only the first page may start late (a window) and the last end early
                g_first = max(g0 * page_size, lo) - g0 * page_size
                g_last = min(g1 * page_size, context) - g0 * page_size
                for logical in range(g0, g1):
                    page, off, first, last = _page_slots(
                        tables[b], logical, g0, page_size, lo, context
                    )
                    k_at = kd.ctypes.data + page * kd.strides[0] + h0 * kd.strides[2]
                    v_at = vd.ctypes.data + page * vd.strides[0] + h0 * vd.strides[2]
                    for slot in range(first, last):
                        if kbits == 0 or kbits == 16:  # past the page's end: another page's
                            prefetch(k_at + (slot + _SLOTS_AHEAD) * k_rows, k_ahead)  # or none
                        if vbits == 0 or vbits == 16:  # this slot's values, read after the softmax
                            prefetch(v_at + slot * v_rows, v_ahead)
                    if keys_in_runs:
                        # unquantized keys 16 slots a call, their lane sums together (one
                        # slot a call, the sums took most of the kernel's time: Llama-3.2-1B
                        # shape, 540 tokens, 2 threads: medians 144 -> 100 us a layer)
                        for s0 in range(first, last, 16):
                            n = min(16, last - s0)
                            for hh in range(heads_per_task):
                                _score_keys(qs, hh * group, group, k_at + s0 * k_rows + hh * k_head,
                                            k_rows, n, scores, off + s0, key_lanes, kbits == 16)  # fmt: skip
                    for slot in range(first, last if not keys_in_runs else first):
                        for hh in range(heads_per_task):
                            h = h0 + hh
                            if kbits == 0:  # fp32 pages: read in place
                                k_row = k_at + slot * k_rows + hh * k_head
                            elif kbits == 16:
                                halves_to_floats(
                                    k_at + slot * k_rows + hh * k_head, row.ctypes.data, head_dim
                                )
                                k_row = row.ctypes.data
                            else:
                                _load_row(
                                    kd, kc, ks, kz, kasym, half_table, kbits, page, slot, h, row
                                )
                                k_row = row.ctypes.data
                            # the group's query heads four at a time (their lane sums
                            # together), the rest one by one
                            g = 0
                            while g + 4 <= group:
                                q_row = qs.ctypes.data + (hh * group + g) * q_step
                                float_dots4(q_row, q_step, k_row, head_dim, four.ctypes.data)
                                for j in range(4):
                                    scores[hh * group + g + j, off + slot] = four[j]
                                g += 4
                            while g < group:
                                q_row = qs.ctypes.data + (hh * group + g) * q_step
                                scores[hh * group + g, off + slot] = float_dot(
                                    q_row, k_row, head_dim
                                )
                                g += 1
                    if has_offset:
                        # q . R(key) mu as one more dot product per key (KeyOffset.query_terms)
                        for slot in range(first, last):
                            key = logical * page_size + slot
                            for j in range(rows):
                                dot = float_dot(
                                    zq.ctypes.data
                                    + (b * zq.strides[0])
                                    + (h0 * group + j) * zq.strides[1],
                                    offset_table.ctypes.data + key * offset_table.strides[0],
                                    head_dim,
                                )
                                scores[j, off + slot] += dot
                # one online-softmax rescale per group of pages
                for j in range(rows):
                    row_scores = scores.ctypes.data + j * scores.strides[0] + g_first * 4
                    new_best = float_max(row_scores, g_last - g_first, best[j])
                    alpha = np.exp(best[j] - new_best)
                    total[j] *= alpha
                    for d in range(head_dim):
                        acc[j, d] *= alpha
                    # exp(score - max) in place, as vector arithmetic (kernels/quant/
                    # fastexp.py's: numba's np.exp calls libm per element), and their sum
                    total[j] += shifted_exps(row_scores, g_last - g_first, new_best)
                    best[j] = new_best
                for logical in range(g0, g1):
                    page, off, first, last = _page_slots(
                        tables[b], logical, g0, page_size, lo, context
                    )
                    v_at = vd.ctypes.data + page * vd.strides[0] + h0 * vd.strides[2]
                    if vbits == 0 or vbits == 16:
                        # unquantized values head by head, the page's slots in one call per
                        # four query heads (their accumulators in registers)
                        for hh in range(heads_per_task):
                            v_row = v_at + first * v_rows + hh * v_head
                            _weigh_values(acc, scores, hh * group, group, off + first,
                                          last - first, v_row, v_rows, vbits == 16)  # fmt: skip
                    else:
                        for slot in range(first, last):
                            for hh in range(heads_per_task):
                                h = h0 + hh
                                _load_row(
                                    vd, vc, vs, vz, vasym, half_table, vbits, page, slot, h, row
                                )
                                for g in range(group):
                                    w = scores[hh * group + g, off + slot]
                                    for d in range(head_dim):
                                        acc[hh * group + g, d] += w * row[d]
            for j in range(rows):
                for d in range(head_dim):
                    out[b, h0 * group + j, d] = acc[j, d] / total[j]

    _NO_DATA = np.zeros((1, 1, 1, 1), dtype=np.float32)
    _NO_CODES = np.zeros((1, 1, 1, 1, 1), dtype=np.uint8)
    _NO_SCALES = np.zeros((1, 1, 1, 1), dtype=np.uint16)
    _NO_QUERY_TERMS = np.zeros((1, 1, 1), dtype=np.float32)
    _NO_TABLE = np.zeros((1, 1), dtype=np.float32)
    _HALF_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _numba_store(fmt: KVFormat, store: dict[str, torch.Tensor]):
    """(data, codes, scales, zeros, asymmetric, bits) numpy views of a store for the kernel:
    ``bits`` 0 for float32 pages, 16 for fp16 ones (``data`` then their bytes as float32)."""
    if fmt.bits is None:
        if fmt.dtype == torch.float16:
            data = store["data"].view(torch.float32).numpy()
            return data, _NO_CODES, _NO_SCALES, _NO_SCALES, False, 16
        return store["data"].numpy(), _NO_CODES, _NO_SCALES, _NO_SCALES, False, 0
    # the words' bytes: code i of a group is bits [i*b, (i+1)*b) of its little-endian bytes
    codes = store["codes"].numpy().view(np.uint8)
    scales = store["scales"].view(torch.int16).numpy().view(np.uint16)
    if fmt.asymmetric:
        zeros = store["zeros"].view(torch.int16).numpy().view(np.uint16)
        return _NO_DATA, codes, scales, zeros, True, fmt.bits
    return _NO_DATA, codes, scales, _NO_SCALES, False, fmt.bits


# whether the numba kernels (this decode kernel, kernels.rope's store) read and write fp16
# pages: they widen and round halves with F16C's instructions
CPU_HALF_PAGES = HAS_NUMBA and _LITTLE_ENDIAN and HAS_F16C


def numba_supported(q: torch.Tensor, fmt_k: KVFormat, fmt_v: KVFormat) -> bool:
    """Whether :func:`paged_decode_numba` handles this call (CPU; fp32, fp16 where the CPU
    converts halves (F16C), or quantized pages)."""
    return (
        HAS_NUMBA
        and _LITTLE_ENDIAN
        and q.device.type == "cpu"
        and all(
            f.bits is not None
            or f.dtype == torch.float32
            or (f.dtype == torch.float16 and CPU_HALF_PAGES)
            for f in (fmt_k, fmt_v)
        )
    )


def paged_decode_numba(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode step (every ``q_lens[b] == 1``) by a numba kernel that reads K/V pages in place.

    One task per sequence (all its KV heads) when the batch fills the threads, else per
    (sequence, KV head): scores of the query heads sharing a KV head over a few pages
    at a time (``_SPAN_SLOTS`` slots, or one longer page), one online-softmax rescale per
    such group, quantized rows decoded in the rotated domain on the fly.  CPU tensors
    with fp32, fp16 or quantized pages (see :func:`numba_supported`).
    """
    _check_call(q, kv, block_tables, seq_lens, q_lens, decode_path="paged_decode_numba")
    if not numba_supported(q, kv.fmt_k, kv.fmt_v):
        raise ValueError(
            "paged_decode_numba needs numba, CPU tensors and fp32, fp16 or quantized pages"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError("sliding_window must be at least 1")
    return decode_numba_unchecked(
        q, kv,
        block_tables.to(torch.int64).contiguous().numpy(),
        seq_lens.to(torch.int64).contiguous().numpy(),
        scale, sliding_window,
    )  # fmt: skip


def _heads_per_task(batch: int, kv_heads: int) -> int:
    """KV heads one kernel task covers: all of a sequence's when the batch alone keeps
    every thread busy (a sequence's K/V rows are then read front to back: 16 x 160 fp32,
    SmolLM2, 30 layers with cold caches: 11.8 ms against 16.8 ms one head per task),
    else one, so that a single sequence still spreads over the threads."""
    return kv_heads if batch >= 2 * numba.get_num_threads() else 1


def numba_stores(kv: LayerKV) -> tuple:
    """``kv``'s K then V store as :func:`decode_numba_unchecked` reads them (numpy views,
    twelve arguments), for callers that keep them across steps: making them takes about
    1.5 us, the kernel on a short context (SmolLM2's shapes, 40 tokens) about ten."""
    return (*_numba_store(kv.fmt_k, kv.k), *_numba_store(kv.fmt_v, kv.v))


def decode_numba_unchecked(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    sliding_window: int | None = None,
    stores: tuple | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_numba` without its argument checks, on int64 numpy block tables
    and lengths: for callers that validated one step's batch once and run it through
    every layer (the checks cost more than the kernel on short contexts). ``stores``:
    ``numba_stores(kv)``, made once by the caller."""
    k_offset = kv.k_offset
    key_terms = None
    if k_offset is not None:
        key_terms = (
            (k_offset.query_terms(q) * scale).contiguous().numpy(),
            k_offset.table.float().contiguous().numpy(),
        )
    qf = kv.query_for_pages(q)  # scaled in the kernel
    out = decode_numba_arrays(
        qf.numpy(), kv, block_tables, seq_lens, scale, sliding_window, stores, key_terms
    )
    return kv.output_from_pages(torch.from_numpy(out), q.dtype)


def decode_numba_arrays(
    q: np.ndarray,
    kv: LayerKV,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    sliding_window: int | None = None,
    stores: tuple | None = None,
    key_terms: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """The kernel of :func:`decode_numba_unchecked` on float32 numpy queries ``[B, heads,
    head_dim]`` already in the pages' domain, its output left in that domain; with
    ``key_terms`` (the key offset's scaled query terms and table), the offset added.
    On float32 pages (no rotation, no offset) that is the whole of it, with no torch op:
    each costs about a microsecond of dispatch, the kernel on SmolLM2's shapes and a
    40-token context about ten."""
    kd, kc, ks, kz, kasym, kbits, vd, vc, vs, vz, vasym, vbits = (
        numba_stores(kv) if stores is None else stores
    )
    kv_heads = kv.kv_heads
    zq, offset_table = (_NO_QUERY_TERMS, _NO_TABLE) if key_terms is None else key_terms
    out = np.empty(q.shape, dtype=np.float32)
    _decode_kernel(
        q,
        np.float32(scale),
        block_tables,
        seq_lens,
        sliding_window or 0,
        q.shape[1] // kv_heads,
        kv.page_size,
        kd, kc, ks, kz, kasym, kbits, vd, vc, vs, vz, vasym, vbits,
        zq, offset_table, key_terms is not None,
        _HALF_TABLE,
        _heads_per_task(q.shape[0], kv_heads),
        out,
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged attention by the fastest path that handles this call.

    CUDA tensors: the Triton kernel (the reference when triton is missing).  CPU: steps
    where every sequence decodes one token go to the numba kernel (when numba is installed
    and the pages are fp32, fp16 or quantized) or else :func:`paged_decode`; anything with a
    prefill chunk goes to the SDPA reference.
    """
    args = (q, kv, block_tables, seq_lens, q_lens, scale, sliding_window)
    if q.is_cuda:
        try:
            from kernels.triton_paged_attention import triton_paged_attention
        except ImportError:  # no triton: the reference runs on CUDA tensors too
            return paged_attention_reference(*args)
        return triton_paged_attention(*args)
    if q.shape[0] == q_lens.shape[0] and bool((q_lens == 1).all()):
        if numba_supported(q, kv.fmt_k, kv.fmt_v):
            return paged_decode_numba(*args)
        return paged_decode(*args)
    return paged_attention_reference(*args)


def warm_up() -> bool:
    """Compile the numba decode kernel now (about 5-10 s, once per install: numba caches
    the machine code beside this file), so that the first reply does not wait for it.
    One specialisation serves every cache format. Returns False without numba."""
    if not HAS_NUMBA:
        return False
    fmt = KVFormat()
    store = {"data": torch.zeros(1, 16, 1, 32)}
    q = torch.zeros(1, 1, 32)
    tables, lens = np.zeros((1, 1), dtype=np.int64), np.ones(1, dtype=np.int64)
    decode_numba_unchecked(q, LayerKV(store, store, fmt, fmt), tables, lens, 1.0)
    return True
