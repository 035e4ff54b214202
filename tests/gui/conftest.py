"""Fixtures for the memory views: a synthetic snapshot of any size (for scale tests
and screenshots without a model) and a fake tokenizer."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from engine.cache.page import PageState  # noqa: E402
from engine.cache.snapshot import CacheSnapshot, cache_stats  # noqa: E402
from engine.engine import EngineSnapshot, JobInfo  # noqa: E402


class FakeTokenizer:
    """Decodes token ids as "t<id>" so tooltips have text without a model."""

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)


def synthetic_snapshot(
    num_pages: int, page_size: int = 16, chats: int = 6, version: int = 1, seed: int = 0
) -> EngineSnapshot:
    """A plausible cache: `chats` jobs whose chains share a common prefix in pairs, a
    cached tail of earlier prompts, the rest free; ~60 % of pages hold content."""
    rng = np.random.default_rng(seed)
    state = np.zeros(num_pages, np.uint8)
    ref = np.zeros(num_pages, np.int32)
    fill = np.zeros(num_pages, np.int32)
    serial = np.zeros(num_pages, np.int64)
    prefix = np.zeros(num_pages, np.uint64)
    owners: list[tuple[int, ...]] = [()] * num_pages
    parent = np.full(num_pages, -1, np.int32)
    tokens: list[list[int]] = [[] for _ in range(num_pages)]
    used = int(num_pages * 0.6)
    per_chat = max(used // (2 * max(chats, 1)), 2)
    page, clock = 0, 0
    for pair in range(0, chats, 2):
        shared_len = max(per_chat // 3, 1)
        shared = list(range(page, page + shared_len))
        page += shared_len
        for member in (pair, pair + 1):
            if member >= chats:
                break
            seq = member + 1
            own = list(range(page, page + per_chat - shared_len))
            page += len(own)
            chain = shared + own
            for i, p in enumerate(chain):
                owners[p] = tuple(sorted(set(owners[p]) | {seq}))
                ref[p] += 1
                state[p] = PageState.REFERENCED
                fill[p] = page_size if p != chain[-1] else int(rng.integers(1, page_size))
                clock += 1
                serial[p] = clock
                if i:
                    parent[p] = chain[i - 1]
    cached_end = min(used, num_pages)
    prev = -1
    for p in range(page, cached_end):
        state[p] = PageState.CACHED
        fill[p] = page_size
        clock += 1
        serial[p] = clock
        parent[p] = prev if (p - page) % 7 else -1
        prev = p
    for p in range(cached_end):
        if fill[p] == page_size:
            prefix[p] = np.uint64(rng.integers(1, 2**63))
        tokens[p] = [int(t) for t in rng.integers(0, 49152, int(fill[p]))]
    children = np.flatnonzero(parent >= 0).astype(np.int32)
    cache = CacheSnapshot(
        state=state,
        ref_count=ref,
        fill=fill,
        tier=np.zeros(num_pages, np.uint8),
        access_serial=serial,
        owners=owners,
        hash_prefix=prefix,
        edges=np.stack([children, parent[children]], axis=1),
        host=None,
        counters={"prefix_query_tokens": 1000, "prefix_hit_tokens": 400},
    )
    free = np.flatnonzero(state == PageState.FREE).tolist()
    cached = [p for p in np.argsort(serial).tolist() if state[p] == PageState.CACHED]
    jobs = [
        JobInfo(
            seq,
            f"chat {seq}",
            "decode",
            200,
            10,
            48 if seq % 2 == 0 else 0,
            0,
            "",
            (seq,),
            per_chat,
        )  # fmt: skip
        for seq in range(1, chats + 1)
    ]
    return EngineSnapshot(
        version=version,
        time=0.0,
        cache=cache,
        stats=cache_stats(cache, page_size),
        page_size=page_size,
        num_pages=num_pages,
        page_tokens=tokens,
        eviction_next=(free + cached)[:64] if len(free) < 32 else free[:32] + cached[:32],
        jobs=jobs,
        seq_jobs={seq: seq for seq in range(1, chats + 1)},
        job_tags={seq: f"chat {seq}" for seq in range(1, chats + 1)},
        cache_bytes=0,
        host_bytes=0,
    )


@pytest.fixture
def fake_tokenizer() -> FakeTokenizer:
    return FakeTokenizer()
