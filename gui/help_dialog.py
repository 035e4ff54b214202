"""The Help menu's two dialogs: the keyboard shortcuts, and "What am I looking at?", one
page in plain words on the memory views.

The shortcuts are read from the window's actions and shortcuts when the dialog opens,
so a key added or changed anywhere shows up here without editing this file. The memory
page names the legend's words (`gui.views.legend`) and draws its swatches in the
palette the views use, so it reads as the same language as the pictures it explains.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QMainWindow,
    QMenu,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from gui.palette import Palette

COMPOSER_KEYS = "In the message box, Enter sends and Shift+Enter starts a new line."


def _plain(text: str) -> str:
    """A menu text as words: no mnemonic ampersand, no trailing ellipsis."""
    return text.replace("&&", "\0").replace("&", "").replace("\0", "&").rstrip("…").strip()


def shortcut_rows(window: QMainWindow) -> list[tuple[str, str]]:
    """(what, keys) for every action and shortcut of ``window`` that has a key, menu
    items named by their menu ("Chat › Stop generating"), in menu order."""
    rows: list[tuple[str, str]] = []
    seen: set[int] = set()

    def add(action: QAction, where: str) -> None:
        if id(action) in seen or action.shortcut().isEmpty():
            return
        seen.add(id(action))
        name = f"{where} › {_plain(action.text())}" if where else _plain(action.text())
        rows.append((name, action.shortcut().toString(QKeySequence.SequenceFormat.NativeText)))

    def walk(menu: QMenu, where: str) -> None:
        for action in menu.actions():
            if action.menu() is not None:
                walk(action.menu(), f"{where} › {_plain(action.text())}")
            else:
                add(action, where)

    for top in window.menuBar().actions():
        if top.menu() is not None:
            walk(top.menu(), _plain(top.text()))
    for action in window.findChildren(QAction):
        add(action, "")
    for shortcut in window.findChildren(QShortcut):
        if not shortcut.key().isEmpty():
            keys = shortcut.key().toString(QKeySequence.SequenceFormat.NativeText)
            rows.append((shortcut.whatsThis() or "(no description)", keys))
    return rows


class ShortcutsDialog(QDialog):
    """A two-column table of `shortcut_rows`, and the composer's keys below it."""

    def __init__(self, window: QMainWindow, parent: QWidget | None = None):
        super().__init__(parent or window)
        self.setWindowTitle("Keyboard shortcuts")
        rows = shortcut_rows(window)
        self.table = QTableWidget(len(rows), 2)
        self.table.setHorizontalHeaderLabels(["Action", "Keys"])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setShowGrid(False)
        self.table.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.table.setAlternatingRowColors(True)
        for r, (what, keys) in enumerate(rows):
            self.table.setItem(r, 0, QTableWidgetItem(what))
            self.table.setItem(r, 1, QTableWidgetItem(keys))
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        self.table.resizeRowsToContents()
        rows_h = sum(self.table.rowHeight(r) for r in range(len(rows)))
        self.table.setMinimumHeight(min(rows_h + header.height() + 6, 520))
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        note = QLabel(COMPOSER_KEYS)
        note.setWordWrap(True)
        layout.addWidget(note)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.resize(440, self.sizeHint().height())

    def rows(self) -> list[tuple[str, str]]:
        """The table as shown."""
        t = self.table
        return [(t.item(r, 0).text(), t.item(r, 1).text()) for r in range(t.rowCount())]


def _swatch(color: str, pal: Palette, mark: str = "") -> str:
    """A cell as the legend draws it, in HTML: a filled square, or a square with a mark."""
    style = f"color:{color};"
    if mark == "frame":
        return f"<span style='color:{pal.evict}'>□</span>"
    if mark == "dot":
        return f"<span style='{style}'>▣</span>"
    if mark == "fill":
        return f"<span style='{style}'>▄</span>"
    if mark == "corner":
        return f"<span style='color:{pal.disk}'>◤</span>"
    return f"<span style='{style}'>■</span>"


# The page map's legend entries: (palette colour, swatch mark, word, what it means).
_PAGE_MAP_ENTRIES = (
    ("free", "", "free", "empty, ready for any chat."),
    (
        "in_use",
        "",
        "in use",
        "held by a chat that is answering; each chat has its own colour, named in the"
        " legend (“API” is requests to the local server).",
    ),
    (
        "cached",
        "",
        "cached",
        "no chat holds it now; it is kept so a prompt that starts the same way is not"
        " computed again. Cached pages are reused when memory runs short.",
    ),
    (
        "in_use",
        "dot",
        "shared",
        "a dot: several chats read this page at once (the same system prompt, say).",
    ),
    (
        "evict",
        "frame",
        "evicted next",
        "a vermillion frame: the first pages to be reused when free pages run out.",
    ),
    (
        "cached",
        "fill",
        "fill",
        "the solid part of a cell is the tokens written; the pale rest is room left.",
    ),
    (
        "host",
        "",
        "host tier",
        "pages moved out of the device into the computer's main memory; copied back"
        " instead of computed again. They follow the device pages after a blank row.",
    ),
    (
        "disk",
        "",
        "disk tier",
        "prompts kept on disk: they survive a restart and are read back instead of"
        " computed. The newest follow after another blank row.",
    ),
    (
        "disk",
        "corner",
        "from disk",
        "an indigo corner: the page was just read back from the disk tier.",
    ),
)


def memory_help_html(pal: Palette, page_size: int | None = None) -> str:
    """The "What am I looking at?" page, its swatches in ``pal``."""
    page = f"{page_size} tokens" if page_size else "a fixed number of tokens"
    items = "\n".join(
        f"<li>{_swatch(getattr(pal, colour), pal, mark)} <b>{word}</b>: {text}</li>"
        for colour, mark, word, text in _PAGE_MAP_ENTRIES
    )
    return f"""
<h3>Page map</h3>
<p>The model's memory of your chats (its KV cache) is cut into pages of {page}. Each
cell is one page. Hover a cell for its details; click it to see the prompt it belongs to.</p>
<ul>
{items}
</ul>
<h3>Prefix tree</h3>
<p>The same pages as the prompts they came from. Each row is one prompt, read left to
right; a fork is where two prompts part after a shared start. Same colours as the map;
shared pages are larger with a heavy outline, a vermillion outline means evicted next,
and a stack with a number is a run of pages (click to unfold). Chats share only whole
pages: a system prompt shorter than one page is not shared.</p>
<h3>Graphs</h3>
<p>The last seconds, newest at the right: tokens per second (prefill reads the prompt,
decode writes the reply), batch size and jobs queued, pages by kind, and the prefix hit
rate (the share of prompt tokens found already in memory).</p>
<h3>Queue</h3>
<p>One row per reply being made or waiting: its chat, state, prompt tokens, how many
were found cached, pages held, and for a waiting job <i>why it waits</i>: the batch is
full, there are not enough free pages (another reply must finish or be stopped first),
it is held so a job that was passed over can go first, or it is reading its cached
pages from disk.</p>
"""


class MemoryHelpDialog(QDialog):
    """One page on the memory views; modeless, so it can stay open beside them."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("What am I looking at?")
        self.text = QTextBrowser()
        self.text.setOpenLinks(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.text)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.resize(600, 680)

    def show_for(self, pal: Palette, page_size: int | None) -> None:
        """Show the page in the views' current palette and page size (either may have
        changed since it was last open)."""
        self.text.setHtml(memory_help_html(pal, page_size))
        self.show()
        self.raise_()
