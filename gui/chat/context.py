"""What of a chat goes into the next job when the whole chat does not fit.

A job holds its prompt and its reply in the KV cache at once, so a chat can outgrow the
cache (or the model's trained context) however short the next message is. Each chat has
a `ContextPolicy`; `fit_turns` is the rule, on token counts alone: the reply budget
shrinks first, down to a floor, and only then are whole turns (a user message with the
replies that answered it) left out, so the roles still alternate as every chat template
wants. The last turn, the message being answered, is always kept.

`ContextPlanner` applies the rule to real messages with the model's tokenizer: counts per
message are estimates (cached, so typing re-tokenizes only the draft), and the kept
messages are then encoded exactly as the engine encodes them, so `ContextPlan.prompt_tokens`
is the job's prompt length and the gauge under the composer counts what the job holds.
Nothing here knows Qt or the store; dropped messages are only named, never deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

REPLY_FLOOR = 256  # the reply budget shrinks to this (or a quarter of the limit) at most
ESTIMATE_ROUNDS = 4  # exact encodes a plan may take when the estimates were short


class ContextPolicy(Enum):
    """What a chat does when it no longer fits. The values are what the store keeps."""

    TRUNCATE_MIDDLE = "truncate_middle"
    ROLLING_WINDOW = "rolling_window"
    STOP = "stop"

    @classmethod
    def parse(cls, value: str) -> ContextPolicy:
        """A stored value; one this version does not know (a newer Folio's) is the default."""
        try:
            return cls(value)
        except ValueError:
            return DEFAULT_POLICY

    @property
    def label(self) -> str:
        return _LABELS[self][0]

    @property
    def description(self) -> str:
        return _LABELS[self][1]


# Truncating the middle is what chat apps do (LM Studio's default too): the system prompt
# and the chat's first exchange, which often sets the task, stay, and so stay a prefix
# the cache already holds; the newest turns follow.
DEFAULT_POLICY = ContextPolicy.TRUNCATE_MIDDLE

_LABELS = {
    ContextPolicy.TRUNCATE_MIDDLE: (
        "Truncate the middle",
        "Keep the system prompt, the first exchange and the latest turns; leave out the "
        "turns in between. The kept start stays cached, so replies start sooner.",
    ),
    ContextPolicy.ROLLING_WINDOW: (
        "Rolling window",
        "Keep the system prompt and the latest turns; leave out the oldest turns first.",
    ),
    ContextPolicy.STOP: (
        "Stop at the limit",
        "Send nothing once the chat no longer fits, and say so: start a new chat or "
        "pick another policy.",
    ),
}


class Outcome(Enum):
    FITS = "fits"  # everything, with the whole reply budget
    SHORTENED = "shortened"  # everything, with a smaller reply budget
    DROPPED = "dropped"  # earlier turns left out
    STOPPED = "stopped"  # does not fit, and the policy leaves nothing out
    TOO_LONG = "too long"  # even the last message alone (with the system prompt) does not fit

    @property
    def sends(self) -> bool:
        return self in (Outcome.FITS, Outcome.SHORTENED, Outcome.DROPPED)


@dataclass(frozen=True)
class Fit:
    kept: tuple[int, ...]  # turn indices, in order
    dropped: tuple[int, ...]
    reply_tokens: int  # the reply budget (0 when nothing is sent)
    prompt_tokens: int  # fixed + the kept turns' tokens
    outcome: Outcome


def reply_floor(requested: int, limit: int, floor: int = REPLY_FLOOR) -> int:
    """The smallest reply budget a send accepts before turns are left out."""
    return max(1, min(requested, floor, limit // 4))


def fit_turns(
    turn_tokens: Sequence[int],
    fixed: int,
    limit: int,
    reply: int,
    policy: ContextPolicy,
    floor: int = REPLY_FLOOR,
) -> Fit:
    """Which turns a job keeps: `turn_tokens[i]` is turn i's tokens (the last turn is the
    message being answered), `fixed` the tokens outside any turn (system prompt,
    template), `limit` what one job may hold (prompt + reply), `reply` the reply budget
    asked for. The reply shrinks to at most `reply_floor` before any turn is dropped;
    then the policy drops the fewest turns that make prompt + floor fit, and the reply
    takes whatever room is left, up to what was asked."""
    least = reply_floor(reply, limit, floor)
    kept = list(range(len(turn_tokens)))
    used = fixed + sum(turn_tokens)
    if used + least <= limit:
        outcome = Outcome.FITS if used + reply <= limit else Outcome.SHORTENED
        return Fit(tuple(kept), (), min(reply, limit - used), used, outcome)
    if policy is ContextPolicy.STOP:
        return Fit(tuple(kept), (), 0, used, Outcome.STOPPED)
    last = len(turn_tokens) - 1  # never dropped
    order = list(range(last))
    if policy is ContextPolicy.TRUNCATE_MIDDLE:
        order = order[1:] + order[:1]  # the first exchange goes last
    dropped: list[int] = []
    for index in order:
        if used + least <= limit:
            break
        kept.remove(index)
        dropped.append(index)
        used -= turn_tokens[index]
    if used + least > limit:
        return Fit(tuple(kept), tuple(sorted(dropped)), 0, used, Outcome.TOO_LONG)
    return Fit(tuple(kept), tuple(sorted(dropped)), min(reply, limit - used), used, Outcome.DROPPED)


Message = Mapping[str, str]


@dataclass(frozen=True)
class Entry:
    """One message of the chat's context: the stored message's id (None for the draft
    being typed) and what the template gets."""

    message_id: int | None
    message: Message


def group_turns(entries: Sequence[Entry]) -> list[list[Entry]]:
    """Turns: each user message with what follows it up to the next user message (a
    chat that starts with a reply has that reply as a turn of its own)."""
    turns: list[list[Entry]] = []
    for entry in entries:
        if entry.message.get("role") == "user" or not turns:
            turns.append([entry])
        else:
            turns[-1].append(entry)
    return turns


@dataclass(frozen=True)
class ContextWindow:
    """What one job of this chat may hold, in tokens: the whole cache (less what parallel
    samples need of their own) and the model's trained context."""

    cache_tokens: int
    model_tokens: int

    @property
    def limit(self) -> int:
        return min(self.cache_tokens, self.model_tokens)

    @property
    def bound_by(self) -> str:
        if self.cache_tokens <= self.model_tokens:
            return "the size of the KV cache"
        return "the model's context length"


@dataclass(frozen=True)
class ContextPlan:
    """The next job of a chat: the messages it sends, its exact prompt length, its reply
    budget, and which stored messages it leaves out."""

    policy: ContextPolicy
    outcome: Outcome
    window: ContextWindow
    messages: tuple[Message, ...]
    prompt_tokens: int  # exact (the engine's count) when it sends; else the whole chat's
    reply_tokens: int
    requested_reply: int
    dropped_ids: tuple[int, ...] = ()

    @property
    def sends(self) -> bool:
        return self.outcome.sends

    def refusal(self) -> str:
        """Why nothing is sent, and what to do, for an error bubble ('' when it sends)."""
        limit = f"{self.window.limit:,}"
        bound = self.window.bound_by
        if self.outcome is Outcome.STOPPED:
            return (
                f"This chat no longer fits: it has {self.prompt_tokens:,} tokens, and one "
                f"job holds at most {limit}, reply included ({bound}). Its context "
                f'policy is "{self.policy.label}": start a new chat, pick "Truncate the '
                'middle" or "Rolling window" under System prompt and sampling to leave '
                "earlier turns out, or give the KV cache a bigger budget in File > Engine "
                "settings."
            )
        if self.outcome is Outcome.TOO_LONG:
            return (
                f"This message is too long: with the system prompt and room for a reply it "
                f"needs more than the {limit} tokens one job holds ({bound}), even with every "
                "earlier turn left out. Shorten it, or give the KV cache a bigger budget in "
                "File > Engine settings."
            )
        return ""


class ContextPlanner:
    """Plans jobs for one tokenizer. `encode_chat(messages)` must be the engine's own
    encoding (the tokenizer's `encode_chat`, generation prompt added), so that the plan's
    prompt length is the job's; `encode(text)` counts a message's text, cached by text."""

    def __init__(
        self,
        encode_chat: Callable[[list[dict[str, str]]], list[int]],
        encode: Callable[[str], list[int]],
    ):
        self._encode_chat = encode_chat
        self._encode = encode
        self._counts: dict[str, int] = {}
        self._per_message = self._template_overhead()

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ContextPlanner:
        return cls(
            lambda messages: tokenizer.encode_chat(messages),
            lambda text: tokenizer.encode(text, add_special_tokens=False),
        )

    def _template_overhead(self) -> int:
        """Tokens the template adds around each message (role markers, separators),
        from two tiny chats; only an estimate, which `plan` corrects."""
        one = [{"role": "user", "content": "a"}]
        two = [*one, {"role": "assistant", "content": "a"}]
        try:
            added = len(self._encode_chat(two)) - len(self._encode_chat(one))
        except Exception:  # noqa: BLE001 - a template that rejects the probe: a guess
            return 8
        return max(0, added - len(self._encode("a")))

    def count(self, message: Message) -> int:
        content = message.get("content", "")
        tokens = self._counts.get(content)
        if tokens is None:
            if len(self._counts) > 4096:  # a long session's edits and drafts
                self._counts.clear()
            tokens = self._counts[content] = len(self._encode(content))
        return tokens + self._per_message

    def plan(
        self,
        system: Message | None,
        entries: Sequence[Entry],
        window: ContextWindow,
        policy: ContextPolicy,
        reply: int,
    ) -> ContextPlan:
        """The job for `system` + `entries` (oldest first; the last is answered)."""
        turns = group_turns(entries)
        turn_tokens = [sum(self.count(e.message) for e in turn) for turn in turns]
        head = [system] if system is not None else []
        fixed = sum(self.count(m) for m in head) + self._per_message  # + generation prompt
        limit = window.limit
        fit = fit_turns(turn_tokens, fixed, limit, reply, policy)
        for _ in range(ESTIMATE_ROUNDS):
            if not fit.outcome.sends:
                break
            messages = head + [e.message for i in fit.kept for e in turns[i]]
            exact = len(self._encode_chat([dict(m) for m in messages]))
            if exact + reply_floor(reply, limit) <= limit:
                dropped = tuple(
                    e.message_id for i in fit.dropped for e in turns[i] if e.message_id is not None
                )
                outcome = fit.outcome
                budget = min(reply, limit - exact)
                if outcome is Outcome.FITS and budget < reply:
                    outcome = Outcome.SHORTENED
                return ContextPlan(
                    policy, outcome, window, tuple(messages), exact, budget, reply, dropped
                )
            fixed += exact - fit.prompt_tokens  # the estimate was short by this much
            fit = fit_turns(turn_tokens, fixed, limit, reply, policy)
        whole = head + [e.message for e in entries]
        prompt = len(self._encode_chat([dict(m) for m in whole])) if whole else 0
        outcome = fit.outcome if not fit.outcome.sends else Outcome.TOO_LONG
        return ContextPlan(policy, outcome, window, tuple(whole), prompt, 0, reply)
