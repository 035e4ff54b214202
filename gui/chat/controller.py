"""Sends, edits, regenerations and parallel samples become engine jobs here, and the
jobs' events become saved messages.

A `Generation` is one job seen from the chat side: the conversation it answers, the
assistant message(s) it fills (one per sample), and the text streamed so far. Text
is kept in memory and written to the store at most every `SAVE_INTERVAL_MS`, so a
killed app loses under a second of a reply, and the UI thread does one small write
per reply per half second, whatever the token rate.

Every failure ends on screen with what to do: a request the engine refuses and a job
that fails become error bubbles; a write the store refuses (a full disk, a read-only
data folder) becomes a "Not saved" notice below the chat, and a reply it could not
store stays in memory, shown, and is written again on every save tick until it is on
disk. No reply is left marked as generating once its job has ended.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine.engine import EngineSnapshot
from engine.generator.job import EventKind, JobEvent, JobRequest, JobResult
from engine.generator.sampler import SamplingSettings
from gui.bridge import EngineBridge
from gui.chat.context import ContextPlan, ContextPlanner, ContextPolicy, ContextWindow, Entry
from gui.status import job_words, prefill_words
from gui.store import Message, Store, StoreError

log = logging.getLogger(__name__)

SAVE_INTERVAL_MS = 500
NOT_SAVED = "not saved"  # the status of a reply the store refused

DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 0,
    "repetition_penalty": 1.1,
    "max_new_tokens": 512,
    "seed": None,
}


@dataclass
class Generation:
    job_id: int
    conversation_id: int
    message_ids: list[int]  # one assistant message per sample index
    texts: list[str]
    status: str = "queued"
    dirty: set[int] = field(default_factory=set)  # sample indices not yet saved
    changed: bool = True  # text or status changed since the view last looked
    context: dict[str, Any] = field(default_factory=dict)  # `context_figures` of its plan


@dataclass
class UnsavedReply:
    """The final state of a reply the store refused, kept until a save gets through."""

    conversation_id: int
    content: str
    error: str
    stats: dict[str, Any]


@dataclass(frozen=True)
class SaveFailure:
    """Why the latest change to a conversation is not on disk: the store's message,
    which names the path and what to do."""

    message: str
    unsent: str = ""  # a message the user wrote that is not stored: it goes back to them


def refused_advice(message: str) -> str:
    """What to do about a request the engine did not take, when its words do not say."""
    if "cache" in message and "pages" in message:
        return (
            "Shorten the message, start a new chat, or give the KV cache a bigger budget "
            "in File > Engine settings."
        )
    if "no model is loaded" in message or "shut down" in message:
        return (
            "Wait until the model has loaded (the status bar shows its name), or open one "
            "with File > Models…, then send the message again."
        )
    return "Edit the message or start a new chat, then try again."


FAILED_ADVICE = (
    "Press Regenerate to try again; if it fails again, start a new chat or load another "
    "model with File > Models…."
)


def with_advice(message: str, advice: str) -> str:
    return f"{message.strip().rstrip('.')}. {advice}"


def sampling_from(settings: dict[str, Any]) -> tuple[SamplingSettings, int]:
    """Conversation sampling settings -> (SamplingSettings, max_new_tokens)."""
    merged = {**DEFAULT_SAMPLING, **settings}
    sampling = SamplingSettings(
        temperature=float(merged["temperature"]),
        top_p=float(merged["top_p"]),
        top_k=int(merged["top_k"]),
        repetition_penalty=float(merged["repetition_penalty"]),
        seed=None if merged["seed"] in (None, "") else int(merged["seed"]),
    )
    return sampling, int(merged["max_new_tokens"])


class ContextRefused(ValueError):
    """The chat does not fit and its policy sends nothing; the message says what to do."""


def context_figures(plan: ContextPlan) -> dict[str, Any]:
    """What a reply's stats keep of its job's plan: the chat view marks the messages the
    job left out, and says how the reply budget was cut."""
    return {
        "policy": plan.policy.value,
        "dropped": list(plan.dropped_ids),
        "reply_tokens": plan.reply_tokens,
        "requested_reply": plan.requested_reply,
        "limit": plan.window.limit,
    }


def figures_of(result: JobResult, index: int = 0) -> dict[str, Any]:
    """Per-message figures from a job result (per sample for n > 1)."""
    new = len(result.token_ids[index]) if index < len(result.token_ids) else result.new_tokens
    prefilled = max(0, result.prompt_tokens - result.cached_tokens)
    return {
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "disk_pages": result.disk_pages,
        "disk_bytes": result.disk_bytes,
        "disk_seconds": result.disk_seconds,
        "new_tokens": new,
        "time_prefill": result.time_prefill,
        "time_generate": result.time_generate,
        "prefill_tps": prefilled / result.time_prefill if result.time_prefill > 0 else 0.0,
        # the first token is timed with the prefill, so decode speed counts the rest
        "decode_tps": (new - 1) / result.time_generate if result.time_generate > 0 else 0.0,
        "eos_reason": (
            result.eos_reasons[index] if index < len(result.eos_reasons) else result.eos_reason
        ),
        "samples": len(result.texts),
    }


class ChatController(QObject):
    """Owns the in-flight generations. Views read `live_text` / `status` and reload on
    `conversation_changed`; they never call the engine."""

    conversation_changed = Signal(int)  # messages added, finished or switched
    conversations_listed = Signal()  # titles or order changed
    generation_failed = Signal(int, str)  # (conversation id, message) for a status line
    # the latest store failure's message, or "" once every change is on disk again
    saving_changed = Signal(str)

    def __init__(self, store: Store, bridge: EngineBridge, parent: QObject | None = None):
        super().__init__(parent)
        self.store = store
        self.bridge = bridge
        self.generations: dict[int, Generation] = {}
        self._by_message: dict[int, Generation] = {}
        self.failures: dict[int, SaveFailure] = {}  # by conversation id
        self.unsaved: dict[int, UnsavedReply] = {}  # by message id
        self._planner: ContextPlanner | None = None
        self._planned_for: object = None  # the tokenizer `_planner` counts with
        bridge.job_events.connect(self.on_job_events)
        bridge.snapshot_ready.connect(self.on_snapshot)
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(self.save_partials)
        self._save_timer.start()

    # -- queries ----------------------------------------------------------------------

    def live_text(self, message_id: int) -> str | None:
        gen = self._by_message.get(message_id)
        if gen is None:
            return None
        return gen.texts[gen.message_ids.index(message_id)]

    def status(self, message_id: int) -> str:
        gen = self._by_message.get(message_id)
        if gen is not None:
            return gen.status
        return NOT_SAVED if message_id in self.unsaved else ""

    def shown(self, message: Message) -> Message:
        """`message` as the user should see it: a finished reply the store refused
        looks as it would once stored."""
        reply = self.unsaved.get(message.id)
        if reply is None:
            return message
        return replace(
            message, content=reply.content, complete=True, error=reply.error, stats=reply.stats
        )

    def take_unsent(self, conversation_id: int) -> str:
        """The message the user wrote that could not be stored, once: for the input box."""
        failure = self.failures.get(conversation_id)
        if failure is None or not failure.unsent:
            return ""
        self.failures[conversation_id] = replace(failure, unsent="")
        return failure.unsent

    def is_generating(self, conversation_id: int) -> bool:
        return any(g.conversation_id == conversation_id for g in self.generations.values())

    def take_changed(self, conversation_id: int) -> list[int]:
        """Message ids of this conversation whose text or status moved since last asked."""
        out: list[int] = []
        for gen in self.generations.values():
            if gen.conversation_id == conversation_id and gen.changed:
                gen.changed = False
                out.extend(gen.message_ids)
        return out

    # -- actions ----------------------------------------------------------------------

    def send(self, conversation_id: int, text: str, n: int = 1) -> int | None:
        """Append a user message below the current leaf and answer it (n samples).
        Returns the job id, or None when nothing was sent (empty text, an error
        bubble or a "Not saved" notice instead)."""
        text = text.strip()
        if not text:
            return None
        conv = self.store.conversation(conversation_id)
        try:
            user = self.store.add_message(conversation_id, conv.current_leaf, "user", text)
        except StoreError as exc:
            self._store_failed(conversation_id, exc, unsent=text)
            return None
        self._stored(conversation_id)
        if conv.title in ("", "New chat"):
            try:
                self.store.update_conversation(conversation_id, title=_title_from(text))
            except StoreError as exc:
                self._store_failed(conversation_id, exc)
            self.conversations_listed.emit()
        return self._answer(conversation_id, user, n)

    def edit(self, message_id: int, text: str) -> int | None:
        """A new version of a user message (a sibling: the old branch stays), answered."""
        text = text.strip()
        old = self.store.message(message_id)
        if not text or old.role != "user":
            return None
        try:
            user = self.store.add_message(old.conversation_id, old.parent_id, "user", text)
        except StoreError as exc:
            self._store_failed(old.conversation_id, exc, unsent=text)
            return None
        self._stored(old.conversation_id)
        return self._answer(old.conversation_id, user, 1)

    def regenerate(self, message_id: int) -> int | None:
        """A new version of an assistant reply, answering the same transcript."""
        old = self.store.message(message_id)
        if old.role != "assistant" or old.parent_id is None:
            return None
        parent = self.store.message(old.parent_id)
        return self._answer(old.conversation_id, parent, 1)

    def switch_version(self, message_id: int) -> None:
        msg = self.store.message(message_id)
        leaf = self.store.deepest_leaf(message_id)
        try:
            self.store.update_conversation(msg.conversation_id, current_leaf=leaf)
        except StoreError as exc:
            self._store_failed(msg.conversation_id, exc)
        self.conversation_changed.emit(msg.conversation_id)

    def stop(self, conversation_id: int) -> None:
        for gen in list(self.generations.values()):
            if gen.conversation_id == conversation_id:
                self.bridge.cancel(gen.job_id)
                gen.status = "stopping"
                gen.changed = True

    def stop_all(self) -> None:
        for gen in list(self.generations.values()):
            self.bridge.cancel(gen.job_id)

    # -- jobs -------------------------------------------------------------------------

    def request_for(
        self, conversation_id: int, leaf: Message, n: int
    ) -> tuple[JobRequest, ContextPlan | None]:
        """The job answering `leaf`: the chat's messages as its context policy keeps
        them, and the reply budget that leaves room for (with the plan; None without a
        tokenizer). Raises ContextRefused when the policy sends nothing."""
        conv = self.store.conversation(conversation_id)
        sampling, max_new = sampling_from(conv.sampling)
        entries = self._entries(conversation_id, leaf.id)
        plan = self.plan(conversation_id, entries, n)
        if plan is None:  # no tokenizer to count with: the engine judges the whole chat
            messages = [*_system_message(conv.system_prompt), *(e.message for e in entries)]
        elif not plan.sends:
            raise ContextRefused(plan.refusal())
        else:
            messages, max_new = list(plan.messages), plan.reply_tokens
        request = JobRequest(
            messages=[dict(m) for m in messages],
            sampling=sampling,
            max_new_tokens=max_new,
            n=n,
            tag=conversation_id,
        )
        return request, plan

    def preview(self, conversation_id: int, draft: str = "", n: int = 1) -> ContextPlan | None:
        """The plan of the next send: the chat below its current leaf plus `draft` as the
        new message (None without a model, or with nothing to send)."""
        leaf = self.store.conversation(conversation_id).current_leaf
        entries = self._entries(conversation_id, leaf)
        if draft.strip():
            entries.append(Entry(None, {"role": "user", "content": draft.strip()}))
        return self.plan(conversation_id, entries, n) if entries else None

    def plan(self, conversation_id: int, entries: list[Entry], n: int = 1) -> ContextPlan | None:
        window = self.context_window(conversation_id, n)
        planner = self._context_planner()
        if window is None or planner is None:
            return None
        conv = self.store.conversation(conversation_id)
        _, max_new = sampling_from(conv.sampling)
        system = _system_message(conv.system_prompt)
        policy = ContextPolicy.parse(conv.context_policy)
        return planner.plan(system[0] if system else None, entries, window, policy, max_new)

    def context_window(self, conversation_id: int, n: int = 1) -> ContextWindow | None:
        """What one job of this chat may hold: the whole cache, less the pages each extra
        sample copies for its own reply (docs/ENGINE.md §8: the samples share the
        prompt's full pages only; `Scheduler.check_fits` counts the same), and the
        model's trained context."""
        engine, loaded = self.bridge.engine, self.bridge.loaded
        if engine is None or loaded is None:
            return None
        page_size = engine.cache.page_size
        cache = engine.cache.num_pages * page_size
        if n > 1:
            _, max_new = sampling_from(self.store.conversation(conversation_id).sampling)
            own_pages = -(-max_new // page_size) + 1
            cache -= (n - 1) * own_pages * page_size
        return ContextWindow(max(cache, 0), int(loaded.config.max_position_embeddings))

    def _context_planner(self) -> ContextPlanner | None:
        tokenizer = self.bridge.tokenizer
        if tokenizer is None or not getattr(tokenizer, "has_chat_template", False):
            return None
        if tokenizer is not self._planned_for:
            self._planner = ContextPlanner.for_tokenizer(tokenizer)
            self._planned_for = tokenizer
        return self._planner

    def _entries(self, conversation_id: int, leaf_id: int | None) -> list[Entry]:
        """The transcript to `leaf_id` as the model sees it, system prompt aside."""
        path = self.store.transcript(conversation_id, leaf_id) if leaf_id is not None else []
        entries: list[Entry] = []
        for i, m in enumerate(path):
            answered_by_error = i + 1 < len(path) and bool(path[i + 1].error)
            # A turn that ended in an error bubble (a prompt too long for the cache, say)
            # stays on screen but is left out of the context, or it would fail again.
            if m.role in ("user", "assistant") and not m.error and m.content:
                if not answered_by_error:
                    entries.append(Entry(m.id, {"role": m.role, "content": m.content}))
        return entries

    def _answer(self, conversation_id: int, parent: Message, n: int) -> int | None:
        n = max(1, int(n))
        replies: list[Message] = []
        try:
            for i in range(n):
                replies.append(
                    self.store.add_message(
                        conversation_id,
                        parent.id,
                        "assistant",
                        "",
                        complete=False,
                        make_current=(i == 0),
                    )
                )
        except StoreError as exc:
            self._store_failed(conversation_id, exc)
            # Replies already added would stay "interrupted": they end as errors that
            # say why, stored once the store takes writes again.
            for reply in replies:
                self._complete(conversation_id, reply.id, "", str(exc), {})
            self.conversation_changed.emit(conversation_id)
            return None
        try:
            request, plan = self.request_for(conversation_id, parent, n)
            handle = self.bridge.submit(request)
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an error bubble
            if not isinstance(exc, (ValueError, RuntimeError)):  # not the documented ones
                log.exception("submitting a chat job failed")
            message = str(exc) or type(exc).__name__
            if not isinstance(exc, ContextRefused):  # that one says what to do already
                message = with_advice(message, refused_advice(message))
            for reply in replies:
                self._complete(conversation_id, reply.id, "", message, {})
            self.conversation_changed.emit(conversation_id)
            self.generation_failed.emit(conversation_id, message)
            return None
        gen = Generation(
            job_id=handle.job_id,
            conversation_id=conversation_id,
            message_ids=[m.id for m in replies],
            texts=[""] * n,
            context=context_figures(plan) if plan is not None else {},
        )
        if gen.context:
            # Stored now, so the view marks what the job leaves out while it streams.
            for reply in replies:
                try:
                    self.store.update_message(reply.id, stats={"context": gen.context})
                except StoreError as exc:
                    self._store_failed(conversation_id, exc)
        self.generations[handle.job_id] = gen
        for mid in gen.message_ids:
            self._by_message[mid] = gen
        self.conversation_changed.emit(conversation_id)
        self.conversations_listed.emit()
        return handle.job_id

    @Slot(list)
    def on_job_events(self, events: list[JobEvent]) -> None:
        """A burst of engine events, on the UI thread: cheap bookkeeping only."""
        finished: list[tuple[Generation, JobEvent]] = []
        for event in events:
            gen = self.generations.get(event.job_id)
            if gen is None:
                continue
            if event.kind in (EventKind.STARTED, EventKind.PREFILL) and event.prefill_total:
                gen.status = prefill_words(event.prefill_done, event.prefill_total)
            elif event.kind == EventKind.STREAMING and event.text:
                if 0 <= event.index < len(gen.texts):
                    gen.texts[event.index] += event.text
                    gen.dirty.add(event.index)
                gen.status = "generating…"
            gen.changed = True
            if event.eos:
                finished.append((gen, event))
        for gen, event in finished:
            self._finish(gen, event.result)

    @Slot(object)
    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        """Each reply's state as the engine's snapshot has it: why it waits, how far its
        prefill is and the time left (events only say a chunk ended)."""
        if not self.generations:
            return
        jobs = {job.job_id: job for job in snapshot.jobs}
        for gen in self.generations.values():
            job = jobs.get(gen.job_id)
            if job is None or job.state == "decode" or gen.status == "stopping":
                continue  # not in the engine yet, streaming (its events say so), or ending
            status = job_words(job, snapshot.time)
            if status != gen.status:
                gen.status = status
                gen.changed = True

    def _finish(self, gen: Generation, result: JobResult | None) -> None:
        del self.generations[gen.job_id]
        for mid in gen.message_ids:
            self._by_message.pop(mid, None)
        failed = ""
        for i, mid in enumerate(gen.message_ids):
            text = gen.texts[i]
            error = ""
            stats: dict[str, Any] = {"context": gen.context} if gen.context else {}
            if result is not None:
                if i < len(result.texts) and result.texts[i]:
                    text = result.texts[i]
                stats.update(figures_of(result, i))
                if result.eos_reason == "error":
                    failed = result.error or "the engine failed"
                    error = with_advice(failed, FAILED_ADVICE)
            self._complete(gen.conversation_id, mid, text, error, stats)
        self.conversation_changed.emit(gen.conversation_id)
        if failed:
            self.generation_failed.emit(gen.conversation_id, failed)

    def _complete(
        self, conversation_id: int, message_id: int, text: str, error: str, stats: dict
    ) -> None:
        """Store a reply's final state, or keep it here (shown, and retried on every save
        tick) when the store refuses it: a finished reply is never lost, nor left
        looking unfinished."""
        self.unsaved[message_id] = UnsavedReply(conversation_id, text, error, stats)
        self._store_unsaved(message_id)

    def _store_unsaved(self, message_id: int) -> bool:
        reply = self.unsaved[message_id]
        try:
            self.store.update_message(
                message_id,
                content=reply.content,
                complete=True,
                error=reply.error,
                stats=reply.stats,
            )
        except StoreError as exc:
            self._store_failed(reply.conversation_id, exc)
            return False
        del self.unsaved[message_id]
        self._stored(reply.conversation_id)
        return True

    @Slot()
    def save_partials(self) -> None:
        """Write streamed text that is not on disk yet (crash safety), and finished
        replies the store refused before. What fails stays in memory for the next tick."""
        for gen in self.generations.values():
            for index in sorted(gen.dirty):
                try:
                    self.store.update_message(
                        gen.message_ids[index], content=gen.texts[index], complete=False
                    )
                except StoreError as exc:
                    self._store_failed(gen.conversation_id, exc)
                    break
                gen.dirty.discard(index)
                self._stored(gen.conversation_id)
        for message_id in list(self.unsaved):
            if not self._store_unsaved(message_id):
                break  # the store still refuses; the notice already says why

    # -- store failures ---------------------------------------------------------------

    def report_store_error(self, conversation_id: int, error: StoreError) -> None:
        """A write for this conversation failed outside the controller (its settings):
        shown like the controller's own."""
        self._store_failed(conversation_id, error)

    def _store_failed(self, conversation_id: int, error: StoreError, unsent: str = "") -> None:
        # Only a new failure is announced: a save tick that keeps failing stays quiet.
        failure = SaveFailure(str(error), unsent)
        if self.failures.get(conversation_id) == failure:
            return
        self.failures[conversation_id] = failure
        self.saving_changed.emit(failure.message)
        self.conversation_changed.emit(conversation_id)

    def _stored(self, conversation_id: int) -> None:
        """A write for this conversation went through: its notice is no longer true,
        unless a reply of it is still waiting."""
        if conversation_id not in self.failures:
            return
        if any(r.conversation_id == conversation_id for r in self.unsaved.values()):
            return
        del self.failures[conversation_id]
        self.conversation_changed.emit(conversation_id)
        if not self.failures:
            self.saving_changed.emit("")


def _system_message(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": prompt}] if prompt.strip() else []


def _title_from(text: str, limit: int = 40) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
