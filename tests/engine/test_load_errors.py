"""Bad model files give a clear error that names the file and the problem."""

from __future__ import annotations

import json

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
    w.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=Q.IQ2_XXS)
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
        assert np.array_equal(ours.tensor_bytes(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))
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
