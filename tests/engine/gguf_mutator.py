"""Seeded damage to a small GGUF model, for the loader's fuzz test (issue 13).

:func:`write_base_model` writes a loadable 12-layer llama GGUF of about 4 MB (int4-loadable
weights, a byte-level vocabulary, a ChatML template). :func:`parse_layout` records where every
header field lies in its bytes, and :func:`mutations` turns that into a fixed list of
:class:`Mutation` for a seed: header counts, KV values, value types, array element types
and counts, string lengths, key names, tensor dims, types, offsets and names, the
alignment, truncations, random bit flips and hostile chat templates. The same seed
gives the same list on every machine, so a failure found in CI can be replayed here.

A mutation holds its edits, not its bytes: ``apply(base, layout)`` builds the damaged file when
it is needed, so a few hundred of them cost no memory up front.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

# -- the base model -----------------------------------------------------------------------

# Many thin layers: the int4 repacking's transient buffers are per matrix, so with a dozen
# layers the largest of them is small beside the file and a normal load stays near 1x it.
HIDDEN, FF, LAYERS, HEADS, KV_HEADS = 256, 512, 12, 4, 2
BASE_ALIGNMENT = 32
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Every linear weight in a type the int4 path keeps packed, so the loaded model is about
# the size of the file and 2x the file size is a bound with room for a transient copy.
_LAYER_TYPES = {
    "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_K,
}  # fmt: skip


def _vocabulary() -> list[str]:
    # GPT-2's byte-to-unicode table: every byte has a token, so any text encodes.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [256 + i for i in range(256 - len(printable))]
    byte_chars = [chr(c) for c in printable + extra]
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_chars, "Ġt", "he", "Ġthe"]


def _random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random codes with small, finite fp16 scales: valid bytes of any block type."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scale_at = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q8_0: (0,), Q.Q6_K: (208,)}[qtype]
    for at in scale_at:
        scales = rng.uniform(1e-3, 3e-3, size=n_blocks).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, cols // block * type_size)


def write_base_model(path: Path, seed: int = 0) -> Path:
    """A loadable llama GGUF of about 4 MB with tokenizer and chat template."""
    rng = np.random.default_rng(seed)
    tokens = _vocabulary()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("fuzz-base")
    w.add_custom_alignment(BASE_ALIGNMENT)
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    kv = HIDDEN // HEADS * KV_HEADS

    def norm(name: str) -> None:
        w.add_tensor(name, rng.normal(1.0, 0.1, size=HIDDEN).astype(np.float32))

    def weight(name: str, qtype: Q, rows: int, cols: int) -> None:
        w.add_tensor(name, _random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    weight("token_embd.weight", Q.Q8_0, len(tokens), HIDDEN)
    weight("output.weight", Q.Q6_K, len(tokens), HIDDEN)
    norm("output_norm.weight")
    shapes = {
        "attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN),
        "ffn_down": (HIDDEN, FF),
    }  # fmt: skip
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for role, (rows, cols) in shapes.items():
            weight(f"blk.{i}.{role}.weight", _LAYER_TYPES[role], rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- where each header field lies ---------------------------------------------------------

_SCALAR_SIZES = {
    VT.UINT8: 1, VT.INT8: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4,
    VT.FLOAT32: 4, VT.BOOL: 1, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8,
}  # fmt: skip


@dataclass
class Span:
    start: int
    end: int


@dataclass
class KVEntry:
    key: str
    key_at: int  # the key's u64 length; the key's text follows
    type_at: int
    vtype: int
    value: Span  # the whole value, after the type id
    etype_at: int | None = None  # arrays: element type, then u64 count
    etype: int | None = None
    count: int = 0
    elements: list[Span] = field(default_factory=list)  # string elements start at their length


@dataclass
class TensorEntry:
    name: str
    name_at: int
    n_dims_at: int
    dims: list[int]  # as stored: innermost first
    type_at: int
    qtype: int
    offset_at: int
    offset: int  # relative to the data section


@dataclass
class Layout:
    kvs: dict[str, KVEntry]
    tensors: dict[str, TensorEntry]
    infos_end: int  # the tensor directory ends here; padding up to data_start follows
    data_start: int
    size: int

    N_TENSORS_AT = 8
    N_KV_AT = 16


def parse_layout(data: bytes) -> Layout:
    """Where every field of a well-formed GGUF v3 header lies (the base model's layout)."""
    pos = 24

    def u(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = u("<Q")
        text = data[pos : pos + n].decode()
        pos += n
        return text

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype == VT.STRING:
            string()
        elif vtype == VT.ARRAY:
            etype, count = u("<I"), u("<Q")
            for _ in range(count):
                skip_value(etype)
        else:
            pos += _SCALAR_SIZES[VT(vtype)]

    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    kvs: dict[str, KVEntry] = {}
    for _ in range(n_kv):
        key_at = pos
        key = string()
        type_at = pos
        vtype = u("<I")
        entry = KVEntry(key, key_at, type_at, vtype, Span(pos, pos))
        if vtype == VT.ARRAY:
            entry.etype_at = pos
            entry.etype, entry.count = u("<I"), u("<Q")
            for _ in range(entry.count):
                start = pos
                skip_value(entry.etype)
                entry.elements.append(Span(start, pos))
        else:
            skip_value(vtype)
        entry.value.end = pos
        kvs[key] = entry
    tensors: dict[str, TensorEntry] = {}
    for _ in range(n_tensors):
        name_at = pos
        name = string()
        n_dims_at = pos
        dims = [u("<Q") for _ in range(u("<I"))]
        type_at = pos
        qtype = u("<I")
        offset_at = pos
        tensors[name] = TensorEntry(
            name, name_at, n_dims_at, dims, type_at, qtype, offset_at, u("<Q")
        )
    data_start = -(-pos // BASE_ALIGNMENT) * BASE_ALIGNMENT
    return Layout(kvs, tensors, pos, data_start, len(data))


# -- mutations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """One damaged variant of the base file: ``kind`` groups it, ``description`` names it.

    ``edits`` are ``(start, end, replacement)`` over the base bytes; ``realign`` keeps the
    tensor data at an aligned offset after edits that change the header's length (as a
    writer would), so that the damage is only the edit; ``truncate`` cuts the result.
    """

    kind: str
    description: str
    edits: tuple[tuple[int, int, bytes], ...] = ()
    realign: bool = False
    truncate: int | None = None

    def apply(self, base: bytes, layout: Layout) -> bytes:
        head = bytearray(base[: layout.infos_end] if self.realign else base)
        for start, end, new in sorted(self.edits, reverse=True):
            head[start:end] = new
        if self.realign:
            head += bytes(-len(head) % BASE_ALIGNMENT)
            head += base[layout.data_start :]
        out = bytes(head)
        return out if self.truncate is None else out[: self.truncate]

    def __str__(self) -> str:
        return f"{self.kind}: {self.description}"


def _put(at: int, fmt: str, value: int | float) -> tuple[int, int, bytes]:
    size = struct.calcsize(fmt)
    if fmt[-1] in "BHIQ":
        value = int(value) % (1 << (8 * size))  # -1 is all ones, 2**64 wraps to 0
    elif fmt[-1] in "bhiq":
        value = (int(value) + (1 << (8 * size - 1))) % (1 << (8 * size)) - (1 << (8 * size - 1))
    return (at, at + size, struct.pack(fmt, value))


def _gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


# Integers a damaged or hostile header holds: the edges of each width, and off-by-ones.
_EDGE_INTS = (0, 1, -1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)  # fmt: skip
_EDGE_FLOATS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 3.4e38, 1e-45)
_INT_FORMATS = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
    VT.INT32: "<i", VT.UINT64: "<Q", VT.INT64: "<q", VT.BOOL: "<B",
}  # fmt: skip
_FLOAT_FORMATS = {VT.FLOAT32: "<f", VT.FLOAT64: "<d"}
# Value type ids a damaged file may claim: every defined one and some that are not.
_VALUE_TYPE_IDS = (*range(13), 13, 99, 2**31, 2**32 - 1)
_TENSOR_TYPE_IDS = (*(int(t) for t in Q), 4, 5, 31, 250, 2**31, 2**32 - 1)

# Templates a hostile or broken model file may carry, rendered once after a load.
HOSTILE_TEMPLATES = {
    "huge repeat": "{{ 'x' * 10**9 }}",
    "power": "{{ 9 ** 9 ** 9 }}",
    "list repeat": "{% set xs = [0] * 10**9 %}{{ xs | length }}",
    "output loop": "{% for i in range(100000) %}{{ 'z' * 100000 }}{% endfor %}",
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    ),
    "doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}"
    ),
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "center": "{{ 'a' | center(10**9) }}",
    "format width": "{{ '%999999999d' % 1 }}",
    "syntax error": "{% for m in messages %}{{ m['content'] }",
    "unclosed block": "{% if messages %}" * 200,
    "deep nesting": "{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000,
    "deep expression": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "undefined name": "{{ nothing_here.attribute() }}",
    "undefined call": "{{ messages[0]['content'].no_such_method() }}",
    "index out of range": "{{ messages[99]['content'] }}",
    "raise": "{{ raise_exception('hostile template') }}",
    "sandbox escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "range overflow": "{% for i in range(10**12) %}{% endfor %}",
    "empty": "",
    "huge text": "y" * (1 << 20),
    "bad utf-8": b"{{ messages[0]['content'] }}\xff\xfe\xc3",
}


def _stream(kind: str, seed: int) -> random.Random:
    # crc32, not hash(): str hashes differ between interpreter runs
    return random.Random(seed * 1_000_003 + zlib.crc32(kind.encode()))


def mutations(base: bytes, layout: Layout, seed: int = 0) -> list[Mutation]:
    """Every mutation kind for ``seed``: the same list on every run."""
    out: list[Mutation] = []
    for kind, generate in _KINDS.items():
        out.extend(generate(base, layout, _stream(kind, seed)))
    return out


def _header_counts(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    n_tensors, n_kv = len(layout.tensors), len(layout.kvs)
    for name, at, n in (
        ("n_tensors", Layout.N_TENSORS_AT, n_tensors),
        ("n_kv", Layout.N_KV_AT, n_kv),
    ):
        for value in (0, n - 1, n + 1, 2 * n, 1_000_001, 2**32, 2**63, 2**64 - 1):
            yield Mutation("header_count", f"{name} = {value}", (_put(at, "<Q", value),))
    for value in (0, 1, 2, 4, 2**32 - 1):
        yield Mutation("header_count", f"version = {value}", (_put(4, "<I", value),))
    for magic in (b"GGUG", b"\0\0\0\0", b"ggml"):
        yield Mutation("header_count", f"magic = {magic!r}", ((0, 4, magic),))


def _kv_ints(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    for entry in layout.kvs.values():
        fmt = _INT_FORMATS.get(entry.vtype)
        if fmt is None:
            continue
        (old,) = struct.unpack_from(fmt, base, entry.value.start)
        # as the field stores them: -1 and 2**32 - 1 are one u32, 2**32 wraps to 0
        edits = {}
        for value in (*_EDGE_INTS, old - 1, old + 1, old * 2, old // 2):
            edit = _put(entry.value.start, fmt, value)
            edits[struct.unpack(fmt, edit[2])[0]] = edit
        edits.pop(old, None)
        for value in rng.sample(sorted(edits), min(3, len(edits))):
            yield Mutation("kv_int", f"{entry.key} = {value} (was {old})", (edits[value],))


def _kv_floats(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    for entry in layout.kvs.values():
        fmt = _FLOAT_FORMATS.get(entry.vtype)
        if fmt is None:
            continue
        for value in rng.sample(_EDGE_FLOATS, 5):
            yield Mutation(
                "kv_float", f"{entry.key} = {value}", (_put(entry.value.start, fmt, value),)
            )


def _kv_types(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    entries = list(layout.kvs.values())
    for entry in rng.sample(entries, 16):
        new = rng.choice([t for t in _VALUE_TYPE_IDS if t != entry.vtype])
        yield Mutation(
            "kv_type", f"{entry.key} type {entry.vtype} -> {new}", (_put(entry.type_at, "<I", new),)
        )


def _arrays(layout: Layout) -> list[KVEntry]:
    return [e for e in layout.kvs.values() if e.etype_at is not None]


def _array_types(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    for entry in _arrays(layout):
        for new in rng.sample([t for t in _VALUE_TYPE_IDS if t != entry.etype], 4):
            edit = _put(entry.etype_at, "<I", new)
            yield Mutation(
                "array_type", f"{entry.key} element type {entry.etype} -> {new}", (edit,)
            )


def _array_counts(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    for entry in _arrays(layout):
        n = entry.count
        for value in (0, n - 1, n + 1, 2 * n, 2**32, 2**63, 2**64 - 1):
            edit = _put(entry.etype_at + 4, "<Q", value)
            yield Mutation("array_count", f"{entry.key} count {n} -> {value}", (edit,))


def _string_lengths(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    """The u64 length before a key, a string value or a string array element."""
    places: list[tuple[str, int]] = []
    for entry in layout.kvs.values():
        places.append((f"key {entry.key!r}", entry.key_at))
        if entry.vtype == VT.STRING:
            places.append((f"{entry.key} value", entry.value.start))
        if entry.etype == VT.STRING:
            for i, element in enumerate(entry.elements):
                places.append((f"{entry.key}[{i}]", element.start))
    for name in layout.tensors.values():
        places.append((f"tensor name {name.name!r}", name.name_at))
    for what, at in rng.sample(places, 20):
        (old,) = struct.unpack_from("<Q", base, at)
        left = layout.size - at - 8
        value = rng.choice([0, old - 1, old + 1, left, left + 1, 2**32, 2**63, 2**64 - 1])
        yield Mutation("string_length", f"{what} length {old} -> {value}", (_put(at, "<Q", value),))


def _key_names(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    entries = list(layout.kvs.values())
    for entry in rng.sample(entries, 10):
        at = entry.key_at + 8 + rng.randrange(len(entry.key.encode()))
        new = bytes([rng.choice(b"._xZ\x00\xff")])
        yield Mutation(
            "key_name",
            f"{entry.key!r} byte {at - entry.key_at - 8} -> {new!r}",
            ((at, at + 1, new),),
        )
    # Another key's name: a duplicate key, whose later value wins, and a lost one.
    for entry in rng.sample(entries, 6):
        other = rng.choice([e for e in entries if e is not entry])
        edit = (entry.key_at, entry.key_at + 8 + len(entry.key.encode()), _gguf_string(other.key))
        yield Mutation("key_name", f"{entry.key!r} renamed {other.key!r}", (edit,), realign=True)
    arch = layout.kvs["general.architecture"].value
    for name in ("qwen2", "qwen3", "gemma3", "mistral", "rwkv6", "", "llama\x00"):
        edit = (arch.start, arch.end, _gguf_string(name))
        yield Mutation("key_name", f"general.architecture = {name!r}", (edit,), realign=True)


def _kv_entries(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    """Keys removed (with n_kv kept true) and a junk key added."""
    n_kv = len(layout.kvs)
    for key in (
        "llama.block_count", "llama.embedding_length", "llama.attention.head_count",
        "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size", "general.alignment",
        "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model",
        "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template",
    ):  # fmt: skip
        entry = layout.kvs[key]
        edits = ((entry.key_at, entry.value.end, b""), _put(Layout.N_KV_AT, "<Q", n_kv - 1))
        yield Mutation("kv_entry", f"{key} removed", edits, realign=True)
    end = layout.kvs[list(layout.kvs)[-1]].value.end
    junk = _gguf_string("junk.key") + struct.pack("<I", VT.ARRAY) + struct.pack("<IQ", VT.UINT8, 0)
    edits = ((end, end, junk), _put(Layout.N_KV_AT, "<Q", n_kv + 1))
    yield Mutation("kv_entry", "an empty junk array added", edits, realign=True)


def _tokenizer_text(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    """Vocabulary strings that parse but make no sense: the tokenizer's own checks."""

    def value(key: str, text: str | bytes, index: int | None = None) -> Mutation:
        entry = layout.kvs[key]
        span = entry.value if index is None else entry.elements[index]
        where = key if index is None else f"{key}[{index}]"
        return Mutation(
            "tokenizer_text",
            f"{where} = {text!r:.60}",
            ((span.start, span.end, _gguf_string(text)),),
            realign=True,
        )

    for model in ("llama", "bert", "none", "", "gemma4", "rwkv"):
        yield value("tokenizer.ggml.model", model)
    for pre in ("qwen2", "llama-bpe", "no-such-pre"):
        yield value("tokenizer.ggml.pre", pre)
    for merge in ("Ġt", "a b c", "", "zz qq", "Ġ t"):
        yield value("tokenizer.ggml.merges", merge, rng.randrange(3))
    tokens = layout.kvs["tokenizer.ggml.tokens"]
    for text in ("", "<|im_end|>", "a", b"\xff\xfe", "x" * 5000):
        yield value("tokenizer.ggml.tokens", text, rng.randrange(len(tokens.elements)))


def _chat_templates(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    span = layout.kvs["tokenizer.chat_template"].value
    for name, template in HOSTILE_TEMPLATES.items():
        yield Mutation(
            "chat_template", name, ((span.start, span.end, _gguf_string(template)),), realign=True
        )


def _tensor_dims(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    tensors = list(layout.tensors.values())
    for t in rng.sample(tensors, 12):
        value = rng.choice([0, 1, 3, 4, 5, 2**31, 2**32 - 1])
        yield Mutation(
            "tensor_n_dims",
            f"{t.name} n_dims {len(t.dims)} -> {value}",
            (_put(t.n_dims_at, "<I", value),),
        )
    for t in rng.sample(tensors, 24):
        i = rng.randrange(len(t.dims))
        old = t.dims[i]
        value = rng.choice(
            [0, 1, old - 1, old + 1, old * 2, old // 2, 2**31, 2**32, 2**62, 2**63, 2**64 - 1]
        )
        edit = _put(t.n_dims_at + 4 + 8 * i, "<Q", value)
        yield Mutation("tensor_dim", f"{t.name} dim {i} {old} -> {value}", (edit,))
    # Two dims swapped: the same element count, the shape the header does not give.
    for t in rng.sample([t for t in tensors if len(t.dims) == 2], 3):
        edit = (t.n_dims_at + 4, t.n_dims_at + 20, struct.pack("<QQ", t.dims[1], t.dims[0]))
        yield Mutation("tensor_dim", f"{t.name} dims swapped", (edit,))


def _tensor_types(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    for t in rng.sample(list(layout.tensors.values()), 24):
        new = rng.choice([q for q in _TENSOR_TYPE_IDS if q != t.qtype])
        yield Mutation(
            "tensor_type", f"{t.name} type {t.qtype} -> {new}", (_put(t.type_at, "<I", new),)
        )


def _tensor_offsets(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    tensors = list(layout.tensors.values())
    data_size = layout.size - layout.data_start
    for t in rng.sample(tensors, 16):
        other = rng.choice(tensors).offset
        near = (t.offset + 1, t.offset + 32, t.offset - 32, other, data_size, data_size - 1)
        value = rng.choice([0, *near, 2**63, 2**64 - 1])
        yield Mutation(
            "tensor_offset",
            f"{t.name} offset {t.offset} -> {value}",
            (_put(t.offset_at, "<Q", value),),
        )


def _tensor_names(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    tensors = list(layout.tensors.values())
    for t in rng.sample(tensors, 6):
        other = rng.choice([o for o in tensors if o is not t]).name
        edit = (t.name_at, t.name_at + 8 + len(t.name), _gguf_string(other))
        yield Mutation("tensor_name", f"{t.name} renamed {other}", (edit,), realign=True)
    for t, new in (
        ("blk.3.ffn_up.weight", "blk.9.ffn_up.weight"),
        ("blk.0.attn_q.weight", "blk.0.attn_q.bias"),
    ):
        entry = layout.tensors[t]
        edit = (entry.name_at, entry.name_at + 8 + len(t), _gguf_string(new))
        yield Mutation("tensor_name", f"{t} renamed {new}", (edit,), realign=True)


def _alignment(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    at = layout.kvs["general.alignment"].value.start
    for value in (0, 1, 2, 3, 8, 16, 24, 64, 4096, 2**31, 2**32 - 1):
        yield Mutation("alignment", f"general.alignment = {value}", (_put(at, "<I", value),))


def _truncations(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    cuts = {0, 3, 4, 23, 24, layout.infos_end - 1, layout.infos_end, layout.data_start, layout.size - 1}  # fmt: skip
    cuts |= {rng.randrange(24, layout.data_start) for _ in range(12)}
    cuts |= {rng.randrange(layout.data_start, layout.size) for _ in range(8)}
    for cut in sorted(cuts):
        yield Mutation("truncate", f"cut at byte {cut:,} of {layout.size:,}", truncate=cut)


def _bit_flips(base: bytes, layout: Layout, rng: random.Random) -> Iterator[Mutation]:
    for _ in range(30):
        flips = [
            (at, 1 << rng.randrange(8))
            for at in sorted(rng.sample(range(4, layout.infos_end), rng.randint(1, 4)))
        ]
        edits = tuple((at, at + 1, bytes([base[at] ^ bit])) for at, bit in flips)
        yield Mutation(
            "bit_flip", "bytes " + ", ".join(f"{at}^{bit:#04x}" for at, bit in flips), edits
        )


_KINDS: dict[str, Callable[[bytes, Layout, random.Random], Iterator[Mutation]]] = {
    "header_count": _header_counts,
    "kv_int": _kv_ints,
    "kv_float": _kv_floats,
    "kv_type": _kv_types,
    "array_type": _array_types,
    "array_count": _array_counts,
    "string_length": _string_lengths,
    "key_name": _key_names,
    "kv_entry": _kv_entries,
    "tokenizer_text": _tokenizer_text,
    "chat_template": _chat_templates,
    "tensor_dims": _tensor_dims,
    "tensor_type": _tensor_types,
    "tensor_offset": _tensor_offsets,
    "tensor_name": _tensor_names,
    "alignment": _alignment,
    "truncate": _truncations,
    "bit_flip": _bit_flips,
}
