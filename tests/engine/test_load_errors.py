"""Bad model files give a clear error that names the file and the problem."""

from __future__ import annotations

import json
import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from engine.model.config import UnsupportedArchitecture
from engine.model.gguf_file import GGUFError, GGUFFile, read_header
from engine.model.loader import ModelLoadError, load_model
from tests.engine.tiny_models import make_hf_model, save_hf_folder, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(make_hf_model("llama"), path, {}, default=Q.Q8_0)
    return path


def test_truncated_gguf(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    for cut in (len(data) - 1000, len(data) // 2, 100, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError) as err:
            load_model(bad, load_tokenizer=False)
        msg = str(err.value)
        assert str(bad) in msg and ("truncated" in msg or "too small" in msg), msg


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(bad, load_tokenizer=False)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    w.add_tensor(
        "token_embd.weight", np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=Q.IQ2_XXS
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as err:
        load_model(path, load_tokenizer=False)
    msg = str(err.value)
    assert str(path) in msg and "IQ2_XXS" in msg and "Q4_K" in msg, msg


def test_unknown_tensor_type_id(tiny_gguf, tmp_path):
    """A type id that no gguf release knows (a newer file format) is named by number."""
    gf = GGUFFile(tiny_gguf)
    data = bytearray(tiny_gguf.read_bytes())
    # Find the type field of the first tensor info: it follows name, n_dims and dims.
    name = next(iter(gf.tensors)).encode()
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "newtype.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="unknown type 250"):
        load_model(bad, load_tokenizer=False)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture) as err:
        load_model(path, load_tokenizer=False)
    assert "rwkv6" in str(err.value) and "llama" in str(err.value) and "gemma3" in str(err.value)
    # the one error type callers catch for a model that cannot be loaded
    assert isinstance(err.value, ModelLoadError) and str(path) in str(err.value)


def test_folder_without_config(tmp_path):
    folder = save_hf_folder(make_hf_model("qwen3"), tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json") as err:
        load_model(folder, load_tokenizer=False)
    assert str(folder) in str(err.value)


def test_unknown_hf_architecture(tmp_path):
    folder = save_hf_folder(make_hf_model("llama"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="mamba"):
        load_model(folder, load_tokenizer=False)


def test_safetensors_missing_tensor(tmp_path):
    folder = save_hf_folder(make_hf_model("llama"), tmp_path / "m")
    weights = folder / "model.safetensors"
    state = load_file(weights)
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as err:
        load_model(folder, load_tokenizer=False)
    msg = str(err.value)
    assert "layers.1.mlp.down_proj.weight" in msg and str(folder) in msg


def test_damaged_safetensors(tmp_path):
    folder = save_hf_folder(make_hf_model("llama"), tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.raises(ModelLoadError, match="damaged") as err:
        load_model(folder, load_tokenizer=False)
    assert str(weights) in str(err.value)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model"):
        load_model(tmp_path / "nope.gguf")


def test_reader_matches_gguf_package(tiny_gguf):
    """Folio's fast header reader agrees with gguf.GGUFReader on metadata and tensors."""
    ours = GGUFFile(tiny_gguf)
    ref = gguf.GGUFReader(str(tiny_gguf))
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == int(t.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(
            ours.tensor_bytes(t.name), np.asarray(t.data).reshape(-1).view(np.uint8)
        )
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert np.all(np.asarray(ours.metadata[key]) == np.asarray(value)), key


def test_header_reader_over_a_prefix(tiny_gguf):
    """The one header parser reads a downloaded prefix as it reads the mapped file."""
    data = tiny_gguf.read_bytes()
    whole = GGUFFile(tiny_gguf)
    data_start = min(t.offset for t in whole.tensors.values())
    complete_from = None
    for cut in range(4, data_start + 1, 7):
        header = read_header(data[:cut], "prefix")
        if header.complete:
            complete_from = complete_from or cut
            assert header.tensors == whole.tensors and header.version == whole.version
        else:
            assert complete_from is None, f"complete at {complete_from} but not at {cut}"
            assert set(header.metadata) <= set(whole.metadata)
    assert complete_from is not None
    with pytest.raises(GGUFError, match="prefix: not a GGUF file"):
        read_header(b"PK\x03\x04" + bytes(200), "prefix")


# -- damaged header values (issue 13, defect 6) ------------------------------------------
# A small llama file written byte by byte, so any field can hold any value.
_KV_TYPES = {int: gguf.GGUFValueType.UINT32, str: gguf.GGUFValueType.STRING}


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, value) -> bytes:
    if isinstance(value, bytes):  # a type id and value already packed
        return _str(key) + value
    if isinstance(value, float):
        return _str(key) + struct.pack("<If", gguf.GGUFValueType.FLOAT32, value)
    if isinstance(value, list):  # an array of strings
        body = b"".join(_str(v) for v in value)
        return _str(key) + struct.pack("<IIQ", 9, 8, len(value)) + body
    vt = _KV_TYPES[type(value)]
    packed = struct.pack("<I", value) if vt == gguf.GGUFValueType.UINT32 else _str(value)
    return _str(key) + struct.pack("<I", vt) + packed


def _raw_gguf(
    path,
    meta=None,
    dims=None,
    alignment=32,
    tensor_dims=None,
    extra_tensors=None,
    tensor_types=None,
):
    """A loadable 1-layer llama GGUF (f32 weights); ``meta`` overrides keys (None drops one),
    ``tensor_dims`` overrides one tensor's dims as stored (innermost first), ``extra_tensors``
    adds f32 tensors by shape and ``tensor_types`` overrides type ids (the bytes stay f32)."""
    h, ff, vocab = 64, 128, 8
    kv = {
        "general.architecture": "llama", "general.alignment": alignment,
        "llama.block_count": 1, "llama.embedding_length": h, "llama.feed_forward_length": ff,
        "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(vocab)],
    }  # fmt: skip
    for key, value in (meta or {}).items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value
    shapes = {
        "token_embd.weight": (vocab, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
        "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (h // 2, h), "blk.0.attn_v.weight": (h // 2, h),
        "blk.0.attn_output.weight": (h, h), "blk.0.ffn_norm.weight": (h,),
        "blk.0.ffn_gate.weight": (ff, h), "blk.0.ffn_up.weight": (ff, h), "blk.0.ffn_down.weight": (h, ff),
    }  # fmt: skip
    shapes |= extra_tensors or {}
    infos, data, rng = b"", b"", np.random.default_rng(0)
    for name, shape in shapes.items():
        stored = (tensor_dims or {}).get(name, tuple(reversed(shape)))
        infos += (
            _str(name)
            + struct.pack("<I", len(stored))
            + b"".join(struct.pack("<Q", d) for d in stored)
        )
        infos += struct.pack("<IQ", (tensor_types or {}).get(name, 0), len(data))
        data += rng.normal(0, 0.02, size=shape).astype(np.float32).tobytes()
        data += bytes(-len(data) % 32)
    head = (
        b"GGUF"
        + struct.pack("<IQQ", 3, len(shapes), len(kv))
        + b"".join(_kv(k, v) for k, v in kv.items())
    )
    head += infos
    head += bytes(-len(head) % 32)
    path.write_bytes(head + data)
    return path


def _load_error(path) -> str:
    with pytest.raises(ModelLoadError) as err:
        load_model(path, load_tokenizer=False)
    msg = str(err.value)
    assert str(path) in msg, msg
    return msg


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except Exception:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_raw_gguf_loads(tmp_path):
    """The hand-written file the damage tests start from is a valid model."""
    loaded = load_model(_raw_gguf(tmp_path / "ok.gguf"), load_tokenizer=False)
    assert loaded.config.num_layers == 1 and loaded.config.vocab_size == 8


@pytest.mark.parametrize(
    "meta, problem",
    [
        ({"general.alignment": 0}, "alignment"),
        ({"general.alignment": 24}, "alignment"),
        ({"llama.attention.head_count": 0}, "head_count"),
        ({"llama.attention.head_count_kv": 0}, "head_count_kv"),
        ({"llama.attention.head_count_kv": 3}, "head_count_kv"),
        ({"llama.attention.head_count": 5, "llama.attention.head_count_kv": 5}, "embedding_length"),
        ({"llama.embedding_length": 0}, "embedding_length"),
        ({"llama.block_count": 2}, "block_count"),
        ({"llama.block_count": 0}, "block_count"),
        ({"llama.feed_forward_length": 100}, "ffn_gate"),
        ({"tokenizer.ggml.tokens": struct.pack("<IIQ", 9, 5, 8) + bytes(32)}, "array of strings"),
        ({"tokenizer.ggml.tokens": [f"t{i}" for i in range(5)]}, "token_embd"),
        ({"llama.vocab_size": 7}, "tokens"),
        ({"llama.attention.head_count": "four"}, "head_count"),
        # found by the fuzz suite (test_gguf_fuzz.py): values that loaded and then poisoned
        # every forward, or failed without naming the key
        ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, "layer_norm_rms_epsilon"),
        ({"llama.attention.layer_norm_rms_epsilon": "small"}, "layer_norm_rms_epsilon"),
        ({"llama.rope.freq_base": 0.0}, "freq_base"),
        ({"llama.rope.freq_base": float("inf")}, "freq_base"),
        ({"llama.context_length": 0}, "context_length"),
        ({"llama.attention.key_length": 0}, "key_length"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else None,
)
def test_damaged_header_value(tmp_path, meta, problem):
    msg = _load_error(_raw_gguf(tmp_path / "bad.gguf", meta))
    assert problem in msg and "download it again" in msg, msg


def test_damaged_alignment_lists_as_a_problem(tmp_path):
    """`folio models list` reports a damaged file instead of failing the whole listing."""
    from engine.hub.library import list_local_models

    _raw_gguf(tmp_path / "ok.gguf")
    _raw_gguf(tmp_path / "bad.gguf", {"general.alignment": 0})
    models = {m.path.name: m for m in list_local_models(tmp_path, include_hf_cache=False)}
    assert models["ok.gguf"].problem is None
    assert "alignment" in models["bad.gguf"].problem


@pytest.mark.parametrize(
    "dims, problem",
    [
        ({"blk.0.attn_q.weight": (64, 0)}, "dimension of 0"),
        ({"output_norm.weight": (1,) * 9}, "dimensions"),
    ],
)
def test_damaged_tensor_dims(tmp_path, dims, problem):
    msg = _load_error(_raw_gguf(tmp_path / "bad.gguf", tensor_dims=dims))
    assert problem in msg, msg


def test_huge_block_count_is_refused_without_allocating(tmp_path):
    path = _raw_gguf(tmp_path / "bad.gguf", {"llama.block_count": 2**31})
    assert "block_count" in _load_error(path)
    assert _peak_bytes(lambda: load_model(path, load_tokenizer=False)) < 4 * path.stat().st_size


def _patched(tmp_path, name: str, old: bytes, new: bytes):
    data = bytearray(_raw_gguf(tmp_path / "ok.gguf").read_bytes())
    at = data.index(old)
    data[at : at + len(new)] = new
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("count", [2**20, 2**40, 2**64 - 1])
def test_bogus_array_count_is_refused_without_allocating(tmp_path, count):
    """An array claiming more elements than the file can hold fails before its elements are read."""
    old = struct.pack("<IIQ", 9, 8, 8)  # the tokens array: ARRAY of STRING, 8 elements
    path = _patched(tmp_path, "count.gguf", old, struct.pack("<IIQ", 9, 8, count))
    _load_error(path)
    assert _peak_bytes(lambda: GGUFFile(path)) < 2 * path.stat().st_size


def test_bogus_string_length_is_refused_without_allocating(tmp_path):
    old = _str("t3")
    path = _patched(tmp_path, "len.gguf", old, struct.pack("<Q", 2**40) + b"t3")
    _load_error(path)
    assert _peak_bytes(lambda: GGUFFile(path)) < 2 * path.stat().st_size


def test_bogus_n_dims_is_refused_without_allocating(tmp_path):
    name = _str("blk.0.attn_q.weight")
    path = _patched(
        tmp_path, "ndims.gguf", name + struct.pack("<I", 2), name + struct.pack("<I", 2**32 - 1)
    )
    assert "dimensions" in _load_error(path)
    assert _peak_bytes(lambda: GGUFFile(path)) < 2 * path.stat().st_size


# -- found by the fuzz suite (test_gguf_fuzz.py) ------------------------------------------


def test_a_tensor_too_large_for_the_file_names_the_file_shape_and_type(tmp_path):
    """Issue 13, item 13: the tensor-size error names the file, and says what the size came from."""
    dims = {"blk.0.ffn_down.weight": (2**62, 2**62)}
    msg = _load_error(_raw_gguf(tmp_path / "huge.gguf", tensor_dims=dims))
    assert "blk.0.ffn_down.weight" in msg and str((2**62, 2**62)) in msg and "F32" in msg, msg


def test_rows_that_are_not_whole_blocks_name_the_file(tmp_path):
    """A 64-wide norm claimed as Q4_K (blocks of 256) reached kernels.dequant, whose
    ValueError named neither the file nor the tensor."""
    path = _raw_gguf(tmp_path / "blocks.gguf", tensor_types={"output_norm.weight": int(Q.Q4_K)})
    msg = _load_error(path)
    assert "output_norm.weight" in msg and "blocks of 256" in msg, msg


@pytest.mark.parametrize(
    "extra, name",
    [
        ({"output.weight": (4, 64)}, "output.weight"),
        ({"rope_freqs.weight": (64,)}, "rope_freqs.weight"),
        ({"blk.0.attn_q.bias": (32,)}, "blk.0.attn_q.bias"),
    ],
)
def test_every_tensor_read_is_checked_against_the_header(tmp_path, extra, name):
    """The output head, rope factors and biases were read at whatever shape the file gave."""
    msg = _load_error(_raw_gguf(tmp_path / "shape.gguf", extra_tensors=extra))
    assert name in msg and "header's sizes" in msg, msg


@pytest.mark.parametrize(
    "old, new, problem",
    [
        (_str("llama.block_count"), _str("general.alignment"), "'general.alignment' appears twice"),
        (
            _str("blk.0.ffn_up.weight"),
            _str("blk.0.attn_q.weight"),
            "'blk.0.attn_q.weight' appears twice",
        ),
    ],
    ids=["key", "tensor"],
)
def test_duplicate_names_are_refused(tmp_path, old, new, problem):
    """A second key or tensor of one name silently replaced the first."""
    assert problem in _load_error(_patched(tmp_path, "twice.gguf", old, new))


def test_names_longer_than_the_spec_allows_are_refused(tmp_path):
    """GGUF keys are at most 65,535 bytes and tensor names shorter than 64 (llama.cpp refuses
    longer); a length gone wrong is refused before the name is decoded."""
    msg = _load_error(_raw_gguf(tmp_path / "key.gguf", {"x" * 70_000: 1}))
    assert "a key of 70,000 bytes" in msg, msg
    msg = _load_error(_raw_gguf(tmp_path / "name.gguf", extra_tensors={"blk.0." + "x" * 60: (4,)}))
    assert "a tensor name of 66 bytes" in msg, msg


def _one_string_header(text: bytes) -> bytes:
    value = struct.pack("<I", gguf.GGUFValueType.STRING) + struct.pack("<Q", len(text)) + text
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _str("general.license") + value


def test_a_long_string_that_is_not_utf8_is_refused_within_bounds():
    """A string length gone wrong swallowed the rest of the file as one string, which
    decoding with replacement characters made up to 4x its size."""
    garbage = np.random.default_rng(0).integers(0, 256, size=2 << 20, dtype=np.uint8).tobytes()
    buf = _one_string_header(garbage)
    with pytest.raises(GGUFError, match="not UTF-8 text"):
        read_header(buf, "garbage")
    assert _peak_bytes(lambda: read_header(buf, "garbage")) < 1.5 * len(buf)
    text = "é" * (1 << 20)
    assert (
        read_header(_one_string_header(text.encode()), "text").metadata["general.license"] == text
    )
    # a short string stays lenient: a vocabulary may hold a piece of a UTF-8 sequence
    assert (
        read_header(_one_string_header(b"a\xe2\x96"), "short").metadata["general.license"]
        == "a\ufffd"
    )


_TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": []}


@pytest.mark.parametrize(
    "meta, problem",
    [
        ({"tokenizer.ggml.model": None}, "no tokenizer metadata"),
        ({"tokenizer.ggml.merges": None}, "cannot build its tokenizer"),
        ({"tokenizer.ggml.merges": ["a b c"]}, "not a pair of tokens"),
        # tokenizers' BPE panicked (a BaseException) on a merge whose result is not a token
        ({"tokenizer.ggml.merges": ["t0 t1"]}, "not a pair of tokens"),
        ({"tokenizer.ggml.bos_token_id": "one"}, "bos_token_id is 'one', not a token id"),
        ({"tokenizer.chat_template": 5}, "chat_template is not text"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else None,
)
def test_tokenizer_failures_are_load_errors_naming_the_file(tmp_path, monkeypatch, meta, problem):
    """The tokenizer's errors left load_model as TokenizerError (naming only the file's name),
    KeyError, TypeError or a Rust panic."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _raw_gguf(tmp_path / "tok.gguf", {**_TOKENIZER, **meta})
    with pytest.raises(ModelLoadError, match=problem) as err:
        load_model(path)
    assert str(path) in str(err.value)


def test_raw_gguf_with_a_tokenizer_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    """The file the tokenizer cases damage loads, tokenizer included."""
    assert load_model(_raw_gguf(tmp_path / "ok.gguf", _TOKENIZER)).tokenizer.token_to_id("t3") == 3
