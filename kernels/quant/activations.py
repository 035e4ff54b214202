"""Activations quantized once per matmul, in one of two formats.

* :class:`Q8Activations`: int8 per 32 elements (llama.cpp's Q8_0 block), read by the
  kernels of :mod:`kernels.quant.rows` (every type but Q4_K and Q6_K): their scales are
  applied per 4-element lane, so the fine block costs one broadcast per 64 elements and
  halves the activation rounding error.
* :class:`Q8KActivations`: int8 per 256 with integer sums per 16 and 32 (llama.cpp's
  Q8_K), read by the super-block kernels (:mod:`kernels.quant.superblock`): with one
  activation scale per super-block, the k-quants' integer sub-block scales let the whole
  block be summed in integers, one float step per 256 elements.

A layer input shared by several weights (q/k/v, gate/up) is quantized once per format it
is read in: the super-block format is made from the per-32 one's source on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numba
import numpy as np

from kernels.quant.blocks import INLINE, JIT
from kernels.quant.fastexp import exp_into
from kernels.quant.simd import quantize32, quantize256, residual32, residual256, sums16

ACT_BLOCK = 32
SUPER_BLOCK = 256
# From this many rows on, activations are quantized with the rows over numba's threads
# (1B shape, 2 threads: making them took 10% of a 512-token prefill on one thread)
PARALLEL_ROWS = 8
PARALLEL = {**JIT, "parallel": True}


def _by_rows(rows: int, serial, parallel):
    """Of a serial driver and its twin with the rows over numba's threads, the one for
    ``rows`` rows (the same values either way)."""
    return parallel if rows >= PARALLEL_ROWS else serial


@dataclass
class Q8KActivations:
    """``[B, K]`` activations in super-blocks (llama.cpp's Q8_K): int8 codes ``q`` with
    one float32 scale ``d`` per 256 elements, and the integer sums of the codes per 16 and
    per 32 (``bsum16`` / ``bsum32``, int32), which the k-quant kernels multiply by the
    weights' integer offsets. The k-quants' sub-block scales are integers, so with one
    activation scale per super-block the whole block is summed in integers
    (:mod:`kernels.quant.superblock`)."""

    q: np.ndarray  # int8 [B, K]
    d: np.ndarray  # float32 [B, K // 256]
    bsum16: np.ndarray  # int32 [B, K // 16]
    bsum32: np.ndarray  # int32 [B, K // 32]
    # Two levels only: int32 [B, K // 16], 256 x the first level's sums plus the
    # second's, per token (the second level's scale is the first's / 256, so a kernel
    # sums a token's two levels in one float step: superblock.kblock_dot, paired)
    pair16: np.ndarray | None = None
    wide: dict = field(default_factory=dict, repr=False)  # :meth:`widened`, by order
    coarse: tuple | None = field(default=None, repr=False)  # :meth:`coarse_levels`
    # the float activations these came from, when made by prepared_activations
    source: np.ndarray | None = field(default=None, repr=False)
    # q_k4 and pair32 are made on first use: the tile kernels read neither, and writing
    # both took half of quantizing 16 tokens of 2,048

    @functools.cached_property
    def q_k4(self) -> np.ndarray:
        """int8 ``[B, K]``: ``q`` in Q4_K's order, the second and third 32 of every 128
        swapped. A Q4_K super-block's 64 code bytes hold elements 0-31 (low nibbles) and
        32-63 (high) of each 64: one vector of unpacked nibbles meets elements 0-31 and
        64-95, which in this order are 64 contiguous codes (one load per 64 instead of two
        and a shuffle). Made once."""
        rows, k = self.q.shape
        q_k4 = padded_rows(rows, k, np.int8)
        _by_rows(rows, _q4_k_order, _q4_k_order_parallel)(self.q, q_k4)
        return q_k4

    @functools.cached_property
    def pair32(self) -> np.ndarray | None:
        """Two levels only: int32 ``[B, K // 32]``, :attr:`pair16`'s sums per 32. Made
        once."""
        if self.pair16 is None:
            return None
        b = self.pair16.shape[0]
        return np.int32(256) * self.bsum32[:b] + self.bsum32[b : 2 * b]

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def kernel_args(
        self, order: str, sub_block: int, paired: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, scales, integer sums) as a super-block kernel reads them: the codes in
        ``order`` (``"natural"`` or ``"q4_k"``), the sums per ``sub_block`` (16 or 32),
        per row, or (``paired``) per token with both levels (:attr:`pair16`)."""
        codes = self.q_k4 if order == "q4_k" else self.q
        if paired:
            if self.pair16 is None:
                raise ValueError("paired sums need two levels of activations")
            return codes, self.d, self.pair16 if sub_block == 16 else self.pair32
        return codes, self.d, self.bsum16 if sub_block == 16 else self.bsum32

    def widened(self, order: str) -> np.ndarray:
        """int16 ``[B, K]`` of a two-level ``[2B, K]``: each token's two levels as one
        integer, ``256 * q_0 + q_1`` (within +-32,640), in ``order`` (``"q4_k"`` or
        ``"natural"``, as :meth:`kernel_args`), each 64 as the elements ``4j, 4j + 1``
        then ``4j + 2, 4j + 3`` (``j < 16``): what
        :func:`~kernels.quant.superblock.kblock_rows` multiplies at ``levels``
        :data:`~kernels.quant.superblock.WIDE`. Made once per order."""
        if self.pair16 is None:
            raise ValueError("int16 activations need two levels")
        if order not in self.wide:
            b = self.q.shape[0] // 2
            wide = padded_rows(b, self.q.shape[1], np.int16)
            _by_rows(b, _widen, _widen_parallel)(self.q_k4 if order == "q4_k" else self.q, wide)
            self.wide[order] = wide
        return self.wide[order]

    def coarse_levels(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A two-level ``[2B, K]``'s second level at 1/16 of the first's scale instead of
        1/256 (``(q_1 + 8) >> 4``: within 1/32 of the first level's scale of the 1/256
        level, itself within 1/512 of the value), as the Q4_K tile kernels read it: (``q``: int8 ``[B, 2K]``, per 32
        elements the first level's codes then the second's; ``xd``: float32
        ``[B, K / 256]``, the second level's scale; ``sums``: int32 ``[B, K / 32]``, each
        level's sums per 32 as int16 pairs of sub-blocks, per block the first level's four
        pairs then the second's). With the levels 16 apart, the weights' codes times 16
        and times 1 multiply both in one 64-element product (:mod:`kernels.quant.amx`).
        Made once."""
        if self.pair16 is None:
            raise ValueError("coarse levels need two levels")
        if self.coarse is None:
            b, k = self.q.shape[0] // 2, self.q.shape[1]
            q = padded_rows(b, 2 * k, np.int8)
            sums = np.empty((b, k // 32), np.int32)
            _by_rows(b, _coarse, _coarse_parallel)(self.q, self.bsum32, q, sums)
            self.coarse = (q, self.d[:b] / np.float32(16.0), sums)
        return self.coarse

    def dequantize(self) -> np.ndarray:
        """float32 ``[B, K]``: exactly the values the kernels multiply by."""
        b, k = self.q.shape
        return (self.q.reshape(b, -1, SUPER_BLOCK) * self.d[:, :, None]).reshape(b, k)


@numba.njit(**INLINE)
def _quantize_k_row(x, b, levels, q, d, bsum16, bsum32, pair16):
    """Row ``b`` of ``x`` to row ``b`` (and, with ``levels == 2``, what its rounding left to
    row ``B + b``, at 1/256 of the first level's scale) of the super-block format; with
    two levels, the paired sums per 16 of row ``b`` too. Each super-block in vector
    intrinsics (its codes, their rest, the sums per 16): 16 rows of 8,192, two levels, one
    thread, 113 us with the rest and the sums in scalar loops, 42 in these."""
    batch, k = x.shape
    row = b + batch
    x_at, q_at, s_at = x[b].ctypes.data, q[b].ctypes.data, bsum16[b].ctypes.data
    d_at = d[b].ctypes.data
    # the second level's rows (B + b) exist only with two levels
    r_at = q[row].ctypes.data if levels == 2 else 0
    rs_at = bsum16[row].ctypes.data if levels == 2 else 0
    for blk in range(k // SUPER_BLOCK):
        e0 = SUPER_BLOCK * blk
        quantize256(x_at + 4 * e0, q_at + e0, d_at + 4 * blk)
        sums16(q_at + e0, s_at + 4 * (e0 // 16))
        if levels == 2:
            # |rest| <= scale / 2, so codes at scale / 256 reach 128 at most: 127
            scale = d[b, blk]
            inv = np.float32(256.0) / scale if scale > 0 else np.float32(0.0)
            residual256(x_at + 4 * e0, q_at + e0, scale, inv, r_at + e0)
            d[row, blk] = scale / np.float32(256.0)
            sums16(r_at + e0, rs_at + 4 * (e0 // 16))
    for level in range(levels):
        r = b + level * batch
        for s in range(k // 32):
            bsum32[r, s] = bsum16[r, 2 * s] + bsum16[r, 2 * s + 1]
    if levels == 2:
        for s in range(k // 16):
            pair16[b, s] = 256 * bsum16[b, s] + bsum16[row, s]


@numba.njit(**JIT)
def _quantize_k(x, levels, q, d, bsum16, bsum32, pair16):
    """:func:`_quantize_k_row` for every row."""
    for b in range(x.shape[0]):
        _quantize_k_row(x, b, levels, q, d, bsum16, bsum32, pair16)


@numba.njit(**PARALLEL)
def _quantize_k_parallel(x, levels, q, d, bsum16, bsum32, pair16):
    """:func:`_quantize_k` with the rows over numba's threads (the same values)."""
    for b in numba.prange(x.shape[0]):
        _quantize_k_row(x, b, levels, q, d, bsum16, bsum32, pair16)


@numba.njit(**INLINE)
def _q4_k_order_row(q, b, q_k4):
    """Row ``b`` of :attr:`Q8KActivations.q_k4`: 32-element runs 0 1 2 3 of each 128 to
    0 2 1 3."""
    for c in range(q.shape[1] // 128):
        for run in range(4):
            at = run if run == 0 or run == 3 else 3 - run
            for i in range(32):
                q_k4[b, 128 * c + 32 * at + i] = q[b, 128 * c + 32 * run + i]


@numba.njit(**JIT)
def _q4_k_order(q, q_k4):
    for b in range(q.shape[0]):
        _q4_k_order_row(q, b, q_k4)


@numba.njit(**PARALLEL)
def _q4_k_order_parallel(q, q_k4):
    for b in numba.prange(q.shape[0]):
        _q4_k_order_row(q, b, q_k4)


@numba.njit(**INLINE)
def _widen_row(codes, b, wide):
    """Row ``b`` of :meth:`Q8KActivations.widened` from the two levels' ``codes`` (in the
    order asked for)."""
    batch = wide.shape[0]
    for c in range(wide.shape[1] // 64):
        for half in range(2):
            for j in range(16):
                for e in range(2):
                    src = 64 * c + 4 * j + 2 * half + e
                    wide[b, 64 * c + 32 * half + 2 * j + e] = np.int16(256) * np.int16(
                        codes[b, src]
                    ) + np.int16(codes[batch + b, src])


@numba.njit(**JIT)
def _widen(codes, wide):
    for b in range(wide.shape[0]):
        _widen_row(codes, b, wide)


@numba.njit(**PARALLEL)
def _widen_parallel(codes, wide):
    for b in numba.prange(wide.shape[0]):
        _widen_row(codes, b, wide)


@numba.njit(**INLINE)
def _coarse_row(codes, bsum32, b, q, sums):
    """Row ``b`` of :meth:`Q8KActivations.coarse_levels` from the two levels' ``codes``."""
    batch = q.shape[0]
    for s in range(sums.shape[1]):
        total = 0
        for i in range(32):
            c = (np.int32(codes[batch + b, 32 * s + i]) + 8) >> 4
            q[b, 64 * s + i] = codes[b, 32 * s + i]
            q[b, 64 * s + 32 + i] = np.int8(c)
            total += c
        # sub-blocks 2j, 2j + 1 of a block as one int32: level 0 at j, level 1 at 4 + j
        at = s - s % 8 + s % 8 // 2
        if s % 2 == 0:
            sums[b, at] = bsum32[b, s] & 0xFFFF
            sums[b, at + 4] = total & 0xFFFF
        else:
            sums[b, at] |= bsum32[b, s] << 16
            sums[b, at + 4] |= total << 16


@numba.njit(**JIT)
def _coarse(codes, bsum32, q, sums):
    for b in range(q.shape[0]):
        _coarse_row(codes, bsum32, b, q, sums)


@numba.njit(**PARALLEL)
def _coarse_parallel(codes, bsum32, q, sums):
    for b in numba.prange(q.shape[0]):
        _coarse_row(codes, bsum32, b, q, sums)


def quantize_super_blocks(x: np.ndarray, levels: int = 1) -> Q8KActivations:
    """float32 ``[B, K]`` (K a multiple of 256) -> :class:`Q8KActivations` of ``levels * B``
    rows: ``x``, then (``levels == 2``) its rounding error at 1/256 of the first level's
    scale (:func:`two_level_activations` does it per 32 with a scale
    of its own; a fixed ratio lets a kernel sum the two levels in integers first)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"activations must be [B, K], got {x.shape}")
    act = _super_block_buffers(*x.shape, levels)
    quantize = _by_rows(x.shape[0], _quantize_k, _quantize_k_parallel)
    quantize(x, levels, act.q, act.d, act.bsum16, act.bsum32, _pair16(act))
    return act


def padded_rows(n: int, k: int, dtype) -> np.ndarray:
    """An uninitialised ``[n, k]`` array whose rows lie one super-block (256 elements)
    further apart than ``k``. A kernel reads a super-block of every token in turn
    (:func:`~kernels.quant.superblock.kblock_dot`); with rows a multiple of 4 KiB apart
    (K = 2048, 8192 and any multiple of 4096 / itemsize), all those reads fall in the same
    few L1 sets and miss each other out: the Q4_K kernel at 32 tokens, 2048 x 8192, one
    thread, 25 cycles per two rows, token and super-block against 8 for the same
    instructions on rows apart (this machine's ``vpdpwssd`` issues two a cycle)."""
    return np.empty((n, k + SUPER_BLOCK), dtype)[:, :k]


def _super_block_buffers(b: int, k: int, levels: int) -> Q8KActivations:
    if k % SUPER_BLOCK:
        raise ValueError(f"activations must be [B, K] with K a multiple of 256, got {(b, k)}")
    if levels not in (1, 2):
        raise ValueError(f"levels must be 1 or 2, got {levels}")
    n = levels * b
    act = Q8KActivations(
        padded_rows(n, k, np.int8),
        np.empty((n, k // SUPER_BLOCK), np.float32),
        np.empty((n, k // 16), np.int32),
        np.empty((n, k // 32), np.int32),
        np.empty((b, k // 16), np.int32) if levels == 2 else None,
    )
    return act


_NO_PAIRS = np.empty((0, 0), np.int32)


def _pair16(act: Q8KActivations) -> np.ndarray:
    return act.pair16 if act.pair16 is not None else _NO_PAIRS


@dataclass
class Q8Activations:
    """``[B, K]`` activations as int8 codes ``q`` with float32 ``scale`` per 32 elements;
    ``sum16`` / ``sum32`` are the sums of the *dequantized* values (``scale * q``) per 16 /
    32 elements, which the weight types with an offset (``w = d * q + m``) multiply by
    ``m``. Two levels (:func:`two_level_activations`): ``2B`` rows, row ``B + b`` what
    row ``b``'s rounding left at exactly 1/256 of its scale, and ``pair32`` the sum of
    both levels per 32."""

    q: np.ndarray  # int8 [B, K], values in [-127, 127]
    scale: np.ndarray  # float32 [B, K // 32]
    sum16: np.ndarray  # float32 [B, K // 16]
    sum32: np.ndarray  # float32 [B, K // 32]
    # the float activations these came from, and how many levels of int8 they hold (the
    # super-block format of the same input is made from them when a weight wants it)
    source: np.ndarray | None = field(default=None, repr=False)
    levels: int = 1
    _super: Q8KActivations | None = field(default=None, repr=False)
    # two levels: float32 [B, K // 32], (256 * sum(q_0) + sum(q_1)) * scale_1 per block
    # (the integer exact), what the offsets of a block multiply by
    pair32: np.ndarray | None = field(default=None, repr=False)
    _wide: np.ndarray | None = field(default=None, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def super_blocks(self) -> Q8KActivations:
        """The same input in super-block format (:class:`Q8KActivations`), with as many
        levels and rows as these; made once, on first use."""
        if self._super is None:
            if self.source is None:
                self._super = quantize_super_blocks(self.dequantize())
            else:
                self._super = quantize_super_blocks(self.source, self.levels)
        return self._super

    def widened(self) -> np.ndarray:
        """int16 ``[B, K]`` of two levels: each element's levels as one integer, ``256 *
        q_0 + q_1`` (within +-32,639), what :func:`~kernels.quant.block32.block32_rows`
        multiplies (``levels`` :data:`~kernels.quant.block32.WIDE32`). Made once."""
        if self.levels != 2:
            raise ValueError("int16 activations need two levels")
        if self._wide is None:
            b = self.q.shape[0] // 2
            self._wide = np.empty((b, self.q.shape[1]), np.int16)
            _pair_codes(self.q, self._wide)
        return self._wide

    def values(self, per_super_block: bool = False) -> np.ndarray:
        """float32 ``[rows, K]``: the values a kernel multiplies by, in the per-32 or the
        super-block format."""
        return self.super_blocks().dequantize() if per_super_block else self.dequantize()

    def dequantize(self) -> np.ndarray:
        """float32 ``[B, K]``: exactly the values the kernels multiply by."""
        b, k = self.q.shape
        return (self.q.reshape(b, -1, ACT_BLOCK) * self.scale[:, :, None]).reshape(b, k)


@numba.njit(**JIT)
def _quantize(x, q, scale, sum16, sum32):
    batch, k = x.shape
    four = np.empty(4, np.float32)
    for b in range(batch):
        x_at = x[b].ctypes.data
        q_at = q[b].ctypes.data
        for blk in range(k // 32):
            quantize32(x_at + 128 * blk, q_at + 32 * blk, four.ctypes.data)
            scale[b, blk] = four[0]
            sum16[b, 2 * blk] = four[1]
            sum16[b, 2 * blk + 1] = four[2]
            sum32[b, blk] = four[3]


def quantize_activations(x: np.ndarray) -> Q8Activations:
    """float32 ``[B, K]`` (K a multiple of 32) -> :class:`Q8Activations`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % ACT_BLOCK:
        raise ValueError(f"activations must be [B, K] with K a multiple of 32, got {x.shape}")
    b, k = x.shape
    act = Q8Activations(
        np.empty((b, k), np.int8),
        np.empty((b, k // 32), np.float32),
        np.empty((b, k // 16), np.float32),
        np.empty((b, k // 32), np.float32),
    )
    _quantize(x, act.q, act.scale, act.sum16, act.sum32)
    act.source = x
    return act


def two_level_activations(x: np.ndarray) -> Q8Activations:
    """``x [B, K]`` as int8 activations of ``2B`` rows: ``x`` itself, then what its int8
    rounding left (``x`` minus the dequantized first rows) at exactly 1/256 of the first
    level's scale (as :func:`quantize_super_blocks` makes it per 256), so that rows ``b``
    and ``B + b`` of a product sum to ``W x_b`` within about 1/256 of the int8 error, and
    the two levels of an element are one integer, ``256 * q_0 + q_1``, that the per-32
    kernels multiply in one piece (:meth:`Q8Activations.widened`).

    One level of int8 per 32 is what llama.cpp multiplies by; on SmolLM2 it moved the
    argmax against exact weights at 4% of the positions of a 512-token text (relative
    error of the leading logit 0.7%); two levels at none (3e-5). The kernel unpacks each
    weight row once for all activation rows, so the second level costs dot products, not
    weight reads. One numba call (three numpy calls and two quantizations took 21 us).
    The super-block format of the same two levels (Q4_K / Q6_K kernels) is made from
    ``x`` on first use; a projection of those types alone makes only that one
    (:func:`~kernels.quant.activations.quantize_super_blocks`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    act = _two_level_buffers(*x.shape)
    _by_rows(x.shape[0], _two_level, _two_level_parallel)(
        x, act.q, act.scale, act.sum16, act.sum32, act.pair32
    )
    act.source = x
    return act


def _two_level_buffers(b: int, k: int) -> Q8Activations:
    if k % ACT_BLOCK:
        raise ValueError(f"activations must be [B, K] with K a multiple of 32, got {(b, k)}")
    return Q8Activations(
        np.empty((2 * b, k), np.int8),
        np.empty((2 * b, k // 32), np.float32),
        np.empty((2 * b, k // 16), np.float32),
        np.empty((2 * b, k // 32), np.float32),
        levels=2,
        pair32=np.empty((b, k // 32), np.float32),
    )


@numba.njit(**JIT)
def _pair_codes(q, wide):
    """``wide[b] = 256 * q[b] + q[B + b]`` (``B`` the rows of ``wide``)."""
    b_rows = wide.shape[0]
    for b in range(b_rows):
        for i in range(wide.shape[1]):
            wide[b, i] = np.int16(256) * np.int16(q[b, i]) + np.int16(q[b_rows + b, i])


@numba.njit(**INLINE)
def _two_level_row(x, b, q, scale, sum16, sum32, pair32):
    """Row ``b`` of ``x`` to rows ``b`` and ``B + b`` of :func:`two_level_activations`
    (and ``pair32[b]``)."""
    batch, k = x.shape
    four = np.empty(4, np.float32)
    x_at = x[b].ctypes.data
    row = b + batch
    q_at, r_at = q[b].ctypes.data, q[row].ctypes.data
    for blk in range(k // 32):
        quantize32(x_at + 128 * blk, q_at + 32 * blk, four.ctypes.data)
        d = four[0]
        scale[b, blk] = d
        sum16[b, 2 * blk] = four[1]
        sum16[b, 2 * blk + 1] = four[2]
        sum32[b, blk] = four[3]
        # |rest| <= d / 2, so codes at d / 256 reach 128 at most: 127
        inv = np.float32(256.0) / d if d > 0 else np.float32(0.0)
        residual32(x_at + 128 * blk, q_at + 32 * blk, d, inv, r_at + 32 * blk, four.ctypes.data)
        scale[row, blk] = d / np.float32(256.0)
        sum16[row, 2 * blk] = four[0]
        sum16[row, 2 * blk + 1] = four[1]
        sum32[row, blk] = four[2]
        pair32[b, blk] = four[3]


@numba.njit(**JIT)
def _two_level(x, q, scale, sum16, sum32, pair32):
    for b in range(x.shape[0]):
        _two_level_row(x, b, q, scale, sum16, sum32, pair32)


@numba.njit(**PARALLEL)
def _two_level_parallel(x, q, scale, sum16, sum32, pair32):
    for b in numba.prange(x.shape[0]):
        _two_level_row(x, b, q, scale, sum16, sum32, pair32)


# What prepared_activations computes from its input rows before quantizing them.
RMS_NORM, SILU_GATE, GELU_TANH_GATE = 0, 1, 2


def prepared_activations(
    x: np.ndarray,
    op: int,
    per32: bool,
    weight: np.ndarray | None = None,
    eps: float = 0.0,
    residual: np.ndarray | None = None,
) -> Q8Activations | Q8KActivations:
    """Two levels of int8 activations (per 32 with ``per32``, else in super-blocks) of
    rows computed from ``x`` in the same numba call, kept as ``source``:

    * ``RMS_NORM``: ``x * rsqrt(mean(x^2) + eps) * weight`` (a layer's norm before q/k/v
      or gate/up); with ``residual`` (``[B, K]``, the last sublayer's output), ``x +=
      residual`` first, in place (``x`` a C-contiguous float32 array: the model's residual
      stream), the float32 sums torch's ``x + residual`` makes;
    * ``SILU_GATE`` / ``GELU_TANH_GATE``: ``x [B, 2I]`` is ``[gate | up]``, the rows
      ``act(gate) * up`` (the input of the down projection).

    At decode sizes each torch op costs microseconds of dispatch on vectors of a few
    hundred floats; here the op and both quantizations take about one."""
    x, w, residual, b, k = _prepare_args(x, op, weight, residual)
    src = np.empty((b, k), np.float32)
    if per32:
        act = _two_level_buffers(b, k)
        prepare = _by_rows(b, _prepared_two_level, _prepared_two_level_parallel)
        prepare(x, op, w, eps, residual, src, act.q, act.scale, act.sum16, act.sum32, act.pair32)
    else:
        act = _super_block_buffers(b, k, 2)
        prepare = _by_rows(b, _prepared_super_blocks, _prepared_super_blocks_parallel)
        prepare(x, op, w, eps, residual, src, act.q, act.d, act.bsum16, act.bsum32, _pair16(act))
    act.source = src
    return act


def prepared_rows(
    x: np.ndarray,
    op: int,
    weight: np.ndarray | None = None,
    eps: float = 0.0,
    residual: np.ndarray | None = None,
) -> np.ndarray:
    """The float32 rows :func:`prepared_activations` computes from ``x`` (``residual``
    added to ``x`` in place first, as there), not quantized: for a projection whose
    parts are all float (F32 / F16 / BF16), which multiplies them as they are."""
    x, w, residual, b, k = _prepare_args(x, op, weight, residual)
    out = np.empty((b, k), np.float32)
    _prepared_floats(x, op, w, eps, residual, out)
    return out


def _prepare_args(x, op, weight, residual):
    """:func:`prepared_activations`' arguments checked and made contiguous: ``(x, weight,
    residual, B, K)``, the missing weight and residual as empty arrays."""
    if residual is None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        residual = _NO_RESIDUAL
    elif op != RMS_NORM or residual.shape != x.shape:
        raise ValueError(f"a residual of shape {residual.shape} for RMS_NORM of {x.shape}")
    elif x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError("adding a residual needs x writable, C-contiguous float32")
    else:
        residual = np.ascontiguousarray(residual, dtype=np.float32)
    b, k = x.shape[0], x.shape[1] // (1 if op == RMS_NORM else 2)
    if op == RMS_NORM and (weight is None or weight.shape != (k,)):
        raise ValueError(f"RMS_NORM needs a weight of shape ({k},)")
    w = _NO_WEIGHT if weight is None else np.ascontiguousarray(weight, dtype=np.float32)
    return x, w, residual, b, k


_NO_WEIGHT = np.empty(0, np.float32)
_NO_RESIDUAL = np.empty((0, 0), np.float32)


@numba.njit(**INLINE)
def _prepare_row(x, b, op, w, eps, residual, out):
    """Row ``b`` of ``out [B, K]`` from ``x`` as :func:`prepared_activations` says (float32
    products, the sum of squares in float64); ``residual`` (``[0, 0]`` for none) added to
    ``x`` first."""
    k = out.shape[1]
    if residual.shape[0]:
        for i in range(k):
            x[b, i] += residual[b, i]
    if op == RMS_NORM:
        # eight partial sums, so that the float64 adds are not one chain of K latencies
        # (each square is exact in float64; the partials' order changes the total's last
        # bits at most)
        part = np.zeros(8, np.float64)
        tail = k - k % 8
        for i0 in range(0, tail, 8):
            for j in range(8):
                part[j] += np.float64(x[b, i0 + j]) * np.float64(x[b, i0 + j])
        total = 0.0
        for i in range(tail, k):
            total += np.float64(x[b, i]) * np.float64(x[b, i])
        for j in range(8):
            total += part[j]
        inv = np.float32(1.0 / np.sqrt(total / k + eps))
        for i in range(k):
            out[b, i] = x[b, i] * inv * w[i]
    else:
        # act(g) = g / (1 + exp(-t)): t = g for SiLU; for tanh-GELU, 0.5 g (1 + tanh(z))
        # is that with t = 2z. exp as vectorised arithmetic (kernels/quant/fastexp.py),
        # over -t written into the output row first.
        if op == SILU_GATE:
            for i in range(k):
                out[b, i] = -x[b, i]
        else:
            for i in range(k):
                g = x[b, i]
                z = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
                out[b, i] = np.float32(-2.0) * z
        exp_into(out[b], out[b], np.empty(k, np.int32), k)
        for i in range(k):
            out[b, i] = x[b, i] / (np.float32(1.0) + out[b, i]) * x[b, k + i]


@numba.njit(**JIT)
def _prepared_floats(x, op, w, eps, residual, out):
    for b in range(out.shape[0]):
        _prepare_row(x, b, op, w, eps, residual, out)


# Each row prepared, then quantized: the rows are independent, so one after the other
# or over numba's threads (PARALLEL_ROWS rows and more), the same values.


@numba.njit(**JIT)
def _prepared_two_level(x, op, w, eps, residual, src, q, scale, sum16, sum32, pair32):
    for b in range(src.shape[0]):
        _prepare_row(x, b, op, w, eps, residual, src)
        _two_level_row(src, b, q, scale, sum16, sum32, pair32)


@numba.njit(**PARALLEL)
def _prepared_two_level_parallel(x, op, w, eps, residual, src, q, scale, sum16, sum32, pair32):
    for b in numba.prange(src.shape[0]):
        _prepare_row(x, b, op, w, eps, residual, src)
        _two_level_row(src, b, q, scale, sum16, sum32, pair32)


@numba.njit(**JIT)
def _prepared_super_blocks(x, op, w, eps, residual, src, q, d, bsum16, bsum32, pair16):
    for b in range(src.shape[0]):
        _prepare_row(x, b, op, w, eps, residual, src)
        _quantize_k_row(src, b, 2, q, d, bsum16, bsum32, pair16)


@numba.njit(**PARALLEL)
def _prepared_super_blocks_parallel(x, op, w, eps, residual, src, q, d, bsum16, bsum32, pair16):
    for b in numba.prange(src.shape[0]):
        _prepare_row(x, b, op, w, eps, residual, src)
        _quantize_k_row(src, b, 2, q, d, bsum16, bsum32, pair16)
