"""The prefix tree: cached pages as the tree of prompts they came from.

A root is the first page of a prompt; its children are the pages that continue it. Two
chats that share a system prompt share a chain of pages and split at a branch point.
The tree is laid out left to right (depth = page position in the prompt), each chain
on one row so a long prompt reads as a line and a split as a fork.

Updates are incremental. `apply_events` follows the engine's cache events (page
stored, removed, evicted, pushed to / restored from the host tier, moved by defrag,
cleared) and `set_snapshot` reconciles against a snapshot, touching only the pages
whose state, owners, fill or parent changed since the last one (numpy diffs; no
per-page Python work for pages that did not change). The layout is recomputed only
when the shape of the tree changed.

Nodes use the page map's colours: a chat's colour while a job holds the page, sky blue
when cached, blue in the host tier; shared pages (ref count > 1) are drawn larger with
a heavy outline; pages next in line for eviction get a vermillion outline.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QPen
from PySide6.QtWidgets import (
    QGraphicsItem,
    QGraphicsRectItem,
    QGraphicsSimpleTextItem,
    QWidget,
)

from engine.cache.page import PageState
from gui.palette import STATE_NAMES, ChatColors, Palette
from gui.views.base import ChatColoredView
from gui.views.captions import fixed_caption, plot_with_caption
from gui.views.page_map import chat_key

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot

NodeKey = tuple[str, int]  # ("h", hash prefix) for hashed pages, ("p", page) otherwise

_X_STEP = 1.6  # room for a label between two generations
_NODE = 13.0  # pixels
_NODE_SHARED = 18.0
_MAX_LABELS = 400
_LABEL_CHARS = 48  # longest snippet kept; what shows is elided to the room on screen
_LABEL_MIN_PX = 72.0  # narrower, a label says nothing ("to Li…"): it takes more room
# and the overlap check leaves out its neighbours' labels instead
_SPECIAL = re.compile(r"<\|[^|>]{1,40}\|>")  # chat-template markers: noise in a label


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
    page: int  # device page, -1 while the page lives only in the host tier
    state: int = PageState.CACHED
    ref_count: int = 0
    fill: int = 0
    owners: tuple[Any, ...] = ()  # chat keys
    evict_next: bool = False
    text: str = ""
    order: int = 0  # creation order: siblings keep their places as the tree grows
    pos: tuple[float, float] = (0.0, 0.0)
    children: list[NodeKey] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        return self.ref_count > 1


class PrefixTreeView(ChatColoredView):
    """The prefix tree of the cache. Signal `node_clicked(list[int])`: the device pages
    of the clicked node's chain (its ancestors, itself and its continuations)."""

    node_clicked = Signal(list)

    def __init__(
        self,
        chats: ChatColors | None = None,
        palette: Palette | None = None,
        parent: QWidget | None = None,
    ):
        super().__init__(chats, palette, parent)
        self._nodes: dict[NodeKey, TreeNode] = {}
        self._by_page: dict[int, NodeKey] = {}
        self._order = itertools.count()
        self._prev: dict[str, np.ndarray] = {}
        self._tokenizer: Any = None
        self._version = -1
        self._structure_dirty = True
        self._selected: set[NodeKey] = set()
        self._labels: dict[NodeKey, _Label] = {}
        self._label_order: list[NodeKey] = []  # most telling first: roots, forks, leaves
        self._user_moved = False
        self.page_size = 0
        self.last_update: dict[str, int] = {}  # what the last update touched (for tests)

        self.plot = pg.PlotWidget(parent=self)
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        vb = self.plot.getViewBox()
        vb.invertY(True)
        vb.sigRangeChangedManually.connect(self._on_user_range)
        vb.sigRangeChanged.connect(lambda *_: self._update_label_visibility())
        vb.sigResized.connect(lambda *_: self._update_label_visibility())  # same range, new px
        self.edges = pg.PlotCurveItem(connect="pairs")
        # pxMode: one cached pixmap per style drawn with drawPixmapFragments, instead of
        # a Python paint call per node (which also trips the PySide6 6.12 / Python 3.11
        # None-refcount bug described in `_Label`).
        self.scatter = pg.ScatterPlotItem(
            pxMode=True, symbol="s", hoverable=True, tip=self._tip_for_point
        )
        self._pens: dict[tuple[str, float], Any] = {}
        self._brushes: dict[str, Any] = {}
        self.scatter.sigClicked.connect(self._on_points_clicked)
        self.plot.addItem(self.edges)
        self.plot.addItem(self.scatter)
        self.caption = fixed_caption(self)
        plot_with_caption(self, self.plot, self.caption)
        self.setMinimumSize(160, 120)
        self.set_palette(self.palette_)

    # -- model data -------------------------------------------------------------------

    def nodes(self) -> dict[NodeKey, TreeNode]:
        return dict(self._nodes)

    def node_for_page(self, page: int) -> TreeNode | None:
        key = self._by_page.get(page)
        return None if key is None else self._nodes[key]

    def roots(self) -> list[NodeKey]:
        return [k for k, n in self._nodes.items() if n.parent not in self._nodes]

    def children_of(self, key: NodeKey) -> list[NodeKey]:
        self._relink()
        return list(self._nodes[key].children)

    def branch_points(self) -> list[NodeKey]:
        """Nodes with two or more continuations: where prompts part ways."""
        self._relink()
        return [k for k, n in self._nodes.items() if len(n.children) >= 2]

    def chain_pages(self, key: NodeKey) -> list[int]:
        """Device pages of the node, its ancestors and all its continuations."""
        self._relink()
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

    def selected(self) -> set[NodeKey]:
        return set(self._selected)

    # -- feeding: events --------------------------------------------------------------

    def apply_events(self, events: list[dict[str, Any]]) -> None:
        """Follow the engine's cache events (`Telemetry.events`); other kinds are
        ignored. States, owners and fills come with the next `set_snapshot`."""
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
            elif kind == "page_restored":
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
        if added or removed:
            self._redraw()

    def _put(self, key: NodeKey, parent: NodeKey | None, page: int, state: int) -> TreeNode:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = TreeNode(key, parent, page, state, order=next(self._order))
            self._structure_dirty = True
        else:
            if node.parent != parent:
                node.parent = parent
                self._structure_dirty = True
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

    # -- feeding: snapshots -------------------------------------------------------

    def set_snapshot(self, snapshot: EngineSnapshot, tokenizer: Any = None) -> None:
        """Reconcile with ``snapshot`` (the truth): fix what events missed or cannot
        say (placeholder pages being written, states, owners, fills)."""
        if tokenizer is not None and tokenizer is not self._tokenizer:
            self._tokenizer = tokenizer
            for node in self._nodes.values():
                node.text = ""  # decode again with the tokenizer now known
            self._prev = {}
        if snapshot.version == self._version and self._prev:
            return
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

        def key_of(page: int) -> NodeKey:
            h = int(cache.hash_prefix[page])
            return ("h", h) if h else ("p", page)

        # Pages the events left out (an event log that overflowed, say) are redone too.
        missing = [p for p in np.flatnonzero(in_tree).tolist() if p not in self._by_page]
        if missing:
            changed[missing] = True
        removed = added = touched = 0
        pages = np.flatnonzero(changed).tolist()
        for page in pages:
            want = key_of(page) if in_tree[page] else None
            have = self._by_page.get(page)
            if have is not None and have != want:
                removed += self._drop_page(page)
            if want is None:
                continue
            p = int(parent[page])
            pkey = key_of(p) if p >= 0 and in_tree[p] else None
            before = len(self._nodes)
            node = self._put(want, pkey, page, int(cache.state[page]))
            added += len(self._nodes) - before
            fill = int(cache.fill[page])
            if fill != node.fill or not node.text:
                node.text = self._decode(snapshot, page, fill)
            node.ref_count = int(cache.ref_count[page])
            node.fill = fill
            node.evict_next = bool(evict[page])
            node.owners = self._owner_keys(snapshot, page)
            touched += 1
        # Host-tier entries: keep those the events told us about, add any they missed,
        # and drop the ones the tier no longer holds.
        host = cache.host
        held = set()
        if host is not None:
            held = {int(h) for h in host.hash_prefix[host.state == PageState.HOST].tolist()}
        for key in [k for k, nd in self._nodes.items() if nd.page < 0]:
            if key[1] not in held:
                del self._nodes[key]
                self._structure_dirty = True
                removed += 1
        for h in held:
            node = self._nodes.get(("h", h))
            if node is None:
                self._put(("h", h), None, -1, PageState.HOST)
                added += 1
            elif node.page < 0:
                node.state, node.ref_count, node.owners = PageState.HOST, 0, ()
        # Any node whose page the snapshot does not show (a missed event) goes.
        for key in [k for k, nd in self._nodes.items() if nd.page >= 0]:
            nd = self._nodes[key]
            if nd.page >= n or not in_tree[nd.page] or key_of(nd.page) != key:
                if self._by_page.get(nd.page) == key:
                    del self._by_page[nd.page]
                del self._nodes[key]
                self._structure_dirty = True
                removed += 1
        self.last_update = {"changed_pages": len(pages), "added": added, "removed": removed,
                            "touched": touched, "relayout": int(self._structure_dirty)}  # fmt: skip
        self._redraw(update_only=not self._structure_dirty and touched == 0)

    def _owner_keys(self, snapshot: EngineSnapshot, page: int) -> tuple[Any, ...]:
        keys: list[Any] = []
        for seq in snapshot.cache.owners[page]:
            job = snapshot.seq_jobs.get(seq)
            key = chat_key(job if job is not None else -seq, snapshot.job_tags.get(job))
            if key not in keys:
                keys.append(key)
        return tuple(keys)

    def _decode(self, snapshot: EngineSnapshot, page: int, fill: int) -> str:
        if self._tokenizer is None or page >= len(snapshot.page_tokens):
            return ""
        ids = list(snapshot.page_tokens[page][:fill])
        if not ids:
            return ""
        try:
            return self._tokenizer.decode(ids)
        except Exception:  # noqa: BLE001 - a label must never break drawing
            return ""

    # -- selection --------------------------------------------------------------------

    def select_pages(self, pages: list[int]) -> None:
        """Outline the nodes of these device pages (what the page map highlights)."""
        self._selected = {self._by_page[p] for p in pages if p in self._by_page}
        self._redraw(update_only=True)

    def select_chat(self, tag: Any) -> None:
        self._selected = {k for k, n in self._nodes.items() if tag in n.owners}
        self._redraw(update_only=True)

    def click_node(self, key: NodeKey) -> list[int]:
        """What a click on a node does: select its chain and emit its pages."""
        if key not in self._nodes:
            return []
        pages = self.chain_pages(key)
        self._selected = {self._by_page[p] for p in pages if p in self._by_page}
        self._selected.add(key)
        self._redraw(update_only=True)
        self.node_clicked.emit(pages)
        return pages

    def _on_points_clicked(self, _item: Any, points: Any, *_: Any) -> None:
        if len(points):
            self.click_node(points[0].data())

    def _on_user_range(self, *_: Any) -> None:
        self._user_moved = True

    def reset_view(self) -> None:
        self._user_moved = False
        self._fit()

    # -- drawing -------------------------------------------------------------------

    def set_palette(self, palette: Palette) -> None:
        self.palette_ = palette
        self.plot.setBackground(palette.background)
        self.caption.setStyleSheet(f"color: {palette.muted_text};")
        for item in self._labels.values():
            self.plot.removeItem(item)
        self._labels.clear()
        self._redraw()

    def _relink(self) -> None:
        if not self._structure_dirty:
            return
        for node in self._nodes.values():
            node.children = []
        for node in sorted(self._nodes.values(), key=lambda nd: nd.order):
            parent = self._nodes.get(node.parent) if node.parent is not None else None
            if parent is not None:
                parent.children.append(node.key)
        self._layout()
        self._structure_dirty = False

    def _layout(self) -> None:
        """x = depth, y = row; a node sits on its first child's row so every chain is
        a straight line and a fork steps down."""
        row = 0.0
        roots = sorted(
            (n for n in self._nodes.values() if n.parent not in self._nodes),
            key=lambda nd: nd.order,
        )
        for root in roots:
            stack: list[tuple[TreeNode, int, bool]] = [(root, 0, True)]
            while stack:  # iterative: chains can be thousands of pages deep
                node, depth, first = stack.pop()
                if not first:
                    row += 1.0
                node.pos = (depth * _X_STEP, row)
                kids = [self._nodes[c] for c in node.children]
                for i, kid in reversed(list(enumerate(kids))):
                    stack.append((kid, depth + 1, i == 0))
            row += 1.5  # a little air between prompts that share nothing

    def _pen(self, color: str, width: float) -> Any:
        """Pens and brushes are shared: thousands of nodes use a handful of styles."""
        pen = self._pens.get((color, width))
        if pen is None:
            pen = self._pens[(color, width)] = pg.mkPen(color, width=width)
        return pen

    def _brush(self, color: str) -> Any:
        brush = self._brushes.get(color)
        if brush is None:
            brush = self._brushes[color] = pg.mkBrush(color)
        return brush

    def _node_color(self, node: TreeNode) -> str:
        if node.owners and node.state == PageState.REFERENCED:
            return self.chats.color(node.owners[0])
        return self.palette_.state_color(int(node.state))

    def _redraw(self, update_only: bool = False) -> None:
        pal = self.palette_
        structure_changed = self._structure_dirty
        self._relink()
        nodes = sorted(self._nodes.values(), key=lambda nd: nd.order)
        if not nodes:
            self.scatter.clear()
            self.edges.setData([], [])
            for item in self._labels.values():
                self.plot.removeItem(item)
            self._labels.clear()
            self.caption.setText("No cached pages yet: send a message to fill the cache.")
            return
        pos = np.array([n.pos for n in nodes], float)
        brushes = [self._brush(self._node_color(n)) for n in nodes]
        pens, sizes = [], []
        for n in nodes:
            if n.key in self._selected:
                pens.append(self._pen(pal.highlight, 3))
            elif n.evict_next:
                pens.append(self._pen(pal.evict, 2.5))
            elif n.shared:
                pens.append(self._pen(pal.shared_mark, 2.5))
            else:
                pens.append(self._pen(pal.background, 1))
            sizes.append(_NODE_SHARED if n.shared else _NODE)
        self.scatter.setData(
            pos=pos, brush=brushes, pen=pens, size=sizes, data=[n.key for n in nodes]
        )
        if structure_changed or not update_only:
            xs, ys = [], []
            for n in nodes:
                parent = self._nodes.get(n.parent) if n.parent is not None else None
                if parent is None:
                    continue
                (x0, y0), (x1, y1) = parent.pos, n.pos
                if y0 == y1:
                    xs += [x0, x1]
                    ys += [y0, y1]
                else:  # an elbow: down at the parent's column, then across
                    xs += [x0, x0, x0, x1]
                    ys += [y0, y1, y1, y1]
            self.edges.setData(np.array(xs, float), np.array(ys, float), connect="pairs")
            self.edges.setPen(pg.mkPen(pal.muted_text, width=1.2))
        self._update_labels(nodes)
        if structure_changed and not self._user_moved:
            self._fit()
        shared = sum(1 for n in nodes if n.shared)
        forks = sum(1 for n in nodes if len(n.children) >= 2)
        roots = sum(1 for n in nodes if n.parent not in self._nodes)
        self.caption.setText(
            f"{len(nodes)} pages in {roots} prompt tree(s) · {forks} branch point(s) · "
            f"{shared} shared · drag to pan, wheel to zoom, click a node to find its pages"
        )

    def _label_priority(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """Which nodes get a text label when there are too many to label all: roots
        and forks first (they explain the shape), then leaves, then the rest."""

        def rank(n: TreeNode) -> tuple[int, int]:
            if n.parent not in self._nodes:
                return 0, n.order
            if len(n.children) >= 2 or n.shared:
                return 1, n.order
            if not n.children:
                return 2, n.order
            return 3, n.order

        return sorted(nodes, key=rank)[:_MAX_LABELS]

    def _update_labels(self, nodes: list[TreeNode]) -> None:
        ranked = self._label_priority(nodes)
        want = {n.key: n for n in ranked}
        self._label_order = [n.key for n in ranked]
        for key in [k for k in self._labels if k not in want]:
            self.plot.removeItem(self._labels.pop(key))
        for key, node in want.items():
            text = _snippet(node.text) or (f"p{node.page}" if node.page >= 0 else "host")
            item = self._labels.get(key)
            if item is None:
                item = _Label(text, self.palette_.foreground)
                self.plot.addItem(item)
                self._labels[key] = item
            else:
                item.set_text(text)
            item.setPos(node.pos[0], node.pos[1])
        self._update_label_visibility()

    def _update_label_visibility(self) -> None:
        """Place labels so that none overlaps another: each starts under its node's
        left edge and is elided to the room before the next node on its row; then, most
        telling first (roots, forks, leaves, the rest), a label shows only if it
        overlaps none already shown. Zooming in makes room for more of them."""
        if not self._labels:
            return
        vb = self.plot.getViewBox()
        (x0, x1), _ = vb.viewRange()
        px_per_unit = vb.width() / (x1 - x0) if x1 > x0 else 0.0
        room = px_per_unit * _X_STEP - 6
        # childTransform() brings the view's matrix up to date first; pyqtgraph updates
        # it lazily, so right after a resize the child group's own transform is stale.
        to_scene = vb.childTransform() * vb.sceneTransform()
        visible = vb.sceneBoundingRect()
        taken: dict[int, list[QRectF]] = {}  # placed rects, bucketed by pixel row
        for key in self._label_order:
            item, node = self._labels.get(key), self._nodes.get(key)
            if item is None or node is None:
                continue
            width = item.fit(max(room, _LABEL_MIN_PX))
            at = to_scene.map(QPointF(*node.pos))
            rect = QRectF(at.x() + item.offset.x(), at.y() + item.offset.y(), width,
                          item.line_height)  # fmt: skip
            band = int(rect.top() // item.line_height)
            near = [r for b in (band - 1, band, band + 1) for r in taken.get(b, ())]
            ok = visible.contains(rect.center()) and not any(rect.intersects(r) for r in near)
            item.setVisible(ok)
            if ok:
                taken.setdefault(band, []).append(rect.adjusted(-3, 0, 3, 0))

    def _fit(self) -> None:
        if not self._nodes:
            return
        xs = [n.pos[0] for n in self._nodes.values()]
        ys = [n.pos[1] for n in self._nodes.values()]
        # Show at most ~12 generations so labels stay readable; pan for the rest.
        x_max = min(max(xs), min(xs) + 11 * _X_STEP)
        self.plot.getViewBox().setRange(
            xRange=(min(xs) - 0.8, x_max + 0.8), yRange=(min(ys) - 0.8, max(ys) + 1.2), padding=0
        )

    def _tip_for_point(self, x: float, y: float, data: Any) -> str:
        node = self._nodes.get(data)
        if node is None:
            return ""
        where = f"page {node.page}" if node.page >= 0 else "host tier"
        lines = [f"{where} · {STATE_NAMES[PageState(int(node.state))]}"]
        if node.key[0] == "h":
            lines.append(f"hash {node.key[1].to_bytes(8, 'little').hex()[:12]}…")
        lines.append(f"ref count {node.ref_count} · fill {node.fill}/{self.page_size}")
        lines.append(f"{len(node.children)} continuation(s)")
        if node.owners:
            lines.append("chats: " + ", ".join(self.chats.name(k) for k in node.owners))
        if node.text:
            lines.append("text: " + node.text[:160].replace("\n", "⏎"))
        return "\n".join(lines)


class _Label(QGraphicsRectItem):
    """A text label that keeps its pixel size at any zoom, just under its node and
    starting at its left edge (so a root's label is never cut by the view's edge).

    Plain Qt items rather than `pg.TextItem`: with PySide6 6.12, TextItem's anchor
    arithmetic (QPointF times pg.Point) drops a reference to None on every update,
    which crashed the interpreter after a few thousand label updates."""

    def __init__(self, text: str, color: str):
        super().__init__()
        self.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIgnoresTransformations, True)
        self.setPen(QPen(Qt.PenStyle.NoPen))
        self.text_item = QGraphicsSimpleTextItem(self)
        font = QFont()
        font.setPointSizeF(7.5)
        self.text_item.setFont(font)
        self.text_item.setBrush(QColor(color))
        self._metrics = QFontMetricsF(font)
        self.line_height = self._metrics.height()
        self.offset = QPointF(-_NODE / 2, _NODE_SHARED / 2 + 1)  # pixels from the node
        self.text_item.setPos(self.offset)
        self._full = ""
        self._width = -1.0
        self.set_text(text)

    def set_text(self, text: str) -> None:
        if text != self._full:
            self._full = text
            self._width = -1.0
            self.text_item.setText(text)

    def fit(self, width: float) -> float:
        """Elide to ``width`` pixels (only when that changed); returns the width used."""
        if width != self._width:
            self._width = width
            shown = self._metrics.elidedText(self._full, Qt.TextElideMode.ElideRight, width)
            self.text_item.setText(shown)
        return self._metrics.horizontalAdvance(self.text_item.text())

    def toPlainText(self) -> str:  # noqa: N802 - mirrors QGraphicsTextItem for callers
        return self.text_item.text()


def _snippet(text: str) -> str:
    text = " ".join(_SPECIAL.sub(" ", text).split())
    return text if len(text) <= _LABEL_CHARS else text[: _LABEL_CHARS - 1] + "…"
