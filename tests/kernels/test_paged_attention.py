"""kernels.paged_attention (and the Triton kernel): paged attention against contiguous attention."""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.kvquant import (
    KeyOffset,
    KVFormat,
    allocate_pages,
    decode,
    encode,
    quantize_into,
    rope_table,
)
from kernels.layer_kv import LayerKV
from kernels.paged_attention import (
    CPU_HALF_PAGES,
    HAS_NUMBA,
    paged_attention,
    paged_attention_reference,
    paged_decode,
    paged_decode_numba,
)

FP32 = KVFormat(None)
FP16 = KVFormat(None, torch.float16)
EXACT = 1e-5


def asym(bits: int) -> KVFormat:
    return KVFormat(bits, asymmetric=True)


# (context length, new tokens): a full prefill, prefill chunks over a cached prefix (one
# crossing page boundaries), decodes at various lengths, and a sequence idle this step.
MIXED = [(37, 37), (300, 20), (1, 1), (129, 1), (512, 1), (70, 5), (50, 0), (17, 1)]
DECODE = [(1, 1), (40, 1), (129, 1), (300, 1), (17, 1)]


@dataclass
class Case:
    q: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [context, kv_heads, head_dim], as written
    values: list[torch.Tensor]
    k_store: dict
    v_store: dict
    fmt_k: KVFormat
    fmt_v: KVFormat
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: torch.Tensor
    scale: float
    k_offset: KeyOffset | None = None  # keys stored as k - R(j) mu

    def paged(self, fn=paged_attention_reference, sliding_window=None) -> torch.Tensor:
        kv = LayerKV(self.k_store, self.v_store, self.fmt_k, self.fmt_v, self.k_offset)
        return fn(
            self.q,
            kv,
            self.block_tables,
            self.seq_lens,
            self.q_lens,
            self.scale,
            sliding_window=sliding_window,
        )

    def reference(self, sliding_window=None, keys=None, values=None) -> torch.Tensor:
        return contiguous_attention(
            self.q,
            keys or self.keys,
            values or self.values,
            self.q_lens.tolist(),
            self.scale,
            sliding_window,
        )

    def stored(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K/V as the cache holds them (after quantization), keys with R(j) mu added back."""

        def back(fmt, x):
            return decode(fmt, encode(fmt, x))

        keys = []
        for k in self.keys:
            if self.k_offset is None:
                keys.append(back(self.fmt_k, k))
            else:
                mu_p = self.k_offset.at(torch.arange(k.shape[0]))
                keys.append(back(self.fmt_k, k - mu_p) + mu_p)
        return keys, [back(self.fmt_v, v) for v in self.values]


def contiguous_attention(q, keys, values, q_lens, scale, sliding_window=None) -> torch.Tensor:
    """Per sequence, float64, GQA by repeating KV heads: the plain definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for k, v, n in zip(keys, values, q_lens):
        if n == 0:
            continue
        ctx = k.shape[0]
        group = q.shape[1] // k.shape[1]
        qs = q[start : start + n].double().transpose(0, 1)  # [h, n, d]
        kk = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [h, ctx, d]
        vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
        pos = torch.arange(ctx - n, ctx)[:, None]
        j = torch.arange(ctx)[None, :]
        allowed = j <= pos
        if sliding_window is not None:
            allowed &= pos - j < sliding_window
        scores = (qs @ kk.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, -math.inf)
        out[start : start + n] = (scores.softmax(-1) @ vv).transpose(0, 1)
        start += n
    return out.float()


def make_case(
    shapes,
    page_size,
    n_heads=6,
    kv_heads=2,
    head_dim=64,
    fmt_k=FP32,
    fmt_v=FP32,
    seed=0,
    spare_pages=3,
    extra_columns=2,
    key_mean=0.0,
) -> Case:
    """Random K/V written into shuffled pages.  With ``key_mean`` the keys get a constant
    pre-RoPE offset of that size (as real keys have) and are stored relative to it through
    a :class:`KeyOffset`, as the engine stores quantized keys."""
    g = torch.Generator().manual_seed(seed)
    k_offset = None
    if key_mean:
        mean = torch.randn(kv_heads, head_dim, generator=g) * key_mean
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        k_offset = KeyOffset(mean, rope_table(inv_freq, max(ctx for ctx, _ in shapes) + 5))
    pages_per_seq = [-(-ctx // page_size) for ctx, _ in shapes]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=g)  # shuffled, non-contiguous pages
    k_store = allocate_pages(fmt_k, num_pages, page_size, kv_heads, head_dim)
    v_store = allocate_pages(fmt_v, num_pages, page_size, kv_heads, head_dim)
    width = max(pages_per_seq) + extra_columns
    block_tables = torch.full((len(shapes), width), -1, dtype=torch.int32)
    keys, values = [], []
    used = 0
    for b, (ctx, _) in enumerate(shapes):
        pages = order[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        block_tables[b, : len(pages)] = pages.to(torch.int32)
        k = torch.randn(ctx, kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, kv_heads, head_dim, generator=g)
        t = torch.arange(ctx)
        if k_offset is not None:
            k = k + k_offset.at(t)
        stored = k if k_offset is None else k - k_offset.at(t)
        quantize_into(fmt_k, k_store, pages[t // page_size], t % page_size, stored)
        quantize_into(fmt_v, v_store, pages[t // page_size], t % page_size, v)
        keys.append(k)
        values.append(v)
    q_lens = torch.tensor([n for _, n in shapes])
    q = torch.randn(int(q_lens.sum()), n_heads, head_dim, generator=g)
    return Case(
        q=q,
        keys=keys,
        values=values,
        k_store=k_store,
        v_store=v_store,
        fmt_k=fmt_k,
        fmt_v=fmt_v,
        block_tables=block_tables,
        seq_lens=torch.tensor([ctx for ctx, _ in shapes]),
        q_lens=q_lens,
        scale=head_dim**-0.5,
        k_offset=k_offset,
    )


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (9, 3)], ids=["gqa3", "mha", "smollm2"])
def test_fp32_cache_matches_contiguous(page_size, heads):
    case = make_case(MIXED, page_size, *heads)
    assert _max_err(case.paged(), case.reference()) < EXACT


@pytest.mark.parametrize("window", [1, 8, 100])
@pytest.mark.parametrize("page_size", [16, 256])
def test_sliding_window(page_size, window):
    case = make_case(MIXED, page_size)
    assert _max_err(case.paged(sliding_window=window), case.reference(window)) < EXACT


def test_fp16_cache_and_fp16_queries():
    case = make_case(
        MIXED, 16, fmt_k=KVFormat(None, torch.float16), fmt_v=KVFormat(None, torch.float16)
    )
    keys, values = case.stored()
    assert _max_err(case.paged(), case.reference(keys=keys, values=values)) < EXACT
    case.q = case.q.half()
    out = case.paged()
    assert out.dtype == torch.float16
    assert _max_err(out, case.reference(keys=keys, values=values)) < 2e-3


# Relative error of the attention output against the unquantized cache (MIXED, page 16,
# gaussian q/k/v, head dim 64).  Measured: K8/V8 0.0066, K4/V4 0.107, K8/V4 0.090, K4/V8 0.058.
QUANT_ERR = {(8, 8): 0.009, (4, 4): 0.14, (8, 4): 0.12, (4, 8): 0.08}


@pytest.mark.parametrize("bits", list(QUANT_ERR), ids=lambda b: f"k{b[0]}v{b[1]}")
def test_quantized_cache(bits):
    case = make_case(MIXED, 16, fmt_k=KVFormat(bits[0]), fmt_v=KVFormat(bits[1]))
    out = case.paged()
    # the paged path adds nothing to the quantization error itself
    keys, values = case.stored()
    assert _max_err(out, case.reference(keys=keys, values=values)) < EXACT
    assert _rel_err(out, case.reference()) < QUANT_ERR[bits]


# The engine's formats: both grids asymmetric, keys with a constant pre-RoPE offset of size 3
# (SmolLM2's run to 12) stored relative to it.  Measured (with or without a window of 20):
# K8/V8 0.0055, K4/V4 0.093, K8/V4 0.077, K4/V8 0.052; the same keys quantized directly
# (offset included): K4/V4 1.15; attending without adding the offset back: 0.63.
QUANT_ERR_OFFSET = {(8, 8): 0.0075, (4, 4): 0.12, (8, 4): 0.1, (4, 8): 0.07}


@pytest.mark.parametrize("bits", list(QUANT_ERR_OFFSET), ids=lambda b: f"k{b[0]}v{b[1]}")
@pytest.mark.parametrize("window", [None, 20])
def test_quantized_cache_with_key_offset(bits, window):
    case = make_case(MIXED, 16, 9, 3, fmt_k=asym(bits[0]), fmt_v=asym(bits[1]), key_mean=3.0)
    out = case.paged(sliding_window=window)
    # SDPA on the dequantized keys plus R(j) mu and the dequantized values
    keys, values = case.stored()
    assert _max_err(out, case.reference(window, keys=keys, values=values)) < EXACT
    assert _rel_err(out, case.reference(window)) < QUANT_ERR_OFFSET[bits]


def test_key_offset_is_added_back():
    """The offset is not optional: attending without it is far from the true keys."""
    case = make_case(MIXED, 16, 9, 3, fmt_k=asym(4), fmt_v=asym(4), key_mean=3.0)
    ref = case.reference()
    assert _rel_err(case.paged(), ref) < QUANT_ERR_OFFSET[(4, 4)]
    offset, case.k_offset = case.k_offset, None
    assert _rel_err(case.paged(), ref) > 0.5
    # nor can it be short: every key position must have a table row
    case.k_offset = KeyOffset(offset.mean, offset.table[:100])
    with pytest.raises(ValueError, match="positions"):
        case.paged()


def test_key_offset_beats_quantizing_the_offset():
    """The same keys quantized directly (offset included) lose far more."""
    with_offset = make_case(MIXED, 16, 9, 3, fmt_k=asym(4), fmt_v=asym(4), key_mean=3.0)
    ref = with_offset.reference()
    direct = make_case(MIXED, 16, 9, 3, fmt_k=asym(4), fmt_v=asym(4))
    # the same full keys, written without the offset
    for b, k in enumerate(with_offset.keys):
        t = torch.arange(k.shape[0])
        pages = direct.block_tables[b, t // 16].long()
        quantize_into(direct.fmt_k, direct.k_store, pages, t % 16, k)
    direct.q = with_offset.q
    assert _rel_err(with_offset.paged(), ref) < 0.2 * _rel_err(direct.paged(), ref)


@st.composite
def _batches(draw):
    """Random batches: (context, new tokens) pairs, page size, heads and window."""
    n = draw(st.integers(1, 5))
    shapes = []
    for _ in range(n):
        ctx = draw(st.integers(1, 70))
        shapes.append((ctx, draw(st.sampled_from([0, 1, 1, ctx, min(ctx, 7)]))))
    if all(q == 0 for _, q in shapes):
        shapes[0] = (shapes[0][0], 1)
    heads = draw(st.sampled_from([(2, 1), (6, 2), (3, 3)]))
    window = draw(st.one_of(st.none(), st.integers(1, 80)))
    return shapes, draw(st.sampled_from([16, 32])), heads, window, draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None)
@given(_batches())
def test_random_batches_match_contiguous(batch):
    shapes, page_size, heads, window, seed = batch
    case = make_case(shapes, page_size, *heads, head_dim=32, seed=seed)
    ref = case.reference(window)
    assert _max_err(case.paged(sliding_window=window), ref) < EXACT
    assert _max_err(case.paged(paged_attention, window), ref) < EXACT


def test_block_table_dtype_and_padding_do_not_matter():
    case = make_case(MIXED, 16, extra_columns=0)
    ref = case.paged()
    case.block_tables = torch.cat(
        [case.block_tables.long(), torch.full((len(MIXED), 5), -1, dtype=torch.long)], 1
    )
    assert torch.equal(case.paged(), ref)


def test_rejects_inconsistent_lengths():
    case = make_case(DECODE, 16)
    case.q_lens = case.q_lens + 1
    with pytest.raises(ValueError, match="q_lens"):
        case.paged()


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize(
    "fmts",
    [
        (FP32, FP32),
        (KVFormat(8), KVFormat(8)),
        (KVFormat(4), KVFormat(6)),
        (asym(4), asym(4)),
        (asym(8), asym(3)),
    ],
    ids=str,
)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("key_mean", [0.0, 3.0], ids=["no_offset", "offset"])
def test_decode_path_matches_reference(page_size, fmts, window, key_mean):
    case = make_case(DECODE, page_size, 9, 3, fmt_k=fmts[0], fmt_v=fmts[1], key_mean=key_mean)
    ref = case.paged(sliding_window=window)
    assert _max_err(case.paged(paged_decode, window), ref) < EXACT


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize(
    "fmts",
    [
        (FP32, FP32),
        (KVFormat(8), KVFormat(8)),
        (KVFormat(4), KVFormat(2)),
        (KVFormat(3), KVFormat(7)),
        (FP32, KVFormat(5)),
        (KVFormat(6), FP32),
        (asym(4), asym(4)),
        (asym(7), asym(2)),
        (FP32, asym(5)),
        (FP16, FP16),
        (FP16, FP32),
        (asym(4), FP16),
    ],
    ids=str,
)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("key_mean", [0.0, 3.0], ids=["no_offset", "offset"])
# five sequences: a task per sequence (all its KV heads); one: a task per KV head
@pytest.mark.parametrize("shapes", [DECODE, [(300, 1)]], ids=["batch5", "batch1"])
def test_numba_decode_matches_reference(page_size, fmts, window, key_mean, shapes):
    case = make_case(shapes, page_size, 9, 3, fmt_k=fmts[0], fmt_v=fmts[1], key_mean=key_mean)
    ref = case.paged(sliding_window=window)
    assert _max_err(case.paged(paged_decode_numba, window), ref) < EXACT


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
# query heads per KV head: 4 (Llama-3.2-1B, Gemma 3) four at a time, 7 (Qwen2-7B) four
# then three one by one (three together for the values), 1 one by one; unquantized pages
# also at head widths with a tail past their last 16 lanes (quantized pages need
# multiples of 32)
@pytest.mark.parametrize(
    "fmts, heads, head_dim",
    [
        *[((FP32, FP32), h, d) for h, d in (((8, 2), 64), ((14, 2), 128), ((4, 4), 80), ((12, 3), 40))],
        *[((asym(4), asym(8)), h, d) for h, d in (((8, 2), 64), ((14, 2), 128), ((4, 4), 96))],
        *[((FP16, FP16), h, d) for h, d in (((8, 2), 64), ((14, 2), 128), ((12, 3), 40))],
        # values four query heads at a time, then the rest: 6 = 4 + 2, 5 = 4 + 1
        *[((FP16, FP32), h, d) for h, d in (((12, 2), 64), ((10, 2), 80))],
    ],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("shapes", [DECODE, [(300, 1)]], ids=["batch5", "batch1"])
def test_numba_decode_head_groupings(fmts, heads, head_dim, shapes):
    case = make_case(shapes, 16, *heads, head_dim, fmt_k=fmts[0], fmt_v=fmts[1])
    ref = case.paged()
    assert _max_err(case.paged(paged_decode_numba), ref) < EXACT


def test_numba_decode_exp_is_within_a_few_ulps():
    """The decode kernel's vectorised exp of scores less their maximum (x <= 0): within
    3e-7 of float64's exp down to -87, where float32 keeps normal numbers; below, tiny."""
    import numba
    import numpy as np

    from kernels.quant.fastexp import exp_into

    @numba.njit
    def run(x, out, bits):
        exp_into(x, out, bits, x.shape[0])

    x = np.concatenate(
        [np.linspace(-87.0, 0.0, 200_001), -np.logspace(-8, 0, 1001), [0.0, -0.5, -1e-30]]
    ).astype(np.float32)
    out = np.empty_like(x)
    run(x, out, np.empty(x.shape, np.int32))
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out / want - 1)) < 3e-7
    assert out[x == 0].min() == 1.0
    low = np.array([-87.5, -100.0, -1e4], np.float32)
    tail = np.empty_like(low)
    run(low, tail, np.empty(3, np.int32))
    assert np.all((tail >= 0) & (tail < 2e-38))


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
def test_numba_decode_rejects_bf16_pages_and_prefill():
    bf16 = KVFormat(None, torch.bfloat16)
    case = make_case(DECODE, 16, fmt_k=bf16, fmt_v=bf16)
    with pytest.raises(ValueError, match="fp32, fp16 or quantized"):
        case.paged(paged_decode_numba)
    with pytest.raises(ValueError, match="q_lens == 1"):
        make_case(MIXED, 16).paged(paged_decode_numba)


def test_dispatch_on_cpu_uses_torch_paths():
    half = KVFormat(None, torch.float16)
    for shapes in (MIXED, DECODE):
        for fmt in (FP32, half, KVFormat(6), asym(4)):
            case = make_case(shapes, 16, fmt_k=fmt, fmt_v=fmt, key_mean=3.0 if fmt.bits else 0.0)
            assert _max_err(case.paged(paged_attention), case.paged()) < EXACT


# ---- Triton, through its CPU interpreter ------------------------------------------------

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def triton_interpreter(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    # triton picks the interpreter when a kernel is decorated, i.e. at import
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import kernels.triton_paged_attention as tpa

    if not tpa.INTERPRETED:
        tpa = importlib.reload(tpa)
    return tpa


TRITON_SHAPES = [(1, 1), (20, 1), (40, 1), (150, 3), (33, 5), (18, 18), (9, 0), (130, 1)]


@pytest.mark.parametrize(
    "fmts",
    [
        (FP32, FP32),
        (KVFormat(None, torch.float16),) * 2,
        (KVFormat(8), KVFormat(4)),
        (KVFormat(3), KVFormat(8)),
        (FP32, KVFormat(4)),
        (KVFormat(2), FP32),
        (asym(4), asym(4)),
        (asym(8), asym(3)),
    ],
    ids=str,
)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("page_size", [16, 128])
def test_triton_matches_reference(triton_interpreter, fmts, window, page_size):
    # keys stored relative to a key offset whenever they are quantized, as the engine does
    key_mean = 3.0 if fmts[0].bits else 0.0
    case = make_case(
        TRITON_SHAPES, page_size, 4, 2, 32, fmt_k=fmts[0], fmt_v=fmts[1], key_mean=key_mean
    )
    ref = case.paged(sliding_window=window)
    out = case.paged(triton_interpreter.triton_paged_attention, window)
    assert _max_err(out, ref) < 1e-4


@pytest.mark.parametrize("fmt", [FP32, KVFormat(5), asym(4)], ids=str)
def test_triton_odd_head_dim_and_smollm2_heads(triton_interpreter, fmt):
    """head_dim 96 is not a power of two (the kernel pads to 128 and masks); 9 query heads
    on 3 KV heads put 5 query rows x 3 heads in each 16-row tile."""
    key_mean = 3.0 if fmt.asymmetric else 0.0
    case = make_case(
        [(40, 1), (23, 23), (70, 2)], 16, 9, 3, 96, fmt_k=fmt, fmt_v=fmt, key_mean=key_mean
    )
    out = case.paged(triton_interpreter.triton_paged_attention)
    assert _max_err(out, case.paged()) < 1e-4


@pytest.mark.parametrize("heads", [(4, 4), (16, 1), (32, 2)], ids=["mha", "mqa16", "gqa16x2"])
def test_triton_head_groupings(triton_interpreter, heads):
    case = make_case([(20, 1), (19, 19), (40, 3)], 16, *heads, 32)
    out = case.paged(triton_interpreter.triton_paged_attention, 9)
    assert _max_err(out, case.paged(sliding_window=9)) < 1e-4


def test_warm_up_compiles_the_decode_kernel():
    from kernels.paged_attention import HAS_NUMBA, _decode_kernel, warm_up

    assert warm_up() is HAS_NUMBA
    if HAS_NUMBA:
        assert _decode_kernel.signatures  # compiled for the argument types every format uses


@pytest.mark.parametrize("heads", [(4, 2), (9, 3)], ids=["gqa2", "smollm2"])
def test_triton_decode_work_list_without_a_round_trip(triton_interpreter, heads):
    """``decode=True`` (every q_len 1, as the caller knows): the work list is one item per
    sequence, made without reading q_lens back (what lets a CUDA graph capture it)."""
    import functools

    case = make_case(DECODE, 16, *heads, 32)
    fn = functools.partial(triton_interpreter.triton_paged_attention, decode=True)
    assert _max_err(case.paged(fn, 7), case.paged(sliding_window=7)) < 1e-4


def test_triton_decode_checks_the_key_offset_against_the_host_length(triton_interpreter):
    """``longest`` (the batch's longest context, known on the host in a decode step) is what
    the key offset table is checked against, so a CUDA graph can capture a quantized K
    cache's decode step: ``seq_lens`` is not read back."""
    import functools

    case = make_case(DECODE, 16, 4, 2, 32, fmt_k=asym(4), fmt_v=asym(4), key_mean=3.0)
    longest = int(case.seq_lens.max())
    fn = functools.partial(triton_interpreter.triton_paged_attention, decode=True, longest=longest)
    assert _max_err(case.paged(fn), case.paged()) < 1e-4
    beyond = functools.partial(fn, longest=case.k_offset.table.shape[0] + 1)
    with pytest.raises(ValueError, match="does not cover the longest context"):
        case.paged(beyond)


def test_a_fresh_prompt_takes_the_causal_kernel_with_the_masks_bits():
    """A prompt from its first token runs SDPA with ``is_causal`` (which skips the
    blocks above the diagonal): the same bits as the causal mask given as a tensor."""
    import torch.nn.functional as F

    case = make_case([(300, 300)], 16)
    q = case.q[None].transpose(1, 2)
    k, v = (t[0][None].transpose(1, 2) for t in (case.keys, case.values))
    mask = torch.ones(300, 300, dtype=torch.bool).tril()
    masked = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True
    ).transpose(1, 2)[0]
    assert torch.equal(case.paged(), masked)


@pytest.mark.parametrize("shape", [(300, 37), (40, 40), (17, 2)])
@pytest.mark.parametrize("window", [None, 8])
def test_one_prompt_chunk_matches_contiguous(shape, window):
    """A step of one sequence's prompt chunk (after a cached prefix, or from the first
    token) takes the reference's path without gathers (kernels/paged_attention.py)."""
    case = make_case([shape], 16)
    assert _max_err(case.paged(sliding_window=window), case.reference(window)) < EXACT


_DECODE_IN_A_CHILD = """
import json, sys, torch
from tests.kernels.test_paged_attention import FP16, asym, make_case
from kernels.paged_attention import paged_decode_numba
out = []
for fmt, kw in ((FP16, {}), (asym(4), {"key_mean": 2.0})):
    case = make_case([(301, 1), (40, 1)], 256, n_heads=8, kv_heads=2, fmt_k=fmt, fmt_v=FP16,
                     seed=5, **kw)
    out.append(case.paged(paged_decode_numba).flatten().view(torch.int32).tolist())
print(json.dumps({"bits": out}))
"""


@pytest.mark.skipif(not CPU_HALF_PAGES, reason="the numba kernel needs F16C for fp16 pages")
def test_the_decode_kernel_gives_the_same_bits_compiled_or_from_numbas_cache(tmp_path):
    """A decode step's attention has the same bits in a process that compiles the kernel
    (into an empty cache), one that loads it from that cache, and one that compiles it with
    the cache off: with fast-math reassociation the first differed from the other two in
    the last bits on 256-token pages, so a seeded reply could change after the kernels
    were compiled again."""
    import os

    from tests.child_process import run_json

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    compiled = run_json(_DECODE_IN_A_CHILD, env=env)
    assert any((tmp_path / "numba").rglob("*.nbi"))  # it wrote the kernel's cache
    loaded = run_json(_DECODE_IN_A_CHILD, env=env)
    uncached = run_json(_DECODE_IN_A_CHILD, env={**env, "NUMBA_DISABLE_CACHE": "1"})
    assert compiled == loaded == uncached
