"""One visual language for every memory view: page-state colours, chat colours, themes.

The page map, the prefix tree, the legend, the queue panel and the graphs all take
their colours from a `Palette`, so a page that is sky blue in the map is sky blue in
the tree and in the "cached" graph. Hues come from Okabe & Ito's colour-blind-safe set
(and Paul Tol's muted set for the chats beyond the fourth); states that must never be
confused also differ in lightness, so they survive greyscale printing too.

Chats (the `tag` of a job, e.g. a conversation id) keep the colour they were first
given for the life of a `ChatColors`, so a chat never changes colour while you watch.
Jobs from the local server (`engine.server.tag.ApiTag`, one tag for all of them) are one
more "chat", named "API", in a colour of its own that no chat is ever given.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication

from engine.cache.page import PageState
from engine.server.tag import ApiTag

# Hues deliberately kept out of the chat colours: blues mean "not owned by any chat"
# (cached on the device, pushed to the host tier, kept on disk: sky blue, blue, indigo,
# darker the further from the device), vermillion means "evicted next".
OKABE_ITO = {
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}

CHAT_COLORS: tuple[str, ...] = (
    OKABE_ITO["orange"],
    OKABE_ITO["bluish_green"],
    OKABE_ITO["reddish_purple"],
    OKABE_ITO["yellow"],
    "#882255",  # Tol muted: wine
    "#999933",  # Tol muted: olive
    "#DDCC77",  # Tol muted: sand
    "#AA4499",  # Tol muted: purple
)

# The disk tier: Tol's indigo, darker than the host tier's blue and more violet, so the
# three tiers differ in hue and in greyscale; lifted on the dark background.
DISK_COLOR = "#332288"
DISK_COLOR_DARK = "#8F84E8"

# The local server's jobs. Brown: a hue no chat colour and no page state uses, darker
# than the orange of the first chat so the two differ in greyscale too.
API_COLOR = "#8C5A2B"

STATE_NAMES = {
    PageState.FREE: "free",
    PageState.REFERENCED: "in use",
    PageState.CACHED: "cached",
    PageState.HOST: "host tier",
    PageState.DISK: "disk tier",
}


@dataclass(frozen=True)
class Palette:
    """Colours for one theme. Hex strings so they travel into numpy and Qt alike."""

    dark: bool
    background: str
    foreground: str
    muted_text: str
    grid_gap: str  # the hairline between page cells
    free: str
    cached: str
    host: str
    disk: str
    in_use: str  # "referenced by some chat" where one colour must stand for all chats
    evict: str
    shared_mark: str  # the dot on pages with ref count > 1
    highlight: str  # outline of a selected node / chain
    prefill: str
    decode: str
    batch: str
    queue: str
    hit_rate: str

    def state_color(self, state: int) -> str:
        return {
            PageState.FREE: self.free,
            PageState.REFERENCED: self.in_use,
            PageState.CACHED: self.cached,
            PageState.HOST: self.host,
            PageState.DISK: self.disk,
        }[PageState(state)]


LIGHT = Palette(
    dark=False,
    background="#FFFFFF",
    foreground="#1F2328",
    muted_text="#57606A",
    grid_gap="#FFFFFF",
    free="#E3E5E8",
    cached=OKABE_ITO["sky_blue"],
    host=OKABE_ITO["blue"],
    disk=DISK_COLOR,
    in_use="#4D5561",
    evict=OKABE_ITO["vermillion"],
    shared_mark="#000000",
    highlight="#000000",
    prefill=OKABE_ITO["blue"],
    decode=OKABE_ITO["orange"],
    batch=OKABE_ITO["bluish_green"],
    queue=OKABE_ITO["vermillion"],
    hit_rate=OKABE_ITO["reddish_purple"],
)

DARK = Palette(
    dark=True,
    background="#1E1F22",
    foreground="#E6E6E6",
    muted_text="#A0A4AA",
    grid_gap="#1E1F22",
    free="#3A3D43",
    cached=OKABE_ITO["sky_blue"],
    host="#3B8FD9",  # Okabe-Ito blue lifted so it reads on a dark background
    disk=DISK_COLOR_DARK,
    in_use="#C9CDD3",
    evict="#FF7A1A",  # vermillion lifted for the same reason
    shared_mark="#FFFFFF",
    highlight="#FFFFFF",
    prefill="#3B8FD9",
    decode=OKABE_ITO["orange"],
    batch=OKABE_ITO["bluish_green"],
    queue="#FF7A1A",
    hit_rate=OKABE_ITO["reddish_purple"],
)


def os_prefers_dark() -> bool:
    """The OS colour scheme as Qt reports it (light when unknown or without an app)."""
    app = QGuiApplication.instance()
    if app is None:
        return False
    return QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark


def palette_for(dark: bool | None = None) -> Palette:
    """The palette for ``dark`` (None: follow the OS)."""
    return DARK if (os_prefers_dark() if dark is None else dark) else LIGHT


def rgba(hex_color: str, alpha: int = 255) -> tuple[int, int, int, int]:
    c = QColor(hex_color)
    return c.red(), c.green(), c.blue(), alpha


def blend(a: str, b: str, t: float) -> str:
    """``a`` moved a fraction ``t`` towards ``b`` (hex in, hex out)."""
    ca, cb = QColor(a), QColor(b)
    mix = [round(x + (y - x) * t) for x, y in zip(ca.getRgb()[:3], cb.getRgb()[:3], strict=True)]
    return QColor(*mix).name()


def luminance(hex_color: str) -> float:
    """WCAG relative luminance: 0 for black, 1 for white."""
    c = QColor(hex_color)
    lin = [
        (v / 255) / 12.92 if v <= 10 else ((v / 255 + 0.055) / 1.055) ** 2.4
        for v in (c.red(), c.green(), c.blue())
    ]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours, 1 (none) to 21 (black on white); body text
    wants 4.5."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def label_color_on(hex_color: str) -> str:
    """Black or white, whichever reads on ``hex_color``."""
    return "#000000" if luminance(hex_color) > 0.25 else "#FFFFFF"


def is_api(tag: Any) -> bool:
    """Whether ``tag`` is the local server's (every API job carries an equal `ApiTag`)."""
    return isinstance(tag, ApiTag)


class ChatColors(QObject):
    """Chat tag -> colour, first come first served, stable while the object lives.

    Tags in ``fixed`` (by default the API's) always get their own colour and take none
    from the chats, so the first chat is orange whether or not the server ran first.
    Shared by every view of one window so a chat has one colour everywhere; `changed`
    fires when a tag gets its first colour or a chat is renamed, which is when a
    legend has something new to say."""

    changed = Signal()

    def __init__(
        self,
        colors: tuple[str, ...] = CHAT_COLORS,
        parent: QObject | None = None,
        fixed: dict[Hashable, str] | None = None,
    ):
        super().__init__(parent)
        self._colors = colors
        self._fixed = {ApiTag(): API_COLOR} if fixed is None else dict(fixed)
        self._index: dict[Hashable, int] = {}
        # Slots are handed out in order of first sight; each keeps the colour it got.
        self._slot_colors: list[str] = []
        self._chats_seen = 0  # tags coloured from `colors` so far
        self._names: dict[Hashable, str] = {}

    def index_of(self, tag: Any) -> int:
        """The colour slot of ``tag`` (assigning the next one on first sight)."""
        key = _key(tag)
        slot = self._index.get(key)
        if slot is None:
            slot = self._index[key] = len(self._index)
            color = self._fixed.get(key)
            if color is None:
                color = self._colors[self._chats_seen % len(self._colors)]
                self._chats_seen += 1
            self._slot_colors.append(color)
            self.changed.emit()
        return slot

    def color(self, tag: Any) -> str:
        return self._slot_colors[self.index_of(tag)]

    def color_table(self, size: int | None = None) -> np.ndarray:
        """RGBA uint8 rows, one per colour slot, for vectorised lookups; slots not
        handed out yet (up to ``size``) continue the chat colours' cycle."""
        n = max(size if size is not None else len(self._index), 1)
        given = len(self._slot_colors)
        rows = [
            self._slot_colors[i]
            if i < given
            else self._colors[(self._chats_seen + i - given) % len(self._colors)]
            for i in range(n)
        ]
        return np.array([rgba(c) for c in rows], np.uint8)

    def set_name(self, tag: Any, name: str) -> None:
        self._names[_key(tag)] = name
        self.changed.emit()

    def name(self, tag: Any) -> str:
        if tag is None:
            return "(untagged job)"
        named = self._names.get(_key(tag))
        return named if named is not None else str(tag)

    def known(self) -> list[Any]:
        """Tags in the order they got their colours."""
        return [k for k, _ in sorted(self._index.items(), key=lambda kv: kv[1])]


def _key(tag: Any) -> Hashable:
    """Tags are whatever the caller chose; unhashable ones are keyed by their repr."""
    try:
        hash(tag)
    except TypeError:
        return repr(tag)
    return tag
