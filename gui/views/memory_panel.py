"""The memory side of the main window: legend, page map, prefix tree, graphs, queue.

The main window embeds one `MemoryPanel` and hands it the engine's latest snapshot and
telemetry with `feed(snapshot, telemetry, tokenizer)`; the panel never calls the
engine. `feed` only stores them: a short panel timer then brings one view up to date
per tick (the queue and header, then the page map, then the prefix tree, then the
graphs, each only when its input changed; the graphs at most 4 times a second). Each
view's update and the repaint it causes then stay a few milliseconds apart from the
next one's, so the UI thread never spends one long stretch on the memory views while
chats stream (the issue's 50 ms budget). `refresh(...)` does all of it at once, for
tests and screenshots. On a GPU the header's part also reads the device's memory (at most
`DEVICE_INTERVAL_S` apart) from the panel's `DeviceMemorySource` and draws it above the
legend (`gui.views.device_memory`); on the CPU that view stays hidden. Clicks travel between the views here (a node clicked in
the tree highlights its pages in the map; a page clicked in the map outlines its
nodes in the tree) and leave through `chat_selected` and `page_clicked`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QFontMetrics, QGuiApplication
from PySide6.QtWidgets import QLabel, QSizePolicy, QSplitter, QVBoxLayout, QWidget

from engine.device import DeviceMemorySource, device_memory
from gui.palette import ChatColors, Palette, os_prefers_dark, palette_for
from gui.status import memory_figures
from gui.views.device_memory import DeviceFigures, DeviceMemoryView
from gui.views.graphs import ThroughputGraphs
from gui.views.legend import LegendBar
from gui.views.page_map import PageMapView
from gui.views.page_map_model import chat_key, disk_pages, tier_counts
from gui.views.prefix_tree import PrefixTreeView
from gui.views.queue_panel import QueuePanel

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot
    from engine.telemetry import Telemetry

log = logging.getLogger(__name__)

PART_TICK_MS = 25  # one view per tick: a tick's work and repaint stay well under 50 ms
GRAPH_INTERVAL_S = 0.25  # the graphs move smoothly at 4 Hz; their repaint is the dearest
DEVICE_INTERVAL_S = 0.5  # the GPU's memory, read as often as the status bar reads it
_PARTS = ("queue", "page_map", "tree", "graphs")


class MemoryPanel(QWidget):
    """Everything about the engine's memory in one widget.

    Signals: `chat_selected(object)` (the tag of a chat picked from the map),
    `page_clicked(int)`. `select_chat(tag)` does the reverse: highlights the chat's
    pages and tree branch. Colours follow the OS theme unless `set_dark` pins one.
    ``device_memory`` reads a GPU's memory (a test passes fake figures)."""

    chat_selected = Signal(object)
    page_clicked = Signal(int)

    def __init__(
        self,
        chats: ChatColors | None = None,
        parent: QWidget | None = None,
        device_memory: DeviceMemorySource = device_memory,
    ):
        super().__init__(parent)
        self._device_memory = device_memory
        self._device_read_at = -DEVICE_INTERVAL_S
        self.chats = chats if chats is not None else ChatColors(parent=self)
        self._pinned_dark: bool | None = None
        self.palette_ = palette_for()
        self._events_since = 0
        self.last_refresh_s = 0.0
        # What `feed` stored and what each view last drew from.
        self._snapshot: EngineSnapshot | None = None
        self._telemetry: Telemetry | None = None
        self._tokenizer: Any = None
        self._tree_events: list[dict[str, Any]] = []
        self._drawn: dict[str, int] = {}  # part -> snapshot / telemetry version it shows
        self._graphs_at = 0.0
        self._next_part = 0
        self.part_costs: dict[str, float] = {}  # the latest seconds each part took
        self._tick = QTimer(self)
        self._tick.setInterval(PART_TICK_MS)
        self._tick.timeout.connect(self._run_next_part)

        # One line, elided: a header that wraps as figures change height would re-lay
        # out the whole panel (and repaint every view) several times a second.
        self.header = QLabel(self)
        self.header.setTextFormat(Qt.TextFormat.PlainText)
        self.header.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self._header_full = ""
        # What the views cannot show for the engine they draw (a remote server's limits),
        # from the snapshot's `note`; hidden for this computer's engine.
        self.note = QLabel(self)
        self.note.setWordWrap(True)
        self.note.setTextFormat(Qt.TextFormat.PlainText)
        self.note.setVisible(False)
        self.device = DeviceMemoryView(self.palette_, self)
        self.legend = LegendBar(self.chats, self.palette_, self)
        self.page_map = PageMapView(self.chats, self.palette_, self)
        self.tree = PrefixTreeView(self.chats, self.palette_, self)
        self.graphs = ThroughputGraphs(self.palette_, self)
        self.queue = QueuePanel(self.chats, self.palette_, self)

        split = QSplitter(Qt.Orientation.Vertical, self)
        for w in (self.page_map, self.tree, self.graphs, self.queue):
            split.addWidget(w)
        for i, stretch in enumerate((4, 3, 3, 1)):
            split.setStretchFactor(i, stretch)
        self.queue.setMaximumHeight(170)  # a few rows; the graphs need the height more
        split.setChildrenCollapsible(False)
        self.splitter = split
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addWidget(self.header)
        layout.addWidget(self.note)
        layout.addWidget(self.device)
        layout.addWidget(self.legend)  # outside the splitter: the legend never scrolls away
        layout.addWidget(split, 1)

        self.tree.node_clicked.connect(self.page_map.highlight_pages)
        self.page_map.page_clicked.connect(self._on_page_clicked)
        self.page_map.chat_selected.connect(self.chat_selected)
        app = QGuiApplication.instance()
        if app is not None:
            QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_os_scheme)
        self._apply_palette()

    # -- the main window's calls -----------------------------------------------------

    def refresh(
        self,
        snapshot: EngineSnapshot | None,
        telemetry: Telemetry | None = None,
        tokenizer: Any = None,
    ) -> None:
        """Redraw every view now from the snapshot and telemetry (reads only)."""
        t0 = time.perf_counter()
        self._store(snapshot, telemetry, tokenizer)
        self._device_read_at = -DEVICE_INTERVAL_S  # read the GPU's memory now too
        for part in _PARTS:
            self._run_part(part, force=True)
        self.last_refresh_s = time.perf_counter() - t0

    def feed(
        self,
        snapshot: EngineSnapshot | None,
        telemetry: Telemetry | None = None,
        tokenizer: Any = None,
    ) -> None:
        """Keep the latest state; the views catch up over the next few ticks."""
        self._store(snapshot, telemetry, tokenizer)
        if not self._tick.isActive():
            self._tick.start()

    def pending_parts(self) -> list[str]:
        """The views that do not show the latest state yet."""
        return [p for p in _PARTS if self._part_due(p, ignore_rate=True)]

    def _store(self, snapshot: Any, telemetry: Any, tokenizer: Any) -> None:
        if snapshot is not None:
            self._snapshot = snapshot
        if telemetry is not None and telemetry is not self._telemetry:
            # A new engine (a model switch, a settings change): its event numbers and
            # versions start again, so nothing drawn from the old one counts.
            self._telemetry = telemetry
            self._events_since = 0
            self._tree_events = []
            self._drawn.clear()
        if tokenizer is not None:
            self._tokenizer = tokenizer

    def _version_of(self, part: str) -> int:
        if part == "graphs":
            return -1 if self._telemetry is None else self._telemetry.version
        return -1 if self._snapshot is None else self._snapshot.version

    def _part_due(self, part: str, ignore_rate: bool = False) -> bool:
        version = self._version_of(part)
        if version < 0 or self._drawn.get(part) == version:
            return False
        if part == "graphs" and not ignore_rate:
            return time.monotonic() - self._graphs_at >= GRAPH_INTERVAL_S
        return True

    def _run_next_part(self) -> None:
        """One due view per tick, round robin so none starves; idle when all are drawn."""
        for i in range(len(_PARTS)):
            part = _PARTS[(self._next_part + i) % len(_PARTS)]
            if self._part_due(part):
                self._next_part = (self._next_part + i + 1) % len(_PARTS)
                self._run_part(part)
                return
        if not self.pending_parts():
            self._tick.stop()  # everything shows the latest state; `feed` restarts it

    def _run_part(self, part: str, force: bool = False) -> None:
        version = self._version_of(part)
        if version < 0 or (not force and self._drawn.get(part) == version):
            return
        t0 = time.perf_counter()
        snap, telemetry = self._snapshot, self._telemetry
        if part == "queue":
            self._read_events()
            if snap is not None:
                self.queue.set_snapshot(snap)
                self.legend.set_active_chats(
                    [chat_key(j.job_id, j.tag) for j in snap.jobs if j.pages > 0]
                )
                self.legend.set_counts(tier_counts(snap))
                self.legend.set_on_gpu(getattr(snap, "device", "").startswith("cuda"))
                self._update_header(snap)
                self._update_device(snap)
                self._update_note(getattr(snap, "note", ""))
        elif part == "page_map" and snap is not None:
            self.page_map.set_snapshot(snap, self._tokenizer)
        elif part == "tree" and snap is not None:
            self._read_events()  # the tree follows every event up to this snapshot
            events, self._tree_events = self._tree_events, []
            self.tree.apply_events(events)
            self.tree.set_snapshot(snap, self._tokenizer)
        elif part == "graphs" and telemetry is not None:
            self.graphs.update_from(telemetry)
            self._graphs_at = time.monotonic()
        self._drawn[part] = version
        self.part_costs[part] = time.perf_counter() - t0

    def _read_events(self) -> None:
        """New telemetry events: job results go to the queue panel now, cache events
        wait for the tree's turn."""
        if self._telemetry is None:
            return
        events = self._telemetry.events(self._events_since)
        if not events:
            return
        self._events_since = events[-1]["seq"] + 1
        self.queue.apply_events(events)
        self.page_map.apply_events(events)
        self._tree_events.extend(events)

    def select_chat(self, tag: Any) -> None:
        """Highlight a chat's pages in the map and its branch in the tree."""
        self.page_map.highlight_chat(tag)
        self.tree.select_chat(tag)

    def set_chat_name(self, tag: Any, name: str) -> None:
        self.chats.set_name(tag, name)

    def set_dark(self, dark: bool | None) -> None:
        """Pin the dark (True) or light (False) theme; None follows the OS again."""
        self._pinned_dark = dark
        self._apply_palette()

    @property
    def dark(self) -> bool:
        return self.palette_.dark

    # -- internals -------------------------------------------------------------------

    def _on_page_clicked(self, page: int) -> None:
        self.tree.select_pages(self.page_map.highlighted_pages())
        self.page_clicked.emit(page)

    def _on_os_scheme(self, *_: Any) -> None:
        if self._pinned_dark is None:
            self._apply_palette()

    def _apply_palette(self) -> None:
        dark = os_prefers_dark() if self._pinned_dark is None else self._pinned_dark
        pal: Palette = palette_for(dark)
        self.palette_ = pal
        self.setAutoFillBackground(True)
        self.setStyleSheet(
            f"MemoryPanel, QSplitter {{ background: {pal.background}; }}"
            f"QLabel {{ color: {pal.foreground}; }}"
        )
        self.header.setStyleSheet(f"color: {pal.foreground};")
        self.note.setStyleSheet(f"color: {pal.foreground}; font-size: 8pt;")
        self._drawn.clear()  # every view redraws in the new colours
        for view in (self.device, self.legend, self.page_map, self.tree, self.graphs, self.queue):
            view.set_palette(pal)

    def _update_header(self, snap: EngineSnapshot) -> None:
        # Jobs are counted in the queue panel and the status bar; the header is the
        # cache's one line, in the status bar's words (`gui.status`).
        text = memory_figures(snap).pages_text()
        if snap.cache.disk_records is not None:
            text += f" · {disk_pages(snap):,} on disk"
        if text != self._header_full:
            self._header_full = text
            self.header.setToolTip(text)
            self._elide_header()

    def _update_device(self, snap: EngineSnapshot) -> None:
        """The GPU's memory beside the engine's shares of it; hidden off a GPU."""
        device = getattr(snap, "device", "")
        if not device.startswith("cuda"):
            self.device.set_figures(None)
            return
        now = time.monotonic()
        if now - self._device_read_at < DEVICE_INTERVAL_S and self.device.figures is not None:
            return
        self._device_read_at = now
        try:
            memory = self._device_memory(device)
        except RuntimeError:  # a driver that stops answering must not take the panel down
            log.warning("could not read %s's memory", device, exc_info=True)
            memory = None
        figures = None
        if memory is not None:
            figures = DeviceFigures(
                device, memory, snap.weight_bytes, snap.cache_bytes, snap.host_bytes
            )
        self.device.set_figures(figures)

    def _update_note(self, note: str) -> None:
        if note != self.note.text():
            self.note.setText(note)
            self.note.setVisible(bool(note))

    def _elide_header(self) -> None:
        fm = QFontMetrics(self.header.font())
        width = max(self.header.width(), 50)
        self.header.setText(fm.elidedText(self._header_full, Qt.TextElideMode.ElideRight, width))

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if self._header_full:
            self._elide_header()
