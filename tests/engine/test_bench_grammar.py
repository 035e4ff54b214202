"""`folio bench grammar` on a small vocabulary: the vocabulary is real BPE (documents encode
to multi-character tokens and decode back), every library installed walks every schema's
document, and a walk notices a mask that refuses the document."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from engine.bench.grammar import DOCUMENTS, Walker, build_vocab, run_grammar_bench, walk


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(3000)


def test_the_vocabulary_is_a_real_bpe(vocab):
    assert len(vocab.tokens) == len(set(vocab.tokens)) == 3000
    backend = vocab.backend()
    text = json.dumps(DOCUMENTS["person"], separators=(",", ":"))
    ids = backend.encode(text).ids
    assert backend.decode(ids) == text
    # multi-character tokens, as a model writes
    assert len(ids) < 0.8 * len(text) and max(len(vocab.decoded()[i]) for i in ids) >= 4
    assert vocab.decoded()[ids[0]] == text.encode()[: len(vocab.decoded()[ids[0]])]


def test_a_walk_notices_a_refused_token():
    walker = Walker(fill=lambda mask: mask.zero_(), consume=lambda token: True)
    with pytest.raises(ValueError, match="masked out"):
        walk(walker, [5], 64)
    walker = Walker(fill=lambda mask: mask.fill_(-1), consume=lambda token: True)
    assert walk(walker, [5, 6], 64)["tokens"] == 2


def test_the_bench_reports_each_library_and_schema(capsys):
    torch_threads = torch.get_num_threads()
    try:
        records = run_grammar_bench(Namespace(vocab=3000, rounds=1, libraries=["llguidance"]))
    finally:
        torch.set_num_threads(torch_threads)
    assert records[0]["vocab"] == 3000 and records[0]["apply_bitmask_us"] > 0
    walks = records[1:]
    assert {r["schema"] for r in walks} == set(DOCUMENTS)
    for record in walks:
        assert "error" not in record, record
        assert record["mask_us_median"] > 0 and record["tokens"] > 10
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == records
