"""One message on screen: its text (Markdown, code blocks with a copy button), its
figures, its version switcher and its actions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.units import format_bytes
from gui.chat.markdown import Segment, Theme, highlight, prose_html, split_segments
from gui.palette import DARK, LIGHT, Palette

FOLD_CHARS = 1200  # longer user messages are shown folded


@dataclass(frozen=True)
class BubbleColors:
    """The chat's colours for one theme; the text colours come from the memory views'
    `Palette`, so the two halves of the window read as one."""

    user: str
    user_border: str
    assistant: str
    assistant_border: str
    error: str
    error_border: str
    code: str
    code_border: str
    status: str
    link: str
    disabled: str


LIGHT_BUBBLES = BubbleColors(
    user="#E8F0FE", user_border="#C6D6F5", assistant="#FFFFFF", assistant_border="#DCDCDC",
    error="#FDECEA", error_border="#F1B0AA", code="#F6F8FA", code_border="#D8DEE4",
    status="#A15C00", link="#1A5FB4", disabled="#AAAAAA",
)  # fmt: skip
DARK_BUBBLES = BubbleColors(
    user="#22304A", user_border="#34496B", assistant="#26282C", assistant_border="#3A3D43",
    error="#45221F", error_border="#7A3A33", code="#1B1D21", code_border="#3A3D43",
    status="#E8A33D", link="#7FB2FF", disabled="#6B6F76",
)  # fmt: skip


def bubble_style(pal: Palette) -> str:
    """The chat's style sheet for ``pal``'s theme (light or dark)."""
    c = DARK_BUBBLES if pal.dark else LIGHT_BUBBLES
    return f"""
QWidget#messages {{ background: {pal.background}; }}
QFrame#bubble_user {{ background: {c.user}; border: 1px solid {c.user_border};
    border-radius: 8px; }}
QFrame#bubble_assistant {{ background: {c.assistant}; border: 1px solid {c.assistant_border};
    border-radius: 8px; }}
QFrame#bubble_error {{ background: {c.error}; border: 1px solid {c.error_border};
    border-radius: 8px; }}
QFrame#code {{ background: {c.code}; border: 1px solid {c.code_border}; border-radius: 4px; }}
QFrame#bubble_user QLabel, QFrame#bubble_assistant QLabel, QFrame#bubble_error QLabel,
QFrame#code QLabel {{ color: {pal.foreground}; }}
QLabel#role {{ font-weight: 600; color: {pal.foreground}; }}
QLabel#figures, QLabel#language, QLabel#hint {{ color: {pal.muted_text}; }}
QLabel#status {{ color: {c.status}; }}
QToolButton, QPushButton#flat {{ border: none; color: {c.link}; padding: 1px 4px; }}
QToolButton:hover, QPushButton#flat:hover {{ text-decoration: underline; }}
QToolButton:disabled {{ color: {c.disabled}; }}
QLabel#gauge {{ color: {pal.muted_text}; }}
QLabel#gauge[level="warn"] {{ color: {c.status}; }}
QLabel#gauge[level="blocked"] {{ color: {c.status}; font-weight: 600; }}
QLabel#outside {{ color: {pal.muted_text}; font-style: italic; }}
QFrame#bubble_user[outside="true"] QLabel, QFrame#bubble_assistant[outside="true"] QLabel {{
    color: {pal.muted_text}; }}
"""


BUBBLE_STYLE = bubble_style(LIGHT)  # the light theme's, for callers that want it fixed


def render_theme(dark: bool) -> Theme:
    """What rendered replies need of the theme: code, table and link colours."""
    pal, c = (DARK, DARK_BUBBLES) if dark else (LIGHT, LIGHT_BUBBLES)
    return Theme(dark, pal.foreground, c.code, c.code_border, c.link)


def format_figures(stats: dict[str, Any]) -> str:
    """'27 prompt · 19 cached · 30 new · prefill 0.36 s (22 tok/s) · decode 18 tok/s'; a
    reply whose context came back from the disk tier says so: '2,100 cached (63 pages from
    disk: 92.9 MB in 0.08 s)'."""
    if "prompt_tokens" not in stats:  # none yet (a reply still streaming keeps only
        return ""  # what its context left out): zeros would read as measured
    cached = f"{stats.get('cached_tokens', 0)} cached"
    if stats.get("disk_pages"):
        cached += (
            f" ({stats['disk_pages']} pages from disk: {format_bytes(stats.get('disk_bytes', 0))}"
            f" in {stats.get('disk_seconds', 0.0):.2f} s)"
        )
    parts = [f"{stats.get('prompt_tokens', 0)} prompt", cached, f"{stats.get('new_tokens', 0)} new"]
    if stats.get("time_prefill"):
        parts.append(
            f"prefill {stats['time_prefill']:.2f} s ({stats.get('prefill_tps', 0):.0f} tok/s)"
        )
    if stats.get("decode_tps"):
        parts.append(f"decode {stats['decode_tps']:.1f} tok/s")
    reason = stats.get("eos_reason", "")
    if reason in ("cancelled", "max_new_tokens"):
        parts.append("stopped" if reason == "cancelled" else "length limit")
    return " · ".join(parts)


class CodeBlock(QFrame):
    """A fenced code block: highlighted monospace text and a copy button that copies
    the plain code."""

    def __init__(self, segment: Segment, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.theme = theme
        self.segment = segment
        self.setObjectName("code")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 2, 6, 6)
        layout.setSpacing(2)
        head = QHBoxLayout()
        self.language = QLabel(segment.language or "code")
        self.language.setObjectName("language")
        self.copy_button = QToolButton()
        self.copy_button.setText("Copy")
        self.copy_button.setToolTip("Copy this code block to the clipboard")
        self.copy_button.clicked.connect(self.copy)
        head.addWidget(self.language)
        head.addStretch(1)
        head.addWidget(self.copy_button)
        layout.addLayout(head)
        self.code = QLabel()
        self.code.setTextFormat(Qt.TextFormat.RichText)
        self.code.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.code.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.code.setWordWrap(True)
        layout.addWidget(self.code)
        self.set_segment(segment)

    def set_segment(self, segment: Segment) -> None:
        self.segment = segment
        shown = highlight(segment.text, segment.language, self.theme, segment.closed)
        self.language.setText(shown.language or "code")
        self.language.setToolTip("Language guessed from the code" if shown.guessed else "")
        self.code.setText(shown.html)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.segment.text)
        self.copy_button.setText("Copied")


def _prose_label() -> QLabel:
    label = QLabel()
    label.setTextFormat(Qt.TextFormat.RichText)
    label.setWordWrap(True)
    label.setOpenExternalLinks(True)
    label.setTextInteractionFlags(
        Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.LinksAccessibleByMouse
    )
    label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
    return label


class MessageBubble(QFrame):
    """Shows one stored message (or one still streaming)."""

    edit_submitted = Signal(int, str)  # (message id, new text)
    regenerate_requested = Signal(int)  # message id of the assistant reply
    version_requested = Signal(int)  # the sibling to switch to

    def __init__(
        self,
        message_id: int,
        role: str,
        versions: list[int],
        parent: QWidget | None = None,
        dark: bool = False,
    ):
        super().__init__(parent)
        self.theme = render_theme(dark)
        self.message_id = message_id
        self.role = role
        self.versions = versions
        self._segments: list[Segment] = []
        self._segment_widgets: list[QWidget] = []
        self.text = ""
        self.setObjectName(f"bubble_{role}")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(10, 6, 10, 6)
        outer.setSpacing(4)

        head = QHBoxLayout()
        self.role_label = QLabel("You" if role == "user" else "Assistant")
        self.role_label.setObjectName("role")
        head.addWidget(self.role_label)
        # Wraps: why a reply waits takes a sentence, and a one-line label that long
        # would hold the whole chat wider than the window.
        self.status = QLabel()
        self.status.setObjectName("status")
        self.status.setWordWrap(True)
        head.addWidget(self.status, 1)
        self.prev_button = QToolButton()
        self.prev_button.setText("‹")
        self.prev_button.setToolTip("Previous version")
        self.version_label = QLabel()
        self.next_button = QToolButton()
        self.next_button.setText("›")
        self.next_button.setToolTip("Next version")
        for w in (self.prev_button, self.version_label, self.next_button):
            head.addWidget(w)
        self.prev_button.clicked.connect(lambda: self._step_version(-1))
        self.next_button.clicked.connect(lambda: self._step_version(+1))
        outer.addLayout(head)

        self.body = QVBoxLayout()
        self.body.setSpacing(4)
        outer.addLayout(self.body)

        # Created on the first edit: a text editor per bubble would make rebuilding a
        # long chat (after each reply) several times slower.
        self.editor: QPlainTextEdit | None = None
        self._outer = outer

        foot = QHBoxLayout()
        self.figures = QLabel()
        self.figures.setObjectName("figures")
        small = QFont(self.figures.font())
        small.setPointSizeF(max(7.0, small.pointSizeF() * 0.88))
        self.figures.setFont(small)
        # Wrapped: a long figures line (disk restores, a cut reply) must not make the
        # whole chat wider than its pane.
        self.figures.setWordWrap(True)
        foot.addWidget(self.figures, 1)
        self.action_buttons: dict[str, QToolButton] = {}
        actions = ["edit"] if role == "user" else ["copy", "regenerate"]
        for name in actions:
            button = QToolButton()
            button.setText(name.capitalize())
            self.action_buttons[name] = button
            foot.addWidget(button)
        if "edit" in self.action_buttons:
            self.action_buttons["edit"].clicked.connect(self.start_edit)
        if "regenerate" in self.action_buttons:
            self.action_buttons["regenerate"].clicked.connect(
                lambda: self.regenerate_requested.emit(self.message_id)
            )
            self.action_buttons["regenerate"].setToolTip("Answer this prompt again (a new version)")
        if "copy" in self.action_buttons:
            self.action_buttons["copy"].clicked.connect(
                lambda: QGuiApplication.clipboard().setText(self.text)
            )
        self._expanded = False
        self.expand_button = QToolButton()
        self.expand_button.setText("Show all")
        self.expand_button.setVisible(False)
        self.expand_button.clicked.connect(self._expand)
        foot.insertWidget(1, self.expand_button)
        self.save_button = QPushButton("Save && send")
        self.cancel_button = QPushButton("Cancel")
        self.save_button.clicked.connect(self._finish_edit)
        self.cancel_button.clicked.connect(self.cancel_edit)
        for b in (self.save_button, self.cancel_button):
            b.setVisible(False)
            foot.addWidget(b)
        outer.addLayout(foot)
        self._update_versions()

    # -- content ----------------------------------------------------------------------

    def set_text(self, text: str) -> None:
        """Re-render the Markdown. Widgets of the leading segments whose kind is unchanged
        are kept and only changed segments re-rendered, so a streaming reply updates
        one label per tick, and a block that starts adds one widget."""
        if text == self.text and self._segment_widgets:
            return
        self.text = text
        if self.role == "user":
            segments = [Segment("text", self._user_text(text))]
        else:
            segments = split_segments(text)
        keep = 0
        while keep < min(len(segments), len(self._segments)) and (
            segments[keep].kind == self._segments[keep].kind
        ):
            keep += 1
        for w in self._segment_widgets[keep:]:
            self.body.removeWidget(w)
            w.hide()
            w.deleteLater()
        del self._segment_widgets[keep:]
        for i, seg in enumerate(segments):
            if i >= keep:
                widget = CodeBlock(seg, self.theme) if seg.kind == "code" else _prose_label()
                self.body.addWidget(widget)
                self._segment_widgets.append(widget)
                if seg.kind == "code":
                    continue  # rendered by its constructor
            elif self._segments[i] == seg:
                continue
            self._render(seg, self._segment_widgets[i])
        self._segments = segments

    def _render(self, segment: Segment, widget: QWidget) -> None:
        if isinstance(widget, CodeBlock):
            widget.set_segment(segment)
        elif isinstance(widget, QLabel):
            if self.role == "user":
                widget.setTextFormat(Qt.TextFormat.PlainText)
                widget.setText(segment.text)
            else:
                widget.setText(prose_html(segment.text, self.theme))

    def _user_text(self, text: str) -> str:
        """A pasted wall of text is shown folded; 'Show all' unfolds it."""
        self.expand_button.setVisible(len(text) > FOLD_CHARS and not self._expanded)
        if len(text) <= FOLD_CHARS or self._expanded:
            return text
        return f"{text[:FOLD_CHARS].rstrip()} … ({len(text) - FOLD_CHARS:,} more characters)"

    def _expand(self) -> None:
        self._expanded = True
        text, self.text = self.text, ""
        self.set_text(text)

    def set_error(self, message: str, title: str = "Error") -> None:
        self.setObjectName("bubble_error")
        self.role_label.setText(title)
        self.setStyleSheet(self.styleSheet())  # re-polish with the new object name
        self.style().unpolish(self)
        self.style().polish(self)
        for seg_widget in self._segment_widgets:
            self.body.removeWidget(seg_widget)
            seg_widget.hide()
            seg_widget.deleteLater()
        self._segment_widgets, self._segments = [], []
        label = _prose_label()
        label.setTextFormat(Qt.TextFormat.PlainText)
        label.setText(message)
        self.body.addWidget(label)
        self._segment_widgets.append(label)
        for button in self.action_buttons.values():
            button.setVisible(button is self.action_buttons.get("regenerate"))

    def set_figures(self, stats: dict[str, Any]) -> None:
        self.figures.setText(format_figures(stats))

    def set_status(self, text: str) -> None:
        self.status.setText(text)
        busy = bool(text)
        for name in ("regenerate", "edit"):
            if name in self.action_buttons:
                self.action_buttons[name].setEnabled(not busy)

    # -- versions ---------------------------------------------------------------------

    def _update_versions(self) -> None:
        many = len(self.versions) > 1
        for w in (self.prev_button, self.version_label, self.next_button):
            w.setVisible(many)
        if many:
            i = self.versions.index(self.message_id)
            self.version_label.setText(f"{i + 1}/{len(self.versions)}")
            self.prev_button.setEnabled(i > 0)
            self.next_button.setEnabled(i < len(self.versions) - 1)

    def _step_version(self, step: int) -> None:
        i = self.versions.index(self.message_id) + step
        if 0 <= i < len(self.versions):
            self.version_requested.emit(self.versions[i])

    # -- editing ----------------------------------------------------------------------

    def start_edit(self) -> None:
        if self.editor is None:
            self.editor = QPlainTextEdit()
            self.editor.setMaximumHeight(120)
            self._outer.insertWidget(2, self.editor)
        self.editor.setPlainText(self.text)
        self.editor.setVisible(True)
        for w in self._segment_widgets:
            w.setVisible(False)
        for b in self.action_buttons.values():
            b.setVisible(False)
        self.save_button.setVisible(True)
        self.cancel_button.setVisible(True)
        self.editor.setFocus()

    def cancel_edit(self) -> None:
        if self.editor is not None:
            self.editor.setVisible(False)
        for w in self._segment_widgets:
            w.setVisible(True)
        for b in self.action_buttons.values():
            b.setVisible(True)
        self.save_button.setVisible(False)
        self.cancel_button.setVisible(False)

    def _finish_edit(self) -> None:
        text = self.editor.toPlainText().strip() if self.editor is not None else ""
        self.cancel_edit()
        if text and text != self.text:
            self.edit_submitted.emit(self.message_id, text)


def notice_bubble(message: str) -> MessageBubble:
    """A "Not saved" bubble below the chat: a store failure, which is no message of
    the conversation, so it has no versions and no actions."""
    bubble = MessageBubble(0, "assistant", [])
    bubble.set_error(message, title="Not saved")
    for button in bubble.action_buttons.values():
        button.setVisible(False)
    return bubble
