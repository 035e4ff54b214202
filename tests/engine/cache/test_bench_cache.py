"""`folio bench cache`: the eviction-order comparison (docs/ENGINE.md §4) and a tiny
end-to-end run."""

from __future__ import annotations

import json
from argparse import Namespace

from engine.bench.cache import _bench_eviction_policies, _eviction_workload, run_cache_bench


def test_workload_is_deterministic_and_chats_share_their_history():
    a = _eviction_workload(64 * 16, chats=3, steps=30, seed=7)
    assert a == _eviction_workload(64 * 16, chats=3, steps=30, seed=7)
    kinds = {kind for kind, _, _ in a}
    assert kinds == {"chat", "oneoff"}
    # some chat turn extends an earlier turn's prompt + reply (the shared prefix)
    chats = [(p, r) for kind, p, r in a if kind == "chat"]
    assert any(
        later[: len(p) + len(r)] == p + r
        for i, (p, r) in enumerate(chats)
        for later, _ in chats[i + 1 :]
    )


def test_tail_first_hits_more_prefix_tokens_than_lru(capsys):
    results = _bench_eviction_policies(num_pages=64, page_size=16, chats=4, steps=60, seed=0)
    tf, lru = results["tail_first"], results["lru"]
    # same workload under both orders
    assert tf["prefix_query_tokens"] == lru["prefix_query_tokens"] > 0
    assert tf["chat_turns"] == lru["chat_turns"] and tf["oneoff_prompts"] == lru["oneoff_prompts"]
    assert lru["evicted_pages"] > 0  # the cache really is under pressure
    assert tf["prefix_hit_tokens"] > lru["prefix_hit_tokens"]
    assert tf["prefilled_tokens"] < lru["prefilled_tokens"]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["bench"] for line in lines] == [
        "cache_eviction",
        "cache_eviction",
        "cache_eviction_ratio",
    ]
    assert lines[2]["hit_tokens_tail_first_over_lru"] > 1


def test_run_cache_bench_end_to_end_tiny(capsys):
    run_cache_bench(Namespace(pages=256, page_size=16, rounds=2, tier_pages=2))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    benches = [line["bench"] for line in lines]
    assert "cache_alloc" in benches and "cache_eviction_ratio" in benches
    assert [line["policy"] for line in lines if line["bench"] == "cache_eviction"] == [
        "tail_first",
        "lru",
    ]
