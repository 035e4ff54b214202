"""The page map: every physical KV-cache page as one cell of a single image.

Why one image: a cache of 16,384 pages drawn as 16,384 graphics items would stutter,
while one RGBA array built with numpy and handed to `pyqtgraph.ImageItem.setImage`
costs a few milliseconds (pyqtgraph's own advice for large grids).

What a cell says (the same language as the legend, `gui.palette`):

- colour: free, cached (unreferenced with content), host tier, or the colour of the
  chat whose job holds the page;
- fill: the lower part of the cell is solid in proportion to the rows written, the
  rest is a pale tint of the same colour;
- a dot in the middle: the page is shared (ref count > 1);
- a vermillion frame: the page is among the next ones the cache will evict;
- an indigo corner: the page was read back from the disk tier a moment ago.

Host-tier slots, when the engine has a host tier, follow the device pages after a
blank row; the disk tier's newest records (at most `disk_cell_cap`, the caption says
how many the store holds) follow after another. Hover gives the page's details, a click
highlights its chain (ancestors and continuations) and selects the chat that holds it.
The numbers behind the picture are `gui.views.page_map_model.PageMapModel` (Qt-free);
this module draws them.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtGui import QCursor, QFontMetrics
from PySide6.QtWidgets import QToolTip

from engine.cache.page import PageState
from gui.palette import STATE_NAMES, Palette, rgba
from gui.views.base import PlotView
from gui.views.page_map_model import PageMapModel

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot

# Cells beyond this many pages get smaller so the image stays near 1024 px wide.
_MAX_IMAGE_PX = 1024
_TEXT_CHARS = 240  # decoded text shown in a tooltip
RESTORED_MARK_S = 60.0  # how long a page read back from disk keeps its mark


def grid_columns(cells: int) -> int:
    """Columns of a near-square grid, a power of two so page indices read easily."""
    return max(8, 2 ** math.ceil(math.log2(max(math.sqrt(max(cells, 1)), 1))))


# Pixel classes inside a cell: which of the cell's six colours a pixel takes.
_TINT, _BASE, _DOT, _FRAME, _GAP, _CORNER = range(6)
_COLORS = 6


@functools.lru_cache(maxsize=8)
def _cell_patterns(cell_px: int) -> np.ndarray:
    """Every look a cell can have, as pixel-class masks: index
    ``fill_rows * 8 + restored * 4 + shared * 2 + evict`` -> (cell_px, cell_px) uint8."""
    inner = cell_px - 1  # one pixel of gap right of and below each cell
    yy = np.arange(cell_px)[:, None]
    xx = np.arange(cell_px)[None, :]
    gap = (yy == inner) | (xx == inner)
    height = np.broadcast_to(inner - 1 - yy, (cell_px, cell_px))  # rows above the bottom
    dot = max(1, inner // 3)
    lo = (inner - dot) // 2
    dot_mask = np.zeros((cell_px, cell_px), bool)
    dot_mask[lo : lo + dot, lo : lo + dot] = True
    frame = ((yy == 0) | (yy == inner - 1) | (xx == 0) | (xx == inner - 1)) & ~gap
    corner = (xx + yy < max(2, inner // 2)) & ~gap  # a triangle in the top left
    out = np.empty(((inner + 1) * 8, cell_px, cell_px), np.uint8)
    for rows in range(inner + 1):
        for restored in (0, 1):
            for shared in (0, 1):
                for evict in (0, 1):
                    p = np.where(height < rows, _BASE, _TINT).astype(np.uint8)
                    if evict and inner >= 3:
                        p[frame] = _FRAME
                    if restored:
                        p[corner] = _CORNER
                    if shared:
                        p[dot_mask] = _DOT
                    p[gap] = _GAP
                    out[rows * 8 + restored * 4 + shared * 2 + evict] = p
    return out


def section_rows(model: PageMapModel, cols: int) -> list[tuple[int, int, int]]:
    """(first cell, cells, first grid row) of the device pages, then of the host tier
    and of the disk tier where there are any, each set apart by a blank row."""
    out, row = [], 0
    for first, count in (
        (0, model.num_pages),
        (model.num_pages, model.host_slots),
        (model.num_pages + model.host_slots, model.disk_cells),
    ):
        if first and not count:
            continue
        if first:
            row += 1
        out.append((first, count, row))
        row += -(-count // cols)
    return out


def _pack(colors: np.ndarray) -> np.ndarray:
    """RGBA uint8 rows -> one uint32 each, so a pixel is copied as a single number."""
    return np.ascontiguousarray(colors, np.uint8).view(np.uint32).reshape(colors.shape[:-1])


def render_cells(
    model: PageMapModel,
    palette: Palette,
    chat_table: np.ndarray,
    cols: int,
    cell_px: int,
    highlight: np.ndarray | None = None,
) -> np.ndarray:
    """The RGBA image (rows*cell_px, cols*cell_px, 4) of the model.

    Each cell gets six colours (tint, base, dot, frame, gap, corner) and one of a few
    precomputed pixel patterns; the image is then a single gather, which keeps a
    16,384-page map at a few milliseconds."""
    sections = section_rows(model, cols)
    first, count, row = sections[-1]
    rows = row + -(-count // cols)
    total = rows * cols
    where = np.empty(model.cells, np.int64)  # grid cell of each model cell
    for first, count, row in sections:
        where[first : first + count] = row * cols + np.arange(count)

    bg = np.array(rgba(palette.background), np.float32)
    state_rgba = np.array([rgba(palette.state_color(s)) for s in PageState], np.uint8)
    base = np.empty((total, 4), np.uint8)
    base[:] = bg.astype(np.uint8)
    cell_base = state_rgba[model.state]
    owned = model.chat_slot >= 0
    if owned.any():
        cell_base[owned] = chat_table[model.chat_slot[owned] % len(chat_table)]
    base[where] = cell_base
    colors = np.empty((total, _COLORS, 4), np.float32)
    colors[:, _BASE] = base
    # The unwritten part of a page: its colour faded most of the way to the background
    # (free pages are all "unwritten" and keep their own colour).
    colors[:, _TINT] = base * 0.35 + bg * 0.65
    free = np.ones(total, bool)
    free[where] = model.state == PageState.FREE
    colors[free, _TINT] = base[free]
    colors[:, _DOT] = rgba(palette.shared_mark)
    colors[:, _FRAME] = rgba(palette.evict)
    colors[:, _GAP] = rgba(palette.grid_gap)
    colors[:, _CORNER] = rgba(palette.disk)
    if highlight is not None and highlight.any():
        # Selected pages stay as they are; everything else fades, which reads at any zoom.
        dim = np.ones(total, bool)
        dim[where[highlight]] = False
        faded = [_TINT, _BASE, _DOT, _FRAME, _CORNER]  # the gaps stay
        colors[np.ix_(dim, faded)] = colors[np.ix_(dim, faded)] * 0.3 + bg * 0.7
    packed = _pack(np.rint(colors).astype(np.uint8)).ravel()

    inner = cell_px - 1
    fill_rows = np.zeros(total, np.int32)
    if model.page_size:
        px = np.ceil(model.fill / model.page_size * inner).astype(np.int32)
        fill_rows[where] = np.where(model.fill > 0, np.clip(px, 1, inner), 0)
    look = fill_rows * 8
    if model.restored is not None:
        look[where[model.restored]] += 4
    look[where[model.ref_count > 1]] += 2
    look[where[(model.evict_rank >= 0) & (model.fill > 0)]] += 1

    pix = _cell_patterns(cell_px)[look.reshape(rows, cols)]  # (rows, cols, px, px)
    pix = pix.transpose(0, 2, 1, 3).reshape(rows * cell_px, cols * cell_px)
    img = packed[pix + _cell_offsets(rows, cols, cell_px)]
    return img.view(np.uint8).reshape(rows * cell_px, cols * cell_px, 4)


@functools.lru_cache(maxsize=4)
def _cell_offsets(rows: int, cols: int, cell_px: int) -> np.ndarray:
    """Per pixel, where its cell's six colours start in the packed colour table."""
    cell = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols) * _COLORS
    return np.repeat(np.repeat(cell, cell_px, axis=0), cell_px, axis=1)


class PageMapView(PlotView):
    """Every physical page as a cell; see the module docstring for the encoding.

    Feed it with `set_snapshot`; it only reads the snapshot. Signals: `page_clicked`
    (device page index) and `chat_selected` (the tag of the chat holding the clicked
    page)."""

    page_clicked = Signal(int)
    chat_selected = Signal(object)

    def _build(self) -> None:
        super()._build()
        self.model = PageMapModel.empty()
        self._snapshot: EngineSnapshot | None = None
        self._tokenizer: Any = None
        self._highlight: np.ndarray | None = None
        self._restored: dict[int, float] = {}  # hash prefix -> when it came back from disk
        self._cols = 8
        self._cell_px = 8
        self._shape: tuple[int, int] | None = None  # (cols, cell_px) of the last layout
        self.last_render_s = 0.0  # time the last image build took (for the curious)
        self.last_tooltip = ""

        vb = self.plot.getViewBox()  # y down: page 0 top left, like reading
        vb.setAspectLocked(True)
        vb.setMouseEnabled(x=True, y=True)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        scene = self.plot.scene()
        scene.sigMouseMoved.connect(self._on_mouse_moved)
        scene.sigMouseClicked.connect(self._on_mouse_clicked)
        self.setMouseTracking(True)
        # Three lines: with the host and disk tiers the figures need one more.
        self.caption.setFixedHeight(3 * QFontMetrics(self.caption.font()).lineSpacing() + 2)
        self.set_palette(self.palette_)

    # -- feeding --------------------------------------------------------------------

    def set_snapshot(self, snapshot: EngineSnapshot, tokenizer: Any = None) -> None:
        """Redraw from ``snapshot``; ``tokenizer`` (anything with ``decode(ids)``)
        turns page contents into text for the tooltip."""
        if tokenizer is not None:
            self._tokenizer = tokenizer
        same = self._snapshot is not None and self._snapshot.version == snapshot.version
        self._snapshot = snapshot
        if same and self.model.num_pages == snapshot.num_pages:
            return  # the engine has not stepped: nothing moved
        now = time.monotonic()
        self._restored = {h: t for h, t in self._restored.items() if now - t < RESTORED_MARK_S}
        self.model = PageMapModel.from_snapshot(snapshot, self.chats, self._restored.keys())
        if self._highlight is not None and len(self._highlight) != len(self.model.state):
            self._highlight = None
        self._redraw()

    def apply_events(self, events: list[dict[str, Any]]) -> None:
        """Note the pages read back from the disk tier (the telemetry's page events):
        they carry a mark for `RESTORED_MARK_S`, from the next snapshot on."""
        now = time.monotonic()
        for ev in events:
            if ev.get("kind") == "page_disk_restored" and ev.get("hash"):
                self._restored[int.from_bytes(bytes.fromhex(ev["hash"])[:8], "little")] = now

    def highlight_pages(self, pages: Iterable[int]) -> None:
        """Fade every page but these (an empty list clears the highlight)."""
        pages = [p for p in pages if 0 <= p < len(self.model.state)]
        if not pages:
            self._highlight = None
        else:
            mask = np.zeros(len(self.model.state), bool)
            mask[pages] = True
            self._highlight = mask
        self._redraw()

    def highlight_chat(self, tag: Any) -> None:
        """Highlight every page a chat holds (a chat chosen in the chat list)."""
        self.highlight_pages(self.model.pages_of_chat(tag))

    def clear_highlight(self) -> None:
        self.highlight_pages([])

    # -- model data (what tests and other views read) --------------------------------

    @property
    def page_count(self) -> int:
        return self.model.num_pages

    def cell_state(self, page: int) -> PageState:
        return PageState(int(self.model.state[page]))

    def cell_ref(self, page: int) -> int:
        return int(self.model.ref_count[page])

    def cell_fill(self, page: int) -> int:
        return int(self.model.fill[page])

    def cell_hash(self, page: int) -> int:
        return int(self.model.hash_prefix[page])

    def cell_owners(self, page: int) -> list[Any]:
        """Chat tags holding the page (untagged jobs appear as ("job", id))."""
        return list(self.model.owner_keys[page]) if page < self.model.num_pages else []

    def cell_color(self, page: int) -> str:
        """The base colour of the cell (hex), as the legend names it."""
        slot = int(self.model.chat_slot[page])
        if slot >= 0:
            owners = self.model.owner_keys[page]
            return self.chats.color(owners[0])
        return self.palette_.state_color(int(self.model.state[page]))

    def chat_name(self, key: Any) -> str:
        tag = _tag_of(key)
        return f"job {key[1]} (no chat)" if tag is None else self.chats.name(tag)

    def highlighted_pages(self) -> list[int]:
        return [] if self._highlight is None else np.flatnonzero(self._highlight).tolist()

    def pages_in_state(self, state: PageState) -> list[int]:
        return np.flatnonzero(self.model.state[: self.model.num_pages] == state).tolist()

    # -- interaction ---------------------------------------------------------------

    def cell_tier(self, cell: int) -> str:
        """ "device", "host" or "disk": which part of the map ``cell`` is in."""
        m = self.model
        if cell < m.num_pages:
            return "device"
        return "host" if cell < m.num_pages + m.host_slots else "disk"

    def page_info(self, page: int) -> dict[str, Any]:
        """Everything the tooltip says about a cell, as data."""
        m = self.model
        tier = self.cell_tier(page)
        start = {"device": 0, "host": m.num_pages, "disk": m.num_pages + m.host_slots}[tier]
        device_and_host = m.access_serial[: m.num_pages + m.host_slots]  # the disk's own clock
        info: dict[str, Any] = {
            "page": page - start,
            "tier": tier,
            "state": STATE_NAMES[PageState(int(m.state[page]))],
            "hash": _hex(int(m.hash_prefix[page]), 12),
            "ref_count": int(m.ref_count[page]),
            "fill": int(m.fill[page]),
            "page_size": m.page_size,
            "last_access": int(m.access_serial[page]) if tier != "disk" else 0,
            "newest_access": int(device_and_host.max()) if len(device_and_host) else 0,
            "evict_rank": int(m.evict_rank[page]),
            "parent": int(m.parent[page]) if tier == "device" else -1,
            "disk_parent": _hex(int(m.disk_parent[page - start]), 8) if tier == "disk" else "",
            "restored": bool(m.restored[page]) if m.restored is not None else False,
            "chats": [self.chat_name(k) for k in self.cell_owners(page)],
            "text": "",
        }
        snap = self._snapshot
        if tier == "device" and snap is not None and self._tokenizer is not None:
            ids = snap.page_tokens[page][: m.fill[page]] if page < len(snap.page_tokens) else []
            if ids:
                try:
                    info["text"] = self._tokenizer.decode(list(ids))
                except Exception:  # noqa: BLE001 - a tooltip must never raise
                    info["text"] = f"({len(ids)} tokens)"
        return info

    def on_gpu(self) -> str:
        """The GPU the pages are on ("cuda:0"), "" when they are in RAM (or not known)."""
        device = getattr(self._snapshot, "device", "")
        return device if device.startswith("cuda") else ""

    def tooltip_text(self, page: int) -> str:
        i = self.page_info(page)
        where = {"device": "Page", "host": "Host slot", "disk": "Disk record"}[i["tier"]]
        lines = [f"{where} {i['page']} · {i['state']}"]
        if self.on_gpu() and i["tier"] != "disk":
            lines[0] += " · in VRAM" if i["tier"] == "device" else " · in host RAM"
        if i["hash"]:
            lines.append(f"hash {i['hash']}…")
        if i["tier"] == "disk":
            lines.append(
                f"parent {i['disk_parent']}…" if i["disk_parent"] else "parent: none (first page)"
            )
            lines.append(f"a full page of {i['page_size']} tokens, read back instead of prefilled")
            return "\n".join(lines)
        if i["restored"]:
            lines.append("read back from the disk tier a moment ago")
        if i["parent"] >= 0:
            parent_hash = int(self.model.hash_prefix[i["parent"]])
            ph = parent_hash.to_bytes(8, "little").hex()[:8] if parent_hash else "unhashed"
            lines.append(f"parent page {i['parent']} ({ph})")
        elif i["tier"] == "device" and i["fill"]:
            lines.append("parent: none (first page of a prompt)")
        lines.append(f"ref count {i['ref_count']} · fill {i['fill']}/{i['page_size']} tokens")
        if i["last_access"]:
            ago = i["newest_access"] - i["last_access"]
            lines.append(f"last access #{i['last_access']} ({ago} allocations ago)")
        if i["evict_rank"] >= 0 and i["fill"]:
            lines.append(f"evicted next: #{i['evict_rank'] + 1} in line")
        if i["chats"]:
            lines.append("chats: " + ", ".join(i["chats"]))
        if i["text"]:
            text = i["text"]
            if len(text) > _TEXT_CHARS:
                text = text[:_TEXT_CHARS] + "…"
            lines.append("text: " + text.replace("\n", "⏎"))
        return "\n".join(lines)

    def hover_page(self, page: int | None) -> str:
        """What hovering ``page`` shows (None: the pointer left the cells)."""
        self.last_tooltip = "" if page is None else self.tooltip_text(page)
        return self.last_tooltip

    def click_page(self, page: int) -> None:
        """A click on ``page``: highlight its chain, tell who holds it."""
        if not 0 <= page < self.model.num_pages:
            return
        self.highlight_pages(self.model.chain(page))
        self.page_clicked.emit(page)
        tags = [t for t in map(_tag_of, self.model.owner_keys[page]) if t is not None]
        if tags:
            self.chat_selected.emit(tags[0])

    def page_at(self, scene_pos: QPointF) -> int | None:
        """The cell under a scene position (host slots numbered after device pages, disk
        records after them)."""
        if self._shape is None:
            return None
        p = self.plot.getViewBox().mapSceneToView(scene_pos)
        cols, px = self._shape
        col, row = int(math.floor(p.x() / px)), int(math.floor(p.y() / px))
        if not 0 <= col < cols or row < 0:
            return None
        for first, count, top in section_rows(self.model, cols):
            i = (row - top) * cols + col
            if 0 <= i < count:
                return first + i
        return None

    def scene_pos_of(self, page: int) -> QPointF:
        """The scene position of a cell's centre (the inverse of `page_at`)."""
        cols, px = self._shape or (self._cols, self._cell_px)
        row = col = 0
        for first, count, top in section_rows(self.model, cols):
            if first <= page < first + count:
                r, col = divmod(page - first, cols)
                row = top + r
        view = QPointF((col + 0.45) * px, (row + 0.45) * px)
        return self.plot.getViewBox().mapViewToScene(view)

    def _on_mouse_moved(self, scene_pos: QPointF) -> None:
        page = self.page_at(scene_pos)
        text = self.hover_page(page)
        if text:
            QToolTip.showText(QCursor.pos(), text, self.plot)
        else:
            QToolTip.hideText()

    def _on_mouse_clicked(self, event: Any) -> None:
        if event.button() != Qt.MouseButton.LeftButton:
            return
        page = self.page_at(event.scenePos())
        if page is None:
            self.clear_highlight()
        else:
            self.click_page(page)

    # -- drawing -----------------------------------------------------------------

    def _cell_px_for(self, cols: int) -> int:
        """Pixels per cell so that the image is about as wide as the view shows it:
        a much larger image would be shrunk with nearest-neighbour sampling and the
        1-px gaps between cells would turn into moire."""
        shown = max(self.plot.width(), 100)
        return int(min(12, max(4, shown // cols), max(_MAX_IMAGE_PX // cols, 2)))

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if self.model.num_pages and self._shape is not None:
            cols = grid_columns(self.model.num_pages)
            if self._cell_px_for(cols) != self._shape[1]:
                self._redraw()

    def _redraw(self) -> None:
        m = self.model
        if m.cells == 0:
            self.image.clear()
            self.caption.setText("No model loaded: the cache has no pages yet.")
            return
        t0 = time.perf_counter()
        cols = grid_columns(m.num_pages)
        cell_px = self._cell_px_for(cols)
        table = self.chats.color_table(max(int(m.chat_slot.max()) + 1, 1))
        img = render_cells(m, self.palette_, table, cols, cell_px, self._highlight)
        self.image.setImage(img, autoLevels=False)
        if self._shape != (cols, cell_px):
            self._shape = (cols, cell_px)
            self.image.setRect(0, 0, img.shape[1], img.shape[0])
            self.plot.getViewBox().autoRange(padding=0.01)
        self._cols, self._cell_px = cols, cell_px
        self.last_render_s = time.perf_counter() - t0
        used = int(np.count_nonzero(m.state[: m.num_pages] == PageState.REFERENCED))
        shared = int(np.count_nonzero(m.ref_count > 1))
        cached = int(np.count_nonzero(m.state[: m.num_pages] == PageState.CACHED))
        text = (
            f"{m.num_pages} pages × {m.page_size} tokens · {used} in use ({shared} shared)"
            f" · {cached} cached · {m.num_pages - used - cached} free"
        )
        gpu = self.on_gpu()
        if gpu:
            text = f"VRAM ({gpu}): {text}"
        idx = np.flatnonzero((m.evict_rank >= 0) & (m.fill > 0))
        marked = idx[np.argsort(m.evict_rank[idx])].tolist()
        if marked:
            text += " · evicted next: " + ", ".join(f"p{p}" for p in marked[:4])
            text += "…" if len(marked) > 4 else ""
        elif cached:
            text += " · no eviction soon: free pages are used first"
        if m.host_slots:
            held = int(np.count_nonzero(m.state[m.num_pages :] == PageState.HOST))
            where = "host tier in host RAM" if gpu else "host tier"
            text += f" · {where} {held}/{m.host_slots} (below the gap)"
        if m.disk_pages:
            shown = "bottom" if m.disk_cells == m.disk_pages else f"newest {m.disk_cells:,} shown"
            text += f" · disk tier {m.disk_pages:,} ({shown})"
        restored = int(np.count_nonzero(m.restored)) if m.restored is not None else 0
        if restored:
            text += f" · {restored} read back from disk"
        self.caption.setText(text)
        self.caption.setToolTip(text)


def _hex(prefix: int, digits: int) -> str:
    """A hash prefix as the page events spell hashes ("" for none)."""
    return prefix.to_bytes(8, "little").hex()[:digits] if prefix else ""


def _tag_of(key: Any) -> Any:
    """The chat tag behind a colour key (untagged jobs have no tag to select)."""
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "job":
        return None
    return key
