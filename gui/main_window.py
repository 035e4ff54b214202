"""The main window: conversations on the left, the chat in the middle, the engine's
memory in a dock on the right, the engine's figures in the status bar.

File > Local server runs the OpenAI-compatible server on the window's engine (see
`gui.server_dialog`); it stays on across model switches and cache rebuilds (the bridge
moves it to the new engine, same address and key) and stops when the window closes.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QColor,
    QIcon,
    QKeySequence,
    QPixmap,
    QShortcut,
)
from PySide6.QtWidgets import (
    QDialog,
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QToolBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.cache.disk_tier import DiskTierStats
from engine.device import device_memory, resolve_or_cpu
from engine.engine import EngineSnapshot
from engine.units import format_bytes
from gui.bridge import EngineBridge, ModelInfo, ServerInfo
from gui.chat.controller import ChatController
from gui.chat.export import ExportError, ask_export_path, export_chat
from gui.chat.presets import PresetStore
from gui.chat.view import ChatView
from gui.data_folder import problem_dialog
from gui.elided_label import ElidedLabel
from gui.help_dialog import MemoryHelpDialog, ShortcutsDialog
from gui.models.loading import process_memory_tip
from gui.models.model_bar import LoadStatus, ModelPicker
from gui.palette import API_COLOR, palette_for
from gui.server_dialog import LocalServerSettings, ServerDialog
from gui.settings_dialog import EngineSettings, SettingsDialog
from gui.settings_hints import PromptLengths, shared_prefix_tokens, work_lost
from gui.status import MemoryFigures, engine_words, memory_figures
from gui.store import Store, StoreError, StoreMode
from gui.views.page_map_model import disk_pages

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.5  # the status bar's figures need not move at 10 Hz
CHAT_MIN_WIDTH = 520  # narrower, and a reply wraps every few words


def make_memory_panel() -> QWidget:
    """The memory views (page map, prefix tree, graphs) or, while they are not there
    yet, a placeholder: the one line to change when they land."""
    try:
        from gui.views.memory_panel import MemoryPanel
    except ImportError:
        placeholder = QLabel("Memory views are not available in this build.")
        placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        placeholder.setMinimumWidth(320)
        return placeholder
    return MemoryPanel()


def tune_garbage_collector() -> None:
    """Keep the cyclic garbage collector from pausing the UI.

    A full collection stops every thread holding the GIL; with a model, numpy and
    pyqtgraph loaded it took 60-150 ms on the 2-core dev machine and ran every second
    or so while four chats generated. What is alive once a model is loaded lives as
    long as the app, so it is frozen out of the collector's reach, and collections
    run after many more allocations (most garbage here is freed by reference counts
    anyway; the collector only finds cycles).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def disk_status(disk: DiskTierStats, records: int, location: str) -> tuple[str, str]:
    """The status bar's words for the prompt cache on disk, and its tooltip. ``records``:
    its pages as the page map counts them (`disk_pages`), so the two always agree."""
    pages = f"{records:,} page{'s' if records != 1 else ''}"
    held = f"{format_bytes(disk.bytes)} of {format_bytes(disk.budget)}"
    tip = (
        f"Prompt cache on disk, in {location}: {pages} ({held} for this model)."
        f" This session wrote {disk.writes:,} and read back {disk.hits:,}."
    )
    if disk.status.startswith("off"):
        return "disk cache off", f"The prompt cache on disk is off: {disk.status[5:]}"
    if disk.status:
        return (
            f"disk cache {pages} (reading only)",
            f"{tip}\n{disk.status[:1].upper()}{disk.status[1:]}.",
        )
    return f"disk cache {pages} · {format_bytes(disk.bytes)}", tip


class ConversationList(QWidget):
    """Search box, 'New chat' and the list; rename and delete from the context menu."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 0, 6)
        head = QHBoxLayout()
        title = QLabel("Chats")
        font = title.font()
        font.setBold(True)
        title.setFont(font)
        head.addWidget(title)
        head.addStretch(1)
        self.new_button = QPushButton("+ New")
        self.new_button.setToolTip("New chat (Ctrl+N)")
        head.addWidget(self.new_button)
        layout.addLayout(head)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        layout.addWidget(self.search)
        self.list = QListWidget()
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        layout.addWidget(self.list, 1)


class MainWindow(QMainWindow):
    def __init__(
        self,
        store: Store,
        settings: QSettings,
        bridge: EngineBridge | None = None,
    ):
        super().__init__()
        self.store = store
        self.settings = settings
        self.bridge = bridge or EngineBridge(self)
        self.controller = ChatController(store, self.bridge, self)
        self.engine_settings = EngineSettings.from_dict(self._settings_json("engine/settings"))
        self.server_prefs = LocalServerSettings.from_dict(self._settings_json("server/settings"))
        # The prompt lengths of the jobs this install ran: the page-size suggestion.
        self.prompt_lengths = PromptLengths.parse(self._settings_json("engine/prompt_lengths"))
        self._kv_bytes = 0  # the running cache's page pool, from the latest snapshot
        self.server_dialog: ServerDialog | None = None  # built on first use
        self._served_model: str | None = None  # what the server served last, while on
        self.error_dialog: QMessageBox | None = None
        self.memory_help: QDialog | None = None  # built on first use
        self.data_folder_dialog: QMessageBox | None = None
        self.model_manager: Any = None  # gui.model_manager.ModelManager, built on first use
        self.model_info: ModelInfo | None = None
        self._last_status = 0.0
        self._shown_figures: MemoryFigures | None = None
        self._loading = ""  # what the status bar says while a load or rebuild runs
        self._rss, self._rss_at = 0, float("-inf")  # the process size, read twice a second
        self._closing = False
        self._chat_names: dict[int, str] = {}

        self.chats = ConversationList()
        self.chat_view = ChatView(store, self.controller)
        self.chat_view.settings.use_presets(PresetStore(settings))
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(self.chats)
        self.splitter.addWidget(self.chat_view)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        # Neither side drags shut (nor comes back shut from a saved layout): the list
        # is how one gets to the other chats.
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setSizes([230, 700])
        self.setCentralWidget(self.splitter)

        self.memory_panel = make_memory_panel()
        self.memory_dock = QDockWidget("Memory", self)
        self.memory_dock.setObjectName("memory_dock")
        # A fixed minimum and an ignored size hint: the views' labels change as chats
        # come and go, and a hint that moves re-lays out the whole window each time.
        hint = self.memory_panel.minimumSizeHint()
        self.memory_panel.setMinimumSize(max(380, hint.width()), 300)
        self.memory_panel.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Ignored)
        self.memory_dock.setWidget(self.memory_panel)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.memory_dock)
        self._connect_memory_panel()

        self._build_status_bar()
        self._build_model_bar()
        self._build_actions()
        self._build_help_and_keys()

        self.chats.new_button.clicked.connect(lambda: self.new_conversation())
        self.chats.search.textChanged.connect(lambda _: self.refresh_conversations())
        self.chats.list.currentItemChanged.connect(self._on_current_item)
        self.chats.list.customContextMenuRequested.connect(self._conversation_menu)
        self.controller.conversations_listed.connect(self.refresh_conversations)
        self.controller.conversation_changed.connect(lambda _: self._mark_generating())
        self.controller.saving_changed.connect(self._show_saving)
        self.controller.generation_failed.connect(
            lambda _cid, message: self.statusBar().showMessage(message, 10_000)
        )
        self.bridge.snapshot_ready.connect(self.on_snapshot)
        self.bridge.engine_ready.connect(self.on_engine_ready)
        self.bridge.engine_failed.connect(self.on_engine_failed)
        self.bridge.load_progress.connect(self.on_load_progress)
        self.bridge.job_events.connect(self._record_prompt_lengths)
        self.bridge.server_changed.connect(self.on_server_changed)
        self.bridge.server_failed.connect(self.on_server_failed)
        self.resize(1400, 860)
        self.resizeDocks([self.memory_dock], [480], Qt.Orientation.Horizontal)
        self._restore_layout()
        self._apply_threads()
        self._show_saving("")
        self.refresh_conversations()
        if self.server_prefs.enabled:
            self.apply_server_settings(self.server_prefs)  # runs once the engine is up
        last = self.settings.value("chats/current")
        if last is not None and self._find_item(int(last)) is not None:
            self.select_conversation(int(last))
        elif self.chats.list.count():
            self.chats.list.setCurrentRow(0)
        else:
            self.new_conversation()

    # -- construction -----------------------------------------------------------------

    def _build_status_bar(self) -> None:
        bar = self.statusBar()
        self.model_label = ElidedLabel("no model")
        self.device_label = QLabel()
        self.cache_label = ElidedLabel()
        self.memory_label = ElidedLabel()
        self.disk_label = ElidedLabel()  # the prompt cache on disk; hidden without one
        self.disk_label.setVisible(False)
        self.jobs_label = QLabel()
        for w in (
            self.model_label,
            self.device_label,
            self.cache_label,
            self.memory_label,
            self.disk_label,
        ):
            w.setStyleSheet("padding: 0 6px; border-right: 1px solid #c8c8c8;")
            bar.addWidget(w)
        self.jobs_label.setStyleSheet("padding: 0 6px;")
        bar.addWidget(self.jobs_label, 1)
        self.saving_label = QLabel()
        self.saving_label.setStyleSheet("padding: 0 6px; color: #B3261E; font-weight: 600;")
        self.saving_label.setVisible(False)
        bar.addPermanentWidget(self.saving_label)
        # The server's address, while it runs (or is about to): a click opens its dialog.
        self.server_button = QToolButton()
        self.server_button.setAutoRaise(True)
        # The swatch the memory views colour API pages with, so the two read as one.
        swatch = QPixmap(10, 10)
        swatch.fill(QColor(API_COLOR))
        self.server_button.setIcon(QIcon(swatch))
        self.server_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.server_button.setVisible(False)
        self.server_button.clicked.connect(self.open_server_dialog)
        bar.addPermanentWidget(self.server_button)

    def _build_model_bar(self) -> None:
        """The model picker and a load's progress, above the chats."""
        bar = QToolBar("Model", self)
        bar.setObjectName("model_toolbar")
        bar.setMovable(False)
        self.model_picker = ModelPicker(
            lambda: self.engine_settings.cache_settings(),
            lambda: self.engine_settings.weights,
            lambda: self.model_info.path if self.model_info is not None else None,
            lambda: (self.model_info.weight_bytes if self.model_info else 0) + self._kv_bytes,
        )
        self.model_picker.load_requested.connect(self._load_from_models)
        self.model_picker.manage_requested.connect(self.open_models)
        self.load_status = LoadStatus()
        label = QLabel("Model")
        label.setContentsMargins(6, 0, 6, 0)
        bar.addWidget(label)
        bar.addWidget(self.model_picker)
        self.load_status.action = bar.addWidget(self.load_status)
        self.load_status.finish()
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, bar)

    def _build_actions(self) -> None:
        menu = self.menuBar()
        file_menu = menu.addMenu("&File")
        self.new_action = QAction("&New chat", self)
        self.new_action.setShortcut(QKeySequence.StandardKey.New)
        self.new_action.triggered.connect(lambda: self.new_conversation())
        open_model = QAction("&Open model…", self)
        open_model.triggered.connect(self.choose_model)
        models_action = QAction("&Models…", self)
        models_action.setShortcut(QKeySequence("Ctrl+M"))
        models_action.triggered.connect(self.open_models)
        settings_action = QAction("Engine &settings…", self)
        settings_action.setShortcut(QKeySequence("Ctrl+,"))
        settings_action.triggered.connect(self.open_settings)
        self.server_action = QAction("&Local server…", self)
        self.server_action.setToolTip("Serve the model to other programs (OpenAI API)")
        self.server_action.triggered.connect(self.open_server_dialog)
        quit_action = QAction("&Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        for action in (
            self.new_action,
            open_model,
            models_action,
            settings_action,
            self.server_action,
        ):
            file_menu.addAction(action)
        file_menu.addSeparator()
        file_menu.addAction(quit_action)
        chat_menu = menu.addMenu("&Chat")
        self.stop_action = QAction("&Stop generating", self)
        self.stop_action.setShortcut(QKeySequence(Qt.Key.Key_Escape))
        self.stop_action.triggered.connect(self.chat_view.stop)
        rename = QAction("&Rename…", self)
        rename.setShortcut(QKeySequence(Qt.Key.Key_F2))
        rename.triggered.connect(lambda: self.rename_conversation())
        delete = QAction("&Delete", self)
        delete.triggered.connect(lambda: self.delete_conversation())
        export = QAction("&Export chat…", self)
        export.setToolTip("Save this chat as Markdown or JSON")
        export.triggered.connect(lambda: self.export_chat())
        for action in (self.stop_action, rename, delete, export):
            chat_menu.addAction(action)
        view_menu = menu.addMenu("&View")
        view_menu.addAction(self.memory_dock.toggleViewAction())
        # Esc must reach the window from the input box too; a window-wide shortcut does.
        self.addAction(self.stop_action)
        self._delete_shortcut = QShortcut(QKeySequence.StandardKey.Delete, self.chats.list)
        self._delete_shortcut.activated.connect(lambda: self.delete_conversation())

    def _build_help_and_keys(self) -> None:
        """Ctrl+F to the chat search, a key for the memory panel, and the Help menu.
        Window-wide actions, so they work from the message box too."""
        find = QAction("&Search chats", self)
        find.setShortcut(QKeySequence("Ctrl+F"))
        find.triggered.connect(self.focus_search)
        self.addAction(find)
        for top in self.menuBar().actions():
            if top.text() == "&Chat":
                top.menu().addAction(find)
        self.memory_dock.toggleViewAction().setShortcut(QKeySequence("Ctrl+Shift+M"))
        self.addAction(self.memory_dock.toggleViewAction())  # works while the dock is hidden
        self._delete_shortcut.setWhatsThis("Delete the selected chat (in the chat list)")
        help_menu = self.menuBar().addMenu("&Help")
        shortcuts = help_menu.addAction("&Keyboard shortcuts…", self.open_shortcuts)
        shortcuts.setShortcut(QKeySequence("Ctrl+/"))
        explain = help_menu.addAction("&What am I looking at?", self.open_memory_help)
        explain.setShortcut(QKeySequence(Qt.Key.Key_F1))

    def focus_search(self) -> None:
        self.chats.search.setFocus(Qt.FocusReason.ShortcutFocusReason)
        self.chats.search.selectAll()

    def open_shortcuts(self) -> QDialog:
        dialog = ShortcutsDialog(self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        return dialog

    def open_memory_help(self) -> QDialog:
        """Modeless and one for the window, so it can stay open beside the views."""
        if self.memory_help is None:
            self.memory_help = MemoryHelpDialog(self)
        pal = getattr(self.memory_panel, "palette_", None) or palette_for()
        self.memory_help.show_for(pal, self.engine_settings.page_size)
        return self.memory_help

    def _connect_memory_panel(self) -> None:
        panel = self.memory_panel
        if hasattr(panel, "chat_selected"):
            panel.chat_selected.connect(self._on_memory_chat_selected)
        if hasattr(panel, "page_clicked"):
            panel.page_clicked.connect(self._on_page_clicked)
        # The panel is not fed while hidden: shown again, it gets the latest state now.
        self.memory_dock.visibilityChanged.connect(
            lambda visible: visible and self.bridge.poll_snapshot(force=True)
        )

    # -- the window's width -----------------------------------------------------------

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        old = event.oldSize()
        if not old.isValid() or event.size().width() < old.width():
            QTimer.singleShot(0, self._make_room_for_the_chat)

    def _make_room_for_the_chat(self) -> None:
        """A window made narrower takes the width from the chat alone (the dock and the
        list keep theirs), until its replies wrap every few words; so the dock, then the
        list, give back width down to their own minimum first."""
        short = CHAT_MIN_WIDTH - self.chat_view.width()
        dock = self.memory_dock
        if short > 0 and dock.isVisible() and not dock.isFloating():
            give = min(short, dock.width() - dock.minimumSizeHint().width())
            if give > 0:
                self.resizeDocks([dock], [dock.width() - give], Qt.Orientation.Horizontal)
                # The chat's new width shows once the layout has run: the list next.
                QTimer.singleShot(0, self._make_room_for_the_chat)
                return
        list_width, chat_width = self.splitter.sizes()
        give = min(short, list_width - self.chats.minimumSizeHint().width())
        if give > 0:
            self.splitter.setSizes([list_width - give, chat_width + give])

    # -- settings (QSettings) ---------------------------------------------------------

    def _settings_json(self, key: str) -> Any:
        raw = self.settings.value(key)
        if not raw:
            return None
        try:
            return json.loads(str(raw))
        except ValueError:
            return None

    def _restore_layout(self) -> None:
        geometry = self.settings.value("window/geometry")
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        state = self.settings.value("window/state")
        if isinstance(state, QByteArray):
            self.restoreState(state)
        splitter = self.settings.value("window/splitter")
        if isinstance(splitter, QByteArray):
            self.splitter.restoreState(splitter)

    def save_layout(self) -> None:
        self.settings.setValue("window/geometry", self.saveGeometry())
        self.settings.setValue("window/state", self.saveState())
        self.settings.setValue("window/splitter", self.splitter.saveState())
        if self.chat_view.conversation_id is not None:
            self.settings.setValue("chats/current", self.chat_view.conversation_id)
        self.settings.sync()

    # -- the engine -------------------------------------------------------------------

    def start_engine(self, model_path: str | Path | None = None) -> None:
        """Load `model_path`, else the last model, else the default model (fetched with
        a progress dialog on first run); or, when Settings > Engine names a server, connect
        to it. Everything slow runs off the UI thread."""
        if model_path is None and self.engine_settings.remote:
            self.connect_remote()
            return
        path = model_path or self.settings.value("model/last_path")
        if path and Path(str(path)).exists():
            self.load_model(Path(str(path)))
            return
        from engine.model.fetch import ensure_default_model, is_fetched

        if is_fetched():
            self.load_model(ensure_default_model())
            return
        from gui.first_run_dialog import FetchDialog

        self.fetch_dialog = FetchDialog(ensure_default_model, self)
        self.fetch_dialog.succeeded.connect(self.load_model)
        self.fetch_dialog.failed.connect(
            lambda msg: self.show_error("Could not get the default model", msg)
        )
        self.fetch_dialog.start()

    def load_model(self, path: str | Path) -> None:
        if self.engine_settings.remote:
            # A model file runs on this computer: the engine setting follows, or the next
            # start would connect to the server again.
            self.engine_settings = dataclasses.replace(self.engine_settings, backend="local")
            self.settings.setValue("engine/settings", json.dumps(self.engine_settings.as_dict()))
        self.model_label.setText(f"loading {Path(path).name}…")
        self.load_status.start(Path(path).stem)
        self._show_loading("loading the model…")
        self.bridge.load(
            path,
            self.engine_settings.cache_settings(),
            self.engine_settings.generator_settings(),
            self.engine_settings.weights,
            self.engine_settings.device,
        )

    def connect_remote(self) -> None:
        """Use the server Settings > Engine names; a failure is shown, the engine that
        ran keeps running."""
        settings = self.engine_settings
        self.model_label.setText(f"connecting to {settings.remote_url}…")
        try:
            self.bridge.connect_remote(settings.remote_settings())
        except ValueError as exc:
            self.on_engine_failed(str(exc))

    def use_loaded(self, loaded: Any) -> None:
        """Start the engine on a model already loaded (tests, embedding)."""
        self.load_status.start(loaded.name, "Starting")
        self._show_loading("starting the engine…")
        self.bridge.use_loaded(
            loaded,
            self.engine_settings.cache_settings(),
            self.engine_settings.generator_settings(),
        )

    def choose_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Open a model", "", "GGUF models (*.gguf);;All files (*)"
        )
        if path:
            self.controller.stop_all()
            self.load_model(path)

    def open_models(self) -> None:
        """The Models window: one instance for the app's life, so downloads outlive it."""
        if self.model_manager is None:
            from gui.model_manager import ModelManager

            self.model_manager = ModelManager(
                self.bridge,
                lambda: self.engine_settings.cache_settings(),
                self,
                device=lambda: str(resolve_or_cpu(self.engine_settings.device)[0]),
            )
            self.model_manager.load_requested.connect(self._load_from_models)
            self.model_manager.downloads.completed.connect(lambda _: self.model_picker.refresh())
        self.model_manager.show()
        self.model_manager.raise_()
        self.model_manager.activateWindow()

    def _load_from_models(self, path: Path) -> None:
        self.controller.stop_all()
        self.load_model(path)

    def on_load_progress(self, fraction: float, what: str) -> None:
        self.load_status.update_progress(fraction, what)

    def on_engine_ready(self, info: ModelInfo) -> None:
        self.model_info = info
        tune_garbage_collector()
        self.load_status.finish()
        self.model_picker.refresh()
        self.model_label.setText(f"{info.name} · {info.format}")
        if info.url:  # a server elsewhere: no file to remember
            self.model_label.setToolTip(
                f"{info.name} on the {info.format} at {info.url}"
                f" · connected in {info.load_seconds:.1f} s"
            )
        else:
            self.settings.setValue("model/last_path", str(info.path))
            self.model_label.setToolTip(
                f"{info.path}\n{info.architecture} · "
                f"{format_bytes(info.weight_bytes, binary=True)} of weights"
                f" · loaded in {info.load_seconds:.1f} s"
            )
        self.device_label.setText(info.device)
        self.device_label.setToolTip(info.device_note)
        if info.device_note:  # CUDA asked for, not there: say so where the device shows
            # (a timed status message would hide the bar's labels, this one included)
            self.device_label.setText(f"{info.device}: no CUDA GPU found")
            self.device_label.setStyleSheet(
                "padding: 0 6px; border-right: 1px solid #c8c8c8; color: #a15c00;"
            )
        else:
            self.device_label.setStyleSheet("padding: 0 6px; border-right: 1px solid #c8c8c8;")
        self._last_status = 0.0
        self._loading = ""

    def _show_loading(self, text: str) -> None:
        """The status bar says so while a load or rebuild runs (the old engine's
        snapshots may still come in meanwhile: they do not say "idle" over it)."""
        self._loading = text
        self.jobs_label.setText(text)

    def on_engine_failed(self, message: str) -> None:
        self._loading = ""
        self.load_status.finish()
        self.model_picker.select_loaded()
        if self.model_info is None:
            self.model_label.setText("no model")
        elif self.model_label.text().startswith("connecting"):
            self.on_engine_ready(self.model_info)  # the engine that ran still does
        if self.engine_settings.remote:
            self.show_error("Could not use the server", message)
        else:
            self.show_error("The model could not be loaded", message)

    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        # The panel only stores the snapshot here and brings its views up to date one
        # per tick of its own timer (see MemoryPanel); nothing at all while the dock is
        # hidden, so a closed dock costs no UI time.
        feed = getattr(self.memory_panel, "feed", None)
        if feed is not None and self.memory_dock.isVisible():
            feed(snapshot, self.bridge.telemetry, self.bridge.tokenizer)
        # The cache's figures as soon as they move (the panel shows them too: the two
        # must agree); the jobs' progress and the process size twice a second.
        figures = memory_figures(snapshot)
        due = snapshot.time - self._last_status >= STATUS_INTERVAL_S
        if due or figures != self._shown_figures or not snapshot.jobs:
            self._last_status = snapshot.time
            self.update_status(snapshot)

    def update_status(self, snapshot: EngineSnapshot) -> None:
        figures = memory_figures(snapshot)
        self._shown_figures = figures
        self.cache_label.setText(figures.cache_text())
        text = figures.use_text()
        if snapshot.time - self._rss_at >= STATUS_INTERVAL_S:
            self._rss, self._rss_at = _process_rss(), snapshot.time
        rss = self._rss
        if rss:
            text += f" · process {format_bytes(rss, binary=True)}"
        loaded = self.bridge.loaded
        vram = device_memory(loaded.device) if loaded is not None else None
        if vram is not None:  # the model on a GPU: what its memory holds
            text += " · " + vram.describe(loaded.weight_bytes, snapshot.cache_bytes)
        self.memory_label.setText(text)
        self._kv_bytes = snapshot.cache_bytes
        if rss and self.model_info is not None:
            info = self.model_info
            self.memory_label.setToolTip(
                process_memory_tip(
                    rss,
                    info.weight_bytes,
                    info.weight_mode,
                    info.batch_copy_bytes,
                    snapshot.cache_bytes,
                    snapshot.host_bytes,
                    info.vocab_size,
                )
                + "\n\nIn use: pages running replies hold. Reclaimable: pages of earlier"
                " prompts, kept so a chat that repeats them skips their prefill; a reply"
                " that needs room takes them over."
            )
        disk = snapshot.cache.disk
        self.disk_label.setVisible(disk is not None)
        if disk is not None:
            text, tip = disk_status(
                disk, disk_pages(snapshot), self.bridge.cache_settings.disk_dir or ""
            )
            self.disk_label.setText(text)
            self.disk_label.setToolTip(tip)
        loading = self._loading if self.bridge.busy else ""
        self.jobs_label.setText(loading or engine_words(snapshot))

    # -- settings dialog --------------------------------------------------------------

    def open_settings(self) -> None:
        dialog = SettingsDialog(
            self.engine_settings,
            self,
            self.model_info,
            self.bridge.clear_disk_cache,
            prompt_lengths=self.prompt_lengths.lengths,
            snapshot=self.bridge.poll_snapshot(force=True),
            shared_prefix=self._shared_prefix(),
        )
        if dialog.exec():
            self.apply_settings(dialog.values(), confirm=True)

    def _shared_prefix(self) -> int | None:
        """The tokens chats with the open chat's system prompt begin with; None without
        a model or a chat."""
        tokenizer = self.bridge.tokenizer
        if tokenizer is None or self.chat_view.conversation_id is None:
            return None
        try:
            return shared_prefix_tokens(tokenizer.encode_chat, self.chat_view.settings.values()[0])
        except Exception:  # noqa: BLE001 - a hint only: a template that refuses is no reason to fail
            log.warning("could not render the system prompt", exc_info=True)
            return None

    def apply_settings(self, new: EngineSettings, confirm: bool = True) -> bool:
        """Save `new`; rebuild the engine when the cache or batching changed. When
        `confirm`, asks once, and only when work would be lost (replies running, cached
        pages the new cache drops). Returns whether the settings were applied."""
        if new.needs_switch(self.engine_settings):
            return self._switch_engine(new, confirm)
        rebuild = new.needs_rebuild(self.engine_settings) and not new.remote
        reload = new.needs_reload(self.engine_settings) and self.bridge.loaded is not None
        if (rebuild or reload) and confirm and self.bridge.ready:
            lost = work_lost(self.bridge.poll_snapshot(force=True), self.engine_settings, new)
            if lost.any:
                what = "the model loaded again" if reload else "a new KV cache"
                answer = QMessageBox.question(
                    self,
                    "Load the model again?" if reload else "Rebuild the KV cache?",
                    f"The new settings need {what}: {lost.text()} Apply now?",
                )
                if answer != QMessageBox.StandardButton.Yes:
                    return False
        self.engine_settings = new
        self.settings.setValue("engine/settings", json.dumps(new.as_dict()))
        self._apply_threads()
        if reload:
            self.load_model(self.bridge.loaded.path)
        elif rebuild and self.bridge.loaded is not None:
            self.load_status.start(self.bridge.loaded.name, "Rebuilding the KV cache of")
            self._show_loading("building the new KV cache…")
            self.bridge.rebuild(new.cache_settings(), new.generator_settings())
        self.model_picker.refresh()  # fits are priced for the cache chosen
        return True

    def _record_prompt_lengths(self, events: list) -> None:
        """Each finished job's prompt length, kept for the page-size suggestion."""
        record = self.prompt_lengths
        for event in events:
            if event.eos and event.result is not None:
                record = record.add(event.result.prompt_tokens)
        if record != self.prompt_lengths:
            self.prompt_lengths = record
            self.settings.setValue("engine/prompt_lengths", json.dumps(list(record.lengths)))

    def _switch_engine(self, new: EngineSettings, confirm: bool) -> bool:
        """This computer's engine to a server, back, or to another server."""
        if confirm and self.controller.generations:
            answer = QMessageBox.question(
                self,
                "Switch the engine?",
                "Replies in progress stop. Switch now?",
            )
            if answer != QMessageBox.StandardButton.Yes:
                return False
        self.engine_settings = new
        self.settings.setValue("engine/settings", json.dumps(new.as_dict()))
        self._apply_threads()
        self.controller.stop_all()
        self.start_engine()
        return True

    def _apply_threads(self) -> None:
        if self.engine_settings.cpu_threads > 0:
            import torch

            torch.set_num_threads(self.engine_settings.cpu_threads)

    # -- the local server -------------------------------------------------------------

    def open_server_dialog(self) -> ServerDialog:
        """One modeless dialog for the window's life, so it can stay open beside the chats."""
        if self.server_dialog is None:
            self.server_dialog = ServerDialog(self.bridge, self.server_prefs, self)
            self.server_dialog.apply_requested.connect(self.apply_server_settings)
        self.server_dialog.show()
        self.server_dialog.raise_()
        self.server_dialog.activateWindow()
        return self.server_dialog

    def apply_server_settings(self, prefs: LocalServerSettings) -> None:
        """Save `prefs` and start (or restart) or stop the server to match; the outcome
        arrives as `on_server_changed` / `on_server_failed`."""
        self._save_server_prefs(prefs)
        if prefs.enabled:
            self.bridge.start_server(prefs.server_settings())
        else:
            self.bridge.stop_server()
        self._show_server(self.bridge.server)

    def _save_server_prefs(self, prefs: LocalServerSettings) -> None:
        self.server_prefs = prefs
        self.settings.setValue("server/settings", json.dumps(prefs.as_dict()))

    def on_server_changed(self, info: ServerInfo | None) -> None:
        self._show_server(info)
        if info is None:
            if self.bridge.server_settings is None:
                self._served_model = None  # switched off, not moving to a new engine
            return
        if self._served_model is not None and info.model_id != self._served_model:
            self.statusBar().showMessage(
                f"API server now serves {info.model_id} (same address: {info.base_url})", 10_000
            )
        self._served_model = info.model_id

    def on_server_failed(self, message: str) -> None:
        # The switch is off now; saved so, or the next start would fail the same way.
        self._save_server_prefs(dataclasses.replace(self.server_prefs, enabled=False))
        self._show_server(None)
        self.statusBar().showMessage("API server: " + message, 15_000)
        if self.server_dialog is None or not self.server_dialog.isVisible():
            box = self.show_error("The local server could not start", message)
            box.setInformativeText("File > Local server… changes the address and port.")

    def _show_server(self, info: ServerInfo | None) -> None:
        """The status bar's server button: its URL while it runs, "starting…" while it
        waits for an engine or moves to a new one, hidden when off."""
        button = self.server_button
        if info is not None:
            button.setText(f"API server: {info.base_url}")
            button.setToolTip(
                f"Serving {info.model_id} to OpenAI clients at {info.base_url}"
                f"{' (API key required)' if info.settings.api_key else ''}. Click for settings."
            )
        elif self.bridge.server_settings is not None:
            button.setText("API server: starting…")
            button.setToolTip("The server starts once the model is running. Click for settings.")
        button.setVisible(info is not None or self.bridge.server_settings is not None)

    # -- conversations ----------------------------------------------------------------

    def refresh_conversations(self) -> None:
        current = self.chat_view.conversation_id
        lst = self.chats.list
        lst.blockSignals(True)
        lst.clear()
        for conv in self.store.conversations(self.chats.search.text().strip()):
            item = QListWidgetItem(conv.title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(conv.title)
            lst.addItem(item)
            self._name_chat_in_views(conv.id, conv.title)
            if conv.id == current:
                lst.setCurrentItem(item)
        lst.blockSignals(False)
        self._mark_generating()

    def _name_chat_in_views(self, conversation_id: int, title: str) -> None:
        # Only on a change: each call re-styles the views' legend, which costs
        # tens of milliseconds of UI time.
        if self._chat_names.get(conversation_id) == title:
            return
        self._chat_names[conversation_id] = title
        set_name = getattr(self.memory_panel, "set_chat_name", None)
        if set_name is not None:
            set_name(conversation_id, title)

    def _mark_generating(self) -> None:
        """A dot before chats whose reply is streaming (even when not shown)."""
        for i in range(self.chats.list.count()):
            item = self.chats.list.item(i)
            cid = item.data(Qt.ItemDataRole.UserRole)
            title = self.store.conversation(cid).title
            busy = self.controller.is_generating(cid)
            item.setText(f"● {title}" if busy else title)

    def _find_item(self, conversation_id: int) -> QListWidgetItem | None:
        for i in range(self.chats.list.count()):
            item = self.chats.list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == conversation_id:
                return item
        return None

    def select_conversation(self, conversation_id: int) -> None:
        item = self._find_item(conversation_id)
        if item is None:  # filtered out by the search: clear the search
            self.chats.search.clear()
            item = self._find_item(conversation_id)
        if item is not None:
            self.chats.list.setCurrentItem(item)
        self.chat_view.show_conversation(conversation_id)
        select = getattr(self.memory_panel, "select_chat", None)
        if select is not None:
            select(conversation_id)

    def _on_current_item(self, item: QListWidgetItem | None, _previous: Any = None) -> None:
        if item is not None:
            cid = item.data(Qt.ItemDataRole.UserRole)
            if cid != self.chat_view.conversation_id:
                self.chat_view.show_conversation(cid)
                select = getattr(self.memory_panel, "select_chat", None)
                if select is not None:
                    select(cid)

    def new_conversation(self, title: str = "New chat") -> int | None:
        """A new chat that inherits the current chat's system prompt and sampling, so
        chats started in a row share their prompt prefix in the cache. None when the
        store refuses it (the user is told why)."""
        system_prompt, sampling = "", {}
        if self.chat_view.conversation_id is not None:
            system_prompt, sampling = self.chat_view.settings.values()
        try:
            conv = self.store.create_conversation(title, system_prompt, sampling)
        except StoreError as exc:
            self.show_error("Could not start a new chat", str(exc))
            return None
        self.chats.search.clear()
        self.refresh_conversations()
        self.select_conversation(conv.id)
        self.chat_view.input.setFocus()
        return conv.id

    def rename_conversation(self, conversation_id: int | None = None, title: str | None = None):
        cid = conversation_id if conversation_id is not None else self.chat_view.conversation_id
        if cid is None:
            return
        if title is None:
            old = self.store.conversation(cid).title
            title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=old)
            if not ok:
                return
        title = title.strip()
        if title:
            try:
                self.store.update_conversation(cid, title=title)
            except StoreError as exc:
                self.show_error("Could not rename the chat", str(exc))
                return
            self.refresh_conversations()
            if cid == self.chat_view.conversation_id:
                self.chat_view.title.setText(title)

    def delete_conversation(self, conversation_id: int | None = None, confirm: bool = True):
        cid = conversation_id if conversation_id is not None else self.chat_view.conversation_id
        if cid is None:
            return
        if confirm:
            title = self.store.conversation(cid).title
            answer = QMessageBox.question(self, "Delete chat", f"Delete “{title}” for good?")
            if answer != QMessageBox.StandardButton.Yes:
                return
        try:
            self.store.delete_conversation(cid)
        except StoreError as exc:
            self.show_error("Could not delete the chat", str(exc))
            return
        self.controller.stop(cid)
        if cid == self.chat_view.conversation_id:
            self.chat_view.show_conversation(None)
        self.refresh_conversations()
        if self.chats.list.count():
            self.chats.list.setCurrentRow(0)

    def export_chat(self, path: Path | None = None) -> None:
        """Chat > Export chat…: the current chat to a file (asked for when not given)."""
        cid = self.chat_view.conversation_id
        if cid is None:
            return
        path = path or ask_export_path(self, self.store.conversation(cid).title)
        if path is None:
            return
        try:
            export_chat(self.store, cid, self.model_info.name if self.model_info else None, path)
        except ExportError as exc:
            self.show_error("Could not export the chat", str(exc))
            return
        self.statusBar().showMessage(f"Exported the chat to {path}", 10_000)

    def _conversation_menu(self, pos: Any) -> None:
        item = self.chats.list.itemAt(pos)
        if item is None:
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename_conversation(cid))
        menu.addAction("Delete", lambda: self.delete_conversation(cid))
        menu.exec(self.chats.list.mapToGlobal(pos))

    def _on_memory_chat_selected(self, tag: Any) -> None:
        if isinstance(tag, int) and self._find_item(tag) is not None:
            self.select_conversation(tag)

    def _on_page_clicked(self, page: int) -> None:
        self.statusBar().showMessage(f"page {page}", 3000)

    # -- errors -----------------------------------------------------------------------

    def _show_saving(self, failure: str) -> None:
        """Title and status bar say so while chats are not being saved: for the whole
        session on a read-only or temporary store, until writes work again after a
        failed one (`failure`) otherwise."""
        mode = self.store.mode
        if mode is StoreMode.SAVED:
            self.setWindowTitle("Folio" if not failure else "Folio — chats are not being saved")
            self.saving_label.setText("⚠ Not saved" if failure else "")
            self.saving_label.setToolTip(failure)
            self.saving_label.setVisible(bool(failure))
            return
        self.setWindowTitle(f"Folio — chats are not being saved ({mode.value})")
        self.saving_label.setText(f"⚠ Chats are not being saved ({mode.value})")
        because = self.store.unsaved_because
        self.saving_label.setToolTip(failure or (str(because) if because else ""))
        self.saving_label.setVisible(True)

    def show_data_folder_problem(self, problem: StoreError) -> QMessageBox:
        """The start-up dialog for a data folder that cannot be used; non-blocking, like
        `show_error`, so the engine goes on loading behind it."""
        box = problem_dialog(problem, self.store, self)
        box.open()
        self.data_folder_dialog = box
        return box

    def show_error(self, title: str, message: str) -> QMessageBox:
        """A non-blocking dialog (`open`, not `exec`): the engine keeps streaming."""
        box = QMessageBox(QMessageBox.Icon.Warning, title, message, parent=self)
        box.setStandardButtons(QMessageBox.StandardButton.Ok)
        box.open()
        self.error_dialog = box
        return box

    # -- closing ----------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt override
        if not self._closing:
            self._closing = True
            self.chat_view.save_settings()
            self.save_layout()
            self.controller.save_partials()
            self.model_picker.runner.wait(5000)  # a listing's report would find no picker
            # Shutting down cancels every job; their last events are drained into the
            # controller here, so stopped replies are saved as complete.
            try:
                self.bridge.shutdown(10.0)
            except RuntimeError:
                log.exception("engine shutdown")
        super().closeEvent(event)


def _process_rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - a figure for display only
        return 0
