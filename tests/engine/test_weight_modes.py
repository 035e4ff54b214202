"""What each weight mode keeps resident, estimated from the tensor directory alone (the
app shows these figures before the user switches) against what loading then keeps."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from engine.model.gguf_file import GGUFFile
from engine.model.loader import load_model
from engine.model.weight_modes import USER_WEIGHT_MODES, resident_weight_bytes
from tests.engine.test_forward_tiny import FILE_MIXES
from tests.engine.tiny_models import make_hf_model, write_gguf


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", True)], ids=["untied", "tied"])
def q4_k_m_file(request, tmp_path_factory):
    family, tied = request.param
    path = tmp_path_factory.mktemp("modes") / f"{family}.gguf"
    model = make_hf_model(family, seed=5, tie_word_embeddings=tied)
    write_gguf(model, path, FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=5)
    return path


@pytest.mark.parametrize("mode", USER_WEIGHT_MODES)
def test_estimate_matches_what_loading_keeps(q4_k_m_file, mode):
    gf = GGUFFile(q4_k_m_file)
    tensors = [(t.name, t.shape, t.nbytes) for t in gf.tensors.values()]
    estimate = resident_weight_bytes(tensors, mode)
    loaded = load_model(q4_k_m_file, weight_mode=mode, load_tokenizer=False)
    assert abs(estimate - loaded.weight_bytes) <= 0.05 * loaded.weight_bytes


def test_modes_cost_in_the_order_the_app_lists_them(q4_k_m_file):
    gf = GGUFFile(q4_k_m_file)
    tensors = [(t.name, t.shape, t.nbytes) for t in gf.tensors.values()]
    costs = [resident_weight_bytes(tensors, mode) for mode in USER_WEIGHT_MODES]
    assert costs == sorted(costs) and costs[0] < costs[-1]


def test_int4_is_not_estimated():
    with pytest.raises(ValueError, match="int4"):
        resident_weight_bytes([("token_embd.weight", (8, 32), 64)], "int4")
