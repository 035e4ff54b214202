"""A (possibly half-streamed) Markdown reply as Qt rich text: prose, tables, links, and
fenced code blocks highlighted by Pygments.

Code blocks get their own widget with a copy button, so `split_segments` cuts them out
of the prose first; an unclosed fence (the model is still writing the block) runs to
the end of the text. Prose goes through markdown-it (CommonMark plus tables) rather
than Qt's own Markdown, which drops what a reply may well contain: raw HTML is shown
as the text the model wrote, never interpreted, and an image becomes a link naming it
("[image: alt] url"), never fetched. The reply is the model's output, not a page from
a site the user chose to visit.

Streaming re-renders the last segment on every tick, and reloading a chat renders
every segment again, so finished segments are rendered once and cached.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from markdown_it import MarkdownIt
from pygments import highlight as pygments_highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.style import Style
from pygments.styles import get_style_by_name
from pygments.token import Whitespace
from pygments.util import ClassNotFound

from gui.palette import blend, contrast

_FENCE = re.compile(r"^[ ]{0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)[^\n]*$", re.MULTILINE)

READABLE_CONTRAST = 4.5  # WCAG AA for body text: every highlighted token meets it


@dataclass(frozen=True)
class Segment:
    kind: str  # "text" or "code"
    text: str
    language: str = ""
    closed: bool = True  # False for a code block whose closing fence has not come yet


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
            segments.append(Segment("code", markdown[body_start:], opening.group(2), False))
            return segments
        segments.append(
            Segment("code", markdown[body_start : end.start()].rstrip("\n"), opening.group(2))
        )
        pos = end.end() + 1
    rest = markdown[pos:]
    if rest.strip() or not segments:
        segments.append(Segment("text", rest.strip("\n")))
    return segments


@dataclass(frozen=True)
class Theme:
    """The colours rendered text needs beyond the label's own: Pygments' token colours
    are made readable on `code_background`; links take `link`, not the application
    palette's, which is light while a chat pinned dark is shown."""

    dark: bool
    foreground: str
    code_background: str
    border: str
    link: str


# Pygments styles with a light and a dark background; token colours that do not reach
# READABLE_CONTRAST on the bubble's code background are moved towards the text colour.
_STYLES = {False: "default", True: "github-dark"}


@lru_cache(maxsize=4)
def _formatter(theme: Theme) -> HtmlFormatter:
    base = get_style_by_name(_STYLES[theme.dark])
    styles: dict[Any, str] = {}
    for token, spec in base:
        if token in Whitespace:
            continue  # invisible: a colour would only lengthen the HTML
        words = ["bold"] if spec["bold"] else []
        if spec["italic"]:
            words.append("italic")
        if spec["color"]:
            color = f"#{spec['color']}"
            for step in range(1, 11):
                if contrast(color, theme.code_background) >= READABLE_CONTRAST:
                    break
                color = blend(f"#{spec['color']}", theme.foreground, step / 10)
            words.append(color)
        styles[token] = " ".join(words)
    style = type("FolioCodeStyle", (Style,), {"styles": styles, "background_color": "none"})
    return HtmlFormatter(style=style, noclasses=True, nowrap=True)


# Plain signatures of the languages a chat most often shows, for a fence without a
# language: Pygments' own guess (guess_lexer) calls two lines of Python "scdoc".
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "python": (r"^\s*(def|class) \w+.*:\s*$", r"^\s*(import \w+|from [\w.]+ import)", r"\bself\.",
               r"^\s*(elif|except)\b.*:", r"\bprint\("),
    "javascript": (r"\b(const|let) \w+ =", r"\bfunction\s*\w*\(", r"=>", r"console\.log\("),
    "bash": (r"^#!/bin/(ba|z)?sh", r"^\s*(\$ )?(sudo|apt|pip|npm|cd|ls|echo|export|git|curl) ",
             r"\$\{?\w+\}?"),
    "c": (r"^#include\s*[<\"]", r"\bint main\(", r"\bprintf\("),
    "cpp": (r"\bstd::", r"^#include <\w+>$", r"\btemplate\s*<"),
    "rust": (r"\bfn \w+\(", r"\blet mut\b", r"\w+!\(", r"\bimpl\b"),
    "go": (r"^package \w+", r"\bfunc \w+\(", r":="),
    "java": (r"\bpublic (static )?(class|void)\b", r"System\.out\."),
    "sql": (r"(?i)^\s*(select|insert into|create table|update|delete from)\b",),
    "html": (r"^\s*<(!DOCTYPE|html|div|p|span|body|head)\b",),
    "json": (r"^\s*[{\[]\s*$", r'^\s*"[^"]+":\s'),
    "yaml": (r"^[\w-]+:\s*$", r"^\s+- \w+"),
}  # fmt: skip
_COMPILED = {lang: [re.compile(p, re.M) for p in pats] for lang, pats in _SIGNATURES.items()}


def guess_language(code: str) -> str:
    """The language whose signatures the code matches most, or "" when none match."""
    scores = {lang: sum(bool(p.search(code)) for p in pats) for lang, pats in _COMPILED.items()}
    best = max(scores, key=scores.__getitem__)
    return best if scores[best] else ""


def _lexer(language: str) -> Lexer:
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return TextLexer()


@dataclass(frozen=True)
class HighlightedCode:
    html: str  # a <pre> block of Pygments spans, for a rich-text label
    language: str  # what the block's header shows: the fence's word or the guess
    guessed: bool


def highlight(code: str, language: str, theme: Theme, closed: bool = True) -> HighlightedCode:
    """``code`` in Pygments' colours for ``theme``; a finished block (``closed``) is
    highlighted once and cached. A block without a language is guessed once it is
    finished, and shown plain while it streams."""
    if closed:
        return _highlight_cached(code, language, theme)
    return _highlight(code, language, theme, guess=False)


def _highlight(code: str, language: str, theme: Theme, guess: bool = True) -> HighlightedCode:
    guessed = False
    if not language and guess:
        language = guess_language(code)
        guessed = bool(language)
    body = (
        pygments_highlight(code, _lexer(language), _formatter(theme))
        if language
        else html.escape(code)
    )
    return HighlightedCode(
        f'<pre style="white-space: pre-wrap; margin: 0">{body}</pre>', language, guessed
    )


_highlight_cached = lru_cache(maxsize=512)(_highlight)


# -- prose ------------------------------------------------------------------------------


def _image(self: Any, tokens: list, idx: int, options: Any, env: dict) -> str:
    token = tokens[idx]
    src = html.escape(token.attrGet("src") or "")
    alt = html.escape(self.renderInlineAsText(token.children or [], options, env))
    link = env["theme"].link
    return f'<a href="{src}" style="color: {link}">[image: {alt}] {src}</a>'


def _link_open(self: Any, tokens: list, idx: int, options: Any, env: dict) -> str:
    tokens[idx].attrSet("style", f"color: {env['theme'].link}")
    return self.renderToken(tokens, idx, options, env)


def _table_open(self: Any, tokens: list, idx: int, options: Any, env: dict) -> str:
    border = env["theme"].border
    return (
        '<table border="1" cellspacing="0" cellpadding="4" '
        f'style="border-collapse: collapse; border-color: {border}; border-style: solid; '
        'margin-top: 4px; margin-bottom: 8px">'
    )


def _paragraph_open(self: Any, tokens: list, idx: int, options: Any, env: dict) -> str:
    # Qt gives a paragraph a 12 px margin above and below: too airy inside a bubble.
    tokens[idx].attrSet("style", "margin-top: 0px; margin-bottom: 6px")
    return self.renderToken(tokens, idx, options, env)


def _code_inline(self: Any, tokens: list, idx: int, options: Any, env: dict) -> str:
    code = html.escape(tokens[idx].content)
    return f'<code style="background-color: {env["theme"].code_background}">{code}</code>'


def _fence(self: Any, tokens: list, idx: int, options: Any, env: dict) -> str:
    """A code block inside prose (in a list item, say): highlighted, without a copy
    button of its own."""
    token = tokens[idx]
    language = token.info.strip().split(" ")[0] if token.info else ""
    return highlight(token.content.rstrip("\n"), language, env["theme"]).html


def _markdown() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
    for name, rule in (
        ("image", _image),
        ("link_open", _link_open),
        ("table_open", _table_open),
        ("paragraph_open", _paragraph_open),
        ("code_inline", _code_inline),
        ("fence", _fence),
        ("code_block", _fence),
    ):
        md.add_render_rule(name, rule)
    return md


_MD = _markdown()


@lru_cache(maxsize=1024)
def prose_html(markdown: str, theme: Theme) -> str:
    """Markdown prose as Qt rich text: raw HTML escaped, images as links, tables as
    tables."""
    return _MD.render(markdown, {"theme": theme})
