"""Pages: chained hash, fingerprint, placeholders, page-size suggestion."""

from __future__ import annotations

import hashlib

import numpy as np

from engine.cache import CacheFingerprint, PageTable, chain_hash, suggest_page_size
from engine.cache.page import is_content_hash, new_placeholder_hash


def test_chain_hash_is_blake2b_over_parent_then_int64_tokens():
    parent = b"p" * 16
    expect = hashlib.blake2b(
        parent + np.array([1, 2, 300], dtype="<i8").tobytes(), digest_size=16
    ).digest()
    assert chain_hash(parent, [1, 2, 300]) == expect


def test_roots_mix_in_model_and_cache_format():
    tokens = list(range(32))
    tables = [
        PageTable(4, 16, CacheFingerprint("model-a", 16)),
        PageTable(4, 16, CacheFingerprint("model-b", 16)),
        PageTable(4, 16, CacheFingerprint("model-a", 16, k_bits=4, v_bits=4)),
        PageTable(4, 16, "model-a"),
    ]
    roots = [t.context_hashes(tokens + [0])[0] for t in tables]
    assert len(set(roots[:3])) == 3
    assert roots[3] == roots[0]
    # the second page chains from the first
    t = tables[0]
    h0, h1 = t.context_hashes(tokens + [0])
    assert h1 == chain_hash(h0, tokens[16:])


def test_placeholders_never_look_like_content_hashes():
    a, b = new_placeholder_hash(), new_placeholder_hash()
    assert a != b
    assert not is_content_hash(a) and is_content_hash(chain_hash(b"x" * 16, [1]))


def test_suggest_page_size():
    assert suggest_page_size([]) == 256
    assert suggest_page_size([10, 20]) == 64  # never below 64
    assert suggest_page_size([2048]) == 512  # 2**floor(log2(512))
    assert suggest_page_size([3000]) == 512  # 750 -> 512
    assert suggest_page_size([100_000]) == 1024  # clipped
    size = suggest_page_size([700, 900, 1200])
    assert size & (size - 1) == 0 and 16 <= size <= 1024
