"""Q4_K and Q6_K tiles (:mod:`kernels.quant.tiles`) times 16 tokens on AMX's int8 matrix
unit, to the bits of the AVX-512 VNNI tile kernel.

Why: the VNNI kernel spends one ``vpdpbusd`` (64 multiply-adds) per 16 rows, 4 elements,
token and level; compute-bound from a few tokens on, it ran a 512-token prefill of the
Llama-3.2-1B shape at 90 G multiply-adds a second a core (Sapphire Rapids). One
``tdpbsud`` multiplies a tile of 16 tokens' int8 activations of one sub-block by that
sub-block's codes of 16 rows: exact int32 sums, the same sums the VNNI kernel forms.

How (Q4_K): the tile records' code lines are already the B tile's layout (VNNI order: a
64-byte line is 16 rows x 4 codes). A sub-block's B tile is its 8 lines masked to its
nibbles, times 16 then times 1 (16 x 64 bytes), written to a scratch buffer first (a tile
load waits for the vector stores before it to reach L1); its A tile is 16 tokens' coarse
levels of it (:meth:`~kernels.quant.activations.Q8KActivations.coarse_levels`: the first
level's 32 codes then the second's, at 1/16 of the first's scale), loaded with the
activations' row stride. One ``tdpbsud`` a sub-block then sums ``16 dot_0 + dot_1`` in a
C tile of 16 tokens x 16 rows, stored to the scratch and read back one step later, and
from there every token takes the VNNI kernel's integer and float steps in its order.
With the levels 256 apart (as Q6_K's), each sub-block took two products and two C tiles
(the C tile stores bounded it): this way the kernel runs 1.2-1.3x faster.

How (Q6_K): taken the same way, a sub-block (K = 16) a B tile, it needed 32 C tiles per
block, and their stores bounded it (taken out, a timing experiment, the kernel ran
1.25-1.3x faster; the B tiles' stores 1.1-1.2x; the per-token vector steps less). So
Q6_K's scales go into the B tiles: codes times scales (int16) as a low (unsigned) and a
high (signed) byte plane, four sub-blocks a tile (K = 64), ``tdpbsud`` and ``tdpbssd``,
and one C tile per level and plane sums the whole block: 4 C tiles per block instead of
32. The VNNI kernel then applies the scales in integers too where AMX serves Q6_K
(``tiles.Q6_K_INT``, the same exact integers), so a row's bits do not depend on which
kernel served its token: batches, prompts and decode steps stay interchangeable (the
invariance tests hold whichever ran).

Measured (``python -m kernels.quant.bench --tiles``, two threads of a Sapphire Rapids
VM, weights cold / warm): Q4_K 8192 x 2048 at 16 tokens 196 / 240 G multiply-adds a
second against 149 / 171 through VNNI; Q6_K 2048 x 8192 at 16 / 32 / 128 tokens, cold,
182 / 212 / 209 against 145 / 166 / 167 with the scales in float steps (VNNI, integer
steps: 122 / 132 / 139, against 131 / 141 / 154 with float steps).

Where: CPUs with AMX-TILE and AMX-INT8 whose kernel grants this process the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, Linux), AVX-512 VNNI present
(the per-token steps); ``FOLIO_AMX=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kernels.quant import tile_layout as layout
from kernels.quant.simd import (
    HOST_ISA,
    I8,
    I16,
    I32,
    I64,
    _features,
    _fn,
    _literal,
    _vec,
    stream_ahead,
)
from kernels.quant.superblock import _load

__all__ = ["AMX_TOKENS", "SCRATCH", "amx_ready", "tile_dot_amx"]

AMX_TOKENS = 16  # tokens a call: a C tile's rows
# scratch bytes a call needs, 64-byte aligned: the tile config; Q4_K: a block's eight B
# tiles, two runs' two C tiles; Q6_K: two blocks' byte planes, two blocks' four C tiles
_CFG, _B, _C = 0, 64, 64 + 8192
_B6, _C6 = 64, 64 + 2 * 8192
SCRATCH = max(_C + 2 * 2048, _C6 + 2 * 4096)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def amx_ready() -> bool:
    """Whether the tile kernel here may take 16 tokens at a time to AMX: the CPU has
    AMX-TILE and AMX-INT8 (and AVX-512 VNNI), and the kernel granted this process the
    tile state (asked once; without it the first tile instruction faults)."""
    if os.environ.get("FOLIO_AMX", "1") == "0" or HOST_ISA != "avx512vnni":
        return False
    if not {"amx-tile", "amx-int8"} <= _features() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _ptr(builder, addr):
    return builder.inttoptr(addr, ir.PointerType(I8))


def _tile_config(builder, at, k: int) -> None:
    """Palette 1: tmm0-3 the C tiles (16 x 64 bytes), tmm4-5 the B tiles (``k / 4`` x 64:
    ``k`` elements of 16 rows), tmm6-7 the A tiles (16 tokens x ``k``): ``k`` 64 (Q4_K's
    sub-blocks at both levels, Q6_K's runs of four sub-blocks)."""
    cfg = bytearray(64)
    cfg[0] = 1
    for t, (rows, colsb) in enumerate([(16, 64)] * 4 + [(k // 4, 64)] * 2 + [(16, k)] * 2):
        cfg[16 + 2 * t : 18 + 2 * t] = colsb.to_bytes(2, "little")
        cfg[48 + t] = rows
    builder.store(
        ir.Constant(_vec(I8, 64), list(cfg)),
        builder.inttoptr(at, ir.PointerType(_vec(I8, 64))),
        align=64,
    )
    load_cfg = _fn(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [ir.PointerType(I8)])
    builder.call(load_cfg, [_ptr(builder, at)])


class _Tiles:
    """The tile instructions, declared in the module being built."""

    def __init__(self, b):
        i8p = ir.PointerType(I8)
        self.b = b
        self.load = _fn(b, "llvm.x86.tileloadd64", ir.VoidType(), [I8, i8p, I64])
        self.store = _fn(b, "llvm.x86.tilestored64", ir.VoidType(), [I8, i8p, I64])
        self.zero = _fn(b, "llvm.x86.tilezero", ir.VoidType(), [I8])
        self.dot = _fn(b, "llvm.x86.tdpbsud", ir.VoidType(), [I8, I8, I8])

    def products(self, f, x_tok, b_tiles, a_at, c_area) -> None:
        """A run's two sub-blocks, both levels in one product each: B tiles from
        ``b_tiles`` (two addresses), A tiles 16 tokens' coarse levels from byte offsets
        ``a_at`` (two) of their rows, C tile ``h`` stored to ``c_area + 1024 h``."""
        b = self.b
        for h in range(2):
            b.call(self.load, [I8(4 + h), _ptr(b, b_tiles[h]), I64(64)])
            b.call(self.zero, [I8(h)])
        for h in range(2):
            b.call(self.load, [I8(6 + h), _ptr(b, b.add(f.x_row[0], a_at[h])), x_tok])
            b.call(self.dot, [I8(h), I8(6 + h), I8(4 + h)])
        for h in range(2):
            at = b.add(c_area, I64(1024 * h))
            b.call(self.store, [I8(h), _ptr(b, at), I64(64)])


def _q4_k_block_amx(f, blk, r_a, x_tok, scratch):
    """One Q4_K super-block of the tile at ``r_a`` into 16 tokens' accumulators: the
    integer sums by ``tdpbsud``, the rest as :func:`kernels.quant.tiles._q4_k_block`.

    A sub-block's B tile is its codes times 16 (8 lines) then its codes (8 lines), its A
    tile 16 tokens' coarse levels of it (:meth:`~kernels.quant.activations.
    Q8KActivations.coarse_levels`: the first level's 32 codes then the second's, at 1/16
    of the first's scale): one product sums ``16 dot_0 + dot_1``, the integer the VNNI
    kernel forms from its two. Ordered for the matrix unit's latencies: the block's B
    tiles are unpacked first (a tile load waits for the vector stores before it to reach
    L1), and each run's C tiles are read back by the vector steps one run later
    (likewise), the next run's tile work issued in between; the A tile alternates
    between two registers."""
    b, nt = f.builder, f.nt
    v16i = _vec(I32, 16)
    b_at, c_at = b.add(scratch, I64(_B)), b.add(scratch, I64(_C))
    # the lines STREAM_AHEAD bytes on, as the VNNI kernel asks for them (the header's
    # here, each code line's as it is unpacked): at decode the records come from memory
    stream_ahead(b, r_a, layout._QS)
    # sub-block 2c + h's B tile at 1024 (2c + h): line k its codes x 16 at 64 k, its
    # codes at 512 + 64 k
    for c in range(4):
        for k in range(8):
            line = b.add(r_a, I64(layout._QS + 64 * (8 * c + k)))
            stream_ahead(b, line, 64)
            q = _load(b, line, v16i, 64)
            pairs = zip(layout.q4_k_nibbles16(b, q), layout.q4_k_nibbles(b, q))
            for h, (x16, x1) in enumerate(pairs):
                at = b.add(b_at, I64(1024 * (2 * c + h) + 64 * k))
                b.store(x16, b.inttoptr(at, ir.PointerType(v16i)), align=64)
                at = b.add(at, I64(512))
                b.store(x1, b.inttoptr(at, ir.PointerType(v16i)), align=64)

    tiles = _Tiles(b)
    for t in range(nt):
        b.store(ir.Constant(layout.V16, None), f.part[t])

    def tile_work(c: int) -> None:
        """Run ``c``'s two products into C area ``c % 2``."""
        e0 = b.add(b.mul(blk, I64(512)), I64(128 * c))
        tiles.products(
            f,
            x_tok,
            [b.add(b_at, I64(1024 * (2 * c + h))) for h in range(2)],
            [b.add(e0, I64(64 * h)) for h in range(2)],
            b.add(c_at, I64(2048 * (c % 2))),
        )

    def token_steps(c: int) -> None:
        """Run ``c``'s per-token steps (:func:`~kernels.quant.tile_layout.q4_k_run`), from
        C area ``c % 2``."""
        scf = layout.q4_k_scales(b, r_a, c)
        area = b.add(c_at, I64(2048 * (c % 2)))
        for t in range(nt):
            dots = [_load(b, b.add(area, I64(1024 * h + 64 * t)), v16i, 64) for h in range(2)]
            b.store(layout.q4_k_run(b, dots, scf, f.part[t]), f.part[t])

    for c in range(4):
        tile_work(c)
        if c:
            token_steps(c - 1)
    token_steps(3)
    layout.q4_k_block_end(f, blk, r_a)


def _q6_k_planes(b, r_a, b_at) -> None:
    """A Q6_K super-block's codes times their sub-blocks' scales (at most 63 x 128 in
    magnitude: int16) as two byte planes per run of four sub-blocks: run p's low bytes
    (unsigned) a B tile at 2048 p, its high bytes (signed) at 2048 p + 1024; row
    4 j + u of a run's tiles: code vector u of its sub-block j (K = 64: the run's 64
    elements, as the activations lie)."""
    v16i, v32w = _vec(I32, 16), _vec(I16, 32)
    bytes_, high = layout._const(0x00FF00FF), layout._const(0xFF00FF00 - (1 << 32))
    # the lines STREAM_AHEAD bytes on: the header's here, each sub-block's as it comes
    stream_ahead(b, r_a, layout._QL6)
    for sb in range(16):
        ql = b.add(r_a, I64(layout._QL6 + 128 * sb))
        qh_at = b.add(r_a, I64(layout._QH6 + 64 * sb))
        stream_ahead(b, ql, 128)
        stream_ahead(b, qh_at, 64)
        lo = _load(b, ql, v16i, 64)
        hi = _load(b, b.add(ql, I64(64)), v16i, 64)
        qh = _load(b, qh_at, v16i, 64)
        sc = layout._bytes16(b, b.add(r_a, I64(layout._SC6 + 16 * sb)), signed=True)
        scw = b.bitcast(
            b.or_(b.and_(sc, layout._const(0xFFFF)), b.shl(sc, layout._const(16))), v32w
        )
        for u, code in enumerate(layout.q6_k_codes(b, lo, hi, qh)):
            even = b.bitcast(b.and_(code, bytes_), v32w)
            odd = b.bitcast(b.and_(b.lshr(code, layout._const(8)), bytes_), v32w)
            pe, po = b.mul(even, scw), b.mul(odd, scw)  # int16 products
            shl8 = b.bitcast(b.shl(po, ir.Constant(v32w, [8] * 32)), v16i)
            sra8 = b.bitcast(b.ashr(pe, ir.Constant(v32w, [8] * 32)), v16i)
            pe, po = b.bitcast(pe, v16i), b.bitcast(po, v16i)
            planes = (
                b.or_(b.and_(pe, bytes_), shl8),
                b.or_(b.and_(sra8, bytes_), b.and_(po, high)),
            )
            for plane, v in enumerate(planes):
                at = b.add(b_at, I64(2048 * (sb // 4) + 1024 * plane + 64 * (4 * (sb % 4) + u)))
                b.store(v, b.inttoptr(at, ir.PointerType(v16i)), align=64)


def _q6_k_amx(f, x_tok, scratch) -> None:
    """Every Q6_K super-block of the tile into 16 tokens' accumulators: per block, the
    codes times the scales in byte planes (:func:`_q6_k_planes`), four runs of 64
    elements, each level's activations (the A tile) times each plane (``tdpbsud`` for the
    unsigned low bytes, ``tdpbssd`` for the signed high ones) summed in one C tile per
    level and plane over the block; then per token the integer and float steps of
    :func:`~kernels.quant.tile_layout.q6_k_token_end`, which the VNNI kernel takes too.
    A block's planes are unpacked while the previous block's products run; a block's C
    tiles are read back after the next block's products (a tile store does not forward
    to vector loads)."""
    b = f.builder
    v16i = _vec(I32, 16)
    tl = _Tiles(b)
    dot_ss = _fn(b, "llvm.x86.tdpbssd", ir.VoidType(), [I8, I8, I8])
    b_at, c_at = b.add(scratch, I64(_B6)), b.add(scratch, I64(_C6))

    def record(blk):
        return b.add(f.rec, b.mul(blk, I64(layout.RECORD6)))

    def planes_at(blk):
        return b.add(b_at, b.mul(b.and_(blk, I64(1)), I64(8192)))

    def area(blk):
        return b.add(c_at, b.mul(b.and_(blk, I64(1)), I64(4096)))

    def steps(blk):
        r_a, c_area = record(blk), area(blk)
        head = layout.q6_k_header(b, r_a)
        for t in range(AMX_TOKENS):
            c = [_load(b, b.add(c_area, I64(1024 * j + 64 * t)), v16i, 64) for j in range(4)]
            total = tuple(
                b.add(b.shl(c[2 * lvl + 1], layout._const(8)), c[2 * lvl]) for lvl in range(2)
            )
            b.store(layout.q6_k_token_end(f, blk, t, total, b.load(f.acc[t]), head), f.acc[t])

    _q6_k_planes(b, f.rec, planes_at(I64(0)))
    with cgutils.for_range(b, f.nblk) as loop:
        blk = loop.index
        bb = planes_at(blk)
        for tile in range(4):  # C tile 2 lvl + plane
            b.call(tl.zero, [I8(tile)])
        for p in range(4):
            for plane in range(2):
                b.call(
                    tl.load,
                    [I8(4 + plane), _ptr(b, b.add(bb, I64(2048 * p + 1024 * plane))), I64(64)],
                )
            for lvl in range(2):
                a_at = b.add(f.x_row[0], b.add(b.mul(blk, I64(256)), I64(64 * p)))
                if lvl:
                    a_at = b.add(a_at, f.x_lvl)
                b.call(tl.load, [I8(6 + lvl), _ptr(b, a_at), x_tok])
                b.call(tl.dot, [I8(2 * lvl), I8(6 + lvl), I8(4)])
                b.call(dot_ss, [I8(2 * lvl + 1), I8(6 + lvl), I8(5)])
        c_area = area(blk)
        for tile in range(4):
            b.call(tl.store, [I8(tile), _ptr(b, b.add(c_area, I64(1024 * tile))), I64(64)])
        nxt = b.add(blk, I64(1))
        with cgutils.if_likely(b, b.icmp_unsigned("<", nxt, f.nblk)):
            _q6_k_planes(b, record(nxt), planes_at(nxt))
        with cgutils.if_likely(b, b.icmp_unsigned(">", blk, I64(0))):
            steps(b.sub(blk, I64(1)))
    steps(b.sub(f.nblk, I64(1)))


@intrinsic
def tile_dot_amx(
    typingctx, rec, nblk, x, x_tok, x_lvl, xd, xd_tok, bs, bs_tok, out, scratch, kind, on
):
    """:func:`kernels.quant.tiles.tile_dot` for 16 tokens (``out``: float32 ``[16, 16]``,
    64-byte aligned), the integer sums on AMX (:func:`amx_ready` must hold); ``scratch``:
    :data:`SCRATCH` bytes, 64-byte aligned; ``kind`` a compile-time ``KBLOCK_CODES``
    value for Q4_K or :data:`kernels.quant.tiles.Q6_K_INT` (Q6_K with its scales in
    integers). The same bits as ``tile_dot`` gives each token. ``on`` (a compile-time bool):
    False compiles to nothing, so that a kernel with the AMX branch turned off compiles
    on any CPU."""
    enabled, code = _literal(on, (0, 1)), _literal(kind, (0, 1, 2))
    if enabled is None or code is None or (enabled and code == 1):
        return None  # Q6_K on AMX only with its scales in integers (tiles.Q6_K_INT)
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, i, u, i, u, i, u, u, kind, on)

    def codegen(context, builder, signature, args):
        if not enabled:
            return context.get_dummy_value()
        f = layout._Frame(builder, AMX_TOKENS, args)
        scratch_at = args[10]
        _tile_config(builder, builder.add(scratch_at, I64(_CFG)), 64)
        if code == 2:
            _q6_k_amx(f, args[3], scratch_at)
        else:
            with cgutils.for_range(builder, f.nblk) as loop:
                blk = loop.index
                rec_at = builder.add(f.rec, builder.mul(blk, I64(layout.RECORD)))
                _q4_k_block_amx(f, blk, rec_at, args[3], scratch_at)
        f.store_out()
        builder.call(_fn(builder, "llvm.x86.tilerelease", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return sig, codegen
