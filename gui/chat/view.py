"""The chat in the middle of the window: settings of the conversation, its messages,
and the input box.

Streaming text is not pushed into widgets as it arrives: a 100 ms timer asks the
controller which messages moved and re-renders only those, so the UI thread does a
bounded amount of work per tick however many tokens came in.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent, QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from gui.chat.bubble import MessageBubble, bubble_style, notice_bubble
from gui.chat.context import DEFAULT_POLICY, ContextPolicy
from gui.chat.controller import DEFAULT_SAMPLING, ChatController
from gui.chat.gauge import NO_PLAN, REFRESH_MS, REMOTE_NO_PLAN, ContextGauge
from gui.chat.presets import PresetPicker, PresetStore
from gui.elided_label import ElidedLabel
from gui.palette import palette_for
from gui.store import Message, Store, StoreError

RENDER_INTERVAL_MS = 100  # streaming re-render throttle
AT_BOTTOM_PX = 40  # this close to the end counts as reading the newest message


class ChatInput(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt override
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ConversationSettings(QFrame):
    """System prompt and sampling settings of one conversation (collapsible)."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.toggle = QToolButton()
        self.toggle.setCheckable(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.toggle.setText("System prompt and sampling")
        self.toggle.toggled.connect(self._set_open)
        self.summary = ElidedLabel(min_width=40)
        self.summary.setObjectName("hint")
        head = QHBoxLayout()
        head.addWidget(self.toggle)
        head.addWidget(self.summary, 1)
        outer.addLayout(head)

        self.panel = QWidget()
        form = QFormLayout(self.panel)
        form.setContentsMargins(8, 0, 8, 4)
        # In a narrow window a field goes under its label rather than beside it.
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("Instructions the model sees before the chat")
        self.system_prompt.setMaximumHeight(70)
        form.addRow("System prompt", self.system_prompt)
        self._add_preset_row(form)
        self.temperature = _spin(0.0, 2.0, 0.05, 2, "Temperature (0 = greedy)")
        self.top_p = _spin(0.05, 1.0, 0.05, 2, "Top-p (1 = off)")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setToolTip("Top-k (0 = off)")
        self.repetition = _spin(1.0, 2.0, 0.05, 2, "Repetition penalty (1 = off)")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 32768)
        self.max_tokens.setToolTip("Longest reply, in tokens")
        self.seed = QLineEdit()
        self.seed.setPlaceholderText("random")
        self.seed.setMinimumWidth(self.seed.fontMetrics().horizontalAdvance("random") + 24)
        # Two rows of three: one row of six needed 840 px, more than the chat gets in a
        # 1024 px window, and the layout then squeezed the boxes until "0.70" read "0".
        sampling = QWidget()
        grid = QGridLayout(sampling)
        grid.setContentsMargins(0, 0, 0, 0)
        for i, (label, widget) in enumerate((
            ("temp", self.temperature),
            ("top-p", self.top_p),
            ("top-k", self.top_k),
            ("rep.", self.repetition),
            ("max tokens", self.max_tokens),
            ("seed", self.seed),
        )):  # fmt: skip
            row, col = divmod(i, 3)
            grid.addWidget(QLabel(label), row, 2 * col)
            grid.addWidget(widget, row, 2 * col + 1)
        grid.setColumnStretch(6, 1)
        form.addRow("Sampling", sampling)
        self.policy = QComboBox()
        for policy in ContextPolicy:
            self.policy.addItem(policy.label, policy.value)
            self.policy.setItemData(
                self.policy.count() - 1, policy.description, Qt.ItemDataRole.ToolTipRole
            )
        self.policy.setToolTip(
            "What to send once the chat outgrows what the model can hold (the KV cache or "
            "the model's context). The reply budget shrinks first; earlier turns stay in "
            "the chat either way."
        )
        self.policy_hint = QLabel()
        self.policy_hint.setObjectName("hint")
        self.policy_hint.setWordWrap(True)
        form.addRow("Long chats", self.policy)
        form.addRow(self.policy_hint)  # the whole width: a few lines, not a narrow column
        outer.addWidget(self.panel)
        self.panel.setVisible(False)
        for spin in (self.temperature, self.top_p, self.repetition):
            spin.valueChanged.connect(self._emit)
        self.top_k.valueChanged.connect(self._emit)
        self.max_tokens.valueChanged.connect(self._emit)
        self.seed.textChanged.connect(self._emit)
        self.system_prompt.textChanged.connect(self._emit)
        self.policy.currentIndexChanged.connect(self._emit)
        self._loading = False

    def _add_preset_row(self, form: QFormLayout) -> None:
        """The preset picker under the system prompt: picking one fills the prompt (and
        so saves it with the chat); editing the prompt moves the picker to "Custom"."""
        self.presets = PresetPicker(self.system_prompt.toPlainText)
        self.presets.chosen.connect(self.system_prompt.setPlainText)
        self.system_prompt.textChanged.connect(
            lambda: self.presets.show_prompt(self.system_prompt.toPlainText())
        )
        form.addRow("Preset", self.presets)

    def use_presets(self, store: PresetStore) -> None:
        """Keep the user's presets in ``store`` (the app's settings)."""
        self.presets.use_store(store)

    def _set_open(self, open_: bool) -> None:
        self.panel.setVisible(open_)
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if open_ else Qt.ArrowType.RightArrow)

    def _emit(self) -> None:
        self._update_summary()
        if not self._loading:
            self.changed.emit()

    def load(
        self,
        system_prompt: str,
        sampling: dict[str, Any],
        policy: ContextPolicy = DEFAULT_POLICY,
    ) -> None:
        self._loading = True
        try:
            merged = {**DEFAULT_SAMPLING, **sampling}
            self.system_prompt.setPlainText(system_prompt)
            self.temperature.setValue(float(merged["temperature"]))
            self.top_p.setValue(float(merged["top_p"]))
            self.top_k.setValue(int(merged["top_k"]))
            self.repetition.setValue(float(merged["repetition_penalty"]))
            self.max_tokens.setValue(int(merged["max_new_tokens"]))
            self.seed.setText("" if merged["seed"] is None else str(merged["seed"]))
            self.policy.setCurrentIndex(self.policy.findData(policy.value))
        finally:
            self._loading = False
        self._update_summary()

    def values(self) -> tuple[str, dict[str, Any]]:
        seed = self.seed.text().strip()
        return self.system_prompt.toPlainText(), {
            "temperature": self.temperature.value(),
            "top_p": self.top_p.value(),
            "top_k": self.top_k.value(),
            "repetition_penalty": self.repetition.value(),
            "max_new_tokens": self.max_tokens.value(),
            "seed": int(seed) if seed.lstrip("-").isdigit() else None,
        }

    def context_policy(self) -> ContextPolicy:
        return ContextPolicy(self.policy.currentData())

    def _update_summary(self) -> None:
        prompt = " ".join(self.system_prompt.toPlainText().split())
        prompt = (prompt[:60] + "…") if len(prompt) > 60 else prompt
        policy = self.context_policy()
        self.policy_hint.setText(policy.description)
        self.summary.setText(
            f"{prompt or 'no system prompt'} · temp {self.temperature.value():g}"
            f" · max {self.max_tokens.value()} tokens · long chats: {policy.label.lower()}"
        )
        self.summary.setToolTip(self.summary.text())


def _spin(lo: float, hi: float, step: float, decimals: int, tip: str) -> QDoubleSpinBox:
    spin = QDoubleSpinBox()
    spin.setRange(lo, hi)
    spin.setSingleStep(step)
    spin.setDecimals(decimals)
    spin.setToolTip(tip)
    return spin


class ChatView(QWidget):
    """One conversation at a time; `show_conversation(id)` switches."""

    def __init__(self, store: Store, controller: ChatController, parent: QWidget | None = None):
        super().__init__(parent)
        self.store = store
        self.controller = controller
        self.conversation_id: int | None = None
        self.bubbles: dict[int, MessageBubble] = {}
        self.notice: MessageBubble | None = None  # why the last change is not on disk
        # "N earlier messages are outside the model's context", one per left-out run
        self.outside_markers: list[QLabel] = []
        # Keep the newest message in view as content grows; off once the user scrolls
        # up, on again when they scroll back down, open a chat or send.
        self.follow = True
        self._hold: int | None = None  # where a reader who scrolled up stays over a rebuild
        self._pinned_dark: bool | None = None
        self.set_dark(None)
        if QGuiApplication.instance() is not None:
            QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_os_scheme)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        self.title = QLabel()
        font = self.title.font()
        font.setPointSizeF(font.pointSizeF() * 1.2)
        font.setBold(True)
        self.title.setFont(font)
        layout.addWidget(self.title)
        self.settings = ConversationSettings()
        layout.addWidget(self.settings)

        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.messages_widget = QWidget()
        self.messages_widget.setObjectName("messages")
        self.messages_layout = QVBoxLayout(self.messages_widget)
        self.messages_layout.setContentsMargins(4, 4, 4, 4)
        self.messages_layout.setSpacing(8)
        self.messages_layout.addStretch(1)
        # An explicit minimum keeps the layout from setting its own, which adds up each
        # bubble at its narrowest (text wrapped at a few words a line): taller than the
        # bubbles at the real width, so the scroll area would end in blank space and a
        # chat opened at its newest message would show nothing.
        self.messages_widget.setMinimumHeight(1)
        self.scroll.setWidget(self.messages_widget)
        layout.addWidget(self.scroll, 1)
        bar = self.scroll.verticalScrollBar()
        bar.rangeChanged.connect(self._on_scroll_range)
        bar.actionTriggered.connect(self._on_user_scroll)
        self.empty_hint = QLabel("Type a message below. Enter sends, Shift+Enter adds a line.")
        self.empty_hint.setObjectName("hint")
        self.empty_hint.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.messages_layout.insertWidget(0, self.empty_hint)

        self.input = ChatInput()
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter new line, Esc stops)")
        self.input.setMaximumHeight(72)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop generating (Esc)")
        self.sample_n = QSpinBox()
        self.sample_n.setRange(2, 16)
        self.sample_n.setValue(3)
        self.sample_n.setToolTip("How many answers to sample in parallel")
        self.sample_button = QPushButton("Sample ×n")
        self.sample_button.setToolTip(
            "Answer this message n times in parallel; the answers share the prompt's pages"
        )
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        sample_row = QHBoxLayout()
        sample_row.addWidget(self.sample_button)
        sample_row.addWidget(self.sample_n)
        buttons.addLayout(sample_row)
        bottom = QHBoxLayout()
        bottom.addWidget(self.input, 1)
        bottom.addLayout(buttons)
        layout.addLayout(bottom)
        self.gauge = ContextGauge()
        layout.addWidget(self.gauge)

        self.input.submitted.connect(lambda: self.send())
        self.send_button.clicked.connect(lambda: self.send())
        self.stop_button.clicked.connect(self.stop)
        self.sample_button.clicked.connect(lambda: self.send(n=self.sample_n.value()))
        controller.conversation_changed.connect(self._on_conversation_changed)

        self._save_settings_timer = QTimer(self)
        self._save_settings_timer.setSingleShot(True)
        self._save_settings_timer.setInterval(400)
        self._save_settings_timer.timeout.connect(self.save_settings)
        self.settings.changed.connect(self._save_settings_timer.start)
        self._gauge_timer = QTimer(self)
        self._gauge_timer.setSingleShot(True)
        self._gauge_timer.setInterval(REFRESH_MS)
        self._gauge_timer.timeout.connect(self.refresh_gauge)
        self.input.textChanged.connect(self._gauge_timer.start)
        self.settings.changed.connect(self._gauge_timer.start)
        bridge = controller.bridge
        bridge.engine_ready.connect(lambda _info: self._gauge_timer.start())
        bridge.snapshot_ready.connect(self._on_snapshot)
        self._render_timer = QTimer(self)
        self._render_timer.setInterval(RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self.render_streaming)
        self._render_timer.start()
        self.setEnabled(False)

    # -- theme ------------------------------------------------------------------------

    def set_dark(self, dark: bool | None) -> None:
        """Pin the dark (True) or light (False) bubbles; None follows the OS, like the
        memory views."""
        self._pinned_dark = dark
        self.dark = palette_for(dark).dark
        self.setStyleSheet(bubble_style(palette_for(dark)))
        if self.conversation_id is not None:
            self.reload()  # code colours are rendered into the bubbles' text

    def _on_os_scheme(self, *_: Any) -> None:
        if self._pinned_dark is None:
            self.set_dark(None)

    # -- conversation -----------------------------------------------------------------

    def show_conversation(self, conversation_id: int | None) -> None:
        if self._save_settings_timer.isActive():
            self._save_settings_timer.stop()
            self.save_settings()
        self.conversation_id = conversation_id
        self.setEnabled(conversation_id is not None)
        if conversation_id is None:
            self.title.setText("")
            self._clear()
            return
        conv = self.store.conversation(conversation_id)
        self.settings.load(
            conv.system_prompt, conv.sampling, ContextPolicy.parse(conv.context_policy)
        )
        self.follow = True  # a chat opens on its newest message
        self.reload()

    def save_settings(self) -> None:
        self._save_settings_timer.stop()  # saved now: a pending save would only repeat it
        if self.conversation_id is None:
            return
        system_prompt, sampling = self.settings.values()
        policy = self.settings.context_policy().value
        conv = self.store.conversation(self.conversation_id)
        # Unchanged settings are not written: closing the window then touches nothing,
        # which is what lets a read-only chat database close cleanly.
        if (conv.system_prompt, conv.sampling, conv.context_policy) == (
            system_prompt,
            sampling,
            policy,
        ):
            return
        try:
            self.store.update_conversation(
                self.conversation_id,
                system_prompt=system_prompt,
                sampling=sampling,
                context_policy=policy,
            )
        except StoreError as exc:
            self.controller.report_store_error(self.conversation_id, exc)

    def _clear(self) -> None:
        # Hidden and out of the layout now; deleted when control returns to the loop.
        shown = list(self.bubbles.values())
        if self.notice is not None:
            shown.append(self.notice)
        for widget in [*shown, *self.outside_markers]:
            self.messages_layout.removeWidget(widget)
            widget.hide()
            widget.deleteLater()
        self.bubbles = {}
        self.notice = None
        self.outside_markers = []

    def reload(self) -> None:
        """Rebuild the bubbles from the store (structure changed: new message, new
        version, a reply finished)."""
        if self.conversation_id is None:
            return
        cid = self.conversation_id
        self.title.setText(self.store.conversation(cid).title)
        self._hold = None if self.follow else self.scroll.verticalScrollBar().value()
        self._clear()
        path = self.store.transcript(cid)
        self.empty_hint.setVisible(not path)
        outside = left_out(path)
        for i, stored in enumerate(path):
            if stored.id not in outside and i and path[i - 1].id in outside:
                self._add_outside_marker(path, i, outside)
            msg = self.controller.shown(stored)
            versions = [m.id for m in self.store.siblings(msg)]
            bubble = MessageBubble(msg.id, msg.role, versions, dark=self.dark)
            bubble.edit_submitted.connect(self._edit)
            bubble.regenerate_requested.connect(self._regenerate)
            bubble.version_requested.connect(self.controller.switch_version)
            live = self.controller.live_text(msg.id)
            if msg.error:
                bubble.set_error(msg.error)
            else:
                bubble.set_text(live if live is not None else msg.content)
            bubble.set_figures(msg.stats)
            status = self.controller.status(msg.id)
            if status:
                bubble.set_status(status)
            elif not msg.complete:
                bubble.set_status("interrupted")
            if msg.id in outside:
                bubble.setProperty("outside", True)
                bubble.setToolTip("Outside the model's context: the latest reply did not see it")
            self.messages_layout.insertWidget(self.messages_layout.count() - 1, bubble)
            self.bubbles[msg.id] = bubble
        failure = self.controller.failures.get(cid)
        if failure is not None:
            self.notice = notice_bubble(failure.message)
            self.messages_layout.insertWidget(self.messages_layout.count() - 1, self.notice)
            self.empty_hint.setVisible(False)
        # What the user typed and the store refused goes back where they typed it.
        unsent = self.controller.take_unsent(cid)
        if unsent and not self.input.toPlainText().strip():
            self.input.setPlainText(unsent)
        self._update_buttons()
        self._gauge_timer.start()
        if self.follow:
            self._scroll_to_bottom()  # the range may not move (a reply's status changed)

    def _add_outside_marker(self, path: list[Message], end: int, outside: set[int]) -> None:
        """Below a run of left-out messages (ending before `end`), how many they are."""
        start = end
        while start > 0 and path[start - 1].id in outside:
            start -= 1
        n = end - start
        marker = QLabel(
            f"↑ {n} earlier message{'s are' if n != 1 else ' is'} outside the model's context"
        )
        marker.setObjectName("outside")
        marker.setAlignment(Qt.AlignmentFlag.AlignCenter)
        marker.setToolTip(
            "The latest reply was written without them, so the chat fits what the model "
            "can hold (this chat's context policy, under System prompt and sampling). "
            "They stay in the chat."
        )
        self.messages_layout.insertWidget(self.messages_layout.count() - 1, marker)
        self.outside_markers.append(marker)

    def _on_conversation_changed(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id:
            self.reload()

    # -- streaming --------------------------------------------------------------------

    def render_streaming(self) -> None:
        if self.conversation_id is None:
            return
        changed = self.controller.take_changed(self.conversation_id)
        if not changed:
            return
        for mid in changed:
            bubble = self.bubbles.get(mid)
            live = self.controller.live_text(mid)
            if bubble is None or live is None:
                continue
            bubble.set_text(live)
            bubble.set_status(self.controller.status(mid))
        self._update_buttons()

    # -- scrolling ----------------------------------------------------------------------

    def _on_scroll_range(self, _minimum: int, maximum: int) -> None:
        """The messages grew or shrank: stay on the newest one while following, else
        where the reader was (the bubbles' heights settle over a few layout passes after
        a rebuild, and a shorter pass would move them)."""
        bar = self.scroll.verticalScrollBar()
        if self.follow:
            bar.setValue(maximum)
        elif self._hold is not None:
            bar.setValue(self._hold)
            if maximum >= self._hold:
                self._hold = None

    def _on_user_scroll(self, _action: int) -> None:
        """The wheel, a drag, a key: only the user's own scrolling stops (or resumes)
        following, never a range that moved under them. `sliderPosition` is where this
        action is taking the bar."""
        bar = self.scroll.verticalScrollBar()
        self.follow = bar.sliderPosition() >= bar.maximum() - AT_BOTTOM_PX
        self._hold = None

    def _scroll_to_bottom(self) -> None:
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())

    # -- the context gauge ------------------------------------------------------------

    def refresh_gauge(self) -> None:
        """Count the next send (the chat under its policy, plus what is typed). Not
        while hidden: a closed window has closed its store too; showing counts again."""
        self._gauge_timer.stop()
        if not self.isVisible():
            return
        if self.conversation_id is None:
            self.gauge.show_plan(None)
            return
        plan = self.controller.preview(self.conversation_id, self.input.toPlainText())
        remote = self.controller.bridge.remote
        self.gauge.show_plan(plan, self.gauge.free_tokens, REMOTE_NO_PLAN if remote else NO_PLAN)

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 - Qt override
        super().showEvent(event)
        self._gauge_timer.start()

    def _on_snapshot(self, snapshot: Any) -> None:
        """The room the cache has now, for the gauge; not while this chat's own reply
        holds it (which is over before the next send)."""
        cid = self.conversation_id
        if cid is not None and self.controller.is_generating(cid):
            self.gauge.set_free_tokens(None)
            return
        stats = snapshot.stats
        self.gauge.set_free_tokens((stats.pages_free + stats.pages_cached) * snapshot.page_size)

    def _update_buttons(self) -> None:
        busy = self.conversation_id is not None and self.controller.is_generating(
            self.conversation_id
        )
        self.stop_button.setEnabled(busy)

    # -- actions ----------------------------------------------------------------------

    def send(self, n: int = 1) -> int | None:
        if self.conversation_id is None:
            return None
        text = self.input.toPlainText()
        if not text.strip():
            return None
        if self._save_settings_timer.isActive():
            self._save_settings_timer.stop()
            self.save_settings()
        self.input.clear()
        self.follow = True  # the new message and its reply come into view
        return self.controller.send(self.conversation_id, text, n=n)

    def stop(self) -> None:
        if self.conversation_id is not None:
            self.controller.stop(self.conversation_id)

    def _edit(self, message_id: int, text: str) -> None:
        self.controller.edit(message_id, text)

    def _regenerate(self, message_id: int) -> None:
        self.controller.regenerate(message_id)


def left_out(path: list[Message]) -> set[int]:
    """Messages of `path` the latest job on it left out of the context (its policy's
    doing), as that job's reply recorded them."""
    for message in reversed(path):
        context = message.stats.get("context")
        if context:
            return set(context.get("dropped", ()))
    return set()
