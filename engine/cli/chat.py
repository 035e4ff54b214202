"""`folio chat`: a conversation in the terminal on the Engine, streaming each reply.

Commands: `/reset` starts over (the cache keeps what it holds), `/stats` prints the
last reply's cached vs new tokens and the page map as text, `/quit` leaves. Every turn
re-renders the whole conversation with the chat template; the pages of earlier turns
are found in the cache by their content hash, so only the new turn is computed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

import numpy as np

from engine.cache.page import PageState
from engine.cli.generate import utf8_problem
from engine.engine import Engine, EngineSnapshot
from engine.generator.job import EventKind, JobRequest, JobResult
from engine.generator.sampler import SamplingSettings

PAGE_CHARS = {
    PageState.FREE: ".",
    PageState.REFERENCED: "#",
    PageState.CACHED: "c",
    PageState.HOST: "h",
}
HELP = "Type a message and press Enter. /stats shows the cache, /reset starts over, /quit leaves."


def page_map_text(snapshot: EngineSnapshot, width: int = 64) -> str:
    """One character per page (`.` free, `#` in use, `c` cached, `+` shared by several
    sequences), rows of `width`, then the counts and the host tier."""
    cache = snapshot.cache
    chars = np.array([PAGE_CHARS[PageState(s)] for s in cache.state])
    chars[cache.ref_count > 1] = "+"
    rows = ["".join(chars[i : i + width]) for i in range(0, len(chars), width)]
    stats = snapshot.stats
    rows.append(
        f"{snapshot.num_pages} pages x {snapshot.page_size} tokens: {stats.pages_referenced} in use "
        f"(+ shared {int(np.count_nonzero(cache.ref_count > 1))}), {stats.pages_cached} cached, "
        f"{stats.pages_free} free; prefix hit rate {stats.prefix_hit_rate:.0%}"
    )
    if cache.host is not None:
        rows.append(f"host tier: {stats.pages_host} pages")
    rows.append("legend: . free  # in use  + shared  c cached (reusable)  h host tier")
    return "\n".join(rows)


def stats_text(result: JobResult | None, snapshot: EngineSnapshot) -> str:
    lines = []
    if result is not None:
        new_prompt = result.prompt_tokens - result.cached_tokens
        lines.append(
            f"last reply: prompt {result.prompt_tokens} tokens = {result.cached_tokens} cached + "
            f"{new_prompt} computed; {result.new_tokens} new tokens"
        )
        if result.time_prefill > 0:
            lines.append(
                f"prefill {result.time_prefill:.2f} s, generate {result.time_generate:.2f} s "
                f"({max(result.new_tokens - 1, 0) / result.time_generate:.1f} tok/s)"
                if result.time_generate > 0
                else f"prefill {result.time_prefill:.2f} s"
            )
    lines.append(page_map_text(snapshot))
    return "\n".join(lines)


def run_chat(
    engine: Engine,
    lines: Iterable[str],
    out: TextIO = sys.stdout,
    system: str | None = None,
    sampling: SamplingSettings | None = None,
    max_new_tokens: int = 512,
    prompt: str = "> ",
) -> list[dict[str, str]]:
    """Read user turns from `lines`, stream replies to `out`; return the conversation."""
    sampling = sampling or SamplingSettings()
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    last: JobResult | None = None
    out.write(HELP + "\n")
    out.write(prompt)
    out.flush()
    for line in lines:
        text = line.rstrip("\n")
        command = text.strip()
        if command in ("/quit", "/exit"):
            break
        if command == "/reset":
            messages = list(base)
            out.write("(conversation cleared; cached pages stay reusable)\n")
        elif command == "/stats":
            out.write(stats_text(last, engine.snapshot()) + "\n")
        elif command.startswith("/"):
            out.write(f"unknown command {command}: {HELP}\n")
        elif (problem := utf8_problem(text)) is not None:
            out.write(f"folio: that line is not valid UTF-8 ({problem}); type it again\n")
        elif command:
            messages.append({"role": "user", "content": text})
            try:
                handle = engine.submit(
                    JobRequest(messages=messages, sampling=sampling, max_new_tokens=max_new_tokens)
                )
            except ValueError as exc:
                messages.pop()
                out.write(f"folio: {exc}\n")
            else:
                for event in handle.events():
                    if event.kind is EventKind.STREAMING and event.text:
                        out.write(event.text)
                        out.flush()
                last = handle.result
                assert last is not None
                if last.eos_reason == "error":
                    messages.pop()
                    out.write(f"\nfolio: {last.error}\n")
                else:
                    messages.append({"role": "assistant", "content": last.text})
                    out.write("\n")
        out.write(prompt)
        out.flush()
    out.write("\n")
    return messages
