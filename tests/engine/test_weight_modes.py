"""What each weight mode keeps resident, estimated from the tensor directory alone (the
app shows these figures before the user switches) against what loading then keeps."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.model.gguf_file import GGUFFile
from engine.model.loader import load_model
from engine.model.weight_modes import USER_WEIGHT_MODES, resident_weight_bytes
from tests.engine.test_forward_tiny import FILE_MIXES
from tests.engine.tiny_models import make_hf_model, write_gguf
from tests.smaps import covering


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


def _mapping_rss(address: int) -> int | None:
    """Resident bytes of the mapping starting at ``address`` (/proc/self/smaps), or None
    where there is no such file."""
    found = covering(address, 1)
    return None if found is None else sum(m.kb["Rss"] * 1024 for m in found)


def test_prefault_maps_every_page_of_the_file(q4_k_m_file):
    """GGUFFile.prefault (run on a thread by native loading) leaves the whole file mapped
    into the process, so the first token does not fault the weights in."""
    gf = GGUFFile(q4_k_m_file)
    address = np.frombuffer(gf._map, np.uint8).ctypes.data
    before = _mapping_rss(address)
    if before is None:
        pytest.skip("no /proc/self/smaps on this system")
    gf.prefault()
    size = q4_k_m_file.stat().st_size
    assert _mapping_rss(address) >= size - 4096 > before


def test_prefault_asks_for_huge_pages_where_it_reads_and_nowhere_else(q4_k_m_file):
    """What prefault reads is marked MADV_HUGEPAGE (read from the disk in 2 MB folios,
    mapped as huge pages); a skipped view (weights repacked into tiles) is not, so its
    pages are not brought back in 2 MB at a time."""
    gf = GGUFFile(q4_k_m_file)
    base = np.frombuffer(gf._map, np.uint8).ctypes.data
    if not hasattr(mmap, "MADV_HUGEPAGE") or covering(base, 1) is None:
        pytest.skip("no MADV_HUGEPAGE or /proc/self/smaps on this system")
    name = max(gf.tensors, key=lambda n: gf.tensors[n].nbytes)
    view = gf.tensor_bytes(name)
    lo, hi = gf._pages_of(view)
    assert hi - lo >= 2 * mmap.PAGESIZE
    gf.prefault(skip=(view,))
    found = covering(base, gf.file_size)
    hole = [m for m in found if m.start >= base + lo and m.end <= base + hi]
    rest = [m for m in found if m.end <= base + lo or m.start >= base + hi]
    assert sum(m.end - m.start for m in hole) == hi - lo
    assert all("hg" not in m.flags for m in hole)
    assert rest and all("hg" in m.flags for m in rest)
