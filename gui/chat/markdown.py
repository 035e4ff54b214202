"""Split a (possibly half-streamed) Markdown reply into prose and fenced code blocks.

Prose is rendered by Qt's own Markdown support; code blocks get their own widget with
a copy button, so they are cut out here. An unclosed fence (the model is still
writing the block) runs to the end of the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FENCE = re.compile(r"^[ ]{0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)[^\n]*$", re.MULTILINE)


@dataclass(frozen=True)
class Segment:
    kind: str  # "text" or "code"
    text: str
    language: str = ""


def split_segments(markdown: str) -> list[Segment]:
    segments: list[Segment] = []
    pos = 0
    while True:
        opening = _FENCE.search(markdown, pos)
        if opening is None:
            break
        fence = opening.group(1)
        before = markdown[pos : opening.start()]
        if before.strip():
            segments.append(Segment("text", before.strip("\n")))
        body_start = opening.end() + 1
        # the closing fence: same character, at least as long, alone on its line
        closing = re.compile(rf"^[ ]{{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", re.M)
        end = closing.search(markdown, body_start)
        if end is None:
            segments.append(Segment("code", markdown[body_start:], opening.group(2)))
            return segments
        segments.append(
            Segment("code", markdown[body_start : end.start()].rstrip("\n"), opening.group(2))
        )
        pos = end.end() + 1
    rest = markdown[pos:]
    if rest.strip() or not segments:
        segments.append(Segment("text", rest.strip("\n")))
    return segments
