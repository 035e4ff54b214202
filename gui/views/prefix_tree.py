"""The prefix tree: cached pages as the tree of prompts they came from, drawn.

The tree itself (nodes, parents, incremental updates from page events and snapshots,
the layout) is `gui.views.prefix_tree_model.PrefixTreeModel`; this widget draws it
and turns clicks into selections. Each chain is one row, left to right, so a long
prompt reads as a line and a split as a fork; the drawing is redone in full only when
the shape of the tree changed.

Nodes use the page map's colours: a chat's colour while a job holds the page, sky blue
when cached, blue in the host tier, indigo on disk; shared pages (ref count > 1) are drawn larger with
a heavy outline; pages next in line for eviction get a vermillion outline.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QPen
from PySide6.QtWidgets import QGraphicsItem, QGraphicsRectItem, QGraphicsSimpleTextItem

from engine.cache.page import PageState
from gui.palette import STATE_NAMES, Palette
from gui.views.base import PlotView
from gui.views.prefix_tree_model import (
    TREE_DISK_CAP,
    X_STEP,
    NodeKey,
    PrefixTreeModel,
    TreeNode,
)

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot

_NODE = 13.0  # pixels
_NODE_SHARED = 18.0
_MAX_LABELS = 400
_LABEL_CHARS = 48  # longest snippet kept; what shows is elided to the room on screen
_LABEL_MIN_PX = 72.0  # narrower, a label says nothing ("to Li…"): it takes more room
# and the overlap check leaves out its neighbours' labels instead
_SPECIAL = re.compile(r"<\|[^|>]{1,40}\|>")  # chat-template markers: noise in a label


class PrefixTreeView(PlotView):
    """The prefix tree of the cache, drawn from `model`. Signal `node_clicked(list[int])`:
    the device pages of the clicked node's chain (its ancestors, itself and its
    continuations)."""

    node_clicked = Signal(list)

    def _build(self) -> None:
        super()._build()
        self.model = PrefixTreeModel()
        self._labels: dict[NodeKey, _Label] = {}
        self._label_order: list[NodeKey] = []  # most telling first: roots, forks, leaves
        self._user_moved = False

        vb = self.plot.getViewBox()
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
        self.set_palette(self.palette_)

    # -- feeding ----------------------------------------------------------------------

    def apply_events(self, events: list[dict[str, Any]]) -> None:
        """Follow the engine's cache events (see `PrefixTreeModel.apply_events`)."""
        if self.model.apply_events(events):
            self._redraw()

    def set_snapshot(self, snapshot: EngineSnapshot, tokenizer: Any = None) -> None:
        """Reconcile with ``snapshot`` (see `PrefixTreeModel.set_snapshot`) and redraw
        what changed."""
        if self.model.set_snapshot(snapshot, tokenizer):
            done = self.model.last_update
            self._redraw(update_only=not done["relayout"] and done["touched"] == 0)

    # -- selection --------------------------------------------------------------------

    def select_pages(self, pages: list[int]) -> None:
        """Outline the nodes of these device pages (what the page map highlights)."""
        self.model.select_pages(pages)
        self._redraw(update_only=True)

    def select_chat(self, tag: Any) -> None:
        self.model.select_chat(tag)
        self._redraw(update_only=True)

    def click_node(self, key: NodeKey) -> list[int]:
        """What a click on a node does: select its chain and emit its pages."""
        if self.model.get(key) is None:
            return []
        pages = self.model.select_chain(key)
        self._redraw(update_only=True)
        self.node_clicked.emit(pages)
        return pages

    def _on_points_clicked(self, _item: Any, points: Any, *_: Any) -> None:
        if len(points):
            self.click_node(points[0].data())

    def _on_user_range(self, *_: Any) -> None:
        self._user_moved = True

    # -- drawing -------------------------------------------------------------------

    def set_palette(self, palette: Palette) -> None:
        for item in self._labels.values():
            self.plot.removeItem(item)
        self._labels.clear()
        super().set_palette(palette)

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
        structure_changed = self.model.relink()
        nodes = sorted(self.model.nodes().values(), key=lambda nd: nd.order)
        selected = self.model.selected()
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
            if n.key in selected:
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
                parent = self.model.parent_of(n)
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
        roots = sum(1 for n in nodes if self.model.is_root(n))
        text = f"{len(nodes)} pages in {roots} prompt tree(s) · {forks} branch point(s) · "
        text += f"{shared} shared · "
        disk = sum(1 for n in nodes if n.state == PageState.DISK)
        if disk:
            text += f"{disk} only on disk"
            if self.model.disk_records > TREE_DISK_CAP:
                text += f" (of the newest {TREE_DISK_CAP} of {self.model.disk_records:,} records)"
            text += " · "
        self.caption.setText(text + "drag to pan, wheel to zoom, click a node to find its pages")

    def _label_priority(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """Which nodes get a text label when there are too many to label all: roots
        and forks first (they explain the shape), then leaves, then the rest."""

        def rank(n: TreeNode) -> tuple[int, int]:
            if self.model.is_root(n):
                return 0, n.order
            if len(n.children) >= 2 or n.shared:
                return 1, n.order
            if not n.children:
                return 2, n.order
            return 3, n.order

        # A chain only on disk has no text to show: its first page says "disk", the rest
        # are left unlabelled.
        labelled = [
            n for n in nodes if n.state != PageState.DISK or n.text or self.model.is_root(n)
        ]
        return sorted(labelled, key=rank)[:_MAX_LABELS]

    def _update_labels(self, nodes: list[TreeNode]) -> None:
        ranked = self._label_priority(nodes)
        want = {n.key: n for n in ranked}
        self._label_order = [n.key for n in ranked]
        for key in [k for k in self._labels if k not in want]:
            self.plot.removeItem(self._labels.pop(key))
        for key, node in want.items():
            text = _snippet(node.text) or _place(node, short=True)
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
        room = px_per_unit * X_STEP - 6
        # childTransform() brings the view's matrix up to date first; pyqtgraph updates
        # it lazily, so right after a resize the child group's own transform is stale.
        to_scene = vb.childTransform() * vb.sceneTransform()
        visible = vb.sceneBoundingRect()
        taken: dict[int, list[QRectF]] = {}  # placed rects, bucketed by pixel row
        for key in self._label_order:
            item, node = self._labels.get(key), self.model.get(key)
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
        nodes = self.model.nodes().values()
        if not nodes:
            return
        xs = [n.pos[0] for n in nodes]
        ys = [n.pos[1] for n in nodes]
        # Show at most ~12 generations so labels stay readable; pan for the rest.
        x_max = min(max(xs), min(xs) + 11 * X_STEP)
        self.plot.getViewBox().setRange(
            xRange=(min(xs) - 0.8, x_max + 0.8), yRange=(min(ys) - 0.8, max(ys) + 1.2), padding=0
        )

    def _tip_for_point(self, x: float, y: float, data: Any) -> str:
        node = self.model.get(data)
        if node is None:
            return ""
        lines = [f"{_place(node)} · {STATE_NAMES[PageState(int(node.state))]}"]
        if node.key[0] == "h":
            lines.append(f"hash {node.key[1].to_bytes(8, 'little').hex()[:12]}…")
        lines.append(f"ref count {node.ref_count} · fill {node.fill}/{self.model.page_size}")
        lines.append(f"{len(node.children)} continuation(s)")
        if node.owners:
            lines.append("chats: " + ", ".join(self.chats.name(k) for k in node.owners))
        if node.text:
            lines.append("text: " + node.text[:160].replace("\n", "⏎"))
        return "\n".join(lines)


def _place(node: TreeNode, short: bool = False) -> str:
    """Where a node's page is: its device page, or the tier that alone holds it."""
    if node.page >= 0:
        return f"p{node.page}" if short else f"page {node.page}"
    tier = "disk" if node.state == PageState.DISK else "host"
    return tier if short else f"{tier} tier"


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
