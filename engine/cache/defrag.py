"""Defragmentation plan (§5): lay every tree's longest chain out in consecutive pages.

Pure planning over page records; ``PageTable.defrag`` applies the plan to records and
storage. Trees are laid out in turn (by the current index of their root), each tree
depth first with the longest child first, so every tree's longest chain is one
consecutive run. The whole layout is then rotated circularly by the shift that keeps
the most pages where they are. Moving is a set of permutation cycles, each rotated
through one scratch page: cycle length + 1 copies per cache tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.page import PageRecord

MIN_MOVE_FRACTION = 0.10


@dataclass
class DefragPlan:
    target: list[int]  # target[i]: new physical index of the page now at i
    cycles: list[list[int]]  # content of cycle[j] goes to cycle[j + 1], last to cycle[0]
    moved_pages: int  # pages holding content that change place


def _layout(pages: Sequence[PageRecord]) -> list[int]:
    live = [p for p in pages if p.fill > 0]
    by_hash = {p.hash: p for p in live}
    children: dict[int, list[int]] = {p.index: [] for p in live}
    roots = []
    for p in live:
        parent = by_hash.get(p.parent_hash) if p.parent_hash is not None else None
        if parent is None:
            roots.append(p.index)
        else:
            children[parent.index].append(p.index)
    # Longest chain below each page (itself included), children before parents.
    depth: dict[int, int] = {}
    for root in roots:
        stack = [(root, False)]
        while stack:
            i, done = stack.pop()
            if done:
                depth[i] = 1 + max((depth[c] for c in children[i]), default=0)
            else:
                stack.append((i, True))
                stack.extend((c, False) for c in children[i])
    sequence: list[int] = []
    for root in sorted(roots):
        stack = [root]
        while stack:
            i = stack.pop()
            sequence.append(i)
            ordered = sorted(children[i], key=lambda c: (-depth[c], c))
            stack.extend(reversed(ordered))  # longest child popped first
    return sequence


def plan_defrag(
    pages: Sequence[PageRecord], min_move_fraction: float = MIN_MOVE_FRACTION
) -> DefragPlan | None:
    """The move that lays trees out contiguously, or None when it would move
    ``min_move_fraction`` of the pages or fewer."""
    n = len(pages)
    sequence = _layout(pages)
    if not sequence:
        return None
    votes = Counter((i - k) % n for k, i in enumerate(sequence))
    shift = max(sorted(votes), key=lambda s: votes[s])
    target = [-1] * n
    for k, i in enumerate(sequence):
        target[i] = (k + shift) % n
    moved = sum(1 for i in sequence if target[i] != i)
    if moved <= min_move_fraction * n:
        return None
    # Empty pages fill the slots the layout left over, staying put where they can.
    taken = set(target[i] for i in sequence)
    free_slots = [s for s in range(n) if s not in taken]
    free_set = set(free_slots)
    leftover = [i for i in range(n) if target[i] < 0]
    for i in leftover:
        if i in free_set:
            target[i] = i
            free_set.discard(i)
    spare = iter(s for s in free_slots if s in free_set)
    for i in leftover:
        if target[i] < 0:
            target[i] = next(spare)
    seen = [False] * n
    cycles = []
    for start in range(n):
        if seen[start] or target[start] == start:
            seen[start] = True
            continue
        cycle = []
        i = start
        while not seen[i]:
            seen[i] = True
            cycle.append(i)
            i = target[i]
        cycles.append(cycle)
    return DefragPlan(target, cycles, moved)
