"""The Models window (File ▸ Models…): find, download and manage quantized models.

Three tabs over engine.hub: Discover (search the Hub, fit each file to the KV cache
the user chose), Downloads (the DownloadManager's jobs) and My models (what is on
disk). Non-modal and kept alive by the main window, so downloads carry on while it
is closed; the manager stops when the application quits (partial files stay and are
resumed next time the window opens).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QCoreApplication, Signal
from PySide6.QtGui import QCloseEvent, QShowEvent
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.cache.kv_cache import CacheSettings
from engine.hub.downloads import DownloadManager
from engine.hub.remote import DEFAULT_ENDPOINT, hub_endpoint
from engine.hub.token import load_token, save_token
from gui.models.common import message_label, set_message
from gui.models.discover import DiscoverTab
from gui.models.downloads import DownloadsTab
from gui.models.library import LibraryTab

DISCOVER, DOWNLOADS, MY_MODELS = range(3)


class ModelManager(QDialog):
    # Path of a model the user asked to load; the main window loads it.
    load_requested = Signal(object)

    def __init__(
        self,
        bridge=None,  # gui.bridge.EngineBridge; optional so tests need no engine
        cache_settings: Callable[[], CacheSettings] | None = None,
        parent: QWidget | None = None,
        manager: DownloadManager | None = None,
        device: Callable[[], str] | None = None,
    ):
        """``device``: where a model would run, for the fit labels (default: the CPU)."""
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.setModal(False)
        self.setSizeGripEnabled(True)
        self.bridge = bridge
        if cache_settings is None:
            # The running engine's cache; before any load, the engine's defaults.
            def cache_settings() -> CacheSettings:
                return bridge.cache_settings if bridge is not None else CacheSettings()

        # progress_interval_s: ~5 updates a second is smooth and keeps the UI thread idle.
        self.manager = manager or DownloadManager(progress_interval_s=0.2)
        self._pending_load: Path | None = None
        self._shut_down = False

        self.discover = DiscoverTab(cache_settings, device=device)
        self.downloads = DownloadsTab(self.manager)
        self.library = LibraryTab(
            self._loaded_path, prompt_cache_dir=lambda: cache_settings().disk_dir
        )
        self.tabs = QTabWidget()
        self.tabs.addTab(self.discover, "Discover")
        self.tabs.addTab(self.downloads, "Downloads")
        self.tabs.addTab(self.library, "My models")

        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(self._token_row())

        self.discover.download_requested.connect(self.downloads.enqueue)
        self.downloads.completed.connect(lambda _: self.library.refresh())
        self.downloads.active_changed.connect(self._name_downloads_tab)
        self.library.load_requested.connect(self._request_load)
        self.tabs.currentChanged.connect(self._on_tab)
        if bridge is not None:
            bridge.engine_ready.connect(self._on_engine_ready)
            bridge.engine_failed.connect(lambda _: setattr(self, "_pending_load", None))
        app = QCoreApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.shutdown)
        self.resize(980, 660)

    def _token_row(self) -> QWidget:
        row = QWidget()
        outer = QVBoxLayout(row)
        outer.setContentsMargins(0, 4, 0, 0)
        line = QHBoxLayout()
        line.addWidget(QLabel("Hugging Face token"))
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setPlaceholderText(
            "a token is stored (type a new one to replace it)"
            if load_token()
            else "hf_… (needed only for gated or private models)"
        )
        self.token_button = QPushButton("Save token")
        self.token_button.setAutoDefault(False)
        line.addWidget(self.token, 1)
        line.addWidget(self.token_button)
        endpoint = hub_endpoint()
        if endpoint != DEFAULT_ENDPOINT:  # HF_ENDPOINT: a mirror (or the tests' fake Hub)
            line.addWidget(QLabel(f"Hub: {endpoint}"))
        outer.addLayout(line)
        self.token_message = message_label()
        outer.addWidget(self.token_message)
        self.token.returnPressed.connect(self.save_token)
        self.token_button.clicked.connect(self.save_token)
        return row

    # -- token ------------------------------------------------------------------------

    def save_token(self) -> None:
        try:
            saved = save_token(self.token.text())
        except (ValueError, OSError) as exc:
            set_message(self.token_message, f"Token not saved: {exc}", "error")
            return
        self.token.clear()
        self.token.setPlaceholderText("a token is stored (type a new one to replace it)")
        where = "the system keyring" if saved.where == "keyring" else saved.where
        text = f"Token stored in {where}."
        if saved.warning:
            set_message(self.token_message, f"{text} Warning: {saved.warning}.", "warning")
        else:
            set_message(self.token_message, text)

    # -- loading ----------------------------------------------------------------------

    def _loaded_path(self) -> Path | None:
        info = getattr(self.bridge, "model_info", None)
        return info.path if info is not None else None

    def _request_load(self, path: Path) -> None:
        self._pending_load = Path(path)
        self.load_requested.emit(Path(path))

    def _on_engine_ready(self, info) -> None:
        # "Last used" is the bridge's to record: every model file it loads counts.
        if self._pending_load is not None and Path(info.path) == self._pending_load:
            set_message(self.library.message, f"{info.name} is loaded.")
        self._pending_load = None
        if self.isVisible():
            self.library.refresh()

    # -- window -----------------------------------------------------------------------

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 - Qt override
        super().showEvent(event)
        self.downloads.resume_pending()
        self._on_tab(self.tabs.currentIndex())

    def _on_tab(self, index: int) -> None:
        if index == MY_MODELS:
            self.library.refresh()
        elif index == DISCOVER:
            self.discover.refresh_fits()  # the cache settings may have changed meanwhile

    def _name_downloads_tab(self, active: int) -> None:
        self.tabs.setTabText(DOWNLOADS, f"Downloads ({active})" if active else "Downloads")

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt override
        # Only hidden: the main window keeps this instance, downloads go on.
        event.accept()
        self.hide()

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop downloads (partial files stay) and wait for pending Hub calls."""
        if self._shut_down:
            return
        self._shut_down = True
        self.downloads.shutdown()
        self.manager.close(timeout)
        for runner in (self.discover.runner, self.library.runner):
            runner.wait(int(timeout * 1000))
