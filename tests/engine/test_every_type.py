"""Every GGUF type the default weight mode reads, on a trained model: SmolLM2-135M's
weights written again in each type (tests/engine/requantize.py), the default mode
against exact weights (the same file dequantized to float32) on a 512-token text."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from engine.model.loader import load_model
from tests.engine.requantize import SUPER_BLOCK_TYPES, requantized
from tests.engine.test_smollm2 import _agreement, _all_logits, _text_ids

pytestmark = pytest.mark.slow

# Q4_1 is the real file's (tests/engine/test_smollm2.py)
TYPES = (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_mode_keeps_the_exact_argmax_in_every_type(qtype, smollm2_path, tmp_path):
    """Each type's kernels, a prompt in one go and the same text decoded a few tokens a
    step, pick the exact weights' argmax at >= 99% of positions.

    SmolLM2's rows are 576 wide: the blocks of 32 and the float types take every matrix
    (the tied embedding and head included), the super-block types (256 a block) only
    ``ffn_down`` (1,536 wide), as in llama.cpp's own k-quant files of it, the rest Q8_0."""

    def choose(name: str, cols: int):
        if qtype in SUPER_BLOCK_TYPES:
            return qtype if name.endswith("ffn_down.weight") else Q.Q8_0
        return qtype

    path = tmp_path / f"smollm2-{qtype.name}.gguf"
    changed = requantized(smollm2_path, path, choose)
    assert changed, "no tensor was written in the new type"
    assert qtype.name in set(changed.values())
    exact = load_model(path, weight_mode="dequant")
    native = load_model(path)
    assert native.weight_mode == "native"
    ids = _text_ids(exact.tokenizer, 512)
    reference = _all_logits(exact, ids)
    agree, top_err = _agreement(_all_logits(native, ids), reference)
    assert agree >= 0.99, f"prompt: argmax agrees on only {agree:.1%} of positions"
    assert top_err < 0.02, f"prompt: relative error of the leading logit {top_err:.2%}"
    # four tokens a forward: the decode kernels (a prompt kernel takes 8 rows and more),
    # whose rows come out as one token a step gives them (the batching tests)
    agree, top_err = _agreement(_all_logits(native, ids, chunk=4), reference)
    assert agree >= 0.99, f"decode: argmax agrees on only {agree:.1%} of positions"
    assert top_err < 0.02, f"decode: relative error of the leading logit {top_err:.2%}"
