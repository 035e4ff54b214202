"""The line under the composer that says how much of the model's context the chat uses.

It counts what the next send would hold (the chat as its context policy keeps it, plus
the message being typed: `ChatController.preview`, the same plan `send` submits), so the
number is the job's prompt length, and it says beforehand when a send will leave earlier
turns out or will not go at all. Counting tokenizes the draft, so it runs on a short
timer after typing stops, never per key.
"""

from __future__ import annotations

from enum import Enum

from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QWidget

from gui.chat.context import ContextPlan, Outcome

REFRESH_MS = 200  # after the last key press


class Level(Enum):
    OK = "ok"
    WARN = "warn"  # a send leaves turns out
    BLOCKED = "blocked"  # a send will be refused


NO_PLAN = "Load a model to see how much of its context this chat uses."
# A server elsewhere: no tokenizer here to count with; the server refuses what is too long.
REMOTE_NO_PLAN = (
    "The server counts this chat's tokens: the whole chat is sent, and one too long for "
    "its context comes back as an error."
)


def gauge_text(
    plan: ContextPlan | None, free_tokens: int | None = None, no_plan: str = NO_PLAN
) -> tuple[str, Level]:
    """The gauge's words for `plan`; `free_tokens` is what the cache has unreferenced now
    (free + reclaimable), said when it is less than the chat may hold; `no_plan` when
    there is nothing to count with."""
    if plan is None:
        return no_plan, Level.OK
    limit = plan.window.limit
    of = f"of {limit:,} this chat can hold"
    if free_tokens is not None and free_tokens < limit:
        of += f" ({max(free_tokens, 0):,} free now, the rest held by replies being written)"
    reply = plan.reply_tokens
    if plan.outcome is Outcome.FITS:
        return f"{plan.prompt_tokens:,} tokens + up to {reply:,} for the reply, {of}", Level.OK
    if plan.outcome is Outcome.SHORTENED:
        return (
            f"{plan.prompt_tokens:,} tokens + up to {reply:,} for the reply "
            f"({plan.requested_reply:,} asked for: the chat fills the rest), {of}",
            Level.OK,
        )
    if plan.outcome is Outcome.DROPPED:
        n = len(plan.dropped_ids)
        return (
            f"Sending leaves {n} earlier message{'s' if n != 1 else ''} out "
            f"({plan.policy.label.lower()}): {plan.prompt_tokens:,} tokens + up to "
            f"{reply:,} for the reply, {of}",
            Level.WARN,
        )
    if plan.outcome is Outcome.STOPPED:
        return (
            f"Does not fit: {plan.prompt_tokens:,} tokens, and one job holds {limit:,} "
            'with its reply. The policy is "stop at the limit": pick another one under '
            "System prompt and sampling, or start a new chat.",
            Level.BLOCKED,
        )
    return (
        f"Too long: this message with the system prompt and a reply needs more than the "
        f"{limit:,} tokens one job holds. Shorten it.",
        Level.BLOCKED,
    )


class ContextGauge(QWidget):
    """A thin bar (the prompt's share of what the chat may hold) and its words."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.plan: ContextPlan | None = None
        self.free_tokens: int | None = None
        self.level = Level.OK
        layout = QHBoxLayout(self)
        layout.setContentsMargins(2, 0, 2, 0)
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setFixedSize(90, 8)
        self.label = QLabel()
        self.label.setObjectName("gauge")
        self.label.setWordWrap(True)
        layout.addWidget(self.bar)
        layout.addWidget(self.label, 1)
        self.show_plan(None)

    @property
    def count(self) -> int:
        """The tokens the next job's prompt holds (0 without a plan)."""
        return self.plan.prompt_tokens if self.plan is not None and self.plan.sends else 0

    def show_plan(
        self, plan: ContextPlan | None, free_tokens: int | None = None, no_plan: str = NO_PLAN
    ) -> None:
        self.plan, self.free_tokens = plan, free_tokens
        text, self.level = gauge_text(plan, free_tokens, no_plan)
        self.label.setText(text)
        self.label.setProperty("level", self.level.value)
        self.label.style().unpolish(self.label)
        self.label.style().polish(self.label)
        self.bar.setVisible(plan is not None)
        if plan is not None:
            limit = max(plan.window.limit, 1)
            self.bar.setRange(0, limit)
            self.bar.setValue(min(plan.prompt_tokens, limit))

    def set_free_tokens(self, free_tokens: int | None) -> None:
        """The cache's unreferenced room moved (another chat started or ended)."""
        if free_tokens != self.free_tokens:
            self.show_plan(self.plan, free_tokens)
