"""How a reply is drawn: code blocks highlighted by Pygments in colours that read on
both themes, the language from the fence or guessed, Markdown tables as tables, images
as links naming them, raw HTML as the text the model wrote; finished blocks are
highlighted once, however often the reply is drawn again."""

from __future__ import annotations

import re

import pytest
from PySide6.QtGui import QGuiApplication, QTextDocument, QTextTable

from gui.chat import markdown
from gui.chat.bubble import DARK_BUBBLES, CodeBlock, MessageBubble, render_theme
from gui.chat.markdown import guess_language, highlight
from gui.palette import contrast

PYTHON = '''import os

class Walker:
    """Lists files."""

    def files(self, root: str = ".") -> list[str]:
        # every file below root
        return [f for f in os.listdir(root) if f.endswith(".py") and len(f) > 0x10]
'''


def bubble_with(qtbot, text: str, dark: bool = False) -> MessageBubble:
    bubble = MessageBubble(1, "assistant", [1], dark=dark)
    qtbot.addWidget(bubble)
    bubble.set_text(text)
    return bubble


def code_blocks(bubble: MessageBubble) -> list[CodeBlock]:
    return [w for w in bubble._segment_widgets if isinstance(w, CodeBlock)]


def prose(bubble: MessageBubble) -> str:
    return "".join(w.text() for w in bubble._segment_widgets if not isinstance(w, CodeBlock))


def test_a_python_block_is_highlighted_and_copy_gives_the_plain_code(qtbot):
    bubble = bubble_with(qtbot, f"Here:\n```python\n{PYTHON}```\nDone.")
    (block,) = code_blocks(bubble)
    shown = block.code.text()
    # Pygments' default style: keywords bold green, comments italic
    assert '<span style="color: #008000; font-weight: bold">def</span>' in shown
    assert re.search(
        r'<span style="[^"]*font-style: italic">(# every file below root)</span>', shown
    )
    assert block.language.text() == "python"
    block.copy()
    assert QGuiApplication.clipboard().text() == PYTHON.rstrip("\n")


@pytest.mark.parametrize("dark", [False, True])
def test_every_token_colour_reads_on_the_code_background(dark):
    theme = render_theme(dark)
    samples = [
        highlight(PYTHON, "python", theme).html,
        highlight('const x = {a: "b", n: 3}; // c\nfunction f() { return x; }', "js", theme).html,
        highlight('$ echo "$HOME" | grep -c x  # count\n', "bash", theme).html,
    ]
    colours = {c for html in samples for c in re.findall(r"color: (#[0-9A-Fa-f]{3,6})", html)}
    assert len(colours) >= 5  # really highlighted, in several colours
    for colour in colours:
        assert contrast(colour, theme.code_background) >= 4.5, colour


def test_the_language_is_guessed_once_a_bare_block_is_finished(qtbot):
    bubble = bubble_with(qtbot, f"```\n{PYTHON}")  # still streaming: shown plain
    (block,) = code_blocks(bubble)
    assert "<span" not in block.code.text() and block.language.text() == "code"
    bubble.set_text(f"```\n{PYTHON}```\n")
    assert block.language.text() == "python" and "guessed" in block.language.toolTip()
    assert '<span style="color: #008000; font-weight: bold">def</span>' in block.code.text()
    assert (
        guess_language('fn main() {\n    let mut v = vec![1];\n    println!("{v:?}");\n}') == "rust"
    )
    assert guess_language("SELECT name FROM users WHERE id = 3;") == "sql"
    assert guess_language("Just some words, nothing like code.") == ""


def test_a_markdown_table_is_a_table(qtbot):
    bubble = bubble_with(
        qtbot, "Sizes:\n\n| model | MB |\n|---|--:|\n| SmolLM2 | 270 |\n| Llama 1B | 808 |"
    )
    html = prose(bubble)
    assert "<table" in html and "<th>model</th>" in html and "<td>SmolLM2</td>" in html
    doc = QTextDocument()
    doc.setHtml(html)
    table = next(f for f in doc.rootFrame().childFrames() if isinstance(f, QTextTable))
    assert (table.rows(), table.columns()) == (3, 2)


def test_an_image_is_a_link_with_its_alt_text_never_fetched(qtbot):
    bubble = bubble_with(qtbot, "A cat: ![a grey cat](https://example.com/cat.png) there.")
    html = prose(bubble)
    link = re.compile(
        r'<a href="https://example.com/cat.png"[^>]*>'
        r"\[image: a grey cat\] https://example.com/cat.png</a>"
    )
    assert link.search(html) and "<img" not in html
    doc = QTextDocument()
    doc.setHtml(html)
    assert (
        doc.toPlainText().strip() == "A cat: [image: a grey cat] https://example.com/cat.png there."
    )


def test_raw_html_is_shown_as_text(qtbot):
    reply = (
        "<table><tr><td>cell</td></tr></table>\n\n"
        'Inline <b>bold</b> and <img src="https://example.com/x.png"> <script>alert(1)</script>'
    )
    bubble = bubble_with(qtbot, reply)
    html = prose(bubble)
    for tag in ("<table>", "<td>", "<b>", "<img", "<script>"):
        assert tag not in html
    doc = QTextDocument()
    doc.setHtml(html)
    shown = doc.toPlainText()
    assert "<table><tr><td>cell</td></tr></table>" in shown
    assert '<img src="https://example.com/x.png">' in shown and "<script>alert(1)</script>" in shown


def test_finished_blocks_are_highlighted_once(qtbot, monkeypatch):
    """Streaming draws the reply ten times a second and a finished reply is drawn again
    when the chat reloads: each finished block goes through Pygments once."""
    calls: list[str] = []
    real = markdown.pygments_highlight

    def counting(code, lexer, formatter):
        calls.append(code)
        return real(code, lexer, formatter)

    monkeypatch.setattr(markdown, "pygments_highlight", counting)
    markdown._highlight_cached.cache_clear()
    blocks = [f"def f{i}(x):\n    return x * {i}" for i in range(5)]
    reply = "".join(f"Step {i}:\n```python\n{b}\n```\n" for i, b in enumerate(blocks)) + "End."
    bubble = MessageBubble(1, "assistant", [1])
    qtbot.addWidget(bubble)
    first_widgets: list = []
    ticks = 0
    for end in range(0, len(reply) + 1, 7):
        bubble.set_text(reply[:end])
        ticks += 1
        if not first_widgets and len(bubble._segment_widgets) >= 2:
            first_widgets = bubble._segment_widgets[:2]
    bubble.set_text(reply)
    assert bubble._segment_widgets[:2] == first_widgets  # earlier widgets kept while streaming
    # per tick at most the open block, and each block once more when it closes
    assert len(calls) <= ticks + len(blocks)
    assert all(b in calls for b in blocks)
    calls.clear()
    bubble.set_text(reply + " And more.")  # prose after the blocks moved
    again = MessageBubble(2, "assistant", [2])  # the chat reloaded
    qtbot.addWidget(again)
    again.set_text(reply)
    assert calls == [] and len(code_blocks(again)) == 5


def test_dark_bubbles_highlight_in_dark_colours(qtbot):
    light = code_blocks(bubble_with(qtbot, f"```python\n{PYTHON}```"))[0].code.text()
    dark = code_blocks(bubble_with(qtbot, f"```python\n{PYTHON}```", dark=True))[0].code.text()
    assert light != dark
    # links too: the application palette's link blue is unreadable on a dark bubble
    link = prose(bubble_with(qtbot, "[docs](https://example.com)", dark=True))
    assert f'style="color: {DARK_BUBBLES.link}"' in link
    theme = render_theme(True)
    for colour in re.findall(r"color: (#[0-9A-Fa-f]{3,6})", dark):
        assert contrast(colour, theme.code_background) >= 4.5


def test_switching_the_theme_redraws_the_code_colours(qtbot, tmp_path):
    from gui.chat.controller import ChatController
    from gui.chat.view import ChatView
    from gui.store import Store
    from tests.gui.test_chat import FakeBridge

    store = Store(tmp_path / "chats.sqlite3")
    conv = store.create_conversation()
    store.add_message(conv.id, None, "assistant", f"```python\n{PYTHON}```")
    view = ChatView(store, ChatController(store, FakeBridge()))
    qtbot.addWidget(view)
    view.set_dark(False)
    view.show_conversation(conv.id)

    def shown() -> str:
        (bubble,) = view.bubbles.values()
        return code_blocks(bubble)[0].code.text()

    assert shown() == highlight(PYTHON.rstrip("\n"), "python", render_theme(False)).html
    view.set_dark(True)
    assert shown() == highlight(PYTHON.rstrip("\n"), "python", render_theme(True)).html
    store.close()
