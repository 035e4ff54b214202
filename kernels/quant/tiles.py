"""Q4_K and Q6_K weights repacked at load into tiles of 16 rows, and the one kernel per
type that multiplies them at every batch size (AVX-512 VNNI).

Why: :func:`~kernels.quant.superblock.kblock_pass` decodes one token at 36 cycles a row
and super-block on a Zen 4 core (two int8 levels of activations, each a ``vpmaddubsw``
and a ``vpdpwssd`` per 64 elements, the scales picked per pair, a float step per row and
block): 14 GB/s of weights a core, so two cores stop at 28 of the 34 GB/s the machine
reads. The lane kernel (:mod:`kernels.quant.lanes`) spends a fifth of that per
multiply-add, but transposes 16 rows' unpacked blocks on every call, which pays only
over many tokens (at 16 tokens it is no faster than the decode kernel), and its bits
are not the decode kernel's, so a decode step cannot take it.

Here the transposition is done once, at load (:func:`repack_parts`): a tile holds 16
rows' super-block ``b`` as one record of :data:`RECORD` bytes, the rows' code bytes
interleaved four at a time, so that one 64-byte load is 16 rows x 8 codes (their low
nibbles 4 elements of one sub-block, their high nibbles 4 of the next), the sub-block
scales and mins in 6 bits as in the file, their low four bits a byte per row and scale,
their top two bits a dword per row: 2,304 bytes, the file's (as bytes they cost 2.8%
more: 36 MB at the 3B shape, and as much more to read at every decode step; unpacked
once a run of two sub-blocks, a few instructions against its 64 ``vpdpbusd`` a token
and level). Then per
load: one ``and`` and one shift give the codes, and per token ``vpdpbusd`` of them with
the token's 4 int8 activations broadcast, for each of its two levels: 64 multiply-adds an
instruction, no shuffle. Q4_K reads the activations' coarse levels (the second at 1/16
of the first's scale), so its codes times 16 meet the first level and its codes the
second in one accumulator (from 4 tokens a call on), each sub-block's
``16 * level_0 + level_1`` exact in integers, then times its scale in float32. Q6_K's
records (:data:`RECORD6`) hold per sub-block two vectors of low nibbles and one of the
two high bits: per 16 elements three loads and a few masks give four code vectors, its
zero point (32) taken off in integers with the token's sums. Measured (before the coarse
levels and 8-token calls), one thread, 8192 x 2048, G multiply-adds a second at 1 / 4 /
16 / 128 tokens: Q4_K 47 / 90 / 90 / 88 (the decode kernel 25 / 36 / 54, the lane
kernel 82 at 128), Q6_K 34 / 77 / 80 (decode 18 / - / 43); after them Q4_K at 8 / 16
tokens 103-110 (docs/PERFORMANCE.md, "coarse levels").

Every token's arithmetic is the same sequence whatever the other tokens (tiles of 8, 4,
2 or 1 tokens), so a decode step, a batch of any size and a prompt give a row the same
bits: one kernel serves them all.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kernels.quant import tiles32
from kernels.quant.amx import AMX_TOKENS, SCRATCH, amx_ready, tile_dot_amx
from kernels.quant.blocks import INLINE, JIT
from kernels.quant.simd import (
    HOST_ISA,
    I8,
    I32,
    I64,
    _fma,
    _literal,
    _vec,
    stream_ahead,
)
from kernels.quant.superblock import KBLOCK_CODES, KBLOCK_KINDS, _load
from kernels.quant.tile_layout import (
    _D,
    _D6,
    _DMIN,
    _LOW,
    _QH6,
    _QL6,
    _QS,
    _SC6,
    _TOP,
    Q4_K_BLOCK,
    Q6_K_BLOCK,
    RECORD,
    RECORD6,
    RECORDS,
    V16,
    _bytes16,
    _const,
    _Frame,
    _halves,
    q4_k_block_end,
    q4_k_nibbles,
    q4_k_nibbles16,
    q4_k_run,
    q4_k_scales,
    q6_k_codes,
    q6_k_header,
    q6_k_token_end,
)
from kernels.quant.tiles32 import call_out, call_tokens, tile_out

__all__ = [
    "RECORD",
    "TILES_ARITHMETIC",
    "TILES_FORMAT",
    "TILE_ROWS",
    "TOKEN_TILE",
    "repack_parts",
    "tile_rows",
    "tiles_nbytes",
    "tiles_supported",
]

TILE_ROWS = 16  # weight rows per tile: one int32 lane each of a 512-bit vector
# tokens whose accumulators stay in registers: Q4_K per token two nibbles' int32 sums
# (both levels in one) and its float sum, Q6_K two levels' sums and its float (or
# integer) sums; 8 tokens' reuse of each unpacked code vector against 4: Q4_K's kernel
# 1.1x, Q6_K's with float steps 1.08x (one thread, 8 and 16 tokens)
TOKEN_TILE = 8
# Q6_K's tile kernel with the scales applied in integers (its own kind code beside
# KBLOCK_CODES' 0, 1: tile_dot), taken for every Q6_K product where AMX serves the tiles,
# so that a row has the same bits whichever of the two kernels takes its token
Q6_K_INT = 2
# Q6_K's tile kernel with the float steps and its zero-point sums negated (``bs``, kind
# code 3): the same integers, one instruction less per token and sub-block from two
# tokens a call on; :func:`tile_rows` takes it for two tokens and more, kind 1 for one
Q6_K_START = 3
Q6_K_INTEGER = amx_ready()
# names this layout: tiles kept on disk are mapped only under the same
# (engine/model/tile_cache.py). TILES_ARITHMETIC names the bits the tiles compute: K/V
# pages kept on disk are reused only under the same (the fingerprint, engine/model/
# loader.py), so a new layout that computes other bits names a new arithmetic too.
# tiles2: llama's q/k rows in the model's order (linear._row_orders), so a tile file
# kept before (their rows in the file's order) is not mapped, nor carried into the next
# file's index, where its stale q/k tiles would be read in at every load
# tiles3: the blocks of 32 in tiles too (kernels/quant/tiles32.py), whose products
# round otherwise
# tiles4: a Q4_K record 2,304 bytes, its scales and mins in 6 bits as in the file (they
# were a byte each: 2.8% over the file's bytes); the same integers, so tiles3's bits
TILES_FORMAT = "tiles4"
TILES_ARITHMETIC = "tiles3"


def tiles_supported(kind_name: str) -> bool:
    """Whether this CPU multiplies ``kind_name`` weights as tiles (AVX-512 VNNI; Q4_K,
    Q6_K; and the blocks of 32 in tiles of their own, :mod:`kernels.quant.tiles32`)."""
    return HOST_ISA == "avx512vnni" and (kind_name in KBLOCK_CODES or kind_name in tiles32.CODES)


@numba.njit(**JIT)
def _repack(src, n, row_bytes, dst, first, last):
    """Q4_K rows (``n`` of ``row_bytes``, flat uint8 ``src``) into tiles ``first`` to
    ``last`` (flat uint8 ``dst``: tiles of nblk records); rows past ``n`` left as they
    are. Without the GIL: :func:`repack_parts` runs it on threads of its own (numba's
    thread pool, started by a parallel function, costs 40 MB resident at once)."""
    nblk = row_bytes // Q4_K_BLOCK
    s32 = src.view(np.uint32)
    d32 = dst.view(np.uint32)
    d16 = dst.view(np.uint16)
    s16 = src.view(np.uint16)
    for t in range(first, last):
        rows = min(TILE_ROWS, n - t * TILE_ROWS)
        base = t * TILE_ROWS * row_bytes
        for b in range(nblk):
            rec = (t * nblk + b) * RECORD
            blk0 = base + b * Q4_K_BLOCK
            for r in range(rows):
                blk = blk0 + r * row_bytes
                d16[(rec + _D) // 2 + r] = s16[blk // 2]
                d16[(rec + _DMIN) // 2 + r] = s16[blk // 2 + 1]
                q = blk + 4
                bits = 0  # the top two bits of each scale and min
                for j in range(4):
                    lo, hi = np.int64(src[q + j]), np.int64(src[q + j + 4])
                    top = np.int64(src[q + j + 8])
                    # sub-blocks j and j + 4 (the file's packing: llama.cpp's get_scale_min_k4)
                    sc, mn = lo & 63, hi & 63
                    sc4, mn4 = (top & 0xF) | ((lo >> 6) << 4), (top >> 4) | ((hi >> 6) << 4)
                    dst[rec + _LOW + TILE_ROWS * j + r] = (sc & 0xF) | ((mn & 0xF) << 4)
                    dst[rec + _LOW + TILE_ROWS * (j + 4) + r] = (sc4 & 0xF) | ((mn4 & 0xF) << 4)
                    bits |= ((sc >> 4) << (2 * j)) | ((mn >> 4) << (16 + 2 * j))
                    bits |= ((sc4 >> 4) << (2 * j + 8)) | ((mn4 >> 4) << (24 + 2 * j))
                d32[(rec + _TOP) // 4 + r] = bits
            # the code bytes four at a time, written in order (16 rows' dwords a line)
            at = (rec + _QS) // 4
            qs = (blk0 + 16) // 4
            step = row_bytes // 4
            for c in range(32):
                for r in range(rows):
                    d32[at + 16 * c + r] = s32[qs + r * step + c]


@numba.njit(**JIT)
def _repack6(src, n, row_bytes, dst, first, last):
    """:func:`_repack` for Q6_K (:data:`RECORD6`)."""
    nblk = row_bytes // Q6_K_BLOCK
    d16 = dst.view(np.uint16)
    s16 = src.view(np.uint16)
    block = np.zeros(212, np.uint8)  # one row's block, 4-byte aligned (210 is not)
    q32 = block.view(np.uint32)  # ql: words 0-31, qh: 32-47
    d32 = dst.view(np.uint32)
    nib, two = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    for t in range(first, last):
        rows = min(TILE_ROWS, n - t * TILE_ROWS)
        for b in range(nblk):
            rec = (t * nblk + b) * RECORD6
            for r in range(rows):
                blk = (t * TILE_ROWS + r) * row_bytes + b * Q6_K_BLOCK
                block[:Q6_K_BLOCK] = src[blk : blk + Q6_K_BLOCK]
                d16[(rec + _D6) // 2 + r] = s16[(blk + 208) // 2]
                for sb in range(16):
                    dst[rec + _SC6 + 16 * sb + r] = block[192 + sb]
                    # vector 4 sb + u (elements 16 sb + 4 u + i) of half h: the low nibbles
                    # of ql word 16 h + 4 (sb % 4) + u shifted by 4 ((sb % 8) // 4), the
                    # two high bits of qh word 8 h + 4 (sb % 2) + u by 2 ((sb % 8) // 2)
                    h, s8 = sb // 8, sb % 8
                    lo_w, lo_s = 16 * h + 4 * (sb % 4), np.uint32(4 * (s8 // 4))
                    hi_w, hi_s = 32 + 8 * h + 4 * (sb % 2), np.uint32(2 * (s8 // 2))
                    low0 = (q32[lo_w] >> lo_s) & nib
                    low1 = (q32[lo_w + 1] >> lo_s) & nib
                    low2 = (q32[lo_w + 2] >> lo_s) & nib
                    low3 = (q32[lo_w + 3] >> lo_s) & nib
                    at = (rec + _QL6 + 128 * sb) // 4 + r
                    d32[at] = low0 | (low1 << np.uint32(4))
                    d32[at + 16] = low2 | (low3 << np.uint32(4))
                    high = (q32[hi_w] >> hi_s) & two
                    for u in range(1, 4):
                        high |= ((q32[hi_w + u] >> hi_s) & two) << np.uint32(2 * u)
                    d32[(rec + _QH6 + 64 * sb) // 4 + r] = high


def _aligned(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 array of ``shape``, page-aligned: anonymous memory of its own, its
    pages faulted in by the threads that repack into it. (Through numpy's allocator,
    which asks for huge pages, or with ``MADV_HUGEPAGE``: the kernel compacted memory
    at each fault when the page cache held the file, 6.5 s for the 4.8 GB of the
    Qwen2-7B shape's tiles; in plain pages, by two threads, about 1. Once written they
    are left to khugepaged: :func:`_huge_pages_later`.)"""
    size = int(np.prod(shape))
    if hasattr(mmap, "MAP_ANONYMOUS"):
        buf = mmap.mmap(-1, max(1, size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows: anonymous memory backed by the paging file, zeroed too
        buf = mmap.mmap(-1, max(1, size))
    return np.frombuffer(buf, np.uint8, count=size).reshape(shape)


# bytes of a weight repacked between two calls of repack_parts' ``release``
REPACK_CHUNK = 16 << 20
# threads repacking one weight (from 4 MB each)
_REPACK_THREADS = max(1, min(4, os.cpu_count() or 1))


def _tiles_of(rows: int) -> int:
    return -(-rows // TILE_ROWS)


def tiles_nbytes(rows: int, k: int, kind_name: str = "Q4_K") -> int:
    """Bytes of the tiles of a weight ``[rows, k]`` of ``kind_name``."""
    if kind_name in tiles32.CODES:
        return _tiles_of(rows) * tiles32.tile_bytes(kind_name, k // 32)
    return _tiles_of(rows) * (k // 256) * RECORDS[KBLOCK_CODES[kind_name]]


def repack_parts(
    parts: list[np.ndarray],
    kind_name: str = "Q4_K",
    release: Callable[[list[np.ndarray]], None] | None = None,
    orders: list[np.ndarray | None] | None = None,
) -> np.ndarray:
    """Weights of ``kind_name`` (uint8 ``[N_i, row bytes]`` each, the same width) -> one
    uint8 ``[tiles, nblk, record]`` array of their tiles in order (64-byte aligned), each
    part from a new tile (a short last tile padded with zero rows). ``release``, if
    given, is called with the rows of each :data:`REPACK_CHUNK` bytes once repacked (a
    mapped file's pages can then leave the resident set: a large weight's file bytes
    and its tiles are never resident together). ``orders`` (per part, None or int64
    ``[N_i]``): the part's rows taken in that order (llama's q/k rows, which the file
    holds permuted per head, tiled in the order the model reads them: no permutation
    of the outputs after each product; the part is then copied once in that order)."""
    if kind_name in tiles32.CODES:  # kernels/quant/tiles32.py: a tile the file's bytes
        layout = tiles32.LAYOUTS[tiles32.CODES[kind_name]]
        block, record, repack = layout.block, layout.tile_block, tiles32.repack32(kind_name)
    else:
        code = KBLOCK_CODES[kind_name]
        block, record = KBLOCK_KINDS[code][1], RECORDS[code]
        repack = _repack if code == 0 else _repack6
    row_bytes = parts[0].shape[1]
    if row_bytes % block or any(p.shape[1] != row_bytes for p in parts):
        raise ValueError(
            f"{kind_name} rows of {[p.shape for p in parts]} bytes: not whole super-blocks"
        )
    nblk = row_bytes // block
    counts = [_tiles_of(p.shape[0]) for p in parts]
    out = _aligned((sum(counts), nblk, record))  # zeros: a short last tile's padding
    step = max(1, REPACK_CHUNK // (TILE_ROWS * row_bytes))  # tiles a chunk
    first = 0
    with ThreadPoolExecutor(_REPACK_THREADS) as pool:
        for i, (p, count) in enumerate(zip(parts, counts)):
            dst = out[first : first + count].reshape(-1)
            order = None if orders is None else orders[i]
            src = np.ascontiguousarray(p if order is None else p[order]).reshape(-1)
            for t0 in range(0, count, step):
                t1 = min(count, t0 + step)
                threads = min(_REPACK_THREADS, max(1, (t1 - t0) * TILE_ROWS * row_bytes >> 22))
                bounds = [t0 + (t1 - t0) * i // threads for i in range(threads + 1)]
                job = functools.partial(repack, src, p.shape[0], row_bytes, dst)
                list(pool.map(job, bounds[:-1], bounds[1:]))
                if release is not None:
                    release([p[t0 * TILE_ROWS : t1 * TILE_ROWS]])
            if release is not None:
                release([p])  # the pages across chunk ends
            first += count
    _huge_pages_later(out)
    return out


def _huge_pages_later(a: np.ndarray) -> None:
    """Let the kernel's khugepaged move ``a`` (:func:`_aligned`, every page written) into
    huge pages in the background, a few MB a second: a weight read at batch 1 is about
    1.16x faster from huge pages. (Not at the faults: see :func:`_aligned`.)"""
    buf = a.base
    while isinstance(buf, np.ndarray):
        buf = buf.base
    if isinstance(buf, memoryview):
        buf = buf.obj
    if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)


def _q4_k_block(f: _Frame, blk, r_a):
    """One Q4_K super-block of the tile at ``r_a`` into each token's accumulator."""
    b, nt = f.builder, f.nt
    v16i = _vec(I32, 16)
    # the lines STREAM_AHEAD bytes on, the header's here and the codes' as the loop
    # reaches them, at every token count: one token without them read 17-21 GB/s of
    # Q4_K where Q6_K read 24 (cold matrices, a decode step), and with them 24; decode
    # at the 1B / 7B shapes 1.17-1.19x (Xeon VM, AMX on and off, 2 threads)
    stream_ahead(b, r_a, _QS)
    # [nibble][level][t]: from 4 tokens on both levels in one sum, 16 dot_0 + dot_1
    # (their codes times 16 and times 1); below, each level in its own (the two
    # instructions' latency in one chain cost a 1-token call a fifth of its speed)
    fused = nt >= 4
    dots = [[f.slots(v16i)] * 2 if fused else [f.slots(v16i) for _ in range(2)] for _ in range(2)]
    for t in range(nt):
        b.store(ir.Constant(V16, None), f.part[t])
    with cgutils.for_range(b, I64(4)) as runs:  # runs of two sub-blocks: 2c, 2c + 1
        c = runs.index
        for h in range(2):
            for lvl in range(1 if fused else 2):
                for t in range(nt):
                    b.store(ir.Constant(v16i, None), dots[h][lvl][t])
        with cgutils.for_range(b, I64(8)) as groups:
            k = groups.index
            q_at = b.add(r_a, b.add(I64(_QS), b.mul(b.add(b.mul(c, I64(8)), k), I64(64))))
            stream_ahead(b, q_at, 64)
            q = _load(b, q_at, v16i, 64)
            # sub-block 2c + h's elements 4k .. 4k + 3: byte 64 (2c + h) + 4k of the
            # coarse levels' block (the second level 32 bytes on)
            e0 = b.add(b.mul(c, I64(128)), b.mul(k, I64(4)))
            codes = q4_k_nibbles(b, q)
            if fused:
                codes = tuple(zip(q4_k_nibbles16(b, q), codes))
            for h in range(2):
                f.dot(dots[h], codes[h], blk, at=b.add(e0, I64(64 * h)), block=512)
        scf = q4_k_scales(b, r_a, c)
        for t in range(nt):
            run = [b.load(dots[h][0][t]) for h in range(2)]
            if not fused:
                run = [b.add(b.shl(s, _const(4)), b.load(dots[h][1][t])) for h, s in enumerate(run)]
            b.store(q4_k_run(b, run, scf, f.part[t]), f.part[t])
    q4_k_block_end(f, blk, r_a)


def _q6_k_block(f: _Frame, blk, r_a, integer: bool, start: bool = False):
    """One Q6_K super-block of the tile at ``r_a`` into each token's accumulator, each
    sub-block's scale applied in float, or (``integer``) in integers (:func:`tile_dot`);
    ``start``: the float steps' zero-point sums come negated (:data:`Q6_K_START`)."""
    b, nt = f.builder, f.nt
    v16i = _vec(I32, 16)
    # the lines STREAM_AHEAD bytes on, asked for as the loop reaches them: the header's
    # here, each sub-block's codes in its turn (53 prefetches at once stalled the loads:
    # 27 against 15 ns per two rows and blocks, one token)
    stream_ahead(b, r_a, _QL6)
    dots = [f.slots(v16i) for _ in range(2)]  # [lvl][t]
    # Q6_K_START: the zero-point term (negated) is the second level's starting sum from 2
    # tokens a call on (an add after the sums at 1): a subtraction less per token and
    # sub-block, 3-8% at 2-16 tokens; at one token, as a kind of its own (the same code
    # compiled with these calls cost a lone token 4-9%), the sums subtracted as before
    start_at_sums = start and nt > 1
    sums = [f.slots(v16i) for _ in range(2)] if integer else None  # sum_s sc[s] * dots
    if not integer:
        for t in range(nt):
            b.store(ir.Constant(V16, None), f.part[t])
    with cgutils.for_range(b, I64(16)) as subs:
        sb = subs.index
        ql = b.add(r_a, b.add(I64(_QL6), b.mul(sb, I64(128))))
        qh_at = b.add(r_a, b.add(I64(_QH6), b.mul(sb, I64(64))))
        stream_ahead(b, ql, 128)
        stream_ahead(b, qh_at, 64)
        lo = _load(b, ql, v16i, 64)
        hi = _load(b, b.add(ql, I64(64)), v16i, 64)
        qh = _load(b, qh_at, v16i, 64)
        codes = q6_k_codes(b, lo, hi, qh)  # the vectors 4 sb + u
        sums_at = b.add(b.mul(blk, I64(64)), b.mul(sb, I64(4)))
        for lvl in range(2):
            for t in range(nt):
                if lvl and start_at_sums:  # the second level's sum starts from bs[s]
                    b.store(f.sum_at(t, sums_at), dots[lvl][t])
                else:
                    b.store(ir.Constant(v16i, None), dots[lvl][t])
        e0 = b.mul(sb, I64(16))
        for u, code in enumerate(codes):
            f.dot(dots, code, blk, at=b.add(e0, I64(4 * u)))
        sc_at = b.add(r_a, b.add(I64(_SC6), b.mul(sb, I64(16))))
        if integer:
            sc = _bytes16(b, sc_at, signed=True)
            for lvl in range(2):
                for t in range(nt):
                    total = b.add(b.load(sums[lvl][t]), b.mul(b.load(dots[lvl][t]), sc))
                    b.store(total, sums[lvl][t])
        else:
            scf = b.sitofp(_load(b, sc_at, _vec(I8, 16), 16), V16)
            for t in range(nt):
                v = b.add(b.shl(b.load(dots[0][t]), _const(8)), b.load(dots[1][t]))
                if not start:
                    v = b.sub(v, f.sum_at(t, sums_at))
                elif not start_at_sums:
                    v = b.add(v, f.sum_at(t, sums_at))
                b.store(_fma(b, b.sitofp(v, V16), scf, b.load(f.part[t])), f.part[t])
    if integer:
        head = q6_k_header(b, r_a)
        for t in range(nt):
            total = (b.load(sums[0][t]), b.load(sums[1][t]))
            b.store(q6_k_token_end(f, blk, t, total, b.load(f.acc[t]), head), f.acc[t])
        return
    d = _halves(b, b.add(r_a, I64(_D6)))
    for t in range(nt):
        a = _fma(b, b.load(f.part[t]), b.fmul(d, f.scale(blk, t)), b.load(f.acc[t]))
        b.store(a, f.acc[t])


def _tile_kernel(kind, ntok, record: int, block):
    """The signature and code of a tile kernel: ``block(frame, blk, record address)``
    for every super-block, then each token's 16 results stored."""
    nt = _literal(ntok, tuple(range(1, TOKEN_TILE + 1)))
    if nt is None:
        return None
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, i, u, i, u, i, u, kind, ntok)

    def codegen(context, builder, signature, args):
        f = _Frame(builder, nt, args)
        with cgutils.for_range(builder, f.nblk) as loop:
            blk = loop.index
            block(f, blk, builder.add(f.rec, builder.mul(blk, I64(record))))
        f.store_out()
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tile_dot(typingctx, rec, nblk, x, x_tok, x_lvl, xd, xd_tok, bs, bs_tok, out, kind, ntok):
    """``out`` (float32 ``[ntok, 16]``, 64-byte aligned) = one tile's 16 rows (``nblk``
    records at ``rec`` of ``kind``, a :data:`~kernels.quant.superblock.KBLOCK_CODES`
    value: :func:`repack_parts`) dotted with ``ntok`` tokens' two levels of
    int8 activations in super-blocks (natural order): token ``t``'s first level at
    ``x + t * x_tok``, its second at ``+ x_lvl``, the second level's float32 scale per
    block at ``xd + t * xd_tok`` (the first's / 256, Q4_K's / 16), its sums
    (:func:`tile_rows` picks them) at ``bs + t * bs_tok``. ``kind`` and ``ntok`` (1 to :data:`TOKEN_TILE`) are
    compile-time.

    Q4_K reads the activations as :meth:`~kernels.quant.activations.Q8KActivations.
    coarse_levels` (``x`` their rows, ``x_lvl`` 32: per 32 elements the first level then
    the second, at 1/16 of the first's scale; ``bs`` each level's sums per 32 as int16
    pairs): per block, token and sub-block ``s``, in integers (exact, per lane
    ``|D| <= 32 * 15 * 2,040 < 2^20``, so exact in float32 too)
    ``D = 16 * dot_0 + dot_1``, then ``part = fma(float(D), float(sc[s]), part)`` over
    the 8 sub-blocks in order from zero, ``acc = fma(part, d * xd, acc)``, and the
    offsets, per level ``L = sum_s min[s] * s[s]`` (exact),
    ``acc = fma(float(16 L_0 + L_1), -(dmin * xd), acc)``.
    With the levels 16 apart (not 256, as for Q6_K), AMX sums a sub-block's
    ``16 dot_0 + dot_1`` in one product (:mod:`kernels.quant.amx`); the activations
    then carry about 12 bits (a value within ``(1/32 + 1/512) / 127`` of its block's
    largest).

    Q6_K (:data:`RECORD6`; ``bs``: the paired sums per 16 times the codes' zero point,
    ``32 * (256 * s_0 + s_1)``, int32): per block, token and sub-block ``s``, in integers
    (exact): ``v = 256 * dot_0 + dot_1 - bs[s]`` (the codes less 32 times both levels:
    ``|v| <= 16 * 32 * 32,640 < 2^24``, so exact in float32 too), then
    ``part = fma(float(v), float(sc[s]), part)`` over the 16 sub-blocks in order from
    zero, and ``acc = fma(part, d * xd, acc)``. :data:`Q6_K_START` (``kind`` 3): the same
    with ``bs`` negated, ``dot_1``'s sum starting from it (from two tokens a call on).

    Q6_K with its scales in integers (``kind`` :data:`Q6_K_INT`, the same records; ``bs``:
    each level's sums per 16 as int16 pairs, :func:`_q6_k_sums`), where AMX serves Q6_K
    (:data:`Q6_K_INTEGER`): per block, token and level, in integers (exact, below 2^29):
    ``L = sum_s sc[s] * dot[s] - 32 * sum_s sc[s] * s[s]``, then
    ``part = fma(float(L_0), 256, float(L_1))`` and ``acc = fma(part, d * xd, acc)``: a
    block's scaled sums in integers, so that on AMX the scales fold into the B tiles and
    one C tile per level and byte plane sums the whole block (:mod:`kernels.quant.amx`:
    1.25-1.4x the float steps' kernel there, where this one takes 0.9x of the VNNI
    kernel's time with the float steps).

    Each: the same operations for a token whatever the others."""
    code = _literal(kind, (0, 1, Q6_K_INT, Q6_K_START))
    if code is None:
        return None
    block = (
        _q4_k_block,
        functools.partial(_q6_k_block, integer=False),
        functools.partial(_q6_k_block, integer=True),
        functools.partial(_q6_k_block, integer=False, start=True),
    )[code]
    return _tile_kernel(kind, ntok, RECORDS[min(code, 1)], block)


_Q4_K, _Q6_K = KBLOCK_CODES["Q4_K"], KBLOCK_CODES["Q6_K"]


@numba.njit(**INLINE)
def _tile_dot(kind, rec_at, nblk, x_at, xs, xl, xd_at, ds, bs_at, bss, tmp_at, nt):
    """:func:`tile_dot` over ``nt`` tokens (8, 4, 2 or 1), the literal picked at run
    time."""
    if nt == 8:
        tile_dot(rec_at, nblk, x_at, xs, xl, xd_at, ds, bs_at, bss, tmp_at, kind, 8)
    elif nt == 4:
        tile_dot(rec_at, nblk, x_at, xs, xl, xd_at, ds, bs_at, bss, tmp_at, kind, 4)
    elif nt == 2:
        tile_dot(rec_at, nblk, x_at, xs, xl, xd_at, ds, bs_at, bss, tmp_at, kind, 2)
    else:
        tile_dot(rec_at, nblk, x_at, xs, xl, xd_at, ds, bs_at, bss, tmp_at, kind, 1)


@numba.njit(**INLINE)
def _tile_rows(kind, tiles, n_rows, q, xl, xd, sums, out, tasks, amx):
    """``out[t, n]`` (float32, ``n < n_rows``; a view into a wider output is fine) =
    row ``n`` of ``tiles`` (:func:`repack_parts`; ``kind`` a ``KBLOCK_CODES`` value) dotted with
    token ``t``'s two levels of super-block activations: its first at ``q[t]``, its
    second ``xl`` bytes on, the second's scales ``xd[t]`` (:func:`tile_rows` says which
    arrays), tiles split in ``tasks`` ranges over numba's threads."""
    tokens = out.shape[0]
    n_tiles, nblk = tiles.shape[0], tiles.shape[1]
    tasks = max(1, min(n_tiles, tasks))
    per = (n_tiles + tasks - 1) // tasks
    xs, ds, bss = q.strides[0], xd.strides[0], sums.strides[0]
    x_at, xd_at, bs_at = q.ctypes.data, xd.ctypes.data, sums.ctypes.data
    for task in numba.prange(tasks):
        tmp_at, tmp = call_out(AMX_TOKENS)
        scratch = np.empty(SCRATCH + 64 if amx else 0, np.uint8)
        scratch_at = (scratch.ctypes.data + 63) & ~63
        for tile in range(task * per, min((task + 1) * per, n_tiles)):
            n0 = tile * TILE_ROWS
            valid = min(TILE_ROWS, n_rows - n0)
            rec_at = tiles[tile].ctypes.data
            j = 0
            while j < tokens:
                if amx and tokens - j >= AMX_TOKENS:
                    nt = AMX_TOKENS
                    tile_dot_amx(
                        rec_at, nblk, x_at + j * xs, xs, xl, xd_at + j * ds, ds,
                        bs_at + j * bss, bss, tmp_at, scratch_at, kind, amx,
                    )  # fmt: skip
                else:
                    nt = call_tokens(tokens - j, TOKEN_TILE)
                    _tile_dot(
                        kind, rec_at, nblk, x_at + j * xs, xs, xl, xd_at + j * ds,
                        ds, bs_at + j * bss, bss, tmp_at, nt,
                    )  # fmt: skip
                tile_out(out, tmp, j, nt, n0, valid)
                j += nt


@numba.njit(**JIT, parallel=True)
def _tile_rows_q4_k(tiles, n_rows, q, xl, xd, sums, out, tasks):
    _tile_rows(_Q4_K, tiles, n_rows, q, xl, xd, sums, out, tasks, False)


@numba.njit(**JIT, parallel=True)
def _tile_rows_q4_k_amx(tiles, n_rows, q, xl, xd, sums, out, tasks):
    _tile_rows(_Q4_K, tiles, n_rows, q, xl, xd, sums, out, tasks, True)


@numba.njit(**JIT, parallel=True)
def _tile_rows_q6_k(tiles, n_rows, q, xl, xd, sums, out, tasks):
    _tile_rows(_Q6_K, tiles, n_rows, q, xl, xd, sums, out, tasks, False)


@numba.njit(**JIT, parallel=True)
def _tile_rows_q6_k_start(tiles, n_rows, q, xl, xd, sums, out, tasks):
    _tile_rows(Q6_K_START, tiles, n_rows, q, xl, xd, sums, out, tasks, False)


@numba.njit(**JIT, parallel=True)
def _tile_rows_q6_k_int(tiles, n_rows, q, xl, xd, sums, out, tasks):
    _tile_rows(Q6_K_INT, tiles, n_rows, q, xl, xd, sums, out, tasks, False)


@numba.njit(**JIT, parallel=True)
def _tile_rows_q6_k_int_amx(tiles, n_rows, q, xl, xd, sums, out, tasks):
    _tile_rows(Q6_K_INT, tiles, n_rows, q, xl, xd, sums, out, tasks, True)


def tile_rows(
    kind: int,
    tiles,
    n_rows,
    act,
    out,
    tasks,
    amx: bool | None = None,
    integer: bool | None = None,
) -> None:
    """``out`` (float32 ``[T, n_rows]``) = the rows of ``tiles`` (``kind`` a
    ``KBLOCK_CODES`` value) times ``act``, two levels of super-block activations
    (:func:`~kernels.quant.activations.quantize_super_blocks` with ``levels=2``): Q4_K
    reads them as :meth:`~kernels.quant.activations.Q8KActivations.coarse_levels`, Q6_K
    as they are. Compiled per kind (as kquants.py does for the lane kernel: the kind a
    constant of each); both take 16 tokens at a time to AMX where
    :func:`~kernels.quant.amx.amx_ready` (which also asks for the tile state) unless told
    not to (``amx`` False), to the same bits. Q6_K's scales go in integers where
    :data:`Q6_K_INTEGER` (or ``integer``) says."""
    on_amx = amx is not False and out.shape[0] >= AMX_TOKENS and amx_ready()
    tokens = out.shape[0]
    if kind == _Q6_K:
        q, xl, xd = act.q, tokens * act.q.strides[0], act.d[tokens:]
        integer = Q6_K_INTEGER if integer is None else integer
        start = not integer and tokens > 1
        if not integer:
            fn = _tile_rows_q6_k_start if start else _tile_rows_q6_k
        else:
            fn = _tile_rows_q6_k_int_amx if on_amx else _tile_rows_q6_k_int
        fn(tiles, n_rows, q, xl, xd, _q6_k_sums(act, integer, start), out, tasks)
        return
    q, xd, sums = act.coarse_levels()
    fn = _tile_rows_q4_k_amx if on_amx else _tile_rows_q4_k
    fn(tiles, n_rows, q, 32, xd, sums, out, tasks)


def _q6_k_sums(act, integer: bool, negated: bool = False) -> np.ndarray:
    """The per-token integer sums Q6_K's tile kernel takes from two-level super-block
    activations: the paired sums per 16 times the codes' zero point 32 (``negated``: times
    -32, for :data:`Q6_K_START`), or, with its
    scales in integers (``integer``: :data:`Q6_K_INTEGER`), each level's sums per 16 as
    int16 pairs of sub-blocks (``|s| <= 16 * 127``), per block the first level's eight
    pairs then the second's (:func:`~kernels.quant.tile_layout.q6_k_token_end`). (Q4_K's
    come with its coarse levels.)"""
    if not integer:
        return act.pair16 * np.int32(-32 if negated else 32)
    tokens, k16 = act.pair16.shape
    lv = act.bsum16[: 2 * tokens].reshape(2, tokens, k16 // 16, 8, 2)
    pairs = (lv[..., 0] & np.int32(0xFFFF)) | (lv[..., 1] << np.int32(16))
    return np.ascontiguousarray(pairs.transpose(1, 2, 0, 3)).reshape(tokens, k16)
