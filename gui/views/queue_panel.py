"""The queue panel: the jobs a snapshot lists, why the pending ones wait, and what
prefix-cache hits saved, and what the disk tier gave back (pages read from disk instead of
prefilled: a job's row while it runs, the latest such job in the summary once it ended).

A hit's saving is its cached tokens (prompt tokens not computed again) and the time
they would have taken at the rate recent jobs actually prefilled at: each finished
job's "job_done" event carries its prompt and cached tokens and its prefill time, so
seconds saved ≈ cached_tokens × (prefill time / prompt tokens computed) over the last
few jobs. (An engine-wide rolling rate would count idle seconds and make a hit look
worth far more than it was.)
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor, QFontMetrics
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
)

from engine.units import format_bytes
from gui.palette import Palette, label_color_on
from gui.status import prefill_words, wait_words
from gui.views.base import ChatColoredView
from gui.views.page_map_model import chat_key

if TYPE_CHECKING:
    from engine.engine import EngineSnapshot, JobInfo

RATE_JOBS = 16  # finished jobs whose prefill prices a hit
SUMMARY_LINES = 3

# Why a job waits comes right after its state: in a narrow dock the last columns scroll
# out of sight, and that is the one people look for.
COLUMNS = ("job", "chat", "state", "why / saved", "prompt", "cached", "new", "pages")
WHY = COLUMNS.index("why / saved")
WHY_WIDTH = 220  # elided beyond it; the cell's tooltip holds the whole text


def restore_text(pages: int, nbytes: int, seconds: float, page_size: int) -> str:
    """'restored 63 pages from disk (92.9 MB in 0.08 s) instead of prefilling 2,016 tokens'."""
    text = f"restored {pages:,} page{'s' if pages != 1 else ''} from disk"
    text += f" ({format_bytes(nbytes)} in {seconds:.2f} s)"
    if page_size:
        text += f" instead of prefilling {pages * page_size:,} tokens"
    return text


def saved_seconds(cached_tokens: int, prefill_tok_s: float) -> float | None:
    """Prefill time a hit saved; None while no prefill rate has been seen."""
    if prefill_tok_s <= 0:
        return None
    return cached_tokens / prefill_tok_s


class QueuePanel(ChatColoredView):
    """A table of `snapshot.jobs` (active first, then pending in queue order) and a
    line that totals what the prefix cache saved for finished jobs."""

    def _build(self) -> None:
        self.prefill_rate = 0.0  # tok/s the recent jobs prefilled at (0: none seen yet)
        self._prefills: deque[tuple[int, float]] = deque(maxlen=RATE_JOBS)
        self.finished_cached_tokens = 0
        self.finished_jobs = 0
        self.finished_hits = 0
        # the latest finished job that read pages back from disk: job, pages, bytes, seconds
        self.last_restore: tuple[int, int, int, float] | None = None
        self.page_size = 0
        self._jobs: list[JobInfo] = []
        self._summary_parts: list[str] = []
        self.table = QTableWidget(0, len(COLUMNS), self)
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setWordWrap(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        header.setSectionResizeMode(WHY, QHeaderView.ResizeMode.Interactive)
        header.resizeSection(WHY, WHY_WIDTH)
        self.table.verticalHeader().setDefaultSectionSize(20)
        self.summary = QLabel(self)
        self.summary.setWordWrap(True)
        # Three lines, fixed: a caption whose height follows its text would re-lay out the
        # panel and repaint every view whenever a figure gains a digit.
        self.summary.setFixedHeight(
            SUMMARY_LINES * QFontMetrics(self.summary.font()).lineSpacing() + 2
        )
        self.summary.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self.summary.setTextFormat(Qt.TextFormat.PlainText)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        self.set_palette(self.palette_)
        self._update_summary()

    def set_palette(self, palette: Palette) -> None:
        self.palette_ = palette
        self.summary.setStyleSheet(f"color: {palette.foreground};")
        self.table.setStyleSheet(
            f"QTableWidget {{ background: {palette.background}; color: {palette.foreground};"
            f" gridline-color: {palette.free}; font-size: 8pt; }}"
            f"QHeaderView::section {{ background: {palette.free}; color: {palette.foreground};"
            f" border: none; padding: 1px 4px; font-size: 8pt; }}"
        )
        self._fill_table()

    def apply_events(self, events: list[dict[str, Any]]) -> None:
        """Totals and the prefill rate from finished jobs (the telemetry's "job_done"
        events); other events are ignored."""
        done = [ev for ev in events if ev.get("kind") == "job_done"]
        for ev in done:
            self.finished_jobs += 1
            cached = int(ev.get("cached_tokens") or 0)
            self.finished_cached_tokens += cached
            self.finished_hits += cached > 0
            computed = int(ev.get("prompt_tokens") or 0) - cached
            seconds = float(ev.get("time_prefill") or 0.0)
            if computed > 0 and seconds > 0:
                self._prefills.append((computed, seconds))
            if ev.get("disk_pages"):
                self.last_restore = (
                    int(ev.get("job") or 0),
                    int(ev["disk_pages"]),
                    int(ev.get("disk_bytes") or 0),
                    float(ev.get("disk_seconds") or 0.0),
                )
        if done:
            tokens = sum(t for t, _ in self._prefills)
            seconds = sum(s for _, s in self._prefills)
            self.prefill_rate = tokens / seconds if seconds > 0 else 0.0
            self._update_summary()

    def set_snapshot(self, snapshot: EngineSnapshot) -> None:
        self._jobs = list(snapshot.jobs)
        self.page_size = snapshot.page_size
        self._fill_table()
        self._update_summary()

    # -- model data -------------------------------------------------------------------

    def rows(self) -> list[dict[str, str]]:
        """The table as data: one dict per job, keyed by column name."""
        out = []
        for r in range(self.table.rowCount()):
            out.append({c: self.table.item(r, i).text() for i, c in enumerate(COLUMNS)})
        return out

    def summary_text(self) -> str:
        """The whole summary (what shows may leave its last parts to the tooltip)."""
        return " · ".join(self._summary_parts)

    # -- drawing -------------------------------------------------------------------

    def _saving(self, cached: int) -> str:
        if cached <= 0:
            return "no cache hit"
        secs = saved_seconds(cached, self.prefill_rate)
        return f"hit: {cached} tok" + (f" ≈ {secs:.2f} s saved" if secs is not None else "")

    def _fill_table(self) -> None:
        pal = self.palette_
        self.table.setRowCount(len(self._jobs))
        for r, job in enumerate(self._jobs):
            key = chat_key(job.job_id, job.tag)
            name = self.chats.name(job.tag) if job.tag is not None else f"job {job.job_id}"
            if job.state == "pending":
                why = wait_words(job.wait_kind, job.wait_reason)
                if job.skips:
                    why += f" (skipped {job.skips}×)"
            else:
                why = self._saving(job.cached_tokens)
                if job.state == "prefill" and job.prefill_total:
                    why = prefill_words(job.prefill_done, job.prefill_total) + " · " + why
                if job.disk_pages:
                    disk = (job.disk_pages, job.disk_bytes, job.disk_seconds, self.page_size)
                    why += " · " + restore_text(*disk)
            values = (str(job.job_id), name, job.state, why, str(job.prompt_tokens),
                      str(job.cached_tokens), str(job.new_tokens), str(job.pages))  # fmt: skip
            for c, text in enumerate(values):
                item = self.table.item(r, c)
                if item is None:
                    item = QTableWidgetItem()
                    self.table.setItem(r, c, item)
                item.setText(text)
                item.setToolTip(text)
                if c == 1:
                    color = self.chats.color(key)
                    item.setBackground(QBrush(QColor(color)))
                    item.setForeground(QBrush(QColor(label_color_on(color))))
                elif c == WHY and job.state == "pending":
                    item.setForeground(QBrush(QColor(pal.evict)))
                else:
                    item.setForeground(QBrush(QColor(pal.foreground)))

    def _update_summary(self) -> None:
        active = sum(1 for j in self._jobs if j.state != "pending")
        pending = len(self._jobs) - active
        parts = [f"{active} running · {pending} waiting"]
        live_cached = sum(j.cached_tokens for j in self._jobs if j.state != "pending")
        total = self.finished_cached_tokens + live_cached
        if total:
            secs = saved_seconds(total, self.prefill_rate)
            saved = f"cache hits saved {total} prompt tokens"
            if secs is not None:
                saved += (
                    f" ≈ {secs:.2f} s of prefill (recent jobs prefilled at"
                    f" {self.prefill_rate:.0f} tok/s)"
                )
            parts.append(saved)
        else:
            parts.append("no prefix-cache hits yet")
        if self.last_restore is not None:
            job, *disk = self.last_restore
            parts.append(f"job {job} " + restore_text(*disk, self.page_size))
        self._summary_parts = parts
        self._fit_summary()

    def _fit_summary(self) -> None:
        """As many of the summary's parts as its three lines hold at this width (the
        last ones go first); all of them in the tooltip."""
        parts = self._summary_parts
        width = max(self.summary.width(), 50)
        metrics = QFontMetrics(self.summary.font())
        flags = int(Qt.TextFlag.TextWordWrap)
        kept = len(parts)
        while kept > 1:
            text = " · ".join(parts[:kept])
            if metrics.boundingRect(0, 0, width, 10_000, flags, text).height() <= (
                SUMMARY_LINES * metrics.lineSpacing()
            ):
                break
            kept -= 1
        self.summary.setText(" · ".join(parts[:kept]))
        self.summary.setToolTip(" · ".join(parts) if kept < len(parts) else "")

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._fit_summary()
