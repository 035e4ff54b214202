"""File > Local server: the OpenAI-compatible server on the app's own engine.

`LocalServerSettings` is what the user picks (on or off, address, port, key) and how
it is stored; `ServerDialog` edits it and shows what runs. The dialog never starts
anything itself: it asks (`apply_requested`) and the window saves the settings and
tells the bridge, whose `server_changed` / `server_failed` the dialog then shows. It is
modeless, so it can stay open beside the chats while the server runs.
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.server.settings import DEFAULT_HOST, DEFAULT_PORT, ServerSettings, is_loopback
from gui.bridge import EngineBridge, ServerInfo

ALL_NETWORKS = "0.0.0.0"
HOSTS = (
    (DEFAULT_HOST, "this computer only"),
    (ALL_NETWORKS, "every network (other computers too)"),
)
WARNING_COLOR = "#a15c00"  # the settings dialog's note colour
ERROR_COLOR = "#B3261E"
RUNNING_COLOR = "#1A7F37"


@dataclass(frozen=True)
class LocalServerSettings:
    """The local server as the user set it up; stored as JSON in the app's QSettings."""

    enabled: bool = False
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str = ""  # "" : no key

    @property
    def exposed(self) -> bool:
        """Reachable from other computers with no key: anyone there can use the model."""
        return not is_loopback(self.host) and not self.api_key

    def server_settings(self) -> ServerSettings:
        return ServerSettings(host=self.host, port=self.port, api_key=self.api_key or None)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> LocalServerSettings:
        """Unknown keys are dropped and bad values fall back to defaults, so a hand-edited
        settings file never stops the app from starting."""
        if not isinstance(data, dict):
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            s = cls(**{k: v for k, v in data.items() if k in known})
            if not (isinstance(s.enabled, bool) and isinstance(s.port, int) and s.port > 0):
                return cls()
            s.server_settings().validate()
            return s
        except (TypeError, ValueError):
            return cls()


def base_url(host: str, port: int) -> str:
    """The URL OpenAI clients on this computer use. A server on every network (0.0.0.0)
    is reached here through the loopback address: 0.0.0.0 is not somewhere to connect."""
    if host in (ALL_NETWORKS, "::", ""):
        host = DEFAULT_HOST
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def lan_address() -> str | None:
    """This computer's address on its network, for clients elsewhere. Connecting a UDP
    socket sends nothing; it only asks the OS which interface would route there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def new_api_key() -> str:
    return secrets.token_urlsafe(24)


class ServerDialog(QDialog):
    """On/off, address, port, key; the URL and model id to give a client; what runs.

    Signals: `apply_requested(LocalServerSettings)` when the user switches the server
    on or off or applies new settings while it runs."""

    apply_requested = Signal(object)

    def __init__(
        self, bridge: EngineBridge, current: LocalServerSettings, parent: QWidget | None = None
    ):
        super().__init__(parent)
        self.setWindowTitle("Local server")
        self.bridge = bridge
        self.current = current
        self._error = ""
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)

        intro = QLabel(
            "Serves the loaded model to other programs through the OpenAI API, on the "
            "same engine as your chats: requests share their prefix cache and show in "
            "the Memory views as <b>API</b>."
        )
        intro.setWordWrap(True)
        self.enabled = QCheckBox("Run the local server")
        font = self.enabled.font()
        font.setBold(True)
        self.enabled.setFont(font)

        self.host = QComboBox()
        self.host.setEditable(True)
        for host, words in HOSTS:
            self.host.addItem(f"{host} — {words}", host)
        self.host.setToolTip(
            "127.0.0.1: only programs on this computer can connect.\n"
            "0.0.0.0: other computers on your networks can too (give a key)."
        )
        self.port = QSpinBox()
        # No "any free port" (0): a port that moved at every model switch would break
        # the clients set up for it.
        self.port.setRange(1, 65535)
        self.port.setToolTip("Clients connect to this port; 8080 unless another program uses it")
        self.key = QLineEdit()
        self.key.setFont(mono)
        self.key.setPlaceholderText("none: no key asked for")
        self.key.setClearButtonEnabled(True)
        self.key.setToolTip("Clients send it as the header Authorization: Bearer <key>")
        self.generate = QPushButton("Generate")
        self.generate.setToolTip("A new random key (you then give it to your clients)")
        self.copy_key = QPushButton("Copy")
        key_row = QHBoxLayout()
        key_row.addWidget(self.key, 1)
        key_row.addWidget(self.generate)
        key_row.addWidget(self.copy_key)
        self.warning = QLabel(
            "⚠ Without a key, anyone who can reach this computer can use the model. "
            "Generate a key, or serve on 127.0.0.1."
        )
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet(f"color: {WARNING_COLOR};")

        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.url.setFont(mono)
        self.copy_url = QPushButton("Copy")
        self.copy_url.setToolTip("Copy the base URL for an OpenAI client")
        url_row = QHBoxLayout()
        url_row.addWidget(self.url, 1)
        url_row.addWidget(self.copy_url)
        self.usage = QLabel()
        self.usage.setWordWrap(True)
        self.usage.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.usage.setTextFormat(Qt.TextFormat.RichText)

        form = QFormLayout()
        form.addRow("Address", self.host)
        form.addRow("Port", self.port)
        form.addRow("API key", key_row)
        form.addRow("", self.warning)
        form.addRow("Base URL", url_row)

        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        self.apply_button = self.buttons.addButton("Apply", QDialogButtonBox.ButtonRole.ApplyRole)
        self.apply_button.setToolTip("Restart the server with these settings")
        self.buttons.rejected.connect(self.close)
        self.apply_button.clicked.connect(self._apply)

        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addWidget(self.enabled)
        layout.addLayout(form)
        layout.addWidget(self.usage)
        layout.addWidget(self.status)
        layout.addWidget(self.buttons)
        self.url.setMinimumWidth(320)  # the width the wrapped lines take their height at

        self.set_values(current)
        self.enabled.toggled.connect(self._on_switch)
        self.host.currentTextChanged.connect(self._refresh)
        self.port.valueChanged.connect(self._refresh)
        self.key.textChanged.connect(self._refresh)
        self.generate.clicked.connect(lambda: self.key.setText(new_api_key()))
        self.copy_key.clicked.connect(lambda: self._copy(self.key.text(), self.copy_key))
        self.copy_url.clicked.connect(lambda: self._copy(self.url.text(), self.copy_url))
        bridge.server_changed.connect(self._on_server_changed)
        bridge.server_failed.connect(self.show_error)
        bridge.engine_ready.connect(lambda _info: self._refresh())
        self._refresh()

    # -- values -----------------------------------------------------------------------

    def set_values(self, s: LocalServerSettings) -> None:
        self.enabled.blockSignals(True)
        self.enabled.setChecked(s.enabled)
        self.enabled.blockSignals(False)
        index = self.host.findData(s.host)
        if index >= 0:
            self.host.setCurrentIndex(index)
        else:
            self.host.setEditText(s.host)
        self.port.setValue(s.port)
        self.key.setText(s.api_key)

    def values(self) -> LocalServerSettings:
        return LocalServerSettings(
            enabled=self.enabled.isChecked(),
            host=self._host(),
            port=self.port.value(),
            api_key=self.key.text().strip(),
        )

    def _host(self) -> str:
        text = self.host.currentText().strip()
        index = self.host.findText(text)
        if index >= 0:
            return str(self.host.itemData(index))
        return text.split(" ", 1)[0] or DEFAULT_HOST  # a typed address, words dropped

    def settings_differ(self) -> bool:
        """The fields say something else than the server runs with."""
        running = self.bridge.server
        values = self.values()
        if running is None:
            return False
        return values.server_settings() != running.settings

    # -- actions ----------------------------------------------------------------------

    def _on_switch(self, on: bool) -> None:
        self._error = ""
        self._request(self.values())

    def _apply(self) -> None:
        self._error = ""
        self._request(dataclasses.replace(self.values(), enabled=True))

    def _request(self, values: LocalServerSettings) -> None:
        try:
            values.server_settings().validate()
        except ValueError as exc:
            self.show_error(str(exc))
            return
        self.current = values
        self.apply_requested.emit(values)
        self._refresh()

    def _copy(self, text: str, button: QPushButton) -> None:
        if not text:
            return
        QGuiApplication.clipboard().setText(text)
        button.setText("Copied")
        # With the button as context: no call once the dialog is gone.
        QTimer.singleShot(1500, button, lambda: button.setText("Copy"))

    # -- what runs --------------------------------------------------------------------

    def show_error(self, message: str) -> None:
        self._error = message
        self.enabled.blockSignals(True)
        self.enabled.setChecked(False)
        self.enabled.blockSignals(False)
        self._refresh()

    def _on_server_changed(self, _info: ServerInfo | None) -> None:
        self._refresh()

    def _refresh(self, *_: Any) -> None:
        values = self.values()
        info = self.bridge.server
        wanted = self.bridge.server_settings is not None
        self.warning.setVisible(values.exposed)
        port = info.port if info is not None else values.port
        host = info.settings.host if info is not None else values.host
        self.url.setText(base_url(host, port))
        self.copy_key.setEnabled(bool(values.api_key))
        self.apply_button.setVisible(info is not None)
        self.apply_button.setEnabled(self.settings_differ())
        self.usage.setText(self._usage(values, info, host, port))
        if self._error:
            self._set_status(self._error, ERROR_COLOR)
        elif info is not None:
            note = " · Apply to restart with the changes" if self.settings_differ() else ""
            self._set_status(f"● Running at {info.base_url}{note}", RUNNING_COLOR)
        elif wanted and self.bridge.engine is None:
            self._set_status("Starts as soon as a model is loaded.", None)
        elif wanted:
            self._set_status("Starting…", None)
        else:
            self._set_status("Off.", None)

    def _set_status(self, text: str, color: str | None) -> None:
        self.status.setText(text)
        self.status.setStyleSheet(f"color: {color}; font-weight: 600;" if color else "")
        # The warning and the status come and go and wrap: the dialog grows to fit them
        # rather than squeezing the fields.
        if self.isVisible():
            self.adjustSize()

    def _usage(
        self, values: LocalServerSettings, info: ServerInfo | None, host: str, port: int
    ) -> str:
        if info is not None:
            model = info.model_id
        elif self.bridge.loaded is not None:
            model = self.bridge.loaded.name
        else:
            model = "the loaded model's name"
        key = "the key above" if values.api_key else "any text: the server asks for none"
        rows = [
            ("base_url", "the URL above"),
            ("api_key", key),
            ("model", f"<code>{_escape(model)}</code> (GET /v1/models lists it)"),
        ]
        if not is_loopback(host):
            lan = lan_address()
            where = f"<code>http://{lan}:{port}/v1</code>" if lan else "this computer's address"
            rows.append(("elsewhere", f"other computers use {where}"))
        cells = "".join(
            f"<tr><td style='padding-right:8px'><code>{name}</code></td><td>{what}</td></tr>"
            for name, what in rows
        )
        return f"In an OpenAI client:<table style='margin-left:8px'>{cells}</table>"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
