"""Eviction order: which unreferenced page (or host-tier slot) is reused first (§4).

Tail first (the default):
1. empty pages (fill 0), oldest access first;
2. orphan chains (parent hash resolves to nothing), leaf first;
3. intact trees, least recently used root first; inside a tree leaf first: a min-heap
   of current leaves keyed by access serial, a parent becomes a leaf when its children
   are gone; referenced or protected pages are never emitted and block their ancestors;
4. leftovers (protected, or blocked by a protected descendant) last, so allocation
   never starves while any unreferenced page exists.

Plain LRU: empty pages, then every other unreferenced page by access serial,
protected last.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable
from enum import StrEnum
from typing import Protocol


class EvictionPolicy(StrEnum):
    TAIL_FIRST = "tail_first"
    LRU = "lru"


class EvictionNode(Protocol):
    """What the order needs to know of a page or a tier slot."""

    index: int
    hash: bytes
    parent_hash: bytes | None
    access_serial: int
    fill: int
    ref_count: int


def eviction_order(
    nodes: Iterable[EvictionNode],
    protected: Collection[bytes] = (),
    policy: EvictionPolicy = EvictionPolicy.TAIL_FIRST,
) -> list[int]:
    """Indices of every unreferenced node, first to evict first.

    ``nodes`` are all nodes of one pool, referenced ones included: they block their
    ancestors. Every unreferenced node appears exactly once.
    """
    nodes = list(nodes)
    empties = sorted(
        (n for n in nodes if n.ref_count == 0 and n.fill == 0), key=lambda n: n.access_serial
    )
    order = [n.index for n in empties]
    live = [n for n in nodes if n.ref_count > 0 or n.fill > 0]
    if policy is EvictionPolicy.LRU:
        rest = sorted(
            (n for n in live if n.ref_count == 0),
            key=lambda n: (n.hash in protected, n.access_serial),
        )
        return order + [n.index for n in rest]

    by_hash = {n.hash: n for n in live}
    children: dict[bytes, int] = dict.fromkeys(by_hash, 0)
    for n in live:
        if n.parent_hash is not None and n.parent_hash in by_hash:
            children[n.parent_hash] += 1

    # Group nodes by tree: follow parents to the root (memoized walk).
    root_of: dict[bytes, bytes] = {}
    for n in live:
        path = []
        cur = n
        while cur.hash not in root_of:
            path.append(cur.hash)
            parent = by_hash.get(cur.parent_hash) if cur.parent_hash is not None else None
            if parent is None:
                root_of[cur.hash] = cur.hash
                break
            cur = parent
        root = root_of[cur.hash]
        for h in path:
            root_of[h] = root
    trees: dict[bytes, list[EvictionNode]] = {}
    for n in live:
        trees.setdefault(root_of[n.hash], []).append(n)

    def tree_rank(root_hash: bytes) -> tuple[int, int]:
        root = by_hash[root_hash]
        orphan = root.parent_hash is not None
        return (0 if orphan else 1, root.access_serial)

    emitted: set[int] = set()
    for root_hash in sorted(trees, key=tree_rank):
        heap = [(n.access_serial, n.index, n) for n in trees[root_hash] if children[n.hash] == 0]
        heapq.heapify(heap)
        while heap:
            _, _, n = heapq.heappop(heap)
            if n.ref_count > 0 or n.hash in protected:
                continue  # never emitted; its ancestors stay blocked
            order.append(n.index)
            emitted.add(n.index)
            if n.parent_hash is not None and n.parent_hash in by_hash:
                children[n.parent_hash] -= 1
                if children[n.parent_hash] == 0:
                    parent = by_hash[n.parent_hash]
                    heapq.heappush(heap, (parent.access_serial, parent.index, parent))

    leftovers = sorted(
        (n for n in live if n.ref_count == 0 and n.index not in emitted),
        key=lambda n: (n.hash in protected, n.access_serial),
    )
    order.extend(n.index for n in leftovers)
    return order
