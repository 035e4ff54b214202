"""Eviction order (docs/ENGINE.md §4) on hand-built trees, and under real pressure."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache import EvictionPolicy, eviction_order
from tests.engine.cache import fill, make_table

PS = 16


@dataclass
class Node:
    index: int
    hash: bytes
    parent_hash: bytes | None
    access_serial: int
    fill: int = PS
    ref_count: int = 0


def h(name: str) -> bytes:
    return name.encode().ljust(16, b"_")


def node(i, name, parent, serial, **kw) -> Node:
    return Node(i, h(name), h(parent) if parent else None, serial, **kw)


def test_empty_pages_first_oldest_first():
    nodes = [
        node(0, "root", None, 1),
        node(1, "e1", None, 9, fill=0),
        node(2, "e2", None, 4, fill=0),
    ]
    assert eviction_order(nodes) == [2, 1, 0]


def test_orphans_before_intact_trees():
    nodes = [
        node(0, "root", None, 1),
        node(1, "child", "root", 2),
        node(2, "orphan", "gone", 50),
        node(3, "orphan-kid", "orphan", 60),
    ]
    assert eviction_order(nodes) == [3, 2, 1, 0]


def test_least_recently_used_tree_first():
    nodes = [
        node(0, "new-root", None, 10),
        node(1, "new-leaf", "new-root", 11),
        node(2, "old-root", None, 3),
        node(3, "old-leaf", "old-root", 12),
    ]
    assert eviction_order(nodes) == [3, 2, 1, 0]


def test_leaf_first_inside_a_tree():
    #        r(1)
    #       /    \
    #    a(10)   b(3)
    #              \
    #              c(20)
    nodes = [
        node(0, "r", None, 1),
        node(1, "a", "r", 10),
        node(2, "b", "r", 3),
        node(3, "c", "b", 20),
    ]
    # leaves a(10), c(20): a first; then c; then b becomes a leaf; the root last
    assert eviction_order(nodes) == [1, 3, 2, 0]


def test_referenced_pages_are_never_emitted_and_block_ancestors():
    nodes = [
        node(0, "r", None, 1),
        node(1, "a", "r", 10),
        node(2, "b", "r", 3),
        node(3, "c", "b", 20, ref_count=1),
        node(4, "other", None, 30),
    ]
    order = eviction_order(nodes)
    assert 3 not in order
    # a goes with its tree; b and r are blocked by c; the other tree comes next;
    # the blocked pages come last as leftovers.
    assert order == [1, 4, 0, 2] or order == [1, 4, 2, 0]
    assert order.index(4) < order.index(2) and order.index(4) < order.index(0)


def test_protected_pages_come_after_every_other_page():
    nodes = [
        node(0, "r", None, 1),
        node(1, "a", "r", 2),
        node(2, "x", None, 100),
        node(3, "y", "x", 101),
        node(4, "e", None, 200, fill=0),
    ]
    order = eviction_order(nodes, protected={h("a")})
    assert order[0] == 4
    assert order[-1] == 1  # protected: last
    assert order.index(0) > order.index(3)  # r blocked by protected a: leftover
    assert sorted(order) == [0, 1, 2, 3, 4]


def test_lru_policy_is_plain_recency():
    nodes = [
        node(0, "r", None, 1),
        node(1, "a", "r", 2),
        node(2, "b", "a", 3),
        node(3, "e", None, 50, fill=0),
    ]
    assert eviction_order(nodes, policy=EvictionPolicy.LRU) == [3, 0, 1, 2]
    assert eviction_order(nodes, policy=EvictionPolicy.TAIL_FIRST) == [3, 2, 1, 0]


def _conversation_then_pressure(policy: str) -> int:
    table = make_table(8, PS, with_storage=False, eviction=policy)
    talk = list(range(6 * PS + 1))  # 6 context pages, 7 pages in all
    job = table.allocate(1, talk, 0)
    fill(table, job, talk, len(talk) - 1)
    table.release(job)
    other = list(range(1000, 1000 + 4 * PS))  # needs 4 pages: 2 empty + 2 evicted
    job = table.allocate(2, other, 0)
    table.release(job)
    table.validate()
    again = table.allocate(3, talk, 0)
    table.validate()
    return again.cached_tokens


def test_long_conversation_under_pressure_keeps_its_root_pages():
    # 8 pages: the conversation leaves 6 full pages and 2 empty ones; the other job's 4
    # pages take the 2 empty ones and evict 2 full pages.
    assert _conversation_then_pressure("tail_first") == 4 * PS  # lost only its last pages
    assert _conversation_then_pressure("lru") == 0  # root evicted first: no prefix left


def test_every_unreferenced_page_appears_once():
    table = make_table(12, PS, with_storage=False)
    for i, n in enumerate([40, 70, 20]):
        seq = [i * 100 + t for t in range(n)]
        job = table.allocate(i, seq, 4)
        fill(table, job, seq, n - 1)
        if i != 1:
            table.release(job)
    order = table.eviction_order()
    assert sorted(order) == sorted(p.index for p in table.unreferenced.values())


def test_next_victims_is_the_order_allocation_consumes():
    from engine.cache.page_table import PageTable

    table = PageTable(8, 16, "fp")
    for job, first in ((1, 0), (2, 500)):
        tokens = list(range(first, first + 40))
        alloc = table.allocate(job, tokens, 0)
        for i in range(len(alloc.block_table)):
            fill = min(16, len(tokens) - i * 16)
            table.mark_filled(alloc, i, tokens[i * 16 : i * 16 + fill], fill)
        table.release(alloc)
    expected = [i for i in table.eviction_order() if table.pages[i].ref_count == 0][:5]
    assert table.next_victims(5) == expected
    taken = table.allocate(3, list(range(900, 930)), 0)  # two fresh pages
    assert taken.block_table == expected[:2]
    assert table.next_victims(3) == expected[2:5]
