"""Rolling graphs of the engine's telemetry: throughput, batch and queue, pages, hits.

Cheap to update by construction: the plots and curves are made once and every update
is one `setData` per curve on arrays the telemetry ring buffers already hold (600
steps by default). Time runs along x in seconds before now, so the newest step is
always at the right edge.

What a repaint costs is mostly pyqtgraph's Python: axes regenerate their ticks when
their range moves, autoranging walks every item's bounds, a `FillBetweenItem` builds
its polygon from two curves. So no plot autoranges: the time window is a fixed
10/20/30/60 s and the y ranges are "nice" ceilings that only move when the data
outgrows them (or falls well below), so the axes are redrawn a few times a minute,
not ten times a second. The stacked page bands are curves filled down to zero drawn
back to front, and long series are peak-downsampled to the plot's width.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from gui.palette import Palette, palette_for

RATE_WINDOW_S = 1.0  # tokens/s are averaged over this trailing window
TIME_WINDOWS_S = (10.0, 20.0, 30.0, 60.0)  # the x range: the first that holds the history
MIN_HEIGHT = 170  # two rows of plots with a readable curve each


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 5 × 10^k at or above ``value`` (at least 1)."""
    if value <= 1:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for m in (1, 2, 5, 10):
        if m * exp >= value:
            return float(m * exp)
    return float(10 * exp)


class TelemetryLike(Protocol):
    version: int

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]: ...


def rolling_rate(times: np.ndarray, tokens: np.ndarray, window_s: float) -> np.ndarray:
    """Tokens per second over the trailing window at every step (vectorised: a
    cumulative sum and one searchsorted). A step's tokens belong to the time before
    its timestamp, so the window starts at the last step at or before its start."""
    if len(times) < 2:
        return np.zeros(len(times))
    cum = np.concatenate(([0.0], np.cumsum(tokens, dtype=float)))
    start = np.maximum(np.searchsorted(times, times - window_s, side="right") - 1, 0)
    span = times - times[start]
    done = cum[1:] - cum[start + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(span > 0, done / np.where(span > 0, span, 1.0), 0.0)
    return rate


class ThroughputGraphs(QWidget):
    """Four small plots sharing one time axis: tokens/s (prefill, decode), batch size
    and queue depth, pages (free, in use, cached, host tier; stacked) and the prefix
    hit rate. Feed with `update_from(telemetry)`."""

    def __init__(self, palette: Palette | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.palette_ = palette if palette is not None else palette_for()
        self._version = -1
        self._telemetry: TelemetryLike | None = None
        self.view = pg.GraphicsLayoutWidget(parent=self)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.view)
        self.plots: dict[str, pg.PlotItem] = {}
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.latest: dict[str, float] = {}
        self._y_top: dict[str, float] = {}  # the y ceiling each plot shows now
        self._x_window = 0.0
        self._build()

    def _hold_plots(self) -> None:
        """The widget's minimum is what its plots need (titles and axes): below it the
        scene would be cut at the right edge, not shrunk."""
        need = self.view.ci.effectiveSizeHint(Qt.SizeHint.MinimumSize)
        self.setMinimumSize(math.ceil(need.width()) + 2, max(math.ceil(need.height()), MIN_HEIGHT))

    def _build(self) -> None:
        pal = self.palette_
        self.view.clear()
        self.view.setBackground(pal.background)
        self.view.ci.layout.setContentsMargins(2, 2, 2, 2)
        self.view.ci.layout.setHorizontalSpacing(4)

        def key(*pairs: tuple[str, str]) -> str:
            # The title doubles as the legend (a legend box would cover the curves).
            return " ".join(
                f"<span style='color:{c}'>■</span><span style='color:{pal.foreground}'>\u2009{t}</span>"
                for t, c in pairs
            )

        specs = [
            ("rate", key(("prefill", pal.prefill), ("decode tok/s", pal.decode)), 0, 0),
            ("batch", key(("batch", pal.batch), ("queued", pal.queue)), 0, 1),
            (
                "pages",
                key(
                    ("in use", pal.in_use),
                    ("cached", pal.cached),
                    ("host", pal.host),
                    ("free", pal.free),
                ),
                1,
                0,
            ),  # fmt: skip
            ("hits", key(("prefix hits %", pal.hit_rate)), 1, 1),
        ]
        for name, title, row, col in specs:
            plot = self.view.addPlot(row=row, col=col)
            plot.setTitle(title, size="8pt")
            plot.setMenuEnabled(False)
            plot.hideButtons()
            plot.setMouseEnabled(x=False, y=False)
            plot.showGrid(x=False, y=True, alpha=0.25)
            plot.getAxis("bottom").setStyle(tickTextOffset=2)
            # Three fixed ticks per plot (see `_fit_y`); on a plot this short pyqtgraph
            # would drop two of their labels as "too dense", leaving one lone number.
            plot.getAxis("left").setStyle(
                tickTextOffset=2, maxTickLevel=0, textFillLimits=[(0, 1.5)]
            )
            for axis in ("left", "bottom"):
                ax = plot.getAxis(axis)
                ax.setPen(pg.mkPen(pal.muted_text))
                ax.setTextPen(pg.mkPen(pal.muted_text))
            plot.getAxis("left").setWidth(30)
            plot.disableAutoRange()
            self.plots[name] = plot
        for name in ("batch", "hits"):
            self.plots[name].setXLink(self.plots["rate"])
        self.plots["pages"].setXLink(self.plots["rate"])
        self.plots["hits"].setYRange(0, 100, padding=0.15)
        # Three ticks: a small plot with one every 20 % reads as a smudge.
        self.plots["hits"].getAxis("left").setTicks([[(v, str(v)) for v in (0, 50, 100)]])
        self._y_top = {"hits": 100.0}
        self._x_window = 0.0
        self._hold_plots()

        def curve(plot: str, name: str, color: str, label: str, **kw: Any) -> None:
            item = self.plots[plot].plot(
                [], [], pen=pg.mkPen(color, width=kw.pop("width", 2)), name=label,
                skipFiniteCheck=True, **kw,
            )  # fmt: skip
            item.setDownsampling(auto=True, method="peak")
            self.curves[name] = item

        curve("rate", "prefill", pal.prefill, "prefill")
        curve("rate", "decode", pal.decode, "decode")
        curve("batch", "batch_size", pal.batch, "batch")
        curve("batch", "queue_depth", pal.queue, "queued")
        # Pages are stacked (in use, then cached, then host, then free on top): each curve
        # is the running total and is filled down to zero, drawn back to front, so the
        # bands' heights are the counts and the top line is the whole pool.
        for z, (name, color, label) in enumerate((
            ("pages_referenced", pal.in_use, "in use"),
            ("pages_cached", pal.cached, "cached"),
            ("pages_host", pal.host, "host"),
            ("pages_free", pal.free, "free"),
        )):  # fmt: skip
            curve("pages", name, color, label, width=1, fillLevel=0.0, brush=pg.mkBrush(color))
            self.curves[name].setZValue(-z)
        curve("hits", "prefix_hit_rate", pal.hit_rate, "hit rate")

    def set_palette(self, palette: Palette) -> None:
        self.palette_ = palette
        self.plots.clear()
        self.curves.clear()
        self._build()
        self._version = -1
        if self._telemetry is not None:
            self.update_from(self._telemetry)

    def update_from(self, telemetry: TelemetryLike, now: float | None = None) -> bool:
        """Redraw from the telemetry's series; returns False when nothing was new.
        ``now`` (the telemetry clock) sets the right edge; the last record otherwise."""
        if telemetry is not self._telemetry:
            self._version = -1  # another engine's telemetry: its versions start again
        self._telemetry = telemetry
        version = telemetry.version
        if version == self._version and now is None:
            return False
        self._version = version
        times, prefill = telemetry.series("prefill_tokens")
        if len(times) == 0:
            for c in self.curves.values():
                c.setData([], [])
            return True
        end = times[-1] if now is None else max(now, times[-1])
        x = times - end
        values = {name: telemetry.series(name)[1] for name in _SERIES}
        prefill_rate = rolling_rate(times, prefill.astype(float), RATE_WINDOW_S)
        decode_rate = rolling_rate(times, values["decode_tokens"].astype(float), RATE_WINDOW_S)
        self.curves["prefill"].setData(x, prefill_rate)
        self.curves["decode"].setData(x, decode_rate)
        self.curves["batch_size"].setData(x, values["batch_size"])
        self.curves["queue_depth"].setData(x, values["queue_depth"])
        total = np.zeros(len(x))
        for name in ("pages_referenced", "pages_cached", "pages_host", "pages_free"):
            total = total + values[name]
            self.curves[name].setData(x, total)
        self.curves["prefix_hit_rate"].setData(x, 100.0 * values["prefix_hit_rate"])
        self.latest = {
            "prefill_tok_s": float(prefill_rate[-1]),
            "decode_tok_s": float(decode_rate[-1]),
            "batch_size": float(values["batch_size"][-1]),
            "queue_depth": float(values["queue_depth"][-1]),
            "prefix_hit_rate": float(values["prefix_hit_rate"][-1]),
        }
        self._fit_x(float(-x[0]))
        self._fit_y("rate", max(float(prefill_rate.max()), float(decode_rate.max())))
        self._fit_y("batch", float(max(values["batch_size"].max(), values["queue_depth"].max())))
        self._fit_y("pages", float(total.max()))
        return True

    def _fit_x(self, span: float) -> None:
        window = next((w for w in TIME_WINDOWS_S if w >= span), TIME_WINDOWS_S[-1])
        if window != self._x_window:  # the plots share x: one call moves them all
            self._x_window = window
            self.plots["rate"].setXRange(-window, 0.0, padding=0.01)

    def _fit_y(self, plot: str, data_max: float) -> None:
        """Grow at once to the next nice ceiling; shrink only when the data fell below
        a third of it, so the range (and the axis picture) stays put while data wobbles."""
        top = self._y_top.get(plot, 0.0)
        want = nice_ceiling(data_max * 1.05)
        if plot == "batch":
            want = max(want, 2.0)  # whole jobs: 0, 1, 2 rather than 0.5 steps
        if want > top or want < top / 3:
            self._y_top[plot] = want
            # padding: room for the 0 and top labels, which pyqtgraph culls when they
            # poke past the plot (the grid sets the axis' bounds)
            self.plots[plot].setYRange(0.0, want, padding=0.15)
            # Three ticks (0, half, top): a small plot with a tick every 0.5 or every
            # 20 reads as a smudge, and fixed ticks never need recomputing.
            ticks = [(v, f"{v:g}") for v in (0.0, want / 2, want)]
            self.plots[plot].getAxis("left").setTicks([ticks])


_SERIES = (
    "decode_tokens",
    "batch_size",
    "queue_depth",
    "pages_free",
    "pages_referenced",
    "pages_cached",
    "pages_host",
    "prefix_hit_rate",
)
