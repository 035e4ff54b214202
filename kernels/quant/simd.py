"""The one SIMD primitive every block-quantized kernel shares, written in LLVM IR.

numba carries its own LLVM, so explicit vector code needs no compiler on the user's
machine: :func:`scaled_dot` is a numba ``@intrinsic`` whose body is built here with
llvmlite. Measured on LLVM 22 (numba 0.68): numba's auto-vectorizer widens byte products
to 64-bit lanes (``vpmuldq`` on ``vpmovsxbq``), about a tenth of what the hardware does;
the generic IR ``reduce.add(mul(zext u8, sext s8))`` *is* matched to ``vpdpbusd`` but only
as a full reduction, which costs a horizontal sum per sub-block. So the fast paths call the
x86 instructions by name, and the generic path states the same arithmetic in plain IR.

``scaled_dot`` computes, in float32, for up to 4 activation rows at once,

    sum_i  fw[i // sw] * fx[i // sx] * c[i] * x[i]          for i in [0, k)

where ``c`` are ``k`` weight codes (uint8, or int8 when ``signed``), ``x`` the ``k`` int8
activations (never -128), ``fw`` / ``fx`` float32 scales per ``sw`` / ``sx`` elements, all
given as addresses. ``k`` is a multiple of 32; ``sw`` is 16 or 32, ``sx`` 32 or 256.
Integer products are exact; each group of 4 products becomes one float and is scaled and
accumulated in float32 (two vector accumulators, one horizontal sum at the end). No float
operation carries fast-math flags: explicit ``llvm.fma`` and a fixed summation tree give
the same bits from a fresh compile and from numba's on-disk cache (measured: with
reassociation allowed the two differed in the last bits).

Instruction sets (:data:`HOST_ISA`, chosen once from the CPU's features):

* ``avx512vnni``: ``vpdpbusd`` on zmm (Ice Lake and later Xeons, Sapphire Rapids, Zen 4).
* ``avxvnni``: ``vpdpbusd`` on ymm (AVX-VNNI: Alder Lake and later cores without AVX-512).
* ``avx2``: ``vpmaddubsw`` + ``vpmaddwd`` (Haswell and later, Zen 1-3). Unsigned codes
  must stay below 128 (``vpmaddubsw`` saturates pairs at 2^15); every GGUF type's
  unsigned codes do (at most 63), and int8 codes go through the sign trick instead.
* ``generic``: the same sums in target-independent IR, for anything else.
"""

from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

__all__ = [
    "HOST_ISA",
    "ISA_CODES",
    "ISAS",
    "WEIGHT_DOT_TOKENS",
    "bitfield",
    "bitplane",
    "expand_codes",
    "f16_to_f32",
    "float_dot",
    "float_dots4",
    "float_max",
    "floats_to_halves",
    "halves_to_floats",
    "prefetch",
    "quantize32",
    "quantize256",
    "host_isa",
    "key_scores",
    "residual256",
    "scaled_dot",
    "shifted_exps",
    "sums16",
    "u8_pointer",
    "weight_dots",
    "weighted_rows",
]

ISAS = ("generic", "avx2", "avxvnni", "avx512vnni")
ISA_CODES = {name: code for code, name in enumerate(ISAS)}
_ISA_ENV = "FOLIO_QUANT_ISA"  # force a lower ISA (tests of the AVX2 / generic paths)

I8, I16, I32, I64, F32 = (
    ir.IntType(8),
    ir.IntType(16),
    ir.IntType(32),
    ir.IntType(64),
    ir.FloatType(),
)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _features() -> set[str]:
    return {name for name, on in llvm.get_host_cpu_features().items() if on}


def host_isa(features: set[str] | None = None) -> str:
    """The best instruction set of :data:`ISAS` that this CPU (or ``features``) has."""
    f = _features() if features is None else features
    if {"avx512vnni", "avx512bw", "avx512vl"} <= f:
        best = "avx512vnni"
    elif "avxvnni" in f or {"avx512vnni", "avx512vl"} <= f:
        best = "avxvnni"
    elif "avx2" in f:
        best = "avx2"
    else:
        best = "generic"
    forced = os.environ.get(_ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{_ISA_ENV}={forced!r}: expected one of {ISAS}")
        if ISA_CODES[forced] > ISA_CODES[best]:
            raise ValueError(f"{_ISA_ENV}={forced!r}: this CPU supports at most {best}")
        best = forced
    return best


HOST_ISA = host_isa()
HAS_F16C = "f16c" in _features()


# ---- fp16 -> fp32 ------------------------------------------------------------------------


@intrinsic
def f16_to_f32(typingctx, bits):
    """IEEE half (as its uint16 bit pattern) -> float32: ``vcvtph2ps`` where the CPU has
    F16C (every AVX2 CPU); callers use :func:`kernels.quant.blocks.half` which falls back
    to integer code elsewhere."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), F32)

    return sig, codegen


def _convert_rows(builder, src, dst, n, src_t: ir.Type, dst_t: ir.Type, convert):
    """``dst[i] = convert(src[i])`` for ``i < n`` at the addresses ``src``, ``dst``: 16
    lanes at a time, then one by one."""
    sb, db = (2 if t == I16 else 4 for t in (src_t, dst_t))
    vs, vd = _vec(src_t, 16), _vec(dst_t, 16)
    chunks = builder.udiv(n, I64(16))
    with cgutils.for_range(builder, chunks) as loop:
        at = builder.mul(loop.index, I64(16))
        v = builder.load(
            builder.inttoptr(builder.add(src, builder.mul(at, I64(sb))), ir.PointerType(vs)),
            align=sb,
        )
        out = builder.inttoptr(builder.add(dst, builder.mul(at, I64(db))), ir.PointerType(vd))
        builder.store(convert(v, vd), out, align=db)
    with cgutils.for_range(builder, n, start=builder.mul(chunks, I64(16))) as loop:
        s = builder.load(
            builder.inttoptr(
                builder.add(src, builder.mul(loop.index, I64(sb))), ir.PointerType(src_t)
            ),
            align=sb,
        )
        out = builder.inttoptr(
            builder.add(dst, builder.mul(loop.index, I64(db))), ir.PointerType(dst_t)
        )
        builder.store(convert(s, dst_t), out, align=db)


def _splat(builder, value, n: int):
    """``value`` in each of ``n`` lanes."""
    t = _vec(value.type, n)
    one = builder.insert_element(ir.Constant(t, ir.Undefined), value, I32(0))
    return builder.shuffle_vector(
        one, ir.Constant(t, ir.Undefined), ir.Constant(_vec(I32, n), [0] * n)
    )


def _no_f16c(builder) -> None:
    """In place of a half conversion on a CPU without F16C, where LLVM would call a runtime
    function numba's JIT does not link (a call to address 0): a trap. Never reached: such
    a CPU's caches keep fp32 pages (`kernels.paged_attention.CPU_HALF_PAGES`)."""
    builder.call(_fn(builder, "llvm.trap", ir.VoidType(), []), [])


def _half_or_float(builder, half, emit) -> None:
    """``emit(True)`` where the runtime flag ``half`` is set (fp16 rows, widened: a trap
    on a CPU without F16C, `_no_f16c`), else ``emit(False)`` (float32 rows)."""
    with builder.if_else(half) as (then, otherwise):
        with then:
            if HAS_F16C:
                emit(True)
            else:
                _no_f16c(builder)
        with otherwise:
            emit(False)


def _half_conversion(widen: bool):
    """The codegen of :func:`halves_to_floats` (``widen``) and :func:`floats_to_halves`."""
    src_t, dst_t = (I16, F32) if widen else (F32, I16)

    def codegen(context, builder, signature, args):
        def convert(v, t):
            if widen:
                return _widen(builder, v, 16)
            half = _vec(ir.HalfType(), 16) if isinstance(t, ir.VectorType) else ir.HalfType()
            return builder.bitcast(builder.fptrunc(v, half), t)

        if HAS_F16C:
            _convert_rows(builder, *args, src_t, dst_t, convert)
        else:
            _no_f16c(builder)
        return context.get_dummy_value()

    return codegen


@intrinsic
def halves_to_floats(typingctx, src, dst, n):
    """The ``n`` IEEE halves at address ``src`` as float32 at ``dst`` (``vcvtph2ps``, 16 at
    a time): a row of fp16 K/V pages for the decode kernel. Exact. Needs F16C
    (:data:`HAS_F16C`; without it LLVM would call a runtime function numba lacks)."""
    return types.void(types.uintp, types.uintp, types.intp), _half_conversion(widen=True)


@intrinsic
def floats_to_halves(typingctx, src, dst, n):
    """The ``n`` float32 at address ``src`` rounded to IEEE halves (to nearest, ties to
    even: torch's ``.half()``) at ``dst`` as their bit patterns (``vcvtps2ph``, 16 at a
    time): a token's K/V into fp16 pages. Needs F16C, as :func:`halves_to_floats`."""
    return types.void(types.uintp, types.uintp, types.intp), _half_conversion(widen=False)


# ---- the scaled dot product --------------------------------------------------------------


def _fn(builder, name: str, ret: ir.Type, params: list[ir.Type]):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)


def _mask(n_out: int, n_in: int) -> ir.Constant:
    """Shuffle mask that repeats each of ``n_in`` lanes ``n_out // n_in`` times."""
    rep = n_out // n_in
    return ir.Constant(_vec(I32, n_out), [i // rep for i in range(n_out)])


def _expand(builder, v, n_in: int, n_out: int):
    if n_in == n_out:
        return v
    return builder.shuffle_vector(v, ir.Constant(_vec(F32, n_in), ir.Undefined), _mask(n_out, n_in))


def _load_scales(builder, addr, count: int):
    """``count`` float32 at ``addr`` as a vector (unaligned)."""
    if count == 1:
        s = builder.load(builder.inttoptr(addr, ir.PointerType(F32)), align=4)
        return builder.insert_element(ir.Constant(_vec(F32, 1), ir.Undefined), s, I32(0))
    return builder.load(builder.inttoptr(addr, ir.PointerType(_vec(F32, count))), align=4)


def _lane_scales(builder, w, nw: int, fx, off, width: int, sw: int, sx: int):
    """float32 <width/4> vector: for the 4-element lane j of the ``width`` elements at
    element offset ``off``, fw[(off + 4j) // sw] * fx[(off + 4j) // sx], where ``w`` holds
    the ``nw`` weight scales of those elements (loaded once for all rows)."""
    lanes = width // 4
    nx = max(1, width // sx)
    x = _load_scales(builder, builder.add(fx, builder.mul(builder.udiv(off, I64(sx)), I64(4))), nx)
    n = max(nw, nx)
    prod = builder.fmul(_expand(builder, w, nw, n), _expand(builder, x, nx, n))
    return _expand(builder, prod, n, lanes)


def _abs_sign(builder, c, x, n: int):
    """(|c| as uint8, x * sign(c)): a signed product as unsigned x signed (x != -128)."""
    zero = ir.Constant(_vec(I8, n), None)
    mag = builder.call(
        _fn(builder, f"llvm.abs.v{n}i8", _vec(I8, n), [_vec(I8, n), ir.IntType(1)]),
        [c, ir.IntType(1)(0)],
    )
    neg = builder.icmp_signed("<", c, zero)
    xs = builder.select(neg, builder.sub(zero, x), x)
    xs = builder.select(builder.icmp_signed("==", c, zero), zero, xs)
    return mag, xs


def _dot4(builder, isa: str, c, x, n: int, signed: bool):
    """<n x i8> codes and activations -> <n/4 x i32>, lane j = sum of products 4j..4j+3."""
    if isa == "generic":
        if signed:
            c, x = _abs_sign(builder, c, x, n)
        p = builder.mul(builder.zext(c, _vec(I32, n)), builder.sext(x, _vec(I32, n)))
        undef = ir.Constant(_vec(I32, n), ir.Undefined)
        parts = [
            builder.shuffle_vector(
                p, undef, ir.Constant(_vec(I32, n // 4), [4 * j + r for j in range(n // 4)])
            )
            for r in range(4)
        ]
        return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
    if isa == "avx512vnni" or (isa == "avxvnni" and n == 32):
        if signed:
            c, x = _abs_sign(builder, c, x, n)
        t = _vec(I32, n // 4)
        bits = 512 if n == 64 else 256
        dp = _fn(builder, f"llvm.x86.avx512.vpdpbusd.{bits}", t, [t, t, t])
        return builder.call(
            dp, [ir.Constant(t, None), builder.bitcast(c, t), builder.bitcast(x, t)]
        )
    if n == 64:  # 256-bit ISAs: two halves
        lo = [ir.Constant(_vec(I32, 32), list(range(32)))]
        hi = [ir.Constant(_vec(I32, 32), list(range(32, 64)))]
        undef = ir.Constant(_vec(I8, 64), ir.Undefined)
        a = _dot4(
            builder,
            isa,
            builder.shuffle_vector(c, undef, lo[0]),
            builder.shuffle_vector(x, undef, lo[0]),
            32,
            signed,
        )
        b = _dot4(
            builder,
            isa,
            builder.shuffle_vector(c, undef, hi[0]),
            builder.shuffle_vector(x, undef, hi[0]),
            32,
            signed,
        )
        return builder.shuffle_vector(a, b, ir.Constant(_vec(I32, 16), list(range(16))))
    # avx2, 32 bytes
    v32, v16s = _vec(I8, 32), _vec(I16, 16)
    if signed:
        sign = _fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32])
        x = builder.call(sign, [x, c])
        c = builder.call(
            _fn(builder, "llvm.abs.v32i8", v32, [v32, ir.IntType(1)]), [c, ir.IntType(1)(0)]
        )
    pairs = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16s, [v32, v32]), [c, x])
    ones = ir.Constant(v16s, [1] * 16)
    return builder.call(
        _fn(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [v16s, v16s]), [pairs, ones]
    )


def _literal(t, allowed) -> int | None:
    if isinstance(t, types.IntegerLiteral) and t.literal_value in allowed:
        return t.literal_value
    if isinstance(t, types.BooleanLiteral) and t.literal_value in allowed:
        return int(t.literal_value)
    return None


def _fma(builder, a, b, c):
    """a * b + c rounded once (``llvm.fma``): the same bits whatever the code generator
    decides, where a contractible fmul + fadd may or may not be fused."""
    n = a.type.count
    fn = _fn(builder, f"llvm.fma.v{n}f32", a.type, [a.type, a.type, a.type])
    return builder.call(fn, [a, b, c])


def _tree_sum(builder, v):
    """Sum of a float vector's lanes by halving (a fixed order, unlike ``reduce.fadd``
    with reassociation, which numba's JIT and its on-disk cache compile differently)."""
    n = v.type.count
    while n > 1:
        half = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, half), list(range(half, n))))
        v = builder.fadd(lo, hi)
        n = half
    return builder.extract_element(v, I32(0))


@intrinsic
def scaled_dot(typingctx, c, x, x_step, fw, fx, fx_step, k, out, rows, isa, sw, sx, signed):
    """For ``r < rows``: ``out[r]`` (float32 at address ``out``) = the scaled dot product of
    the module docstring between the codes at ``c`` and the activation row ``r`` at
    ``x + r * x_step`` with its scales at ``fx + r * fx_step``. Each code chunk is loaded
    once for all ``rows``; each row's arithmetic is the same whatever ``rows`` is, so its
    result is too (batch invariance). ``rows`` (1, 2 or 4), ``isa`` (an :data:`ISA_CODES`
    value), ``sw``, ``sx`` and ``signed`` must be compile-time constants."""
    lit = (
        _literal(rows, (1, 2, 4)),
        _literal(isa, range(len(ISAS))),
        _literal(sw, (16, 32)),
        _literal(sx, (32, 256)),
        _literal(signed, (0, 1)),
    )
    if any(v is None for v in lit):
        return None  # numba retries with literal argument types
    n_rows, isa_name, sw_v, sx_v, signed_v = lit[0], ISAS[lit[1]], lit[2], lit[3], bool(lit[4])
    u, i = types.uintp, types.intp
    sig = types.void(u, u, i, u, u, i, i, u, rows, isa, sw, sx, signed)

    def codegen(context, builder, signature, args):
        c_a, x_a, x_step, fw_a, fx_a, fx_step, k_v, out_a = args[:8]
        x_rows = [builder.add(x_a, builder.mul(x_step, I64(r))) for r in range(n_rows)]
        fx_rows = [builder.add(fx_a, builder.mul(fx_step, I64(r))) for r in range(n_rows)]

        def step(accs, at, width):
            vt = ir.PointerType(_vec(I8, width))
            cv = builder.load(builder.inttoptr(builder.add(c_a, at), vt), align=1)
            lanes = width // 4
            nw = max(1, width // sw_v)
            wv = _load_scales(
                builder, builder.add(fw_a, builder.mul(builder.udiv(at, I64(sw_v)), I64(4))), nw
            )
            for r in range(n_rows):
                xv = builder.load(builder.inttoptr(builder.add(x_rows[r], at), vt), align=1)
                dots = builder.sitofp(
                    _dot4(builder, isa_name, cv, xv, width, signed_v), _vec(F32, lanes)
                )
                scales = _lane_scales(builder, wv, nw, fx_rows[r], at, width, sw_v, sx_v)
                builder.store(_fma(builder, dots, scales, builder.load(accs[r])), accs[r])

        def accumulators(width):
            return [
                cgutils.alloca_once_value(builder, ir.Constant(_vec(F32, width), None))
                for _ in range(n_rows)
            ]

        # per row two accumulators: consecutive 64-element chunks alternate (FMA latency)
        acc0, acc1, acc8 = accumulators(16), accumulators(16), accumulators(8)
        pairs = builder.udiv(k_v, I64(128))
        with cgutils.for_range(builder, pairs) as loop:
            off = builder.mul(loop.index, I64(128))
            step(acc0, off, 64)
            step(acc1, builder.add(off, I64(64)), 64)
        rest = builder.sub(k_v, builder.mul(pairs, I64(128)))
        with builder.if_then(builder.icmp_unsigned(">=", rest, I64(64))):
            step(acc0, builder.mul(pairs, I64(128)), 64)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(rest, I64(63)), I64(0))):
            step(acc8, builder.sub(k_v, I64(32)), 32)
        for r in range(n_rows):
            total = _tree_sum(builder, builder.fadd(builder.load(acc0[r]), builder.load(acc1[r])))
            total = builder.fadd(total, _tree_sum(builder, builder.load(acc8[r])))
            dst = builder.inttoptr(builder.add(out_a, I64(4 * r)), ir.PointerType(F32))
            builder.store(total, dst, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def float_dot(typingctx, a, b, n):
    """``sum_i a[i] * b[i]`` over ``n`` float32 at the addresses ``a``, ``b``, in a fixed
    order (16 lanes, then a scalar tail): the offset terms ``sum_s fo[s] * xsum[s]``."""
    sig = types.float32(types.uintp, types.uintp, types.intp)

    def codegen(context, builder, signature, args):
        a_a, b_a, n_v = args
        v16 = _vec(F32, 16)
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16, None))
        chunks = builder.udiv(n_v, I64(16))
        with cgutils.for_range(builder, chunks) as loop:
            off = builder.mul(loop.index, I64(64))
            va = builder.load(builder.inttoptr(builder.add(a_a, off), ir.PointerType(v16)), align=4)
            vb = builder.load(builder.inttoptr(builder.add(b_a, off), ir.PointerType(v16)), align=4)
            builder.store(_fma(builder, va, vb, builder.load(acc)), acc)
        tail = cgutils.alloca_once_value(builder, F32(0.0))
        fma1 = _fn(builder, "llvm.fma.f32", F32, [F32, F32, F32])
        with cgutils.for_range(builder, n_v, start=builder.mul(chunks, I64(16))) as loop:
            off = builder.mul(loop.index, I64(4))
            sa = builder.load(builder.inttoptr(builder.add(a_a, off), ir.PointerType(F32)), align=4)
            sb = builder.load(builder.inttoptr(builder.add(b_a, off), ir.PointerType(F32)), align=4)
            builder.store(builder.call(fma1, [sa, sb, builder.load(tail)]), tail)
        return builder.fadd(_tree_sum(builder, builder.load(acc)), builder.load(tail))

    return sig, codegen


@intrinsic
def float_max(typingctx, a, n, start):
    """The largest of ``start`` and the ``n`` float32 at address ``a`` (``llvm.maxnum``,
    16 lanes then one by one: a NaN is passed over; the result is exact, so the order
    does not matter). numba's ``max`` in a loop stays scalar: each step waits for the
    last one's compare."""
    sig = types.float32(types.uintp, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        a_a, n_v, start = args
        v16 = _vec(F32, 16)
        vmax = _fn(builder, "llvm.maxnum.v16f32", v16, [v16, v16])
        smax = _fn(builder, "llvm.maxnum.f32", F32, [F32, F32])
        acc = cgutils.alloca_once_value(builder, _splat(builder, start, 16))
        chunks = builder.udiv(n_v, I64(16))
        with cgutils.for_range(builder, chunks) as loop:
            at = builder.add(a_a, builder.mul(loop.index, I64(64)))
            va = builder.load(builder.inttoptr(at, ir.PointerType(v16)), align=4)
            builder.store(builder.call(vmax, [builder.load(acc), va]), acc)
        best = cgutils.alloca_once_value(
            builder,
            builder.call(
                _fn(builder, "llvm.vector.reduce.fmax.v16f32", F32, [v16]), [builder.load(acc)]
            ),
        )
        with cgutils.for_range(builder, n_v, start=builder.mul(chunks, I64(16))) as loop:
            at = builder.add(a_a, builder.mul(loop.index, I64(4)))
            sa = builder.load(builder.inttoptr(at, ir.PointerType(F32)), align=4)
            builder.store(builder.call(smax, [builder.load(best), sa]), best)
        return builder.load(best)

    return sig, codegen


@intrinsic
def weighted_rows(typingctx, acc, acc_step, w, w_step, v, v_step, n, width, rows, half):
    """For ``r < rows``, ``d < width``: ``acc[r][d] += sum_s w[r][s] * v[s][d]`` over ``s <
    n`` in order, one ``fma`` each: attention's values weighted by the softmax
    probabilities of ``rows`` query heads. ``acc`` rows (float32) at ``acc + r *
    acc_step``; weights (float32) at ``w + r * w_step + 4 s``; value rows at ``v + s *
    v_step``, fp16 when ``half`` (widened by ``vcvtph2ps``) else float32. The ``rows``
    accumulators stay in registers, 16 lanes at a time, for all ``n`` values: one load
    of each value chunk for all rows, where a loop over slots outside loads and stores
    every accumulator per value. ``rows`` (1..4) is a compile-time constant."""
    n_rows = _literal(rows, (1, 2, 3, 4))
    if n_rows is None:
        return None
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, u, i, i, i, rows, types.boolean)

    def codegen(context, builder, signature, args):
        acc_a, acc_step, w_a, w_step, v_a, v_step, n_v, width = args[:8]
        half = args[9]
        v16 = _vec(F32, 16)
        acc_rows = [builder.add(acc_a, builder.mul(acc_step, I64(r))) for r in range(n_rows)]
        w_rows = [builder.add(w_a, builder.mul(w_step, I64(r))) for r in range(n_rows)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16, None)) for _ in range(n_rows)]
        tails = [cgutils.alloca_once_value(builder, F32(0.0)) for _ in range(n_rows)]
        fma1 = _fn(builder, "llvm.fma.f32", F32, [F32, F32, F32])

        def value(at, count: int, is_half: bool):
            """``count`` values (16 or 1) at byte address ``at`` as float32."""
            if is_half:
                t = _vec(I16, count) if count > 1 else I16
                raw = builder.load(builder.inttoptr(at, ir.PointerType(t)), align=2)
                h = _vec(ir.HalfType(), count) if count > 1 else ir.HalfType()
                return builder.fpext(builder.bitcast(raw, h), v16 if count > 1 else F32)
            t = v16 if count > 1 else F32
            return builder.load(builder.inttoptr(at, ir.PointerType(t)), align=4)

        def weight(r, s):
            at = builder.add(w_rows[r], builder.mul(s, I64(4)))
            return builder.load(builder.inttoptr(at, ir.PointerType(F32)), align=4)

        def emit(is_half: bool):
            vb = 2 if is_half else 4
            chunks = builder.udiv(width, I64(16))
            with cgutils.for_range(builder, chunks) as chunk:
                off = builder.mul(chunk.index, I64(64))
                for r in range(n_rows):
                    at = builder.inttoptr(builder.add(acc_rows[r], off), ir.PointerType(v16))
                    builder.store(builder.load(at, align=4), accs[r])
                v_off = builder.add(v_a, builder.mul(chunk.index, I64(16 * vb)))
                with cgutils.for_range(builder, n_v) as slot:
                    vv = value(builder.add(v_off, builder.mul(slot.index, v_step)), 16, is_half)
                    for r in range(n_rows):
                        wv = _splat(builder, weight(r, slot.index), 16)
                        builder.store(_fma(builder, wv, vv, builder.load(accs[r])), accs[r])
                for r in range(n_rows):
                    at = builder.inttoptr(builder.add(acc_rows[r], off), ir.PointerType(v16))
                    builder.store(builder.load(accs[r]), at, align=4)
            with cgutils.for_range(builder, width, start=builder.mul(chunks, I64(16))) as d:
                for r in range(n_rows):
                    at = builder.inttoptr(
                        builder.add(acc_rows[r], builder.mul(d.index, I64(4))), ir.PointerType(F32)
                    )
                    builder.store(builder.load(at, align=4), tails[r])
                v_off = builder.add(v_a, builder.mul(d.index, I64(vb)))
                with cgutils.for_range(builder, n_v) as slot:
                    sv = value(builder.add(v_off, builder.mul(slot.index, v_step)), 1, is_half)
                    for r in range(n_rows):
                        builder.store(
                            builder.call(fma1, [weight(r, slot.index), sv, builder.load(tails[r])]),
                            tails[r],
                        )
                for r in range(n_rows):
                    at = builder.inttoptr(
                        builder.add(acc_rows[r], builder.mul(d.index, I64(4))), ir.PointerType(F32)
                    )
                    builder.store(builder.load(tails[r]), at, align=4)

        _half_or_float(builder, half, emit)
        return context.get_dummy_value()

    return sig, codegen


def _four_sums(builder, vs):
    """The lane sums of four 16-lane float vectors as one 4-lane vector, by halving the
    lanes of all four at once (ten shuffles and five adds, against four of each per vector
    summed alone; a fixed order, as :func:`_tree_sum`)."""

    def add(x, y, lo: list[int], hi: list[int]):
        pick = _vec(I32, len(lo))
        return builder.fadd(
            builder.shuffle_vector(x, y, ir.Constant(pick, lo)),
            builder.shuffle_vector(x, y, ir.Constant(pick, hi)),
        )

    # lanes 0-7: the first vector's halves summed, 8-15: the second's (16 on: y's lanes)
    lo16, hi16 = [*range(8), *range(16, 24)], [*range(8, 16), *range(24, 32)]
    a, b = add(vs[0], vs[1], lo16, hi16), add(vs[2], vs[3], lo16, hi16)
    # lanes 4j .. 4j + 3: vector j's four partial sums
    c = add(a, b, [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
            [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31])  # fmt: skip
    d = add(c, c, [0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15])
    return add(d, d, [0, 2, 4, 6], [1, 3, 5, 7])


def _widen(builder, v, a_bits: int):
    """float32 lanes (or a scalar) of ``v``: as they are (``a_bits`` 0), IEEE halves (16)
    or bfloat16 (-16) widened (exact)."""
    if a_bits == 0:
        return v
    vector = isinstance(v.type, ir.VectorType)
    f32 = _vec(F32, v.type.count) if vector else F32
    if a_bits == 16:
        return builder.fpext(
            builder.bitcast(v, _vec(ir.HalfType(), v.type.count) if vector else ir.HalfType()), f32
        )
    wide = _vec(I32, v.type.count) if vector else I32
    shift = ir.Constant(wide, [16] * v.type.count) if vector else I32(16)
    return builder.bitcast(builder.shl(builder.zext(v, wide), shift), f32)


def _dots_codegen(a_bits: int, nt: int, operands):
    """Four ``a`` rows dotted with ``nt`` ``b`` rows: ``out[t][j] = sum_i a_j[i] *
    b_t[i]`` over ``n`` elements, in a fixed order per ``(t, j)`` whatever ``nt``: 16
    lanes, each row's and token's ``fma`` chain in element order, the four rows' lanes
    summed together per token (:func:`_four_sums`), then a scalar tail. ``a_bits``: the
    ``a`` rows float32 (0), IEEE halves (16) or bfloat16 (-16), each widened as loaded
    (and, weights streamed from memory, asked for :data:`STREAM_AHEAD` bytes ahead).
    ``operands(builder, args)``: the four rows' addresses, ``b``, ``b``'s row step in
    bytes, ``n``, ``out`` and ``out``'s row step in bytes."""
    src = F32 if a_bits == 0 else I16
    size = 4 if a_bits == 0 else 2

    def codegen(context, builder, signature, args):
        rows, b_a, b_step, n_v, o_a, o_step = operands(builder, args)
        v16 = _vec(F32, 16)
        b_rows = [builder.add(b_a, builder.mul(b_step, I64(t))) for t in range(nt)]
        accs = [
            [cgutils.alloca_once_value(builder, ir.Constant(v16, None)) for _ in range(4)]
            for _ in range(nt)
        ]
        fma1 = _fn(builder, "llvm.fma.f32", F32, [F32, F32, F32])

        def step(index, lanes: int, slots):
            """Element(s) ``index * lanes ..`` of every row into each (token, row) slot."""
            a_t, b_t = (_vec(src, lanes), v16) if lanes > 1 else (src, F32)
            vals = []
            for row in rows:
                at = builder.add(row, builder.mul(index, I64(lanes * size)))
                if a_bits and lanes > 1:  # weight rows streamed from memory: asked for ahead
                    stream_ahead(builder, at, 1)
                v = builder.load(builder.inttoptr(at, ir.PointerType(a_t)), align=size)
                vals.append(_widen(builder, v, a_bits))
            for t in range(nt):
                at = builder.add(b_rows[t], builder.mul(index, I64(4 * lanes)))
                vb = builder.load(builder.inttoptr(at, ir.PointerType(b_t)), align=4)
                for va, slot in zip(vals, slots[t]):
                    prev = builder.load(slot)
                    total = (
                        _fma(builder, va, vb, prev)
                        if lanes > 1
                        else builder.call(fma1, [va, vb, prev])
                    )
                    builder.store(total, slot)

        chunks = builder.udiv(n_v, I64(16))
        with cgutils.for_range(builder, chunks) as loop:
            step(loop.index, 16, accs)
        sums = [_four_sums(builder, [builder.load(acc) for acc in accs[t]]) for t in range(nt)]
        tails = [
            [cgutils.alloca_once_value(builder, F32(0.0)) for _ in range(4)] for _ in range(nt)
        ]
        with cgutils.for_range(builder, n_v, start=builder.mul(chunks, I64(16))) as loop:
            step(loop.index, 1, tails)
        for t in range(nt):
            out_t = builder.add(o_a, builder.mul(o_step, I64(t)))
            for j, tail in enumerate(tails[t]):
                total = builder.fadd(builder.extract_element(sums[t], I32(j)), builder.load(tail))
                at = builder.inttoptr(builder.add(out_t, I64(4 * j)), ir.PointerType(F32))
                builder.store(total, at)
        return context.get_dummy_value()

    return codegen


def _strided_rows(builder, args):
    a_a, step, b_a, n_v, o_a = args
    rows = [builder.add(a_a, builder.mul(step, I64(j))) for j in range(4)]
    return rows, b_a, I64(0), n_v, o_a, I64(0)


@intrinsic
def float_dots4(typingctx, a, a_step, b, n, out):
    """``out[j] = sum_i a[j * a_step + i] * b[i]`` for ``j < 4`` over ``n`` float32 (``a``,
    ``b``, ``out`` addresses, ``a_step`` in bytes), in a fixed order: 16 lanes each, the
    four vectors' lanes summed together (:func:`_four_sums`), then a scalar tail. Four
    query heads' scores against one key row: a lone dot's lane sum costs more than its
    multiply-adds at a head's 64 or 128 elements."""
    sig = types.void(types.uintp, types.intp, types.uintp, types.intp, types.uintp)
    return sig, _dots_codegen(0, 1, _strided_rows)


#: the tokens a :func:`weight_dots` call is best given at most: 16 accumulators in
#: registers with AVX-512's 32, 8 (two registers each) with AVX2's 16 (it takes up to 4
#: on every CPU: more spill, the same bits)
WEIGHT_DOT_TOKENS = 4 if HOST_ISA == "avx512vnni" else 2


@intrinsic
def weight_dots(typingctx, a0, a1, a2, a3, b, b_step, n, out, bits, ntok):
    """``out[4 t + j] = sum_i a_j[i] * b[t * b_step + i]`` for four weight rows at the
    addresses ``a0 .. a3`` of IEEE halves (``bits`` 16: ``vcvtph2ps``) or bfloat16
    (``bits`` -16) and ``ntok`` float32 token rows (1 to 4; :data:`WEIGHT_DOT_TOKENS`
    the most this CPU keeps in registers),
    over ``n`` elements: each row widened once for all the tokens, each ``(t, j)`` the
    float32 steps :func:`float_dots4` takes for one token, whatever ``ntok``. F16 needs
    F16C (without it: a trap, never reached: `kernels.quant.float_rows`)."""
    kind = _literal(bits, (16, -16))
    nt = _literal(ntok, (1, 2, 3, 4))
    if kind is None or nt is None:
        return None
    u, i = types.uintp, types.intp
    sig = types.void(u, u, u, u, u, i, i, u, bits, ntok)

    def operands(builder, args):
        return list(args[:4]), args[4], args[5], args[6], args[7], I64(16)

    if kind == 16 and not HAS_F16C:

        def trap(context, builder, signature, args):
            _no_f16c(builder)
            return context.get_dummy_value()

        return sig, trap
    return sig, _dots_codegen(kind, nt, operands)


def _masked_store(builder):
    """``llvm.masked.store`` of 16 float32: (value, address, alignment, lane mask)."""
    v16 = _vec(F32, 16)
    return _fn(
        builder,
        "llvm.masked.store.v16f32.p0",
        ir.VoidType(),
        [v16, ir.PointerType(v16), I32, _vec(ir.IntType(1), 16)],
    )


def _slot_sums(builder, vs):
    """The lane sums of sixteen 16-lane float vectors as one vector, lane ``s`` vector
    ``s``'s: each vector's lanes summed in :func:`_tree_sum`'s order (``i + 8``, then
    ``+ 4``, ``+ 2``, ``+ 1``), two vectors' halves per shuffle pair, so 15 adds for all
    sixteen where a sum alone takes four."""

    def add(x, y, lo: list[int], hi: list[int]):
        pick = _vec(I32, len(lo))
        return builder.fadd(
            builder.shuffle_vector(x, y, ir.Constant(pick, lo)),
            builder.shuffle_vector(x, y, ir.Constant(pick, hi)),
        )

    def halves(width: int) -> tuple[list[int], list[int]]:
        """Of each run of ``2 * width`` lanes of the pair (x's 16, then y's), the first
        ``width`` and the second."""
        runs = range(0, 32, 2 * width)
        lo = [r + i for r in runs for i in range(width)]
        return lo, [i + width for i in lo]

    for width in (8, 4, 2, 1):
        lo, hi = halves(width)
        vs = [add(vs[i], vs[i + 1], lo, hi) for i in range(0, len(vs), 2)]
    return vs[0]


@intrinsic
def key_scores(typingctx, q, q_step, k, k_step, n, width, out, out_step, scratch, rows, half):
    """For ``r < rows``, ``s < n`` (at most 16): ``out[r][s] = sum_i q[r][i] * k[s][i]``
    over ``width`` elements (a multiple of 16), with the bits of :func:`float_dots4` and
    :func:`float_dot`: per slot 16 lanes of ``fma``, then each lane sum in their order.
    Attention's scores of ``rows`` query heads (float32 rows at ``q + r * q_step``) over
    up to 16 key rows (at ``k + s * k_step``, fp16 when ``half``, widened by
    ``vcvtph2ps``, else float32); out rows at ``out + r * out_step``, lanes past ``n``
    masked off. Two slots at a time, each slot's and row's ``fma`` chain in its own order
    (twice as many chains in flight: 1.06-1.27x the one-slot loop, 7 query heads, fp16
    keys, head dim 128, one thread). Each slot's lane vectors go to ``scratch`` (``rows *
    1 KB``), then sixteen slots' sums are taken together (:func:`_slot_sums`): a slot at
    a time, its lane sums cost more than its multiply-adds. ``rows`` (1..4) is a
    compile-time constant."""
    n_rows = _literal(rows, (1, 2, 3, 4))
    if n_rows is None:
        return None
    u, i = types.uintp, types.intp
    sig = types.void(u, i, u, i, i, i, u, i, u, rows, types.boolean)

    def codegen(context, builder, signature, args):
        q_a, q_step, k_a, k_step, n_v, width, o_a, o_step, s_a = args[:9]
        half = args[10]
        v16 = _vec(F32, 16)
        zero = ir.Constant(v16, None)
        # [slot of the pair][row]: two slots' rows at a time, so that twice as many
        # multiply-add chains are in flight (each chain, a slot's row, in its own order)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_rows)] for _ in range(2)]
        chunks = builder.udiv(width, I64(16))

        def slot_vectors(is_half: bool):
            vb = 2 if is_half else 4

            def slots(first, count: int):
                """The lane vectors of slots ``first .. first + count`` into ``scratch``."""
                rows = [
                    builder.add(k_a, builder.mul(builder.add(first, I64(j)), k_step))
                    for j in range(count)
                ]
                for j in range(count):
                    for acc in accs[j]:
                        builder.store(zero, acc)
                with cgutils.for_range(builder, chunks) as chunk:
                    off = builder.mul(chunk.index, I64(64))
                    vqs = []
                    for r in range(n_rows):
                        q_at = builder.add(builder.add(q_a, builder.mul(q_step, I64(r))), off)
                        vqs.append(
                            builder.load(builder.inttoptr(q_at, ir.PointerType(v16)), align=4)
                        )
                    for j in range(count):
                        at = builder.add(rows[j], builder.mul(chunk.index, I64(16 * vb)))
                        if is_half:
                            raw = builder.load(
                                builder.inttoptr(at, ir.PointerType(_vec(I16, 16))), align=2
                            )
                            vk = builder.fpext(builder.bitcast(raw, _vec(ir.HalfType(), 16)), v16)
                        else:
                            vk = builder.load(builder.inttoptr(at, ir.PointerType(v16)), align=4)
                        for vq, acc in zip(vqs, accs[j]):
                            builder.store(_fma(builder, vq, vk, builder.load(acc)), acc)
                for j in range(count):
                    for r, acc in enumerate(accs[j]):
                        at = builder.add(
                            s_a,
                            builder.mul(
                                builder.add(builder.add(first, I64(j)), I64(16 * r)), I64(64)
                            ),
                        )
                        builder.store(
                            builder.load(acc), builder.inttoptr(at, ir.PointerType(v16)), align=4
                        )

            with cgutils.for_range(builder, builder.udiv(n_v, I64(2))) as pair:
                slots(builder.mul(pair.index, I64(2)), 2)
            odd = builder.icmp_unsigned("!=", builder.urem(n_v, I64(2)), I64(0))
            with builder.if_then(odd):
                slots(builder.sub(n_v, I64(1)), 1)

        _half_or_float(builder, half, slot_vectors)
        lanes = ir.Constant(_vec(I32, 16), list(range(16)))
        live = builder.icmp_unsigned("<", lanes, _splat(builder, builder.trunc(n_v, I32), 16))
        store = _masked_store(builder)
        for r in range(n_rows):
            vs = [
                builder.load(
                    builder.inttoptr(builder.add(s_a, I64(64 * (16 * r + s))), ir.PointerType(v16)),
                    align=4,
                )
                for s in range(16)
            ]
            # the scalar tail float_dots4 adds (none here): + 0.0, the same bits
            sums = builder.fadd(_slot_sums(builder, vs), zero)
            at = builder.inttoptr(
                builder.add(o_a, builder.mul(o_step, I64(r))), ir.PointerType(v16)
            )
            builder.call(store, [sums, at, I32(4), live])
        return context.get_dummy_value()

    return sig, codegen


# The float32 exp's constants, for both of its forms: kernels/quant/fastexp.py's scalar
# `exp_parts` (numba's loops, which import them from here) and `_fast_exp` below (vector
# IR), which must give its bits. The clamp keeps exp(v) a normal float32; ln 2 in two
# parts, so that v - k ln 2 is exact; Taylor's coefficients of exp(r), r^6 / 6! first.
EXP_LOW, EXP_HIGH = -87.0, 88.0
EXP_LOG2E, EXP_LN2_HI, EXP_LN2_LO = 1.4426950408889634, 0.693145751953125, 1.428606765330187e-06
EXP_TAYLOR = (0.0013888889, 0.008333334, 0.041666668, 0.16666667, 0.5, 1.0, 1.0)


def _f32(value: float) -> float:
    """``value`` rounded to float32, as numba's ``np.float32(value)`` makes it."""
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


def _fast_exp(builder, v):
    """`kernels.quant.fastexp.exp_parts` and its product on a float32 vector, the same
    operations in the same order (no fused multiply-add), so the same bits."""
    t = v.type
    n = t.count

    def c(x):
        return _splat(builder, F32(_f32(x)), n)

    lo, hi = c(EXP_LOW), c(EXP_HIGH)
    v = builder.select(builder.fcmp_ordered(">", v, lo), v, lo)
    v = builder.select(builder.fcmp_ordered("<", v, hi), v, hi)
    k = builder.call(_fn(builder, f"llvm.rint.v{n}f32", t, [t]), [builder.fmul(v, c(EXP_LOG2E))])
    r = builder.fsub(
        builder.fsub(v, builder.fmul(k, c(EXP_LN2_HI))), builder.fmul(k, c(EXP_LN2_LO))
    )
    p = builder.fadd(builder.fmul(c(EXP_TAYLOR[0]), r), c(EXP_TAYLOR[1]))
    for coef in EXP_TAYLOR[2:]:
        p = builder.fadd(builder.fmul(p, r), c(coef))
    ki = builder.fptosi(k, _vec(I32, n))
    bits = builder.shl(builder.add(ki, _splat(builder, I32(127), n)), _splat(builder, I32(23), n))
    return builder.fmul(p, builder.bitcast(bits, t))


@intrinsic
def shifted_exps(typingctx, a, n, shift):
    """``a[i] = exp(a[i] - shift)`` for the ``n`` float32 at address ``a``, in place, by
    :func:`_fast_exp` 16 lanes at a time (the last lanes masked); returns their sum in
    four partial sums by ``i % 4``, the ``n % 4`` left into the first, then ``(s0 + s1)
    + (s2 + s3)``: the bits of the decode kernel's ``exp_into`` and ``_sum4``, one pass
    of vector code where those were a scalar loop each."""
    sig = types.float32(types.uintp, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        a_a, n_v, shift = args
        v16, v4 = _vec(F32, 16), _vec(F32, 4)
        mask_t = _vec(ir.IntType(1), 16)
        load = _fn(
            builder, "llvm.masked.load.v16f32.p0", v16, [ir.PointerType(v16), I32, mask_t, v16]
        )
        store = _masked_store(builder)
        lanes = ir.Constant(_vec(I32, 16), list(range(16)))
        shifts = _splat(builder, shift, 16)
        with cgutils.for_range(builder, builder.udiv(builder.add(n_v, I64(15)), I64(16))) as loop:
            first = builder.mul(loop.index, I64(16))
            left = builder.trunc(builder.sub(n_v, first), I32)
            live = builder.icmp_unsigned("<", lanes, _splat(builder, left, 16))
            at = builder.inttoptr(builder.add(a_a, builder.mul(first, I64(4))), ir.PointerType(v16))
            v = builder.call(load, [at, I32(4), live, ir.Constant(v16, None)])
            builder.call(store, [_fast_exp(builder, builder.fsub(v, shifts)), at, I32(4), live])
        # the sum, in _sum4's order: quads in turn into four partial sums
        part = cgutils.alloca_once_value(builder, ir.Constant(v4, None))
        quads = builder.udiv(n_v, I64(4))
        with cgutils.for_range(builder, quads) as loop:
            at = builder.inttoptr(
                builder.add(a_a, builder.mul(loop.index, I64(16))), ir.PointerType(v4)
            )
            builder.store(builder.fadd(builder.load(part), builder.load(at, align=4)), part)
        s0 = cgutils.alloca_once_value(builder, builder.extract_element(builder.load(part), I32(0)))
        with cgutils.for_range(builder, n_v, start=builder.mul(quads, I64(4))) as loop:
            at = builder.inttoptr(
                builder.add(a_a, builder.mul(loop.index, I64(4))), ir.PointerType(F32)
            )
            builder.store(builder.fadd(builder.load(s0), builder.load(at, align=4)), s0)
        p = builder.load(part)
        low = builder.fadd(builder.load(s0), builder.extract_element(p, I32(1)))
        high = builder.fadd(builder.extract_element(p, I32(2)), builder.extract_element(p, I32(3)))
        return builder.fadd(low, high)

    return sig, codegen


# ---- byte-parallel unpacking -------------------------------------------------------------
#
# numba cannot tell LLVM that a weight row and the codes buffer do not overlap, so its
# unpack loops stay scalar (measured: 241 ns per Q4_K block, against 10 ns for the dot).
# These two state the vector operation directly; LLVM lowers them for any target.


@intrinsic
def bitfield(typingctx, dst, src, n, shift, mask, lshift, accumulate):
    """``dst[i] (|)= ((src[i] >> shift) & mask) << lshift`` for ``i < n`` (bytes at the
    addresses ``dst``, ``src``); ``n`` (16, 32 or 64) and ``accumulate`` (or into ``dst``
    instead of storing) are compile-time constants, the rest may vary."""
    width = _literal(n, (16, 32, 64))
    acc = _literal(accumulate, (0, 1))
    if width is None or acc is None:
        return None
    sig = types.void(types.uintp, types.uintp, n, types.intp, types.intp, types.intp, accumulate)

    def codegen(context, builder, signature, args):
        d, s, _, sh, mk, lsh, _ = args
        vt = _vec(I8, width)
        ptr_d = builder.inttoptr(d, ir.PointerType(vt))
        v = builder.load(builder.inttoptr(s, ir.PointerType(vt)), align=1)

        def splat(value):
            one = builder.insert_element(
                ir.Constant(vt, ir.Undefined), builder.trunc(value, I8), I32(0)
            )
            return builder.shuffle_vector(
                one, ir.Constant(vt, ir.Undefined), ir.Constant(_vec(I32, width), [0] * width)
            )

        v = builder.shl(builder.and_(builder.lshr(v, splat(sh)), splat(mk)), splat(lsh))
        if acc:
            v = builder.or_(builder.load(ptr_d, align=1), v)
        builder.store(v, ptr_d, align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bitplane(typingctx, dst, src, value):
    """``dst[i] |= value`` where bit ``i`` of the 4 little-endian bytes at ``src`` is set,
    for ``i < 32`` (the high bits of Q5_0 / Q5_1)."""
    sig = types.void(types.uintp, types.uintp, types.intp)

    def codegen(context, builder, signature, args):
        d, s, val = args
        v32 = _vec(I8, 32)
        four = builder.load(builder.inttoptr(s, ir.PointerType(_vec(I8, 4))), align=1)
        spread = builder.shuffle_vector(
            four,
            ir.Constant(_vec(I8, 4), ir.Undefined),
            ir.Constant(_vec(I32, 32), [i // 8 for i in range(32)]),
        )
        bits = ir.Constant(v32, [1 << (i % 8) for i in range(32)])
        on = builder.icmp_unsigned("!=", builder.and_(spread, bits), ir.Constant(v32, None))
        one = builder.insert_element(ir.Constant(v32, ir.Undefined), builder.trunc(val, I8), I32(0))
        vals = builder.shuffle_vector(
            one, ir.Constant(v32, ir.Undefined), ir.Constant(_vec(I32, 32), [0] * 32)
        )
        ptr_d = builder.inttoptr(d, ir.PointerType(v32))
        add = builder.select(on, vals, ir.Constant(v32, None))
        builder.store(builder.or_(builder.load(ptr_d, align=1), add), ptr_d, align=1)
        return context.get_dummy_value()

    return sig, codegen


# Sub-block scales: the integer field of each lane, gathered from the block's scale bytes
# (``n_bytes`` read exactly, never past the block), then ``dst[j] = float(field[j]) * mul``.
# One entry per packing: (lanes, bytes read, gather index per lane / part, shift, mask,
# left shift) for up to two parts or-ed together, then a signed bias and signedness.
SCALE_KINDS = {
    # Q6_K: 16 int8 scales
    "i8": (16, 16, [(list(range(16)), [0] * 16, [255] * 16, [0] * 16)], 0, True),
    # Q2_K: low / high nibbles of 16 bytes
    "lo4": (16, 16, [(list(range(16)), [0] * 16, [15] * 16, [0] * 16)], 0, False),
    "hi4": (16, 16, [(list(range(16)), [4] * 16, [15] * 16, [0] * 16)], 0, False),
    # Q4_K / Q5_K: 8 six-bit scales and mins in 12 bytes (gguf.quants.Q4_K.get_scale_min)
    "k4_scale": (
        8,
        12,
        [
            ([0, 1, 2, 3, 8, 9, 10, 11], [0] * 8, [63] * 4 + [15] * 4, [0] * 8),
            ([0, 1, 2, 3, 0, 1, 2, 3], [0] * 4 + [6] * 4, [0] * 4 + [3] * 4, [0] * 4 + [4] * 4),
        ],
        0,
        False,
    ),
    "k4_min": (
        8,
        12,
        [
            ([4, 5, 6, 7, 8, 9, 10, 11], [0] * 4 + [4] * 4, [63] * 4 + [15] * 4, [0] * 8),
            ([4, 5, 6, 7, 4, 5, 6, 7], [0] * 4 + [6] * 4, [0] * 4 + [3] * 4, [0] * 4 + [4] * 4),
        ],
        0,
        False,
    ),
    # Q3_K: 16 six-bit scales in 12 bytes, stored with a bias of 32
    "k3_scale": (
        16,
        12,
        [
            ([i % 8 for i in range(16)], [4 * (i // 8) for i in range(16)], [15] * 16, [0] * 16),
            ([8 + i % 4 for i in range(16)], [2 * (i // 4) for i in range(16)], [3] * 16, [4] * 16),
        ],
        32,
        False,
    ),
}
SCALE_KIND_CODES = {name: code for code, name in enumerate(SCALE_KINDS)}


def scale_field(builder, raw, kind: str):
    """The integer sub-block fields of ``SCALE_KINDS[kind]`` from the block's scale bytes
    ``raw`` (a byte vector) as ``<lanes x i32>``: what :func:`scale_lanes` multiplies, and
    what the super-block kernels multiply integer sums by."""
    lanes, n_bytes, parts, bias, signed = SCALE_KINDS[kind]
    vi = _vec(I32, lanes)
    undef = ir.Constant(raw.type, ir.Undefined)
    field = ir.Constant(vi, None)
    for index, shift, mask, lshift in parts:
        g = builder.shuffle_vector(raw, undef, ir.Constant(_vec(I32, lanes), index))
        g = builder.sext(g, vi) if signed else builder.zext(g, vi)
        if not signed:
            g = builder.and_(builder.lshr(g, ir.Constant(vi, shift)), ir.Constant(vi, mask))
        field = builder.or_(field, builder.shl(g, ir.Constant(vi, lshift)))
    if bias:
        field = builder.sub(field, ir.Constant(vi, [bias] * lanes))
    return field


def _amax(builder, chunks: list):
    """The largest magnitude in the float32 vectors ``chunks`` (``<32 x float>`` each), as
    the largest of their bit patterns with the sign cleared: for floats that are not NaN
    the integers order as the magnitudes do, so it is ``fabs`` then ``maxnum``'s value,
    in integer instructions (``maxnum``'s NaN rules cost a compare and a blend per step: a
    super-block quantized in 13.5 against 31.4 us for 16 x 8192). A NaN is the largest
    pattern, so a block holding one gets a NaN scale and its products are NaN, as float
    arithmetic would make them."""
    v32i = _vec(I32, 32)
    smax = _fn(builder, "llvm.smax.v32i32", v32i, [v32i, v32i])
    magnitude = ir.Constant(v32i, [0x7FFFFFFF] * 32)
    m = None
    for v in chunks:
        bits = builder.and_(builder.bitcast(v, v32i), magnitude)
        m = bits if m is None else builder.call(smax, [m, bits])
    top = builder.call(_fn(builder, "llvm.vector.reduce.smax.v32i32", I32, [v32i]), [m])
    return builder.bitcast(top, F32)


def _int8_scale(builder, amax):
    """``(d, inv)`` for a block whose largest magnitude is ``amax``: ``d = amax / 127``
    and ``inv = 127 / amax`` (0 for an all-zero block) splat over 32 lanes."""
    v32f = _vec(F32, 32)
    d = builder.fdiv(amax, F32(127.0))
    positive = builder.fcmp_ordered(">", amax, F32(0.0))
    inv = builder.select(positive, builder.fdiv(F32(127.0), amax), F32(0.0))
    one = builder.insert_element(ir.Constant(v32f, ir.Undefined), inv, I32(0))
    invv = builder.shuffle_vector(
        one, ir.Constant(v32f, ir.Undefined), ir.Constant(_vec(I32, 32), [0] * 32)
    )
    return d, invv


@intrinsic
def scale_lanes(typingctx, dst, src, kind, mul):
    """float32 ``dst[j] = field_kind(bytes at src)[j] * mul`` (see :data:`SCALE_KINDS`;
    ``kind`` is a compile-time :data:`SCALE_KIND_CODES` value)."""
    code = _literal(kind, range(len(SCALE_KINDS)))
    if code is None:
        return None
    lanes, n_bytes, parts, bias, signed = SCALE_KINDS[list(SCALE_KINDS)[code]]
    sig = types.void(types.uintp, types.uintp, kind, types.float32)

    def codegen(context, builder, signature, args):
        d, s, _, mul = args
        raw = builder.load(builder.inttoptr(s, ir.PointerType(_vec(I8, n_bytes))), align=1)
        field = scale_field(builder, raw, list(SCALE_KINDS)[code])
        vf = _vec(F32, lanes)
        f = builder.sitofp(field, vf)
        m1 = builder.insert_element(ir.Constant(vf, ir.Undefined), mul, I32(0))
        m = builder.shuffle_vector(
            m1, ir.Constant(vf, ir.Undefined), ir.Constant(_vec(I32, lanes), [0] * lanes)
        )
        builder.store(builder.fmul(f, m), builder.inttoptr(d, ir.PointerType(vf)), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def expand_codes(typingctx, dst, codes, fw, fo, k, sw, signed, to_bf16):
    """``w[i] = fw[i // sw] * codes[i] + fo[i // sw]`` for ``i < k`` (``fo`` ignored when
    ``signed``), stored at ``dst`` as float32, or as bf16 bit patterns rounded to nearest
    even when ``to_bf16`` (``Tensor.to(torch.bfloat16)``'s rounding; NaN is not expected in
    dequantized weights). A multiply then an add, each rounded, as ``gguf.quants`` does."""
    lit = (_literal(sw, (16, 32)), _literal(signed, (0, 1)), _literal(to_bf16, (0, 1)))
    if any(v is None for v in lit):
        return None
    sw_v, signed_v, bf16_v = lit
    sig = types.void(
        types.uintp, types.uintp, types.uintp, types.uintp, types.intp, sw, signed, to_bf16
    )

    def codegen(context, builder, signature, args):
        d_a, c_a, fw_a, fo_a, k_v = args[:5]
        v16f, v16i = _vec(F32, 16), _vec(I32, 16)

        def splat(addr):
            s = builder.load(builder.inttoptr(addr, ir.PointerType(F32)), align=4)
            one = builder.insert_element(ir.Constant(v16f, ir.Undefined), s, I32(0))
            return builder.shuffle_vector(
                one, ir.Constant(v16f, ir.Undefined), ir.Constant(v16i, [0] * 16)
            )

        with cgutils.for_range(builder, builder.udiv(k_v, I64(16))) as loop:
            g = loop.index
            c = builder.load(
                builder.inttoptr(
                    builder.add(c_a, builder.mul(g, I64(16))), ir.PointerType(_vec(I8, 16))
                ),
                align=1,
            )
            v = builder.sitofp(builder.sext(c, v16i) if signed_v else builder.zext(c, v16i), v16f)
            sub = builder.udiv(builder.mul(g, I64(16)), I64(sw_v))
            val = builder.fmul(v, splat(builder.add(fw_a, builder.mul(sub, I64(4)))))
            if not signed_v:
                val = builder.fadd(val, splat(builder.add(fo_a, builder.mul(sub, I64(4)))))
            if bf16_v:
                u = builder.bitcast(val, v16i)
                lsb = builder.and_(
                    builder.lshr(u, ir.Constant(v16i, [16] * 16)), ir.Constant(v16i, [1] * 16)
                )
                r = builder.lshr(
                    builder.add(builder.add(u, ir.Constant(v16i, [0x7FFF] * 16)), lsb),
                    ir.Constant(v16i, [16] * 16),
                )
                out = builder.trunc(r, _vec(I16, 16))
                ptr = builder.inttoptr(
                    builder.add(d_a, builder.mul(g, I64(32))), ir.PointerType(_vec(I16, 16))
                )
            else:
                out = val
                ptr = builder.inttoptr(
                    builder.add(d_a, builder.mul(g, I64(64))), ir.PointerType(v16f)
                )
            builder.store(out, ptr, align=2)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def quantize32(typingctx, x, q, out):
    """One activation block: the 32 float32 at ``x`` to int8 at ``q``,
    ``q = clamp(rint(x * 127 / amax), -127, 127)``; writes float32
    ``[d, d * sum(q[:16]), d * sum(q[16:]), d * sum(q)]`` at ``out`` with ``d = amax / 127``
    (numba's ``np.rint`` is a libm call per element)."""
    sig = types.void(types.uintp, types.uintp, types.uintp)

    def codegen(context, builder, signature, args):
        x_a, q_a, o_a = args
        v32f, v32i = _vec(F32, 32), _vec(I32, 32)
        v = builder.load(builder.inttoptr(x_a, ir.PointerType(v32f)), align=4)
        d, invv = _int8_scale(builder, _amax(builder, [v]))
        r = builder.call(_fn(builder, "llvm.rint.v32f32", v32f, [v32f]), [builder.fmul(v, invv)])
        i = builder.fptosi(r, v32i)
        i = builder.call(
            _fn(builder, "llvm.smax.v32i32", v32i, [v32i, v32i]),
            [i, ir.Constant(v32i, [-127] * 32)],
        )
        i = builder.call(
            _fn(builder, "llvm.smin.v32i32", v32i, [v32i, v32i]), [i, ir.Constant(v32i, [127] * 32)]
        )
        builder.store(
            builder.trunc(i, _vec(I8, 32)),
            builder.inttoptr(q_a, ir.PointerType(_vec(I8, 32))),
            align=1,
        )
        v16i = _vec(I32, 16)
        add16 = _fn(builder, "llvm.vector.reduce.add.v16i32", I32, [v16i])
        s0 = builder.call(add16, [builder.shuffle_vector(i, i, ir.Constant(v16i, list(range(16))))])
        s1 = builder.call(
            add16, [builder.shuffle_vector(i, i, ir.Constant(v16i, list(range(16, 32))))]
        )
        values = [d] + [
            builder.fmul(d, builder.sitofp(s, F32)) for s in (s0, s1, builder.add(s0, s1))
        ]
        for j, val in enumerate(values):
            builder.store(
                val, builder.inttoptr(builder.add(o_a, I64(4 * j)), ir.PointerType(F32)), align=4
            )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def u8_pointer(typingctx, addr):
    """The address ``addr`` as a ``uint8*`` (for ``numba.carray``: a weight row found
    through a part table, kernels.quant.blocks.byte_row)."""
    sig = types.CPointer(types.uint8)(types.uintp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(I8))

    return sig, codegen


# Bytes ahead of the block being unpacked that each block (or group of blocks) asks into L2 (``prefetcht1``
# per 64-byte line): a steady stream where the hardware prefetchers fall behind. Cold
# matrices, one thread, one token, two levels, 2-core AMD EPYC, none / 4096 / 8192 /
# 16384 bytes ahead (the next row's whole bytes asked for at each row's start before):
# Q6_K 6400 x 18944 7.9 / 23.1 / 24.1 / 20.8 GB/s, Q4_K 6400 x 18944 9.4 / 21.6 / 26.5 /
# 25.1, Q4_K 34000 x 3584 21.4 / 25.8 / 25.4 / 25.7, Q6_K 34000 x 3584 29.1 / 33.8 /
# 36.9 / 35.8 (long rows were slowest: their two levels of activations, 37 KB at 18,944
# wide, overflow L1 and take the misses the weights' stream needs)
STREAM_AHEAD = 8192


def stream_ahead(builder, base, nbytes: int):
    """Ask for the lines :data:`STREAM_AHEAD` bytes past the ``nbytes`` at ``base`` into
    L2 (past a row's end that is the next row's start; past a matrix's end, addresses a
    prefetch may name without faulting)."""
    fn = _fn(builder, "llvm.prefetch.p0", ir.VoidType(), [ir.PointerType(I8), I32, I32, I32])
    for line in range((nbytes + 63) // 64):
        at = builder.inttoptr(builder.add(base, I64(STREAM_AHEAD + 64 * line)), ir.PointerType(I8))
        builder.call(fn, [at, I32(0), I32(2), I32(1)])


@intrinsic
def prefetch(typingctx, addr, nbytes):
    """Ask for the ``nbytes`` at ``addr`` to be brought into L2 (``prefetcht1`` per
    64-byte line): the next weight row, while this one is unpacked and dotted. Not into
    L1: an 8,192-wide row, the next one and two levels of activations overflow it."""
    sig = types.void(types.uintp, types.intp)

    def codegen(context, builder, signature, args):
        a, n = args
        fn = _fn(builder, "llvm.prefetch.p0", ir.VoidType(), [ir.PointerType(I8), I32, I32, I32])
        with cgutils.for_range(builder, builder.udiv(builder.add(n, I64(63)), I64(64))) as loop:
            p = builder.inttoptr(
                builder.add(a, builder.mul(loop.index, I64(64))), ir.PointerType(I8)
            )
            builder.call(fn, [p, I32(0), I32(2), I32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def quantize256(typingctx, x, q, out):
    """One super-block of activations: the 256 float32 at ``x`` to int8 at ``q``,
    ``q = clamp(rint(x * 127 / amax), -127, 127)`` with ``amax`` over all 256, and
    ``d = amax / 127`` (float32) at ``out`` (llama.cpp's Q8_K block, for the k-quant
    kernels of :mod:`kernels.quant.superblock`)."""
    sig = types.void(types.uintp, types.uintp, types.uintp)

    def codegen(context, builder, signature, args):
        x_a, q_a, o_a = args
        v32f, v32i = _vec(F32, 32), _vec(I32, 32)
        chunks = [
            builder.load(
                builder.inttoptr(builder.add(x_a, I64(128 * c)), ir.PointerType(v32f)), align=4
            )
            for c in range(8)
        ]
        d, invv = _int8_scale(builder, _amax(builder, chunks))
        rint = _fn(builder, "llvm.rint.v32f32", v32f, [v32f])
        smax = _fn(builder, "llvm.smax.v32i32", v32i, [v32i, v32i])
        smin = _fn(builder, "llvm.smin.v32i32", v32i, [v32i, v32i])
        for c, v in enumerate(chunks):
            i = builder.fptosi(builder.call(rint, [builder.fmul(v, invv)]), v32i)
            i = builder.call(smax, [i, ir.Constant(v32i, [-127] * 32)])
            i = builder.call(smin, [i, ir.Constant(v32i, [127] * 32)])
            dst = builder.inttoptr(builder.add(q_a, I64(32 * c)), ir.PointerType(_vec(I8, 32)))
            builder.store(builder.trunc(i, _vec(I8, 32)), dst, align=1)
        builder.store(d, builder.inttoptr(o_a, ir.PointerType(F32)), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _residual_chunk(builder, x_a, q0_a, scale_v, inv_v, q1_a):
    """:func:`residual256`'s step on 32 elements: the second-level codes stored at
    ``q1_a``, returned as ``<32 x i32>``."""
    v32f, v32i, v32b = _vec(F32, 32), _vec(I32, 32), _vec(I8, 32)
    rint = _fn(builder, "llvm.rint.v32f32", v32f, [v32f])
    smax = _fn(builder, "llvm.smax.v32i32", v32i, [v32i, v32i])
    smin = _fn(builder, "llvm.smin.v32i32", v32i, [v32i, v32i])
    x_v = builder.load(builder.inttoptr(x_a, ir.PointerType(v32f)), align=4)
    codes = builder.load(builder.inttoptr(q0_a, ir.PointerType(v32b)), align=1)
    rest = builder.fsub(x_v, builder.fmul(builder.sitofp(codes, v32f), scale_v))
    i = builder.fptosi(builder.call(rint, [builder.fmul(rest, inv_v)]), v32i)
    i = builder.call(smax, [i, ir.Constant(v32i, [-127] * 32)])
    i = builder.call(smin, [i, ir.Constant(v32i, [127] * 32)])
    builder.store(builder.trunc(i, v32b), builder.inttoptr(q1_a, ir.PointerType(v32b)), align=1)
    return i


@intrinsic
def residual256(typingctx, x, q0, scale, inv, q1):
    """The second level of one super-block of activations: with the 256 float32 at ``x``
    and their first-level int8 codes at ``q0`` (scale ``scale``), the int8 codes
    ``clamp(rint((x - q0 * scale) * inv), -127, 127)`` at ``q1`` (``inv`` = 256 /
    ``scale``, 0 for an all-zero block), each product and difference rounded to float32
    on its own (no fused multiply-add): numpy's float32 arithmetic, step for step."""
    sig = types.void(types.uintp, types.uintp, types.float32, types.float32, types.uintp)

    def codegen(context, builder, signature, args):
        x_a, q0_a, scale, inv, q1_a = args
        scale_v, inv_v = _splat(builder, scale, 32), _splat(builder, inv, 32)
        for c in range(8):
            at = [builder.add(a, I64(n * c)) for a, n in ((x_a, 128), (q0_a, 32), (q1_a, 32))]
            _residual_chunk(builder, at[0], at[1], scale_v, inv_v, at[2])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def residual32(typingctx, x, q0, scale, inv, q1, out):
    """The second level of one block of 32 activations, as :func:`residual256` makes it
    for 256 (codes at 1/256 of the first level's ``scale``, ``inv`` = 256 / ``scale``),
    and at ``out`` the float32 ``[d * sum(q1[:16]), d * sum(q1[16:]), d * sum(q1),
    d * (256 * sum(q0) + sum(q1))]`` with ``d = scale / 256`` (the last the block's sum
    of both levels: the integer exact, |.| < 2^21, rounded once)."""
    sig = types.void(
        types.uintp, types.uintp, types.float32, types.float32, types.uintp, types.uintp
    )

    def codegen(context, builder, signature, args):
        x_a, q0_a, scale, inv, q1_a, o_a = args
        q1 = _residual_chunk(
            builder, x_a, q0_a, _splat(builder, scale, 32), _splat(builder, inv, 32), q1_a
        )
        v32i, v16i = _vec(I32, 32), _vec(I32, 16)
        add16 = _fn(builder, "llvm.vector.reduce.add.v16i32", I32, [v16i])
        add32 = _fn(builder, "llvm.vector.reduce.add.v32i32", I32, [v32i])
        lo, hi = (
            builder.call(
                add16, [builder.shuffle_vector(q1, q1, ir.Constant(v16i, list(range(h, h + 16))))]
            )
            for h in (0, 16)
        )
        q0 = builder.load(builder.inttoptr(q0_a, ir.PointerType(_vec(I8, 32))), align=1)
        s0 = builder.call(add32, [builder.sext(q0, v32i)])
        s1 = builder.add(lo, hi)
        pair = builder.add(builder.mul(s0, I32(256)), s1)
        d = builder.fdiv(scale, ir.Constant(F32, 256.0))
        for j, s in enumerate((lo, hi, s1, pair)):
            at = builder.inttoptr(builder.add(o_a, I64(4 * j)), ir.PointerType(F32))
            builder.store(builder.fmul(d, builder.sitofp(s, F32)), at, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sums16(typingctx, q, out):
    """The int32 sums per 16 of the 256 int8 codes at ``q``, at ``out`` (16 int32)."""
    sig = types.void(types.uintp, types.uintp)

    def codegen(context, builder, signature, args):
        q_a, o_a = args
        v16i, v16b = _vec(I32, 16), _vec(I8, 16)
        # (vector, the sub-block of each lane): sub-block s widened, then vectors added in
        # pairs, each pair's lanes halved per sub-block (two shuffles and an add), until
        # one vector holds one sum per lane; a last shuffle puts them in order
        parts = []
        for s in range(16):
            at = builder.inttoptr(builder.add(q_a, I64(16 * s)), ir.PointerType(v16b))
            parts.append((builder.sext(builder.load(at, align=1), v16i), [s] * 16))
        while len(parts) > 1:
            merged = []
            for (a, la), (b, lb) in zip(parts[::2], parts[1::2]):
                lo, hi, labels = [], [], []
                for offset, lab in ((0, la), (16, lb)):
                    for sub in dict.fromkeys(lab):
                        lanes = [i for i, x in enumerate(lab) if x == sub]
                        half = len(lanes) // 2
                        lo += [offset + i for i in lanes[:half]]
                        hi += [offset + i for i in lanes[half:]]
                        labels += [sub] * half
                pick = [
                    builder.shuffle_vector(a, b, ir.Constant(_vec(I32, 16), m)) for m in (lo, hi)
                ]
                merged.append((builder.add(*pick), labels))
            parts = merged
        total, labels = parts[0]
        order = ir.Constant(_vec(I32, 16), [labels.index(s) for s in range(16)])
        total = builder.shuffle_vector(total, ir.Constant(v16i, ir.Undefined), order)
        builder.store(total, builder.inttoptr(o_a, ir.PointerType(v16i)), align=4)
        return context.get_dummy_value()

    return sig, codegen
