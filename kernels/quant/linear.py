"""Projections and embeddings on weights kept in their GGUF block format (issue 14).

:class:`BlockLinear` is the model's ``Linear`` for weights read in place from the mapped
file: one or several parts fused along the output dimension (q/k/v, gate/up), each a
:class:`~kernels.quant.weight.QuantWeight` of its own type (a Q4_K_M file mixes Q4_K and
Q6_K within a layer). The input is quantized to int8 once for all parts.
:class:`BlockEmbedding` dequantizes the rows a step looks up, never the table.

On AVX-512 VNNI the Q4_K / Q6_K parts, and the blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1), are repacked at construction into tiles of 16 rows (:mod:`kernels.quant.tiles`,
:mod:`kernels.quant.tiles32`; all parts of a run but the last whole tiles), which one
kernel per type multiplies at every row count, a row's result the same in any batch or
prompt. For the others (any type on CPUs without VNNI), which kernel runs depends on the
number of rows and on whether they are a prompt's or a decode step's
(:func:`prompt_rows`; never on what else is in the batch): a decode step always, and
outside a forward up to :data:`~kernels.quant.matmul.DECODE_MAX_ROWS` rows (a prompt's
forward below :data:`LANE_MIN_ROWS`), the integer decode kernel on two levels of int8
activations (:func:`two_level_activations`; per 256 for the k-quant super-block
kernels), whose row ``b`` depends on input row ``b`` alone. Above, the Q4_K / Q6_K parts take the prompt kernel
with weight rows in vector lanes (:mod:`kernels.quant.lanes`, AVX-512 VNNI;
:data:`LANE_PROMPT_ROWS` rows a call, each row's result the same in any prompt), or
where the CPU lacks it the decode kernel :data:`PROMPT_ROWS` rows at a time (so a
prompt's rows equal what decoding them one by one gives); the other types float32 tiles
dequantized into a reused buffer and torch's GEMM.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from kernels.quant.activations import (
    GELU_TANH_GATE,
    RMS_NORM,
    SILU_GATE,
    Q8Activations,
    Q8KActivations,
    prepared_activations,
    prepared_rows,
    quantize_super_blocks,
    two_level_activations,
)
from kernels.quant.float_rows import float_rows_supported, row_table, rows_of_table
from kernels.quant.lanes import lanes_supported
from kernels.quant.matmul import (
    DECODE_MAX_ROWS,
    decode_tasks,
    dequantize_weight,
    parts_kernel_args,
    prefill_matmul,
    prompt_kernel_args,
)
from kernels.quant.registry import ActivationFormat
from kernels.quant.simd import HOST_ISA
from kernels.quant.superblock import KBLOCK_CODES
from kernels.quant.tiles import (
    TILE_ROWS,
    repack_parts,
    tile_rows,
    tiles_supported,
)
from kernels.quant.tiles32 import CODES as TILES32
from kernels.quant.tiles32 import tile_rows32
from kernels.quant.weight import QuantWeight

# A prompt's rows go through the prompt kernel in lanes (kernels/quant/lanes.py) this many
# a call: its activations (int8 in two orders and int16, 5 bytes an element and token)
# stay within 5 MB at K = 8192, and each tile's unpacked rows serve 16 tiles of tokens
LANE_PROMPT_ROWS = 128
# Within a prompt's forward (:func:`prompt_rows`), from this many rows on: a 32-token
# prompt at the Qwen2-7B shape on a Zen 4 core (the first token of a short chat) took
# 2.52 s through the decode kernel. Without AVX-512 (256-bit lanes, 4 tokens a pass)
# unpacking a tile costs about six tokens' dots, and the lanes win from about 24 rows:
# 8192 x 2048 Q4_K, two threads, AVX2, lanes over the decode kernel in turns at 8 / 16 /
# 32 / 128 rows 0.79-0.85x / 0.96x / 1.02-1.04x / 1.30x
LANE_MIN_ROWS = 8 if HOST_ISA == "avx512vnni" else 24
_FORWARD = threading.local()


@contextlib.contextmanager
def prompt_rows(prompt: bool | None):
    """Within: whether the rows :class:`BlockLinear` multiplies are a prompt's (True: the
    lane kernel from :data:`LANE_MIN_ROWS` rows), a decode step's (False: the decode
    kernel at any row count, so that a sequence decodes to the same bits in a batch of any
    size) or either (None, outside: the lane kernel above ``DECODE_MAX_ROWS`` rows).
    Per thread; the model's forward says which (``Transformer.forward``)."""
    before = _forward_prompt()
    _FORWARD.prompt = prompt
    try:
        yield
    finally:
        _FORWARD.prompt = before


def _forward_prompt() -> bool | None:
    """What :func:`prompt_rows` says on this thread now."""
    return getattr(_FORWARD, "prompt", None)


def _lane_rows(rows: int) -> bool:
    """Whether ``rows`` rows take the lane kernel here (:func:`prompt_rows`)."""
    prompt = _forward_prompt()
    if prompt is None:
        return rows > DECODE_MAX_ROWS
    return prompt and rows >= LANE_MIN_ROWS


# Where it has no such kernel, through the super-block decode kernel this many a call (any count
# gives each row the bits of decoding it alone). The kernel keeps every row-token's
# accumulators and a block of the tokens' activations in L1: at 16 tokens 20 KB with 8
# rows a group, at 32 tokens 40 KB of a 48 KB L1. One thread, 2048 x 8192 Q4_K, in turns:
# 18.9-20.6 cycles per two rows, token and block at 16 tokens, 20.9-24.2 at 32.
PROMPT_ROWS = 16


class PartsLinear:
    """What the projections over file blocks share (here and on a device,
    kernels/quant/device_linear.py): ``parts`` with ``nbytes``, a bias, and no batch copies
    (the point is to keep only the file's bytes)."""

    __slots__ = ()

    def nbytes(self) -> int:
        n = sum(p.nbytes for p in self.parts)
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def add_batched(self) -> int:
        return 0

    def batched_bytes(self) -> int:
        return 0


class BlockLinear(PartsLinear):
    """``y = x W^T (+ b)``, ``W`` the concatenation of ``parts`` along the output dim.

    ``perm`` (optional, int64 ``[N]``) reorders the output columns: llama.cpp stores the
    q/k rows of ``llama`` models permuted per head. Where the parts it moves are repacked
    into tiles anyway and it moves rows only within a part, the tiles take those rows in
    the permuted order (`_row_orders`); otherwise the products are permuted after each
    call, which leaves the file's bytes untouched (no copy at load). The permutation cost
    a 512-token prefill at the 1B shape 1.5% (numpy's ``take`` of the q/k/v output).
    """

    __slots__ = (
        "parts",
        "bias",
        "perm",
        "batched",
        "in_features",
        "out_features",
        "_per32",
        "_quantized",
        "_groups",
        "_take",
        "_bias",
        "_lanes",
        "_tiled",
    )

    def __init__(
        self,
        parts: list[QuantWeight],
        bias: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
        repack: Callable[[list[np.ndarray], str], np.ndarray] = repack_parts,
    ):
        """``repack``: how parts become tiles (:func:`~kernels.quant.tiles.repack_parts`'s
        signature; the loader's releases their file pages as they are done, or maps
        tiles an earlier load kept on disk: engine/model/tile_cache.py)."""
        if not parts:
            raise ValueError("BlockLinear needs at least one weight")
        k = parts[0].in_features
        if any(p.in_features != k for p in parts):
            raise ValueError(f"fused weights disagree on in_features: {[p.shape for p in parts]}")
        self.parts = list(parts)
        self.in_features = k
        self.out_features = sum(p.out_features for p in parts)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        if perm is not None and perm.shape != (self.out_features,):
            raise ValueError(f"perm of shape {tuple(perm.shape)} for {self.out_features} outputs")
        self.bias = bias
        self.perm = perm
        # the permutation in the tiles' row order where it can go there (then no product
        # is permuted after it: `_row_orders`), else applied to the products
        orders = _row_orders(self.parts, perm)
        # numpy copies for the products, which are numpy arrays until returned
        self._take = None if perm is None or orders is not None else perm.numpy()
        self._bias = None if bias is None else bias.float().numpy()
        # whether any part's kernel reads activations per 32 (else only super-blocks are made)
        self._per32 = any(
            not p.is_float and p.kind.activation is ActivationFormat.Q8_32 for p in parts
        )
        # whether any part reads int8 activations at all (all float: the rows as they are,
        # of any width: super-block activations need K a multiple of 256)
        self._quantized = not all(p.is_float for p in parts)
        self._groups = _decode_groups(self.parts, repack, orders)
        self._lanes = any(_in_lanes(g) for g in self._groups)
        # every part in tiles: one kernel at every row count (see `fuses`)
        self._tiled = all(g.tiles is not None for g in self._groups)
        self.batched = None  # no bf16 copies: the point is to keep only the file's bytes

    def __call__(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        """``x [..., K]`` -> float32 ``[..., N]``; ``bf16`` is ignored (``Linear``'s
        signature: only int4 weights keep batch copies)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = torch.from_numpy(self._finish(self._matmul(x2.contiguous())))
        return y.reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        """Resident bytes: the file's blocks read in place, or the tiles they were
        repacked into (whose file pages are then never read)."""
        n = sum(
            g.tiles.nbytes if g.tiles is not None else sum(p.nbytes for p in g.parts)
            for g in self._groups
        )
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def repacked(self) -> list[QuantWeight]:
        """The parts held as tiles (their file bytes are not read again)."""
        return [p for g in self._groups if g.tiles is not None for p in g.parts]

    def rebind_tiles(self, views: Mapping[int, np.ndarray]) -> int:
        """Read each group's tiles from ``views`` (keyed by the address of the array it
        reads now: the same bytes elsewhere, a tile file's mapping) where that holds an
        array of the same shape; how many groups moved. A call under way keeps the arrays
        it took, the next takes the new ones, and the old are freed once unreferenced."""
        groups, moved = [], 0
        for g in self._groups:
            new = None if g.tiles is None else views.get(g.tiles.ctypes.data)
            if new is not None and new.shape == g.tiles.shape:
                g, moved = replace(g, tiles=new), moved + 1
            groups.append(g)
        self._groups = groups
        return moved

    @property
    def prefills_in_row_chunks(self) -> bool:
        """Whether every part of more than DECODE_MAX_ROWS rows goes through the decode
        kernels PROMPT_ROWS rows at a time or through tiles (super-block types, and the
        blocks of 32 in tiles: the others dequantize tiles for torch's GEMM, once per
        call), so that a caller can split its rows into calls at no cost."""
        return all(_super_blocks(g) or g.tiles is not None for g in self._groups)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether :meth:`normed` and :meth:`gated` take ``x``: float32 rows ``[T, ...]``
        few enough for the decode kernels and not for the lane kernel (the row count and
        :func:`prompt_rows` decide, as in ``__call__``), or any number of them where every
        part is in tiles. Tiles multiply a forward's rows alike at any count, so there a
        prompt's norm and gate are the decode step's too, and a prompt's row has the same
        bits however the prompt is split into forwards (a prefix found in the cache, the
        rest computed). At 128 rows the fused norm takes 0.11 ms where torch's and the
        quantization take 0.15, the fused SiLU gate 0.76 where torch's 0.58 (1B shape):
        a 512-token prefill the same speed either way."""
        if x.dtype != torch.float32 or x.dim() != 2:
            return False
        return self._tiled or (x.shape[0] <= DECODE_MAX_ROWS and not self.takes_lanes(x.shape[0]))

    @property
    def has_lanes(self) -> bool:
        """Whether some of its parts take the lane kernel on this CPU (prompt rows)."""
        return self._lanes

    def takes_lanes(self, rows: int) -> bool:
        """Whether ``rows`` rows go through the lane kernel here and now."""
        return _lane_rows(rows) and self.has_lanes

    def normed(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``self(rms_norm(x) * weight)`` for rows that :meth:`fuses`: the norm and the
        activations' quantization in one numba call; with ``residual`` (float32, ``x``'s
        shape), ``x += residual`` first, in place, in the same call."""
        res = None if residual is None else residual.numpy()
        return torch.from_numpy(self.normed_rows(x.numpy(), weight.numpy(), eps, res))

    def gated(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """``self(act(gate) * up)`` (SiLU, or with ``gelu`` tanh-approximated GELU) for
        ``gate_up = [gate | up]`` rows that :meth:`fuses`: the gate and the activations'
        quantization in one numba call."""
        return torch.from_numpy(self.gated_rows(gate_up.numpy(), gelu))

    # The same on numpy rows (float32 ``[T, K]``, T at most DECODE_MAX_ROWS unless every
    # part is in tiles), numpy out: a decode step on the CPU runs its layers so
    # (``Transformer.forward``), each torch op or conversion costing about a microsecond
    # of dispatch on vectors this small.

    def rows(self, x: np.ndarray) -> np.ndarray:
        """``self(x)``."""
        return self._finish(self._decode(x))

    def normed_rows(
        self,
        x: np.ndarray,
        weight: np.ndarray,
        eps: float,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        """:meth:`normed`."""
        return self._prepared_rows(x, RMS_NORM, weight, eps, residual)

    def gated_rows(self, gate_up: np.ndarray, gelu: bool) -> np.ndarray:
        """:meth:`gated`."""
        return self._prepared_rows(gate_up, GELU_TANH_GATE if gelu else SILU_GATE)

    def _prepared_rows(
        self,
        x: np.ndarray,
        op: int,
        weight: np.ndarray | None = None,
        eps: float = 0.0,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        """The product of :func:`prepared_activations` of ``x``; more rows than a decode
        call takes (a prompt's, in tiles) :data:`LANE_PROMPT_ROWS` a call, as
        :meth:`_matmul` quantizes them, so that their activations stay in L2."""
        rows = x.shape[0]
        if not self._quantized:
            return self._finish(self._decode(prepared_rows(x, op, weight, eps, residual)))
        if rows <= DECODE_MAX_ROWS:
            act = prepared_activations(x, op, self._per32, weight, eps, residual)
            return self._finish(self._decode(act.source, act))
        out = np.empty((rows, self.out_features), np.float32)
        for i in range(0, rows, LANE_PROMPT_ROWS):
            part = slice(i, i + LANE_PROMPT_ROWS)
            res = None if residual is None else residual[part]
            act = prepared_activations(x[part], op, self._per32, weight, eps, res)
            self._decode(act.source, act, out=out[part])
        return self._finish(out)

    def _finish(self, y: np.ndarray) -> np.ndarray:
        """The product's columns permuted (``perm``), plus the bias."""
        if self._take is not None:
            y = y.take(self._take, axis=1)
        return y if self._bias is None else y + self._bias

    def _matmul(self, x: torch.Tensor) -> np.ndarray:
        rows = x.shape[0]
        in_lanes = self.takes_lanes(rows)
        if rows <= DECODE_MAX_ROWS and not in_lanes:
            return self._decode(x.numpy())
        out = np.empty((rows, self.out_features), np.float32)
        if _forward_prompt() is False:
            # a decode step of more sequences than one decode call takes: the decode
            # kernels DECODE_MAX_ROWS rows a call, so that each row equals decoding it
            # alone whatever the batch (float32 tiles would round otherwise)
            for i in range(0, rows, DECODE_MAX_ROWS):
                part = x[i : i + DECODE_MAX_ROWS].numpy()
                self._decode(part, out=out[i : i + DECODE_MAX_ROWS])
            return out
        # Q4_K / Q6_K: the decode kernel, PROMPT_ROWS rows a call; each row comes out
        # as decoding it alone would, and sooner than from float32 tiles (where the
        # dequantized tile costs more than the integer dots it replaces; not so for the
        # per-32 types, whose decode kernels unpack into a buffer)
        # Q4_K / Q6_K tiles (kernels/quant/tiles.py): the same bits at any row count
        tiled = [g for g in self._groups if g.tiles is not None]
        chunked = [g for g in self._groups if _super_blocks(g) and g.tiles is None]
        # a prompt's rows, where the CPU has it: the prompt kernel with weight rows in
        # lanes (a row's result is the same in any chunk of any size: kernels/quant/lanes.py)
        lanes = [g for g in chunked if in_lanes and _in_lanes(g)]
        chunked = [g for g in chunked if g not in lanes]
        if rows <= DECODE_MAX_ROWS:  # the other parts as the decode path takes them
            others = [g for g in self._groups if g not in lanes and g.tiles is None]
            if others:
                xn = x.numpy()
                act = two_level_activations(xn) if self._per32 else None
                self._decode(xn, act, out=out, groups=others)
            chunked, rest = [], []
        else:
            rest = self._groups
        per32 = [g for g in tiled if _per32_tiles(g)]
        for i in range(0, rows if lanes or tiled else 0, LANE_PROMPT_ROWS):
            chunk = x[i : i + LANE_PROMPT_ROWS].numpy()
            ka = (
                quantize_super_blocks(chunk, levels=2) if len(per32) < len(tiled) or lanes else None
            )
            a32 = two_level_activations(chunk) if per32 else None
            for group in tiled:
                _tiles(
                    group,
                    a32 if _per32_tiles(group) else ka,
                    out[i : i + LANE_PROMPT_ROWS, group.first : group.first + group.columns],
                )
            for group in lanes:
                kind = group.parts[0].kind
                cols = out[i : i + LANE_PROMPT_ROWS, group.first : group.first + group.columns]
                args = prompt_kernel_args(kind, ka)
                kind.prompt_parts(group.table, group.row_bytes, *args, cols, decode_tasks())
        for i in range(0, rows if chunked else 0, PROMPT_ROWS):
            self._decode(
                x[i : i + PROMPT_ROWS].numpy(), out=out[i : i + PROMPT_ROWS], groups=chunked
            )
        # the other types: float32 tiles, exact products of the dequantized weights (bf16
        # tiles round every output to 8 bits of mantissa: SmolLM2's argmax then moved at
        # 2% of the positions of a 512-token text, against none in float32)
        for group in rest:
            if _super_blocks(group) or group.tiles is not None:
                continue
            cols = out[:, group.first : group.first + group.columns]
            if group.table is None:  # float parts
                _each_float_part(x, group.parts, cols)
                continue
            first = 0  # each part into its columns (a copy of gate and up would double them)
            for p in group.parts:
                part_cols = torch.from_numpy(cols[:, first : first + p.out_features])
                prefill_matmul(x, p, dtype=torch.float32, out=part_cols)
                first += p.out_features
        return out

    def _decode(
        self,
        x: np.ndarray,
        act: Q8Activations | Q8KActivations | None = None,
        out: np.ndarray | None = None,
        groups: list[_Group] | None = None,
    ) -> np.ndarray:
        """Two levels of int8 activations (``act``: already made from ``x``); each group
        of parts (all, or ``groups``) in one kernel call that writes its columns of the
        output (``out``, else a new array; the levels summed in the kernel)."""
        rows = x.shape[0]
        out = np.empty((rows, self.out_features), np.float32) if out is None else out
        if act is None and self._quantized:
            act = (
                two_level_activations(x)
                if self._per32 and groups is None
                else quantize_super_blocks(x, levels=2)
            )
        act_k = None  # super-block activations for tiles, where ``act`` is per 32
        for group in self._groups if groups is None else groups:
            cols = out[:, group.first : group.first + group.columns]
            if group.table is None:  # float parts
                _float_rows_into(x, group, cols)
                continue
            if _per32_tiles(group):
                if not isinstance(act, Q8Activations):  # made in super-blocks for others
                    act = two_level_activations(x)
                _tiles(group, act, cols)
                continue
            if group.tiles is not None:
                if act_k is None:  # ``act`` itself, unless made per 32 for other parts
                    act_k = (
                        act
                        if isinstance(act, Q8KActivations)
                        else quantize_super_blocks(x, levels=2)
                    )
                _tiles(group, act_k, cols)
                continue
            kind = group.parts[0].kind
            levels, *args = parts_kernel_args(kind, act, rows)
            kind.decode_parts(group.table, group.row_bytes, levels, *args, cols, decode_tasks())
        return out


@dataclass(frozen=True, eq=False)  # compared by identity (its table is an array)
class _Group:
    """Output columns ``first .. first + columns`` of a :class:`BlockLinear`: consecutive
    parts of one block type, multiplied in one call through their row table (``table``:
    int64 ``[P, 2]``, each part's first-row address and row count), or float parts
    (``table`` None)."""

    parts: tuple[QuantWeight, ...]
    first: int
    columns: int
    row_bytes: int = 0
    table: np.ndarray | None = None
    # Q4_K / Q6_K on AVX-512 VNNI: the parts repacked into tiles of 16 rows
    # (kernels/quant/tiles.py), which every row count then multiplies
    tiles: np.ndarray | None = None
    # F16 / BF16 parts where kernels/quant/float_rows.py takes them: its row table
    floats: np.ndarray | None = None


def _in_lanes(group: _Group) -> bool:
    """Whether the group's prompt rows take :func:`~kernels.quant.lanes.lane_rows`."""
    kind = group.parts[0].kind if group.table is not None and group.tiles is None else None
    return kind is not None and kind.prompt_parts is not None and lanes_supported(kind.name)


def _tiles(group: _Group, act: Q8KActivations | Q8Activations, cols: np.ndarray) -> None:
    """``cols`` = the tiled group's product with two levels of activations: per 32 for
    the blocks of 32 (:func:`_per32_tiles`), else in super-blocks."""
    name = group.parts[0].kind.name
    if name in TILES32:
        tile_rows32(name, group.tiles, group.columns, act, cols, decode_tasks())
        return
    tile_rows(KBLOCK_CODES[name], group.tiles, group.columns, act, cols, decode_tasks())


def _per32_tiles(group: _Group) -> bool:
    """Whether the group is in tiles that read activations per 32 (the blocks of 32:
    kernels/quant/tiles32.py)."""
    return group.tiles is not None and group.parts[0].kind.name in TILES32


def _super_blocks(group: _Group) -> bool:
    """Whether the group's kernel reads activations per 256 (Q4_K, Q6_K)."""
    return group.table is not None and group.parts[0].kind.activation is ActivationFormat.Q8_256


def _runs(parts: list[QuantWeight]) -> list[list[QuantWeight]]:
    """The parts as :func:`_decode_groups` groups them: consecutive parts of one type
    together (float parts too: :func:`_float_rows_into` takes them in one call)."""
    runs: list[list[QuantWeight]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _in_tiles(run: list[QuantWeight]) -> bool:
    """Whether a run of parts is repacked into tiles: fused parts as one array of tiles,
    every part but the last whole tiles."""
    return (
        not run[0].is_float
        and tiles_supported(run[0].kind.name)
        and all(p.out_features % TILE_ROWS == 0 for p in run[:-1])
    )


def _row_orders(parts: list[QuantWeight], perm: torch.Tensor | None) -> list | None:
    """Per part, the order of its rows that puts ``perm`` into its tiles (None for a part
    it leaves as it is), where it can: ``perm`` moves each part's outputs only within the
    part (llama's q/k rows per head), and every part it moves is in tiles. Else None."""
    if perm is None:
        return None
    orders, first = [], 0
    moved_in_tiles = {id(p): _in_tiles(run) for run in _runs(parts) for p in run}
    cols = perm.numpy()
    for p in parts:
        local = cols[first : first + p.out_features] - first
        first += p.out_features
        if np.array_equal(local, np.arange(p.out_features)):
            orders.append(None)
            continue
        if not moved_in_tiles[id(p)] or not np.array_equal(
            np.sort(local), np.arange(p.out_features)
        ):
            return None
        orders.append(local.astype(np.int64))
    return orders


def _decode_groups(
    parts: list[QuantWeight],
    repack: Callable[..., np.ndarray] = repack_parts,
    orders: list | None = None,
) -> list[_Group]:
    """``orders`` (:func:`_row_orders`): the tiled parts' rows in that order."""
    order_of = {} if orders is None else dict(zip(map(id, parts), orders))
    groups: list[_Group] = []
    first = 0
    for run in _runs(parts):
        columns = sum(p.out_features for p in run)
        if run[0].is_float:
            floats = None
            if float_rows_supported(run[0].qtype):
                floats = row_table([p.data for p in run], run[0].qtype)
            groups.append(_Group(tuple(run), first, columns, floats=floats))
            first += columns
            continue
        table = np.array([[p.data.ctypes.data, p.out_features] for p in run], np.int64)
        tiles = None
        if _in_tiles(run):
            run_orders = [order_of.get(id(p)) for p in run]
            tiles = repack([p.data for p in run], run[0].kind.name, orders=run_orders)
        groups.append(_Group(tuple(run), first, columns, run[0].data.shape[1], table, tiles))
        first += columns
    return groups


def _float_rows_into(x: np.ndarray, group: _Group, cols: np.ndarray) -> None:
    """``cols = x @ W.T`` for a group of float parts at decode sizes: F16 / BF16 read as
    the file has them, in one call (:mod:`kernels.quant.float_rows`), F32 (and F16
    without F16C) by torch, part by part."""
    if group.floats is not None:
        rows_of_table(group.floats, group.parts[0].qtype, x, cols, decode_tasks())
        return
    _each_float_part(torch.from_numpy(x), group.parts, cols)


def _each_float_part(x: torch.Tensor, parts: tuple[QuantWeight, ...], cols: np.ndarray) -> None:
    """Each float part's product (:func:`_float_part`) into its columns of ``cols``."""
    first = 0
    for p in parts:
        cols[:, first : first + p.out_features] = _float_part(x, p).numpy()
        first += p.out_features


def _float_part(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """F32 as it is; F16 / BF16 through float32 tiles (exact: computing in half
    precision rounds the activations and every output)."""
    wt = w.float_tensor()
    if wt.dtype == torch.float32:
        return F.linear(x, wt)
    return prefill_matmul(x, w, dtype=torch.float32)


class BlockEmbedding:
    """Token rows of a ``[vocab, hidden]`` table in its file format, dequantized (float32)
    when looked up; ``read`` (``GGUFFile.row_reader``), if given, reads the rows from the
    file instead of the mapping (the table's pages then stay out of the resident set)."""

    __slots__ = ("weight", "read")

    def __init__(self, weight: QuantWeight, read: Callable[[np.ndarray], np.ndarray] | None = None):
        self.weight = weight
        self.read = read

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weight
        index = tokens.reshape(-1).numpy()
        if index.size == 0:
            return torch.empty((*tokens.shape, w.in_features))
        if int(index.min()) < 0 or int(index.max()) >= w.out_features:
            raise IndexError(f"token id outside the vocabulary of {w.out_features:,}")
        if w.is_float:
            rows = F.embedding(torch.from_numpy(index), w.float_tensor()).float()
        else:
            picked = (
                self.read(index) if self.read is not None else np.ascontiguousarray(w.data[index])
            )
            rows = dequantize_weight(
                QuantWeight.from_raw(picked, w.qtype, (index.size, w.in_features))
            )
        return rows.reshape(*tokens.shape, w.in_features)

    def nbytes(self) -> int:
        return self.weight.nbytes
