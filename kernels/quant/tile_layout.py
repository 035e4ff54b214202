"""What the tile kernels' code generators share (:mod:`kernels.quant.tiles` on AVX-512
VNNI, :mod:`kernels.quant.amx` on AMX): the tile records' layout, the frame of a kernel
call (its arguments, each token's rows and accumulators), and the steps that end a Q4_K
super-block (float) and a Q6_K one (integer, where AMX serves it), so that both kernels
take them in one order and give a row the same bits.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from kernels.quant.simd import F32, I8, I16, I32, I64, _fma, _fn, _splat, _vec
from kernels.quant.superblock import KBLOCK_CODES, KBLOCK_KINDS, _load

# bytes of a super-block in the file, by kind
Q4_K_BLOCK, Q6_K_BLOCK = (KBLOCK_KINDS[KBLOCK_CODES[k]][1] for k in ("Q4_K", "Q6_K"))
# A tile's record per super-block, 2,304 bytes: the rows' 16 super-blocks as in the file
# (the scales and mins in 6 bits, as the file packs them). d[16] f16, dmin[16] f16;
# low[8][16] u8, row r's byte j the low four bits of sub-block j's scale (and in its high
# four, of its min); top[16] u32, row r's dword the top two bits of scale j at bit 2j
# and of min j at 16 + 2j; then the codes: 64 bytes per (c, k), c < 4 the 64-element
# group, k < 8, row r's bytes 32c + 4k .. 32c + 4k + 3 at 4r
_D, _DMIN, _LOW, _TOP, _QS = 0, 32, 64, 192, 256
RECORD = _QS + 32 * 64
# Q6_K's record: d[16] f16, scales[16][16] i8, then per sub-block s (16 elements, 4
# vectors of 4: u < 4): two 64-byte vectors of low nibbles (row r's dword at 4r: the
# vectors 4s, 4s + 1 in the low and high nibbles of the first, 4s + 2, 4s + 3 of the
# second), and one of their high two bits (byte i of row r's dword: element i of vector
# 4s + u at bits 2u, 2u + 1). 3,360 bytes as in the file, padded to 64-byte lines.
_D6, _SC6, _QL6, _QH6 = 0, 32, 320, 320 + 2048
RECORD6 = _QH6 + 1024
# a record's bytes by kind code (superblock.KBLOCK_CODES: Q4_K 0, Q6_K 1)
RECORDS = (RECORD, RECORD6)


class _Frame:
    """What the tile kernels' code shares: their arguments (:func:`tile_dot`), each
    token's rows, float accumulators and int32 dot products in registers."""

    def __init__(self, builder, nt: int, args):
        self.builder, self.nt = builder, nt
        self.rec, self.nblk, x, x_tok, self.x_lvl, xd, xd_tok, bs, bs_tok, self.out = args[:10]
        v16i = _vec(I32, 16)
        self.dpbusd = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16i, [v16i, v16i, v16i])
        self.acc, self.part = self.slots(V16), self.slots(V16)

        def rows(at, step):
            return [builder.add(at, builder.mul(step, I64(t))) for t in range(nt)]

        self.x_row, self.xd_row, self.bs_row = rows(x, x_tok), rows(xd, xd_tok), rows(bs, bs_tok)

    def slots(self, t: ir.Type) -> list:
        """One register-promoted variable of type ``t`` per token, zeroed."""
        return [
            cgutils.alloca_once_value(self.builder, ir.Constant(t, None)) for _ in range(self.nt)
        ]

    def dot(self, dots: list, codes, blk, at, block: int = 256):
        """``dots[lvl][t] += vpdpbusd(codes[lvl], token t's 4 int8 of level lvl)``, from
        byte ``at`` of block ``blk`` (``block`` bytes a block and level: 256, or 512
        for :meth:`~kernels.quant.activations.Q8KActivations.coarse_levels`); ``codes``
        one vector for both levels or one per level; ``dots[0]`` and ``dots[1]`` may be
        the same slots (both levels summed in one)."""
        b = self.builder
        for lvl in range(2):
            for t in range(self.nt):
                x = b.add(b.add(self.x_row[t], b.mul(blk, I64(block))), at)
                if lvl:
                    x = b.add(x, self.x_lvl)
                xv = _splat(b, _load(b, x, I32, 4), 16)
                prev = b.load(dots[lvl][t])
                code = codes[lvl] if isinstance(codes, tuple) else codes
                b.store(b.call(self.dpbusd, [prev, code, xv]), dots[lvl][t])

    def scale(self, blk, t: int):
        """Token ``t``'s second-level scale of block ``blk``, in every lane."""
        b = self.builder
        return _splat(b, _load(b, b.add(self.xd_row[t], b.mul(blk, I64(4))), F32, 4), 16)

    def sum_at(self, t: int, offset):
        """Token ``t``'s int32 sum ``offset`` bytes into its sums, in every lane."""
        b = self.builder
        return _splat(b, _load(b, b.add(self.bs_row[t], offset), I32, 4), 16)

    def store_out(self):
        b = self.builder
        for t in range(self.nt):
            dst = b.inttoptr(b.add(self.out, I64(64 * t)), ir.PointerType(V16))
            b.store(b.load(self.acc[t]), dst, align=64)


V16 = _vec(F32, 16)


def _const(v: int):
    return ir.Constant(_vec(I32, 16), [v] * 16)


def _halves(builder, addr):
    """16 IEEE halves at ``addr`` as float32."""
    h = _load(builder, addr, _vec(I16, 16), 32)
    return builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), 16)), V16)


def _bytes16(builder, addr, signed: bool = False):
    """16 bytes at ``addr`` widened to int32."""
    v = _load(builder, addr, _vec(I8, 16), 16)
    return builder.sext(v, _vec(I32, 16)) if signed else builder.zext(v, _vec(I32, 16))


def q4_k_scales(b, r_a, c) -> list:
    """Run ``c``'s two sub-blocks' scales (2c and 2c + 1; ``c`` an int or an i64 value)
    of the record at ``r_a``, 16 rows each, as float32: their low four bits from
    ``low``, the top two from ``top`` (:data:`RECORD`)."""
    c = I64(c) if isinstance(c, int) else c
    # the top bits of scale j at bits 4, 5 after a right shift by 2j
    top = b.shl(_load(b, b.add(r_a, I64(_TOP)), _vec(I32, 16), 64), _const(4))
    out = []
    for h in range(2):
        j = b.add(b.mul(c, I64(2)), I64(h))
        low = _bytes16(b, b.add(r_a, b.add(I64(_LOW), b.mul(j, I64(16)))))
        shift = _splat(b, b.trunc(b.mul(j, I64(2)), I32), 16)
        scale = b.or_(b.and_(low, _const(0x0F)), b.and_(b.lshr(top, shift), _const(0x30)))
        out.append(b.sitofp(scale, V16))
    return out


def q4_k_mins(b, r_a) -> list:
    """The record's eight sub-blocks' mins, 16 rows each, as int32 (:data:`RECORD`)."""
    top = _load(b, b.add(r_a, I64(_TOP)), _vec(I32, 16), 64)
    return [
        b.or_(
            b.lshr(_bytes16(b, b.add(r_a, I64(_LOW + 16 * s))), _const(4)),
            b.and_(b.lshr(top, _const(12 + 2 * s)), _const(0x30)),
        )
        for s in range(8)
    ]


def q4_k_run(b, dots: list, scf: list, part_slot):
    """A token's ``part`` after a run of two Q4_K sub-blocks: ``part = fma(float(dot),
    scale, part)`` for each in order (``dot`` the exact ``16 dot_0 + dot_1``)."""
    part = b.load(part_slot)
    for dot, scale in zip(dots, scf):
        part = _fma(b, b.sitofp(dot, V16), scale, part)
    return part


def q4_k_block_end(f: _Frame, blk, r_a):
    """A Q4_K super-block's float steps once its sub-blocks are summed into ``f.part``:
    each token's ``acc = fma(part, d * xd, acc)``, then its offsets in integers, per
    level ``L = sum_s min[s] * s[s]`` (one ``vpdpwssd`` per pair of sub-blocks: the
    token's sums are int16 pairs, :meth:`~kernels.quant.activations.Q8KActivations.
    coarse_levels`), ``acc = fma(float(16 L_0 + L_1), -(dmin * xd), acc)``."""
    b, nt = f.builder, f.nt
    v16i = _vec(I32, 16)
    dpwssd = _fn(b, "llvm.x86.avx512.vpdpwssd.512", v16i, [v16i, v16i, v16i])
    d, dmin = _halves(b, b.add(r_a, I64(_D))), _halves(b, b.add(r_a, I64(_DMIN)))
    mins = q4_k_mins(b, r_a)
    pairs = [b.or_(mins[2 * j], b.shl(mins[2 * j + 1], _const(16))) for j in range(4)]
    for t in range(nt):
        xd_v = f.scale(blk, t)
        a = _fma(b, b.load(f.part[t]), b.fmul(d, xd_v), b.load(f.acc[t]))
        sums = b.mul(blk, I64(32))
        lv = []
        for lvl in range(2):
            off = ir.Constant(v16i, None)
            for j in range(4):
                at = b.add(sums, I64(4 * (4 * lvl + j)))
                off = b.call(dpwssd, [off, pairs[j], f.sum_at(t, at)])
            lv.append(off)
        imin = b.add(b.shl(lv[0], _const(4)), lv[1])
        fm = b.fneg(b.fmul(dmin, xd_v))
        b.store(_fma(b, b.sitofp(imin, V16), fm, a), f.acc[t])


def q6_k_header(b, r_a) -> tuple:
    """A Q6_K record's super-block scale ``d`` (float32) and its sixteen sub-blocks'
    scales as int16 pairs ``scp[j] = (sc[2j], sc[2j + 1])`` per row: what
    :func:`q6_k_token_end` takes."""
    d = _halves(b, b.add(r_a, I64(_D6)))
    sc = [_bytes16(b, b.add(r_a, I64(_SC6 + 16 * s)), signed=True) for s in range(16)]
    words = _const(0xFFFF)
    scp = [b.or_(b.and_(sc[2 * j], words), b.shl(sc[2 * j + 1], _const(16))) for j in range(8)]
    return d, scp


def q6_k_token_end(f: _Frame, blk, t: int, sums: tuple, acc, head):
    """Token ``t``'s accumulator after a Q6_K super-block whose codes times scales summed
    to ``sums`` (int32, per level: ``L = sum_s sc[s] * sum_i x[i] * q[i]``, exact): less
    the codes' zero point 32 times ``sum_s sc[s] * s_lvl[s]`` (one ``vpdpwssd`` per pair
    of sub-blocks; the token's sums are int16 pairs, :func:`~kernels.quant.tiles._q6_k_sums`),
    then ``part = fma(float(L_0), 256, float(L_1))`` and ``acc = fma(part, d * xd, acc)``."""
    b = f.builder
    d, scp = head
    v16i = _vec(I32, 16)
    dpwssd = _fn(b, "llvm.x86.avx512.vpdpwssd.512", v16i, [v16i, v16i, v16i])
    at = b.mul(blk, I64(64))
    flt = []
    for lvl in range(2):
        off = ir.Constant(v16i, None)
        for j in range(8):
            off = b.call(dpwssd, [off, scp[j], f.sum_at(t, b.add(at, I64(4 * (8 * lvl + j))))])
        flt.append(b.sitofp(b.sub(sums[lvl], b.shl(off, _const(5))), V16))
    part = _fma(b, flt[0], ir.Constant(V16, [256.0] * 16), flt[1])
    return _fma(b, part, b.fmul(d, f.scale(blk, t)), acc)


def q4_k_nibbles(b, q) -> tuple:
    """A Q4_K code line (16 rows x 4 bytes) as its low and its high nibbles: the codes of
    sub-blocks 2c and 2c + 1 (:data:`RECORD`)."""
    low = _const(0x0F0F0F0F)
    return b.and_(q, low), b.and_(b.lshr(q, _const(4)), low)


def q4_k_nibbles16(b, q) -> tuple:
    """:func:`q4_k_nibbles` times 16 (unsigned bytes): what the first of the coarse
    levels multiplies (:meth:`~kernels.quant.activations.Q8KActivations.coarse_levels`)."""
    high = _const(0xF0F0F0F0 - (1 << 32))
    return b.and_(b.shl(q, _const(4)), high), b.and_(q, high)


def q6_k_codes(b, lo, hi, qh) -> tuple:
    """A Q6_K sub-block's four code vectors 4 sb + u (16 rows x 4 codes each) from its two
    vectors of low nibbles and one of high bits (:data:`RECORD6`)."""
    low, top = _const(0x0F0F0F0F), _const(0x30303030)
    lshr, shl, and_, or_ = b.lshr, b.shl, b.and_, b.or_
    return (
        or_(and_(lo, low), and_(shl(qh, _const(4)), top)),
        or_(and_(lshr(lo, _const(4)), low), and_(shl(qh, _const(2)), top)),
        or_(and_(hi, low), and_(qh, top)),
        or_(and_(lshr(hi, _const(4)), low), and_(lshr(qh, _const(2)), top)),
    )
