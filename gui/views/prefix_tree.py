"""The prefix tree: cached pages as the tree of prompts they came from, drawn.

The tree itself (nodes, parents, incremental updates from page events and snapshots,
chains folded into runs, the layout) is `gui.views.prefix_tree_model.PrefixTreeModel`;
what it says in words is `gui.views.prefix_tree_text`. This widget draws it and turns
clicks into selections. Each chain is one row, left to right, so a long prompt reads as
a line and a split as a fork; a chain of like pages (one chat's, say) is one node, a
stack, labelled with its page count, until a click unfolds it.

Nodes use the page map's colours: a chat's colour while a job holds the page, sky blue
when cached, blue in the host tier, indigo on disk; shared pages (ref count > 1) are drawn larger with
a heavy outline; pages next in line for eviction get a vermillion outline.

Labels never overlap: each is elided to the room its node has (to the next column, or
for a leaf to the view's edge), and shown only when it overlaps no label already shown,
no node and no edge, and lies wholly inside the view; the full text is in the tooltip.
"""

from __future__ import annotations

import textwrap
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRect, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetrics, QFontMetricsF, QPainterPath, QPen
from PySide6.QtWidgets import (
    QApplication,
    QGraphicsItem,
    QGraphicsRectItem,
    QGraphicsSimpleTextItem,
)

from engine.cache.page import PageState
from gui.palette import Palette
from gui.views.base import PlotView
from gui.views.prefix_tree_model import (
    TREE_DISK_CAP,
    X_STEP,
    NodeKey,
    PrefixTreeModel,
    Run,
    TreeNode,
)
from gui.views.prefix_tree_text import one_line, plural, state_in_words

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot

_NODE = 13.0  # pixels
_NODE_SHARED = 18.0
_NODE_RUN = 20.0  # a folded chain's stack
_MAX_LABELS = 400
_LABEL_CHARS = 120  # longest snippet kept; what shows is elided to the room on screen
_LABEL_MIN_PX = 60.0  # narrower, a label says nothing ("to Li…"): it takes more room
# and the overlap check leaves out its neighbours' labels instead
_LABEL_MAX_PX = 360.0  # a leaf's label runs to the view's edge, but no further than this
_LABEL_GAP = 6.0  # pixels between a label and the next one on its row
_COL_PX = 150.0  # a column's width at the first fit: a node and a readable label
_COL_MAX_PX = 240.0
_ROW_PX = 36.0  # a row's height at the first fit: a node with its label under it
_ROW_MAX_PX = 60.0
_MARGIN_PX = 14.0  # around the tree at the first fit
_LABEL_BELOW_PX = 26.0  # from a node's centre to the bottom of its label
_TIP_TEXT = 320  # characters of text in a tooltip
_TIP_WIDTH = 64  # its lines' length
_HINT = (
    "Drag to pan, wheel to zoom. Click a node to find its pages in the page map; click a "
    "stack (a chain of like pages) to show its pages one by one, and double-click one of "
    "them to fold the chain again."
)


def _stack_symbol() -> QPainterPath:
    """Three pages, each a little behind the one before: a folded chain. pyqtgraph draws
    a symbol inside the unit square around the point."""
    path = QPainterPath()
    path.setFillRule(Qt.FillRule.WindingFill)
    for d in (0.3, 0.15, 0.0):
        path.addRect(QRectF(-0.5 + d, -0.5 + d, 0.7, 0.7))
    return path.simplified()


_STACK = _stack_symbol()


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
        self._last_click: tuple[NodeKey | None, float] = (None, 0.0)  # key, monotonic s
        self._caption_parts: list[tuple[int, str]] = []  # (priority, text) of the caption
        self._caption_brief = ""  # what it says when not even its first part fits
        # Pixel geometry of what is drawn, for the label check: run centres and sizes in
        # data units, edge segments as (x0, y0, x1, y1).
        self._run_xy = np.zeros((0, 2))
        self._run_size = np.zeros(0)
        self._segments = np.zeros((0, 4))

        self.caption.setToolTip(_HINT)
        vb = self.plot.getViewBox()
        vb.sigRangeChangedManually.connect(self._on_user_range)
        vb.sigRangeChanged.connect(lambda *_: self._update_label_visibility())
        vb.sigResized.connect(self._on_resized)  # same range, new pixels
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
        # A label's hover shows its node's tooltip. pyqtgraph finds hovered items through
        # their scene transform, which is wrong for items that ignore the zoom, so the
        # view looks the label up itself from where it placed it.
        self._shown_labels: list[tuple[QRectF, NodeKey]] = []  # scene pixels
        self._label_tip = ""
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)
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
        """What a click on a node does: unfold it if it is a stack, select its chain and
        emit its pages."""
        if self.model.get(key) is None:
            return []
        unfolded = self.model.unfold(key)
        pages = self.model.select_chain(key)
        self._redraw(update_only=not unfolded)
        self.node_clicked.emit(pages)
        return pages

    def fold_node(self, key: NodeKey) -> bool:
        """What a double click on an unfolded page does: fold its chain again."""
        if not self.model.fold(key):
            return False
        self._redraw()
        return True

    def _on_points_clicked(self, _item: Any, points: Any, *_: Any) -> None:
        """A click, or the second click of a double click on the same node: pyqtgraph's
        scene hands items the double click as a plain second click, so it is told
        apart here by the time since the first."""
        if not len(points):
            return
        key, now = points[0].data(), time.monotonic()
        last_key, last_at = self._last_click
        self._last_click = (key, now)
        if key == last_key and now - last_at <= QApplication.doubleClickInterval() / 1000:
            self._last_click = (None, 0.0)
            self.fold_node(key)
        else:
            self.click_node(key)

    def _on_user_range(self, *_: Any) -> None:
        self._user_moved = True

    def _on_resized(self, *_: Any) -> None:
        if not self._user_moved and self.model.nodes():
            self._fit()
        self._update_label_visibility()

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._set_caption()

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
        model = self.model
        structure_changed = model.relink()
        runs = list(model.runs().values())
        if not runs:
            self.scatter.clear()
            self.edges.setData([], [])
            for item in self._labels.values():
                self.plot.removeItem(item)
            self._labels.clear()
            self._run_xy, self._run_size = np.zeros((0, 2)), np.zeros(0)
            self._segments = np.zeros((0, 4))
            self._caption_parts = [(0, "No cached pages yet: send a message to fill the cache.")]
            self._caption_brief = self._caption_parts[0][1]
            self._set_caption()
            return
        selected = model.selected()
        heads = [model.get(r.key) for r in runs]
        pens, sizes, symbols = [], [], []
        for run, head in zip(runs, heads, strict=True):
            if selected and any(k in selected for k in run.members):
                pens.append(self._pen(pal.highlight, 3))
            elif head.evict_next:
                pens.append(self._pen(pal.evict, 2.5))
            elif head.shared:
                pens.append(self._pen(pal.shared_mark, 2.5))
            else:
                pens.append(self._pen(pal.background, 1))
            if run.folded:
                sizes.append(_NODE_RUN)
                symbols.append(_STACK)
            else:
                sizes.append(_NODE_SHARED if head.shared else _NODE)
                symbols.append("s")
        xy = np.array([r.pos for r in runs], float)
        self._run_xy, self._run_size = xy, np.array(sizes, float)
        self.scatter.setData(
            pos=xy,
            brush=[self._brush(self._node_color(n)) for n in heads],
            pen=pens,
            size=sizes,
            symbol=symbols,
            data=[r.key for r in runs],
        )
        if structure_changed or not update_only:
            self._draw_edges(runs)
        self._update_labels(runs)
        if structure_changed and not self._user_moved:
            self._fit()
        self._caption_parts = self._caption(runs)
        self._set_caption()

    def _draw_edges(self, runs: list[Run]) -> None:
        """Parent to child: straight along a row, or an elbow down the parent's column
        and across to the child."""
        all_runs = self.model.runs()
        segs = []
        for run in runs:
            if run.parent is None:
                continue
            (x0, y0), (x1, y1) = all_runs[run.parent].pos, run.pos
            if y0 != y1:
                segs.append((x0, y0, x0, y1))
            segs.append((x0, y1, x1, y1))
        self._segments = np.array(segs, float).reshape(-1, 4)
        pts = self._segments.reshape(-1, 2)
        self.edges.setData(pts[:, 0], pts[:, 1], connect="pairs")
        self.edges.setPen(pg.mkPen(self.palette_.muted_text, width=1.2))

    def _caption(self, runs: list[Run]) -> list[tuple[int, str]]:
        """The caption's parts, each with the rank at which it is dropped when the
        caption has no room (higher goes first)."""
        nodes = self.model.nodes().values()
        shared = sum(1 for n in nodes if n.shared)
        forks = sum(1 for n in nodes if len(n.children) >= 2)
        roots = sum(1 for r in runs if r.parent is None)
        short = self.model.short_shared_prefix()
        sharing = self._caption_brief = f"{shared} shared"
        if short is not None:  # the "0 shared" a short common prompt gives, explained
            glue = ": " if shared == 0 else " · "
            self._caption_brief = sharing + glue + short.explain(brief=True)
            sharing += glue + short.explain()
        parts = [
            (2, f"{plural(len(nodes), 'page')} in {plural(roots, 'prompt tree')}"),
            (3, plural(forks, "branch point")),
            (0, sharing),
        ]
        disk = sum(1 for n in nodes if n.state == PageState.DISK)
        if disk:
            text = f"{disk} only on disk"
            if self.model.disk_records > TREE_DISK_CAP:
                text += f" (of the newest {TREE_DISK_CAP} of {self.model.disk_records:,} records)"
            parts.append((1, text))
        if short is None:
            folded = sum(1 for r in runs if r.folded)
            hint = "click a node to find its pages"
            if folded:
                hint = f"{plural(folded, 'stack')} of like pages: click one to open it"
            parts.append((4, hint))
        return parts

    def _set_caption(self) -> None:
        """The caption's parts that fit its two lines, most telling first (all of them
        while it is not on screen: its width is not known yet)."""
        parts = list(self._caption_parts)
        if not self.caption.isVisible():
            self.caption.setText(" · ".join(t for _, t in parts))
            return
        metrics = QFontMetrics(self.caption.font())
        room = QRect(0, 0, max(self.caption.width(), 1), 10_000)
        flags = int(Qt.TextFlag.TextWordWrap)

        def fits(text: str) -> bool:
            return metrics.boundingRect(room, flags, text).height() <= self.caption.height()

        text = " · ".join(t for _, t in parts)
        while len(parts) > 1 and not fits(text):
            parts.remove(max(parts, key=lambda p: p[0]))
            text = " · ".join(t for _, t in parts)
        self.caption.setText(text if fits(text) else self._caption_brief)

    def _label_priority(self, runs: list[Run]) -> list[Run]:
        """Which runs get a text label when there are too many to label all: roots and
        forks first (they explain the shape), then stacks and leaves, then the rest."""

        def rank(run: Run) -> tuple[int, int]:
            if run.parent is None:
                return 0, run.order
            if len(run.children) >= 2 or self.model.get(run.key).shared:
                return 1, run.order
            if run.folded or not run.children:
                return 2, run.order
            return 3, run.order

        # A chain only on disk has no text to show: its first page says "disk", the rest
        # are left unlabelled.
        labelled = [
            r
            for r in runs
            if r.folded
            or r.parent is None
            or self.model.get(r.key).state != PageState.DISK
            or self.model.text(self.model.get(r.key))
        ]
        return sorted(labelled, key=rank)[:_MAX_LABELS]

    def _label_text(self, run: Run) -> str:
        """A stack's page count, then the words that tell its prompt apart: past a
        page or chain's first words when those end a turn begun before it (the end of
        the shared system prompt), from the turn it begins."""
        text = self.model.run_readable(run)
        words = text.text
        if run.parent is not None and not text.starts_turn and "\n" in words:
            words = words.split("\n", 1)[1]
        snippet = one_line(words)[:_LABEL_CHARS]
        if not any(c.isalnum() for c in snippet):
            snippet = ""  # a lone "." says nothing
        if run.folded:
            count = f"{len(run.members)} pages"
            return f"{count} · {snippet}" if snippet else count
        if snippet or self.model.has_tokenizer:
            return snippet
        return _place(self.model.get(run.key))

    def _update_labels(self, runs: list[Run]) -> None:
        ranked = self._label_priority(runs)
        want = {r.key: r for r in ranked}
        self._label_order = [r.key for r in ranked]
        for key in [k for k in self._labels if k not in want]:
            self.plot.removeItem(self._labels.pop(key))
        for key, run in want.items():
            text = self._label_text(run)
            item = self._labels.get(key)
            if not text:  # only template tokens: nothing to say, the tooltip says so
                if item is not None:
                    self.plot.removeItem(self._labels.pop(key))
                continue
            if item is None:
                item = _Label(text, self.palette_.foreground)
                self.plot.addItem(item)
                self._labels[key] = item
            else:
                item.set_text(text)
            item.setPos(run.pos[0], run.pos[1])
        self._update_label_visibility()

    def _update_label_visibility(self) -> None:
        """Place labels so that none overlaps another, a node or an edge, and none is cut
        by the view's edge: each starts under its node (right of the line down from a
        fork) and is elided to the room before the next column, or for a leaf to the
        view's edge; then, most telling first (roots, forks, stacks, leaves, the rest), a
        label shows only if it overlaps nothing already placed. Zooming in makes room for
        more of them."""
        if not self._labels:
            return
        vb = self.plot.getViewBox()
        (x0, x1), _ = vb.viewRange()
        px_per_unit = vb.width() / (x1 - x0) if x1 > x0 else 0.0
        col_px = px_per_unit * X_STEP
        # childTransform() brings the view's matrix up to date first; pyqtgraph updates
        # it lazily, so right after a resize the child group's own transform is stale.
        to_scene = vb.childTransform() * vb.sceneTransform()
        visible = vb.sceneBoundingRect()
        taken = _Grid()
        self._add_drawing(taken, to_scene, visible)
        self._shown_labels = []
        runs = self.model.runs()
        for key in self._label_order:
            item, run = self._labels.get(key), runs.get(key)
            if item is None or run is None:
                continue
            at = to_scene.map(QPointF(*run.pos))
            size = _NODE_RUN if run.folded else _NODE_SHARED
            fork = len(run.children) >= 2
            left = at.x() + 3 if fork else at.x() - _NODE / 2
            if run.children:  # up to the next column's label; the overlap check decides
                room = max(at.x() + col_px - _NODE / 2 - _LABEL_GAP - left, _LABEL_MIN_PX)
            else:
                room = _LABEL_MAX_PX
            room = min(room, visible.right() - 2 - left)
            if room < _LABEL_MIN_PX / 2:
                item.setVisible(False)
                continue
            rect = item.place(QPointF(left - at.x(), size / 2 + 2), room)
            rect.translate(at)
            ok = visible.contains(rect) and not taken.hits(rect, own=at)
            item.setVisible(ok)
            if ok:
                taken.add(rect.adjusted(-_LABEL_GAP / 2, 0, _LABEL_GAP / 2, 0))
                self._shown_labels.append((rect, key))

    def _add_drawing(self, grid: _Grid, to_scene: Any, visible: QRectF) -> None:
        """The nodes and edges in view, as pixel rectangles a label must not cover."""
        m = (to_scene.m11(), to_scene.m21(), to_scene.dx(), to_scene.m12(), to_scene.m22())
        dy = to_scene.dy()

        def px(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return m[0] * x + m[1] * y + m[2], m[3] * x + m[4] * y + dy

        left, top, right, bottom = visible.left(), visible.top(), visible.right(), visible.bottom()
        if len(self._run_xy):
            cx, cy = px(self._run_xy[:, 0], self._run_xy[:, 1])
            half = self._run_size / 2
            show = (
                (cx + half > left) & (cx - half < right) & (cy + half > top) & (cy - half < bottom)
            )
            for x, y, h in zip(cx[show], cy[show], half[show], strict=True):
                grid.add(QRectF(x - h, y - h, 2 * h, 2 * h), node=True)
        if len(self._segments):
            sx0, sy0 = px(self._segments[:, 0], self._segments[:, 1])
            sx1, sy1 = px(self._segments[:, 2], self._segments[:, 3])
            lo_x, hi_x = np.minimum(sx0, sx1), np.maximum(sx0, sx1)
            lo_y, hi_y = np.minimum(sy0, sy1), np.maximum(sy0, sy1)
            show = (hi_x >= left) & (lo_x <= right) & (hi_y >= top) & (lo_y <= bottom)
            for a, b, c, d in zip(lo_x[show], lo_y[show], hi_x[show], hi_y[show], strict=True):
                grid.add(QRectF(a - 1, b - 1, c - a + 2, d - b + 2))

    def _fit(self) -> None:
        """Show the tree from its top left at a scale where labels are readable: columns
        and rows at least `_COL_PX` and `_ROW_PX` apart (pan for the rest), spread out
        to fill the view when the tree is small."""
        runs = self.model.runs().values()
        if not runs:
            return
        vb = self.plot.getViewBox()
        width, height = max(vb.width(), 1.0), max(vb.height(), 1.0)
        # Columns up to the last whose label has `_COL_PX` before the right edge,
        # stretched so the next column falls past it (no node cut in half).
        last_col = max(r.column for r in runs)
        room_w = max(width - _MARGIN_PX - _COL_PX + _NODE_RUN, 1.0)
        fit_cols = int(room_w // _COL_PX)
        col_px = room_w / fit_cols if fit_cols else _COL_PX
        if last_col <= fit_cols:  # all of it fits: spread out, but not too far
            col_px = min(room_w / max(last_col, 1), _COL_MAX_PX)
        # Rows down to the last whose label fits above the bottom edge, stretched so
        # that label ends there: the next row (a whole row further) falls wholly below.
        rows = sorted({r.pos[1] for r in runs})
        room = max(height - _MARGIN_PX - _LABEL_BELOW_PX, 1.0)
        shown = [y for y in rows if y * _ROW_PX <= room]
        row_px = room / shown[-1] if shown[-1] > 0 else _ROW_MAX_PX
        if len(shown) == len(rows):  # all of it fits: spread out, but not too far
            row_px = min(row_px, _ROW_MAX_PX)
        x0 = -_MARGIN_PX * X_STEP / col_px
        y0 = -_MARGIN_PX / row_px
        vb.setRange(
            xRange=(x0, x0 + width * X_STEP / col_px),
            yRange=(y0, y0 + height / row_px),
            padding=0,
        )

    # -- tooltips ---------------------------------------------------------------------

    def _on_mouse_moved(self, pos: QPointF) -> None:
        """Show the tooltip of the label under the mouse; off a label, take back only a
        tooltip of ours (the scatter sets and clears its nodes' own)."""
        vb = self.plot.getViewBox()
        key = next((k for rect, k in self._shown_labels if rect.contains(pos)), None)
        if key is not None:
            self._label_tip = self.tooltip(key)
            if vb.toolTip() != self._label_tip:
                vb.setToolTip(self._label_tip)
        elif self._label_tip:
            if vb.toolTip() == self._label_tip:
                vb.setToolTip("")
            self._label_tip = ""

    def _tip_for_point(self, x: float, y: float, data: Any) -> str:
        return self.tooltip(data)

    def tooltip(self, key: NodeKey) -> str:
        """What a node says on hover, in words: the chats that use the prefix, its
        tokens and where they sit in the prompt, its state and why it is kept or goes
        next, and its text without the chat template."""
        model = self.model
        run = model.run_of(key)
        if run is None:
            return ""
        nodes = [model.get(k) for k in run.members]
        first, last = nodes[0], nodes[-1]
        lines = []
        if first.owners:
            lines.append(f"Used by {self._names(first.owners)}")
        elif first.used_by:
            lines.append(f"Last used by {self._names(first.used_by)}")
        # The host tier and the disk hold full pages only; their nodes' fill is not sent.
        tokens = sum(n.fill if n.page >= 0 else model.page_size for n in nodes)
        size = f"{plural(len(nodes), 'page')}, {plural(tokens, 'token')}"
        if first.page >= 0 and model.prompt_start_known(first):
            start = first.depth * model.page_size
            size += f": tokens {start + 1:,} to {start + tokens:,} of the prompt"
        elif first.page >= 0:
            size += ", later in a prompt whose first pages were reused"
        lines.append(size)
        chats = len(first.owners)
        after = model.pages_after(last)
        words = state_in_words(
            first.state, chats, last.evict_next, last.fill, model.page_size, after
        )
        lines.append(words[0].upper() + words[1:])
        text = model.run_readable(run).text
        if text:
            if len(text) > _TIP_TEXT:
                text = text[: _TIP_TEXT - 1].rstrip() + "…"
            quoted = "“" + text + "”"
            lines += [w for line in quoted.splitlines() for w in textwrap.wrap(line, _TIP_WIDTH)]
        elif first.page < 0:
            lines.append("Its text is not in memory: only its keys and values are kept.")
        elif model.has_tokenizer and first.fill:
            lines.append("Only chat-template tokens (turn markers), no words.")
        if run.folded:
            lines.append("Click to show its pages one by one.")
        elif model.unfolded(key):
            lines.append("Double-click to fold its chain again.")
        return "\n".join(lines)

    def _names(self, tags: tuple[Any, ...], most: int = 3) -> str:
        names = []
        for tag in tags[:most]:
            # An untagged job's key is ("job", id) (`chat_key`): say it as a person would.
            untagged = isinstance(tag, tuple) and len(tag) == 2 and tag[0] == "job"
            name = f"job {tag[1]}" if untagged else self.chats.name(tag)
            names.append("“" + (name if len(name) <= 32 else name[:31] + "…") + "”")
        if len(tags) > most:
            return ", ".join(names) + f" and {len(tags) - most} more"
        return " and ".join(names) if len(names) == 2 else ", ".join(names)


def _place(node: TreeNode) -> str:
    """Where a node's page is, for a label without text: its device page, or the tier
    that alone holds it."""
    if node.page >= 0:
        return f"page {node.page}"
    return "on disk" if node.state == PageState.DISK else "in host memory"


class _Grid:
    """Placed pixel rectangles, bucketed by row of pixels, for quick overlap tests."""

    _BAND = 24.0

    def __init__(self) -> None:
        self._bands: dict[int, list[tuple[QRectF, bool]]] = {}

    def _span(self, rect: QRectF) -> range:
        return range(int(rect.top() // self._BAND), int(rect.bottom() // self._BAND) + 1)

    def add(self, rect: QRectF, node: bool = False) -> None:
        for band in self._span(rect):
            self._bands.setdefault(band, []).append((rect, node))

    def hits(self, rect: QRectF, own: QPointF) -> bool:
        """Whether ``rect`` overlaps anything placed but the node at ``own`` (a label
        may touch its own node)."""
        for band in self._span(rect):
            for other, node in self._bands.get(band, ()):
                if rect.intersects(other) and not (node and other.contains(own)):
                    return True
        return False


class _Label(QGraphicsRectItem):
    """A text label that keeps its pixel size at any zoom, just under its node.

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
        self._full = ""
        self._width = -1.0
        self.set_text(text)

    def set_text(self, text: str) -> None:
        if text != self._full:
            self._full = text
            self._width = -1.0
            self.text_item.setText(text)

    def place(self, offset: QPointF, width: float) -> QRectF:
        """Elide to ``width`` pixels (only when that changed) and put the text at
        ``offset`` from the node; returns its rectangle in pixels from the node."""
        if width != self._width:
            self._width = width
            shown = self._metrics.elidedText(self._full, Qt.TextElideMode.ElideRight, width)
            self.text_item.setText(shown)
        self.text_item.setPos(offset)
        rect = self.text_item.boundingRect().translated(offset)
        return rect

    def full_text(self) -> str:
        return self._full

    def toPlainText(self) -> str:  # noqa: N802 - mirrors QGraphicsTextItem for callers
        return self.text_item.text()
