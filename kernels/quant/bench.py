"""GB/s of the block-quantized kernels against the machine's read bandwidth (issue 14).

    python -m kernels.quant.bench [--threads 2] [--types Q4_K,Q6_K,Q8_0] [--quick]

Every figure is *weight bytes* (the file's block bytes, or torch int4's packed bytes plus
its scales) per second. Weights are cold: each timing runs over enough copies of the matrix
to exceed the last-level cache, as one decode step reads a whole model. Kernels are timed
in rotation, several rounds, best round kept, so that a noisy neighbour slows all of them
alike. Columns:

* ``bound``: ``torch.sum`` over 1 GiB of float32 (the read bandwidth the kernels chase);
* ``int8``: :func:`kernels.quant.decode_matmul` (int8 activations, integer dot products),
  activation quantization included;
* ``f32act``: the same unpacker with float32 activations and float dot products (a
  bench-only variant, the road not taken);
* ``int4``: torch's ``_weight_int4pack_mm_for_cpu`` (kernels/int4.py, today's Q4 path).

Then prefill: dequantized tiles into a reused buffer + torch GEMM against dequantizing the
whole matrix first, and the first-call compile time of each kernel.

    python -m kernels.quant.bench --tiles [--threads 2]

instead: the repacked tile kernels (:mod:`kernels.quant.tiles`, Q4_K and Q6_K, two levels
of activations) at 16, 32 and 128 tokens, through AVX-512 VNNI and, where the CPU grants
it, AMX (:mod:`kernels.quant.amx`), in rotation: multiply-adds a second (one level
counted) and weight bytes a second, with the weights cold (copies past the last-level
cache, as decode steps read them) and warm (one copy again and again, as a prompt's token
groups meet a tile).

    python -m kernels.quant.bench --tiles32 [--threads 2]

the blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in their tiles (:mod:`kernels.quant.
tiles32`) against the per-32 kernel on the file's blocks, at 1, 4, 16 and 128 tokens,
cold and warm, in rotation.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numba
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kernels.quant import (
    QuantWeight,
    decode_matmul,
    dequantize_weight,
    prefill_matmul,
    quantize_activations,
)
from kernels.quant.blocks import JIT
from kernels.quant.kquants import unpack_q4_k
from kernels.quant.simd import F32, HOST_ISA, I8, I32, I64, _fma, _tree_sum, _vec, float_dot

Q = GGMLQuantizationType
SHAPES = ((14336, 4096), (4096, 4096))  # Llama-3-8B ffn up/gate, attention q/o
BATCHES = (1, 4, 16)
COLD_BYTES = 640 << 20  # above any last-level cache we have met (the dev VM reports 300 MiB)

# The byte offsets of fp16 scales per block: random bytes elsewhere are valid codes.
_FP16_FIELDS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
}


def random_blocks(
    qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator
) -> np.ndarray:
    """uint8 ``[n, row_bytes]``: random codes with small positive fp16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    nb = n * k // block_size
    blocks = rng.integers(0, 256, (nb, type_size), dtype=np.uint8)
    for at in _FP16_FIELDS[qtype]:
        scale = (np.abs(rng.standard_normal(nb)) * 1e-3 + 1e-5).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def read_bandwidth(reps: int = 5, device: str | torch.device = "cpu") -> float:
    """bytes/s of ``torch.sum`` over 1 GiB of float32 on ``device``."""
    x = torch.ones(1 << 28, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def read() -> None:
        x.sum()
        sync()

    read()
    best = min(_timed(read) for _ in range(reps))
    return x.numel() * 4 / best


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ---- the float-activation variant (bench only) -------------------------------------------


@intrinsic
def _float_codes_dot(typingctx, c, x, fw, k):
    """sum_i fw[i // 32] * c[i] * x[i] for uint8 codes ``c`` and float32 ``x``: the dot
    product a kernel without activation quantization does (16 lanes, FMA)."""
    sig = types.float32(types.uintp, types.uintp, types.uintp, types.intp)

    def codegen(context, builder, signature, args):
        c_a, x_a, fw_a, k_v = args
        v16f, v16i = _vec(F32, 16), _vec(I32, 16)
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, None))
        with cgutils.for_range(builder, builder.udiv(k_v, I64(32))) as loop:
            sub = loop.index
            s = builder.load(
                builder.inttoptr(builder.add(fw_a, builder.mul(sub, I64(4))), ir.PointerType(F32))
            )
            one = builder.insert_element(ir.Constant(v16f, ir.Undefined), s, I32(0))
            sv = builder.shuffle_vector(
                one, ir.Constant(v16f, ir.Undefined), ir.Constant(v16i, [0] * 16)
            )
            for half_ in range(2):
                at = builder.add(builder.mul(sub, I64(32)), I64(16 * half_))
                cv = builder.load(
                    builder.inttoptr(builder.add(c_a, at), ir.PointerType(_vec(I8, 16))), align=1
                )
                xv = builder.load(
                    builder.inttoptr(
                        builder.add(x_a, builder.mul(at, I64(4))), ir.PointerType(v16f)
                    ),
                    align=4,
                )
                prod = builder.fmul(builder.uitofp(cv, v16f), xv)
                builder.store(_fma(builder, prod, sv, builder.load(acc)), acc)
        return _tree_sum(builder, builder.load(acc))

    return sig, codegen


@numba.njit(**JIT, parallel=True)
def _decode_q4_k_f32(w, x, xsum32, out, tasks):
    n_rows = w.shape[0]
    batch, k = x.shape
    n_sub = k // 32
    per = (n_rows + tasks - 1) // tasks
    for t in numba.prange(tasks):
        codes = np.empty(k, np.uint8)
        fw = np.empty(n_sub, np.float32)
        fo = np.empty(n_sub, np.float32)
        for n in range(t * per, min((t + 1) * per, n_rows)):
            unpack_q4_k(w[n], codes, fw, fo)
            for b in range(batch):
                s = _float_codes_dot(codes.ctypes.data, x[b].ctypes.data, fw.ctypes.data, k)
                out[b, n] = s + float_dot(fo.ctypes.data, xsum32[b].ctypes.data, n_sub)


def _f32_variant(w: QuantWeight, x: np.ndarray, out: np.ndarray, tasks: int) -> None:
    xsum = x.reshape(x.shape[0], -1, 32).sum(-1, dtype=np.float32)
    _decode_q4_k_f32(w.data, x, xsum, out, tasks)


# ---- decode -----------------------------------------------------------------------------


def _rotation(make: Callable[[], object], nbytes: int, cold_bytes: int = COLD_BYTES) -> list:
    return [make() for _ in range(max(2, -(-cold_bytes // nbytes)))]


def bench_decode(qtype: GGMLQuantizationType, n: int, k: int, rounds: int, rng) -> dict:
    """{"kernel B=b": bytes/s} for one type and shape."""
    from kernels.int4 import int4_from_gguf, int4_linear

    raw = random_blocks(qtype, n, k, rng)
    weights = _rotation(lambda: QuantWeight.from_raw(raw.copy(), qtype, (n, k)), raw.nbytes)
    tasks = numba.get_num_threads() * 4
    # name -> (fn(m) running over the first m copies, bytes per copy, copies available)
    kernels: dict[str, tuple[Callable[[int], object], int, int]] = {}
    for b in BATCHES:
        x = rng.standard_normal((b, k)).astype(np.float32)
        out = np.empty((b, n), np.float32)

        def ours(m, x=x, out=out):
            for w in weights[:m]:
                decode_matmul(quantize_activations(x), w, out)

        kernels[f"int8 B={b}"] = (ours, raw.nbytes, len(weights))
        if qtype == Q.Q4_K:

            def f32act(m, x=x, out=out):
                for w in weights[:m]:
                    _f32_variant(w, x, out, tasks)

            kernels[f"f32act B={b}"] = (f32act, raw.nbytes, len(weights))
    if qtype == Q.Q4_K:
        packed = _rotation(
            lambda: int4_from_gguf(torch.from_numpy(raw.reshape(-1)), qtype, (n, k)), raw.nbytes
        )
        for b in BATCHES:
            xt = torch.from_numpy(rng.standard_normal((b, k)).astype(np.float32))

            def int4(m, xt=xt):
                for p in packed[:m]:
                    int4_linear(xt, p)

            kernels[f"int4 B={b}"] = (int4, packed[0].nbytes(), len(packed))
    # Copies per timing: all of them (cold) unless that takes more than ~0.5 s; a kernel
    # that slow is nowhere near the bandwidth, so cache residency does not change it.
    count = {}
    for name, (fn, _, available) in kernels.items():
        fn(1)  # compile / warm up
        one = _timed(lambda fn=fn: fn(1))
        count[name] = int(min(available, max(2, 0.5 // max(one, 1e-9))))
    best = {name: float("inf") for name in kernels}
    for _ in range(rounds):
        for name, (fn, _, _) in kernels.items():
            best[name] = min(best[name], _timed(lambda fn=fn, m=count[name]: fn(m)) / count[name])
    return {name: kernels[name][1] / best[name] for name in kernels}


# ---- prefill ----------------------------------------------------------------------------


def bench_prefill(qtype: GGMLQuantizationType, n: int, k: int, b: int, rounds: int, rng) -> dict:
    """{path: seconds} for a ``[b, k]`` x weight ``[n, k]`` product."""
    raw = random_blocks(qtype, n, k, rng)
    w = QuantWeight.from_raw(raw, qtype, (n, k))
    x = torch.from_numpy(rng.standard_normal((b, k)).astype(np.float32))
    from kernels.quant.matmul import prefill_dtype

    dt = prefill_dtype()

    def whole():
        full = dequantize_weight(w, dtype=dt)
        return (x.to(dt) @ full.t()).float()

    paths = {
        "tiles": lambda: prefill_matmul(x, w),
        "whole": whole,
        "dequant only": lambda: dequantize_weight(w, dtype=dt),
    }
    best = {p: float("inf") for p in paths}
    for fn in paths.values():
        fn()
    for _ in range(rounds):
        for p, fn in paths.items():
            best[p] = min(best[p], _timed(fn))
    return best


# ---- tile kernels -------------------------------------------------------------------------

TILE_SHAPES = {Q.Q4_K: (8192, 2048), Q.Q6_K: (2048, 8192)}  # Llama-3.2-1B ffn up, down
TILE_TOKENS = (16, 32, 128)


def bench_tiles(
    qtype: GGMLQuantizationType,
    rounds: int,
    rng,
    shape: tuple[int, int] | None = None,
    tokens_list: tuple[int, ...] = TILE_TOKENS,
    cold_bytes: int = COLD_BYTES,
) -> dict:
    """{(tokens, path, "cold" | "warm"): seconds per matrix} for the tile kernels on an
    ``[n, k]`` matrix (default :data:`TILE_SHAPES`), path "vnni" or "amx" (the latter
    where :func:`~kernels.quant.amx.amx_ready`)."""
    from kernels.quant.activations import quantize_super_blocks
    from kernels.quant.amx import amx_ready
    from kernels.quant.matmul import decode_tasks
    from kernels.quant.superblock import KBLOCK_CODES
    from kernels.quant.tiles import repack_parts, tile_rows

    n, k = shape or TILE_SHAPES[qtype]
    code = KBLOCK_CODES[qtype.name]
    raw = random_blocks(qtype, n, k, rng)
    copies = _rotation(lambda: repack_parts([raw], qtype.name), raw.nbytes, cold_bytes)
    paths = {"vnni": False} | ({"amx": True} if amx_ready() else {})
    cases = {}
    for tokens in tokens_list:
        act = quantize_super_blocks(rng.standard_normal((tokens, k)).astype(np.float32), levels=2)
        out = np.empty((tokens, n), np.float32)
        for path, amx in paths.items():
            for temp, mats in (("cold", copies), ("warm", copies[:1] * len(copies))):

                def run(mats=mats, act=act, out=out, amx=amx):
                    for tiles in mats:
                        tile_rows(code, tiles, n, act, out, decode_tasks(), amx)

                cases[(tokens, path, temp)] = (run, len(mats))
    return _best_per_matrix(cases, rounds)


def _best_per_matrix(cases: dict, rounds: int) -> dict:
    """{case: best seconds per matrix} over ``rounds`` rounds of every case in turn
    (``cases``: case -> (run, matrices a run multiplies)), after one run each to compile
    and warm up."""
    best = {case: float("inf") for case in cases}
    for run, _ in cases.values():
        run()
    for _ in range(rounds):
        for case, (run, m) in cases.items():
            best[case] = min(best[case], _timed(run) / m)
    return best


def _file_bytes(qtype, n: int, k: int) -> int:
    """The file's bytes of an ``[n, k]`` matrix of ``qtype``."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return n * (k // block_size) * type_size


def print_tiles(rounds: int, rng) -> None:
    for qtype, (n, k) in TILE_SHAPES.items():
        nbytes = _file_bytes(qtype, n, k)
        res = bench_tiles(qtype, rounds, rng)
        for (tokens, path, temp), sec in res.items():
            print(
                f"tiles {qtype.name} {n}x{k} {tokens:4d} tokens {path:>4} {temp}: "
                f"{tokens * n * k / sec / 1e9:6.0f} G multiply-adds/s, "
                f"weights {nbytes / sec / 1e9:5.1f} GB/s",
                flush=True,
            )


# the blocks of 32: Gemma 3 270M's tied head and an ffn matrix, SmolLM2's fused gate/up,
# and the Llama-3.2-1B ffn up for the types neither model holds
TILE32_SHAPES = {
    Q.Q8_0: (262144, 640),
    Q.Q5_0: (2048, 640),
    Q.Q4_1: (3072, 576),
    Q.Q4_0: (8192, 2048),
    Q.Q5_1: (8192, 2048),
}
TILE32_TOKENS = (1, 4, 16, 128)


def bench_tiles32(
    qtype: GGMLQuantizationType,
    rounds: int,
    rng,
    shape: tuple[int, int] | None = None,
    tokens_list: tuple[int, ...] = TILE32_TOKENS,
    cold_bytes: int = COLD_BYTES,
) -> dict:
    """{(tokens, path, "cold" | "warm"): seconds per matrix} for a block-of-32 type on an
    ``[n, k]`` matrix (default :data:`TILE32_SHAPES`), path "tiles" (its tiles,
    :mod:`kernels.quant.tiles32`) or "block32" (the per-32 kernel reading the file's
    blocks, :mod:`kernels.quant.block32`, what CPUs without AVX-512 VNNI run), both on the
    same two levels of activations, in rotation."""
    from kernels.quant.activations import two_level_activations
    from kernels.quant.matmul import decode_tasks, parts_kernel_args
    from kernels.quant.registry import quant_type
    from kernels.quant.tiles import _aligned, _huge_pages_later, repack_parts
    from kernels.quant.tiles32 import tile_rows32

    n, k = shape or TILE32_SHAPES[qtype]
    kind = quant_type(qtype)
    raw = random_blocks(qtype, n, k, rng)

    def in_pages():
        # in the pages repack_parts gives the tiles (4 KB, then left to khugepaged): numpy's
        # copies get transparent huge pages at once, which one token reads 1.2-1.3x faster
        out = _aligned(raw.shape)
        out[:] = raw
        _huge_pages_later(out)
        return out

    blocks = _rotation(in_pages, raw.nbytes, cold_bytes)
    tiles = _rotation(lambda: repack_parts([raw], qtype.name), raw.nbytes, cold_bytes)
    cases = {}
    for tokens in tokens_list:
        act = two_level_activations(rng.standard_normal((tokens, k)).astype(np.float32))
        out = np.empty((tokens, n), np.float32)
        levels, *args = parts_kernel_args(kind, act, tokens)

        def by_tiles(mats, act=act, out=out):
            for t in mats:
                tile_rows32(qtype.name, t, n, act, out, decode_tasks())

        def by_blocks(mats, levels=levels, args=args, out=out):
            for m in mats:
                table = np.array([[m.ctypes.data, n]], np.int64)
                kind.decode_parts(table, m.shape[1], levels, *args, out, decode_tasks())

        for path, fn, mats in (("tiles", by_tiles, tiles), ("block32", by_blocks, blocks)):
            for temp, used in (("cold", mats), ("warm", mats[:1] * len(mats))):
                cases[(tokens, path, temp)] = (functools.partial(fn, used), len(used))
    return _best_per_matrix(cases, rounds)


def print_tiles32(rounds: int, rng) -> None:
    for qtype, (n, k) in TILE32_SHAPES.items():
        nbytes = _file_bytes(qtype, n, k)
        res = bench_tiles32(qtype, rounds, rng)
        for tokens in TILE32_TOKENS:
            for temp in ("cold", "warm"):
                t, b = res[(tokens, "tiles", temp)], res[(tokens, "block32", temp)]
                print(
                    f"tiles32 {qtype.name} {n}x{k} {tokens:4d} tokens {temp}: tiles "
                    f"{t * 1e3:8.3f} ms ({tokens * n * k / t / 1e9:5.0f} G multiply-adds/s, "
                    f"{nbytes / t / 1e9:5.1f} GB/s), block32 {b * 1e3:8.3f} ms: {b / t:.2f}x",
                    flush=True,
                )


def compile_times(types: list[GGMLQuantizationType]) -> dict:
    """Seconds to compile each type's decode kernel from scratch (no cache)."""
    from kernels.quant.registry import quant_type

    times = {}
    for qt in types:
        kind = quant_type(qt)
        fresh = numba.njit(**{**JIT, "cache": False, "parallel": True})(kind.decode.py_func)
        w = QuantWeight.from_raw(random_blocks(qt, 8, 256, np.random.default_rng(0)), qt, (8, 256))
        act = quantize_activations(np.ones((1, 256), np.float32))
        xsum = act.sum16 if kind.sub_block == 16 else act.sum32
        out = np.empty((1, 8), np.float32)
        times[qt.name] = _timed(functools.partial(fresh, w.data, act.q, act.scale, xsum, out, 4))
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4096 x 4096 only, 3 rounds")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="the tile kernels instead (VNNI, AMX)")
    ap.add_argument(
        "--tiles32",
        action="store_true",
        help="the blocks of 32 in tiles against the per-32 kernel instead (VNNI)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    if args.tiles or args.tiles32:
        print(f"ISA {HOST_ISA}, {args.threads} threads")
        (print_tiles if args.tiles else print_tiles32)(args.rounds, np.random.default_rng(0))
        return
    types = [Q[name] for name in args.types.split(",")]
    shapes = SHAPES[1:] if args.quick else SHAPES
    rounds = 3 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    bound = read_bandwidth()
    print(
        f"ISA {HOST_ISA}, {args.threads} threads; read bandwidth (torch.sum, 1 GiB fp32): {bound / 1e9:.1f} GB/s"
    )
    print(
        f"{'type':6} {'shape':>12} {'kernel':>8} "
        + " ".join(f"{'B=' + str(b):>14}" for b in BATCHES)
    )
    for qt in types:
        for n, k in shapes:
            res = bench_decode(qt, n, k, rounds, rng)
            for kernel in ("int8", "f32act", "int4"):
                cells = [res.get(f"{kernel} B={b}") for b in BATCHES]
                if cells[0] is None:
                    continue
                text = " ".join(f"{c / 1e9:6.1f} ({c / bound:4.0%})" for c in cells)
                print(f"{qt.name:6} {f'{n}x{k}':>12} {kernel:>8} {text}", flush=True)
    n, k = SHAPES[1]
    for qt in types:
        for b in (64, 512):
            t = bench_prefill(qt, n, k, b, rounds, rng)
            flops = 2 * b * n * k
            print(
                f"prefill {qt.name} B={b} {n}x{k}: tiles {t['tiles'] * 1e3:.2f} ms ({flops / t['tiles'] / 1e9:.0f} GFLOP/s), "
                f"whole-matrix dequant + matmul {t['whole'] * 1e3:.2f} ms, dequant alone {t['dequant only'] * 1e3:.2f} ms",
                flush=True,
            )
    if not args.no_compile:
        for name, sec in compile_times(types).items():
            print(f"compile {name} decode kernel (cold, no cache): {sec:.1f} s")


if __name__ == "__main__":
    main()
