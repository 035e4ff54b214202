"""The prefix tree's model: cached pages as the tree of prompts they came from.

A root is the first page of a prompt; its children are the pages that continue it. Two
chats that share a system prompt share a chain of pages and split at a branch point.
What is drawn is runs: a chain of at least `RUN_MIN` pages of one kind (the same state,
chats, sharing and eviction mark), each the only continuation of the one before, is one
node (a stack) until the user unfolds it, so a 100-page chat is a node, not a hundred.
The layout runs left to right (x = the run's column), each chain on one row so a long
prompt reads as a line and a split as a fork.

Text is decoded on first need, without the chat template (`prefix_tree_text`), and kept
until the page's fill changes: most pages are never labelled or hovered.

Pages that live only in the host tier or on disk are nodes too (no device page); the
disk tier's are its newest `TREE_DISK_CAP` records, with their parents from the
snapshot's record list, so a chat kept on disk shows as its chain.

Updates are incremental. `apply_events` follows the engine's cache events (page
stored, removed, evicted, pushed to / restored from the host tier, read back from disk,
moved by defrag, cleared) and `set_snapshot` reconciles against a snapshot, touching only the pages
whose state, owners, fill or parent changed since the last one (numpy diffs; no
per-page Python work for pages that did not change). The layout is recomputed only
when the shape of the tree or the kind of a page changed.

Qt-free, like the page map's model: `gui.views.prefix_tree` draws it and turns clicks
into selections.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.cache.page import PageState
from gui.views.page_map_model import chat_keys
from gui.views.prefix_tree_text import Readable, ShortPrefix, readable_text, special_token_ids

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot

NodeKey = tuple[str, int]  # ("h", hash prefix) for hashed pages, ("p", page) otherwise

X_STEP = 1.6  # layout units from one column to the next: room for a label
RUN_MIN = 3  # a chain of this many pages of one kind or more is drawn as one node
TREE_DISK_CAP = 256  # disk-only nodes drawn at most (the newest records)


def hash_key(hex_or_int: str | int) -> NodeKey:
    """The node key of a content hash, from an event's hex digest or a snapshot's
    uint64 prefix (its first 8 bytes, little-endian) alike."""
    if isinstance(hex_or_int, str):
        return ("h", int.from_bytes(bytes.fromhex(hex_or_int)[:8], "little"))
    return ("h", int(hex_or_int))


@dataclass
class TreeNode:
    key: NodeKey
    parent: NodeKey | None
    page: int  # device page, -1 while the page lives only in the host or disk tier
    state: int = PageState.CACHED
    ref_count: int = 0
    fill: int = 0
    owners: tuple[Any, ...] = ()  # chat keys
    used_by: tuple[Any, ...] = ()  # the chat keys that held it last (kept once released)
    evict_next: bool = False
    tokens: list[int] = field(default_factory=list)  # the snapshot's (shared) token list
    order: int = 0  # creation order: siblings keep their places as the tree grows
    depth: int = 0  # pages before it in its prompt (those the tree still holds)
    children: list[NodeKey] = field(default_factory=list)
    _text: tuple[int, str] | None = None  # (fill, readable text), decoded on first need

    @property
    def shared(self) -> bool:
        return self.ref_count > 1

    @property
    def kind(self) -> tuple[Any, ...]:
        """What a node shows: pages of one chain fold into one run only while this is
        the same for all of them."""
        return (self.state, self.owners, self.shared, self.evict_next, self.page < 0)


@dataclass
class Run:
    """What the view draws as one node: one page, or a chain of at least `RUN_MIN`
    pages of one kind, each the only continuation of the one before, folded."""

    key: NodeKey  # its first page's
    members: list[NodeKey]
    parent: NodeKey | None  # the run before it, None for a root's
    column: int  # runs before it on its path from the root
    order: int
    children: list[NodeKey] = field(default_factory=list)
    pos: tuple[float, float] = (0.0, 0.0)

    @property
    def folded(self) -> bool:
        return len(self.members) > 1


class PrefixTreeModel:
    """The nodes of the tree, keyed by content hash (or by page while a page has none),
    with their parents, children, states, owners and layout positions; and which
    nodes are selected."""

    def __init__(self) -> None:
        self._nodes: dict[NodeKey, TreeNode] = {}
        self._by_page: dict[int, NodeKey] = {}
        self._order = itertools.count()
        self._prev: dict[str, np.ndarray] = {}
        self._tokenizer: Any = None
        self._special: frozenset[int] = frozenset()
        self._version = -1
        self._structure_dirty = True
        self._selected: set[NodeKey] = set()
        self._runs: dict[NodeKey, Run] = {}  # what the view draws, keyed by first page
        self._run_of: dict[NodeKey, NodeKey] = {}  # node -> the run it is drawn in
        self._unfolded: set[NodeKey] = set()  # nodes the user unfolded: never in a run
        self._run_texts: dict[NodeKey, tuple[tuple, Readable]] = {}  # run -> its text
        self.page_size = 0
        self.disk_records = 0  # records the disk tier holds (its newest are nodes)
        self._disk_seen: object = None  # the record list last applied (rebuilt on change)
        self._disk_nodes: dict[int, int] = {}  # hash prefix -> parent prefix, drawn ones
        self.last_update: dict[str, int] = {}  # what the last update added, removed, touched

    # -- reading ----------------------------------------------------------------------

    def nodes(self) -> dict[NodeKey, TreeNode]:
        return dict(self._nodes)

    def node_for_page(self, page: int) -> TreeNode | None:
        key = self._by_page.get(page)
        return None if key is None else self._nodes[key]

    def roots(self) -> list[NodeKey]:
        return [k for k, n in self._nodes.items() if n.parent not in self._nodes]

    def children_of(self, key: NodeKey) -> list[NodeKey]:
        self.relink()
        return list(self._nodes[key].children)

    def branch_points(self) -> list[NodeKey]:
        """Nodes with two or more continuations: where prompts part ways."""
        self.relink()
        return [k for k, n in self._nodes.items() if len(n.children) >= 2]

    def chain_pages(self, key: NodeKey) -> list[int]:
        """Device pages of the node, its ancestors and all its continuations."""
        self.relink()
        keys, seen = [], set()
        k: NodeKey | None = key
        while k is not None and k in self._nodes and k not in seen:
            seen.add(k)
            keys.append(k)
            k = self._nodes[k].parent
        stack = list(self._nodes[key].children) if key in self._nodes else []
        while stack:
            c = stack.pop()
            if c not in seen:
                seen.add(c)
                keys.append(c)
                stack.extend(self._nodes[c].children)
        return sorted(self._nodes[k].page for k in keys if self._nodes[k].page >= 0)

    def get(self, key: NodeKey) -> TreeNode | None:
        return self._nodes.get(key)

    def parent_of(self, node: TreeNode) -> TreeNode | None:
        """The node's parent, None for a root (whose parent page is not in the tree)."""
        return self._nodes.get(node.parent) if node.parent is not None else None

    def is_root(self, node: TreeNode) -> bool:
        return node.parent not in self._nodes

    def selected(self) -> set[NodeKey]:
        return set(self._selected)

    def runs(self) -> dict[NodeKey, Run]:
        """The nodes as drawn (chains of like pages folded), in drawing order; the
        model's own dict, not to be changed."""
        self.relink()
        return self._runs

    def run_of(self, key: NodeKey) -> Run | None:
        self.relink()
        head = self._run_of.get(key)
        return None if head is None else self._runs[head]

    def pages_after(self, node: TreeNode) -> int:
        """Pages continuing ``node`` (its descendants in the tree)."""
        self.relink()
        count, stack = 0, list(node.children)
        while stack:
            count += 1
            stack.extend(self._nodes[stack.pop()].children)
        return count

    def prompt_start_known(self, node: TreeNode) -> bool:
        """Whether the tree still holds the first page of ``node``'s prompt (an orphan's
        was reused, so where it sits in its prompt is not known)."""
        self.relink()
        return self._root_of(node).parent is None

    def _root_of(self, node: TreeNode) -> TreeNode:
        for _ in range(node.depth):
            node = self._nodes[node.parent]  # type: ignore[index]
        return node

    # -- text -------------------------------------------------------------------------

    @property
    def has_tokenizer(self) -> bool:
        """Whether pages can be read: without a tokenizer every text is empty."""
        return self._tokenizer is not None

    def readable(self, node: TreeNode) -> Readable:
        """The page's text without the chat template (see `readable_text`), decoded on
        first need: most pages are never labelled or hovered."""
        if node._text is None or node._text[0] != node.fill:
            node._text = (node.fill, self._readable([node]))
        return node._text[1]

    def text(self, node: TreeNode) -> str:
        return self.readable(node).text

    def run_readable(self, run: Run, pages: int = 4) -> Readable:
        """The text of the run's first ``pages`` pages, decoded together (so a word or
        a turn that crosses a page boundary reads whole); kept until they change."""
        first = [self._nodes[k] for k in run.members[:pages]]
        if len(first) == 1:
            return self.readable(first[0])
        sig = tuple((n.key, n.fill) for n in first)
        kept = self._run_texts.get(run.key)
        if kept is None or kept[0] != sig:
            kept = self._run_texts[run.key] = (sig, self._readable(first))
        return kept[1]

    def _readable(self, chain: list[TreeNode]) -> Readable:
        """``chain``'s tokens (consecutive pages) without the chat template; a role
        header at its start is known for one when the page before ended on a marker."""
        ids = [t for n in chain for t in n.tokens[: n.fill]]
        if self._tokenizer is None or not ids:
            return Readable("", (), False)
        head = chain[0]
        parent = self._nodes.get(head.parent) if head.parent is not None else None
        after = bool(
            parent is not None
            and 0 < parent.fill <= len(parent.tokens)
            and parent.tokens[parent.fill - 1] in self._special
        )
        return readable_text(self._tokenizer.decode, ids, self._special, after)

    def short_shared_prefix(self) -> ShortPrefix | None:
        """The longest start that two or more prompts share when it is shorter than a
        page: their first pages differ after it, so none is shared (the "0 shared" a
        short common system prompt gives). Worth saying only when a whole turn (a system
        prompt, say) is common, or, without template tokens, at least 8 tokens."""
        self.relink()
        firsts = sorted(
            tuple(n.tokens[: n.fill])
            for n in self._nodes.values()
            if n.parent is None and n.page >= 0 and n.fill and n.tokens
        )
        best, at = 0, -1
        for i in range(len(firsts) - 1):
            a, b = firsts[i], firsts[i + 1]
            same = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if same is None:
                same = min(len(a), len(b))
            if best < same < self.page_size:
                best, at = same, i
        if best == 0 or self._tokenizer is None:
            return None
        common = list(firsts[at][:best])
        text = readable_text(self._tokenizer.decode, common, self._special)
        if not (text.closes_turn or (not self._special and best >= 8)):
            return None
        prompts = sum(1 for f in firsts if list(f[:best]) == common)
        return ShortPrefix(prompts, best, self.page_size, text.roles)

    # -- feeding: events --------------------------------------------------------------

    def apply_events(self, events: list[dict[str, Any]]) -> bool:
        """Follow the engine's cache events (`Telemetry.events`); other kinds are
        ignored. States, owners and fills come with the next `set_snapshot`. True when
        nodes came or went."""
        added = removed = 0
        moves: dict[int, int] = {}
        for ev in events:
            kind = ev.get("kind", "")
            page = ev.get("page", -1)
            if kind == "page_defrag_move":
                moves[page] = int(ev.get("detail", -1))
                continue
            if moves:
                self._move_pages(moves)
                moves = {}
            if kind == "page_stored":
                removed += self._drop_page(page)
                key = hash_key(ev["hash"])
                parent = hash_key(ev["parent"]) if ev.get("parent") else None
                old = self._nodes.get(key)
                if old is not None and old.page >= 0 and old.page != page:
                    self._by_page.pop(old.page, None)
                self._put(key, parent, page, PageState.REFERENCED)
                added += 1
            elif kind in ("page_removed", "page_evicted"):
                removed += self._drop_page(page)
            elif kind == "page_tier_push":
                key = hash_key(ev["hash"])
                parent = hash_key(ev["parent"]) if ev.get("parent") else None
                self._put(key, parent, -1, PageState.HOST)
                added += 1
            elif kind in ("page_restored", "page_disk_restored"):
                key = hash_key(ev["hash"])
                parent = hash_key(ev["parent"]) if ev.get("parent") else None
                removed += self._drop_page(page)
                self._put(key, parent, page, PageState.REFERENCED)
                added += 1
            elif kind == "page_cleared":
                removed += len(self._nodes)
                self._nodes.clear()
                self._by_page.clear()
                self._structure_dirty = True
        if moves:
            self._move_pages(moves)
        self.last_update = {"events": len(events), "added": added, "removed": removed}
        return bool(added or removed)

    def _put(self, key: NodeKey, parent: NodeKey | None, page: int, state: int) -> TreeNode:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = TreeNode(key, parent, page, state, order=next(self._order))
            self._structure_dirty = True
        else:
            if node.parent != parent:
                node.parent = parent
                self._structure_dirty = True
            if node.state != state or (node.page < 0) != (page < 0):
                self._structure_dirty = True  # runs of like pages change
            node.page, node.state = page, state
        if page >= 0:
            self._by_page[page] = key
        return node

    def _drop_page(self, page: int) -> int:
        key = self._by_page.pop(page, None)
        if key is None:
            return 0
        node = self._nodes.get(key)
        if node is not None and node.page == page:
            del self._nodes[key]
            self._selected.discard(key)
            self._structure_dirty = True
            return 1
        return 0

    def _move_pages(self, moves: dict[int, int]) -> None:
        """Defrag moves pages in cycles (A to B while B goes to C): apply one batch of
        moves at once so no mapping is overwritten before it is read."""
        moving = {src: self._by_page.pop(src) for src in moves if src in self._by_page}
        for src, key in moving.items():
            dst = moves[src]
            if dst >= 0 and key in self._nodes:
                self._nodes[key].page = dst
                self._by_page[dst] = key

    # -- feeding: snapshots ----------------------------------------------------------

    def set_snapshot(self, snapshot: EngineSnapshot, tokenizer: Any = None) -> bool:
        """Reconcile with ``snapshot`` (the truth): fix what events missed or cannot
        say (placeholder pages being written, states, owners, fills). False when the
        snapshot is the one already applied; `last_update` says what changed."""
        if tokenizer is not None and tokenizer is not self._tokenizer:
            self._tokenizer = tokenizer
            self._special = special_token_ids(tokenizer)
            for node in self._nodes.values():
                node._text = None  # decode again with the tokenizer now known
            self._run_texts.clear()
            self._prev = {}
        if snapshot.version == self._version and self._prev:
            return False
        self._version = snapshot.version
        self.page_size = snapshot.page_size
        cache = snapshot.cache
        n = snapshot.num_pages
        parent = np.full(n, -1, np.int64)
        if len(cache.edges):
            parent[cache.edges[:, 0]] = cache.edges[:, 1]
        in_tree = (cache.hash_prefix != 0) | (cache.fill > 0)
        evict = np.zeros(n, bool)
        if snapshot.eviction_next:
            evict[np.asarray(snapshot.eviction_next, np.int64)] = True
        evict &= cache.fill > 0
        owner_ids = np.zeros(n, np.int64)  # a cheap fingerprint of the owners tuple
        for page in np.flatnonzero(cache.ref_count > 0).tolist():
            owner_ids[page] = hash(cache.owners[page])
        cur = {
            "hash": cache.hash_prefix.astype(np.uint64),
            "parent": parent,
            "state": cache.state.astype(np.int64),
            "ref": cache.ref_count.astype(np.int64),
            "fill": cache.fill.astype(np.int64),
            "owners": owner_ids,
            "in": in_tree,
            "evict": evict,
        }
        prev = self._prev
        if not prev or len(prev["hash"]) != n:
            changed = np.ones(n, bool)
        else:
            changed = np.zeros(n, bool)
            for name, arr in cur.items():
                changed |= arr != prev[name]
            # A page whose parent changed identity (a placeholder that got its content
            # hash) must re-point its children too.
            rekeyed = (cur["hash"] != prev["hash"]) | (cur["in"] != prev["in"])
            has_parent = parent >= 0
            changed[has_parent] |= rekeyed[parent[has_parent]]
        self._prev = cur

        # Plain lists: indexing numpy arrays one page at a time costs more than the copy.
        hashes, parents, states = cur["hash"].tolist(), parent.tolist(), cur["state"].tolist()
        refs, fills, evicts, inside = (
            cur["ref"].tolist(), cur["fill"].tolist(), evict.tolist(), in_tree.tolist()
        )  # fmt: skip
        tags: dict[tuple[int, ...], tuple[Any, ...]] = {}  # owners -> chat keys, once each

        def key_of(page: int) -> NodeKey:
            h = hashes[page]
            return ("h", h) if h else ("p", page)

        # Pages the events left out (an event log that overflowed, say) are redone too.
        missing = [p for p in np.flatnonzero(in_tree).tolist() if p not in self._by_page]
        if missing:
            changed[missing] = True
        removed = added = touched = 0
        pages = np.flatnonzero(changed).tolist()
        for page in pages:
            want = key_of(page) if inside[page] else None
            have = self._by_page.get(page)
            if have is not None and have != want:
                removed += self._drop_page(page)
            if want is None:
                continue
            p = parents[page]
            pkey = key_of(p) if p >= 0 and inside[p] else None
            old = self._nodes.get(want)
            kind = None if old is None else old.kind
            node = self._put(want, pkey, page, states[page])
            added += old is None
            node.tokens = snapshot.page_tokens[page] if page < len(snapshot.page_tokens) else []
            node.ref_count = refs[page]
            node.fill = fills[page]
            node.evict_next = evicts[page]
            owners = cache.owners[page]
            keys = tags.get(owners)
            if keys is None:
                keys = tags[owners] = chat_keys(snapshot, owners)
            node.owners = keys
            if node.owners:
                node.used_by = node.owners
            if node.kind != kind:
                self._structure_dirty = True  # runs of like pages change
            touched += 1
        # Host-tier entries and disk records: keep those the events told us about, add
        # any they missed, and drop the ones neither tier holds any more. A page in both
        # shows as the host tier's, the faster one.
        host = cache.host
        held = set()
        if host is not None:
            held = {int(h) for h in host.hash_prefix[host.state == PageState.HOST].tolist()}
        on_disk = self._disk_records(snapshot)
        for key in [k for k, nd in self._nodes.items() if nd.page < 0]:
            if key[1] not in held and key[1] not in on_disk:
                del self._nodes[key]
                self._structure_dirty = True
                removed += 1
        for h in held:
            node = self._nodes.get(("h", h))
            if node is None:
                self._put(("h", h), None, -1, PageState.HOST)
                added += 1
            elif node.page < 0 and node.state != PageState.HOST:
                node.state, node.ref_count, node.owners = PageState.HOST, 0, ()
                self._structure_dirty = True
        for h, parent_h in on_disk.items():
            node = self._nodes.get(("h", h))
            if node is None:
                self._put(("h", h), ("h", parent_h) if parent_h else None, -1, PageState.DISK)
                node = self._nodes[("h", h)]
                node.fill = snapshot.page_size
                added += 1
            elif node.page < 0 and h not in held and node.state != PageState.DISK:
                node.state, node.ref_count, node.owners = PageState.DISK, 0, ()
                self._structure_dirty = True
        # Any node whose page the snapshot does not show (a missed event) goes.
        for key in [k for k, nd in self._nodes.items() if nd.page >= 0]:
            nd = self._nodes[key]
            if nd.page >= n or not inside[nd.page] or key_of(nd.page) != key:
                if self._by_page.get(nd.page) == key:
                    del self._by_page[nd.page]
                del self._nodes[key]
                self._structure_dirty = True
                removed += 1
        self.last_update = {"changed_pages": len(pages), "added": added, "removed": removed,
                            "touched": touched, "relayout": int(self._structure_dirty)}  # fmt: skip
        return True

    def _disk_records(self, snapshot: EngineSnapshot) -> dict[int, int]:
        """The newest disk records (hash prefix -> parent prefix), worked out again only
        when the snapshot carries a new record list."""
        records = snapshot.cache.disk_records
        if records is not self._disk_seen:
            self._disk_seen = records
            if records is None:
                self.disk_records, self._disk_nodes = 0, {}
            else:
                self.disk_records = len(records.hash_prefix)
                newest = slice(-TREE_DISK_CAP, None)
                self._disk_nodes = dict(
                    zip(
                        records.hash_prefix[newest].tolist(),
                        records.parent_prefix[newest].tolist(),
                        strict=True,
                    )
                )
        return self._disk_nodes

    # -- selection --------------------------------------------------------------------

    def select_pages(self, pages: list[int]) -> None:
        """Select the nodes of these device pages (what the page map highlights)."""
        self._selected = {self._by_page[p] for p in pages if p in self._by_page}

    def select_chat(self, tag: Any) -> None:
        self._selected = {k for k, n in self._nodes.items() if tag in n.owners}

    def select_chain(self, key: NodeKey) -> list[int]:
        """Select the node and its chain; returns the chain's device pages."""
        if key not in self._nodes:
            return []
        pages = self.chain_pages(key)
        self.select_pages(pages)
        self._selected.add(key)
        return pages

    # -- layout -----------------------------------------------------------------------

    def unfold(self, key: NodeKey) -> bool:
        """Draw the pages of the run holding ``key`` one by one; False when it is one
        page already."""
        run = self.run_of(key)
        if run is None or not run.folded:
            return False
        self._unfolded.update(run.members)
        self._structure_dirty = True
        return True

    def unfolded(self, key: NodeKey) -> bool:
        """Whether ``key`` is drawn alone because the user unfolded its chain."""
        return key in self._unfolded

    def fold(self, key: NodeKey) -> bool:
        """Fold again the unfolded chain through ``key`` (the nodes unfolded with it:
        up and down while each is the only continuation of the one before)."""
        node = self._nodes.get(key)
        if node is None or key not in self._unfolded:
            return False
        self.relink()
        chain = [key]
        up = self._nodes.get(node.parent) if node.parent is not None else None
        while up is not None and up.key in self._unfolded and len(up.children) == 1:
            chain.append(up.key)
            up = self._nodes.get(up.parent) if up.parent is not None else None
        down = node
        while len(down.children) == 1 and down.children[0] in self._unfolded:
            down = self._nodes[down.children[0]]
            chain.append(down.key)
        self._unfolded.difference_update(chain)
        self._structure_dirty = True
        return True

    def relink(self) -> bool:
        """Bring children lists, runs and positions up to date after the tree's shape
        (or a page's kind) changed; True when it had to."""
        if not self._structure_dirty:
            return False
        nodes = self._nodes
        for node in nodes.values():
            node.children = []
        ordered = sorted(nodes.values(), key=lambda nd: nd.order)
        roots = []
        for node in ordered:
            parent = nodes.get(node.parent) if node.parent is not None else None
            if parent is not None:
                parent.children.append(node.key)
            else:
                roots.append(node)
        self._unfolded.intersection_update(nodes)
        self._lay_out(roots)
        self._structure_dirty = False
        return True

    def _lay_out(self, roots: list[TreeNode]) -> None:
        """Fold chains into runs and place them: x = column (runs from the root), y =
        row; a run sits on its first child's row, so a chain is a straight line and a
        fork steps down. One pass, depth first, iterative: chains can be thousands of
        pages deep."""
        nodes, unfolded = self._nodes, self._unfolded
        runs: dict[NodeKey, Run] = {}
        run_of: dict[NodeKey, NodeKey] = {}
        # (first node, parent run, column, depth, rows to step down before it)
        stack = [(r, None, 0, 0, 1.5 if i else 0.0) for i, r in reversed(list(enumerate(roots)))]
        row = 0.0
        while stack:
            head, up, column, depth, step = stack.pop()
            chain = [head]
            if head.key not in unfolded:
                kind, tail = head.kind, head
                while len(tail.children) == 1:
                    tail = nodes[tail.children[0]]
                    if tail.key in unfolded or tail.kind != kind:
                        break
                    chain.append(tail)
                if len(chain) < RUN_MIN:
                    chain = [head]
            row += step
            run = Run(head.key, [n.key for n in chain], up, column, head.order)
            run.pos = (column * X_STEP, row)
            runs[head.key] = run
            if up is not None:
                runs[up].children.append(head.key)
            for i, n in enumerate(chain):
                n.depth = depth + i
                run_of[n.key] = head.key
            kids = chain[-1].children
            for i in range(len(kids) - 1, -1, -1):
                stack.append(
                    (nodes[kids[i]], head.key, column + 1, depth + len(chain), float(i > 0))
                )
        self._runs, self._run_of = runs, run_of
        self._run_texts = {k: v for k, v in self._run_texts.items() if k in runs}
