"""Chat widgets without a model: Markdown split into prose and code, code copy,
folding long messages, figures text."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication

from gui.chat.bubble import FOLD_CHARS, CodeBlock, MessageBubble, format_figures
from gui.chat.markdown import Segment, split_segments


def test_split_segments_closed_and_streaming_fences():
    text = "Here:\n```python\nprint(1)\n```\nDone."
    assert split_segments(text) == [
        Segment("text", "Here:"),
        Segment("code", "print(1)", "python"),
        Segment("text", "Done."),
    ]
    # half-streamed: the open block runs to the end
    assert split_segments("Try\n```sh\nls -") == [
        Segment("text", "Try"),
        Segment("code", "ls -", "sh"),
    ]
    assert split_segments("") == [Segment("text", "")]


def test_bubble_renders_code_with_copy_and_updates_in_place(qtbot):
    bubble = MessageBubble(1, "assistant", [1])
    qtbot.addWidget(bubble)
    bubble.set_text("A\n```py\nx = 1")
    first_widgets = list(bubble._segment_widgets)
    bubble.set_text("A\n```py\nx = 1\ny = 2")  # same shape: no widget rebuilt
    assert bubble._segment_widgets == first_widgets
    code = [w for w in bubble._segment_widgets if isinstance(w, CodeBlock)][0]
    code.copy()
    assert QGuiApplication.clipboard().text() == "x = 1\ny = 2"


def test_long_user_message_is_folded(qtbot):
    bubble = MessageBubble(2, "user", [2, 5])
    qtbot.addWidget(bubble)
    bubble.set_text("word " * 1000)
    label = bubble._segment_widgets[0]
    assert len(label.text()) < FOLD_CHARS + 60 and not bubble.expand_button.isHidden()
    bubble.expand_button.click()
    assert len(bubble._segment_widgets[0].text()) == len("word " * 1000)
    assert bubble.version_label.text() == "1/2" and not bubble.prev_button.isEnabled()


def test_figures_text():
    stats = {
        "prompt_tokens": 412,
        "cached_tokens": 384,
        "new_tokens": 57,
        "time_prefill": 0.1,
        "prefill_tps": 280.0,
        "decode_tps": 61.5,
        "eos_reason": "cancelled",
    }
    text = format_figures(stats)
    assert text.startswith("412 prompt · 384 cached · 57 new · prefill 0.10 s")
    assert "decode 61.5 tok/s" in text and text.endswith("stopped")
    assert format_figures({}) == ""


def test_bubbles_follow_the_theme(qtbot):
    """The chat's colours come from the same light/dark palettes as the memory views:
    dark bubbles with light text in the dark theme, and back."""
    from PySide6.QtWidgets import QVBoxLayout, QWidget

    from gui.chat.bubble import DARK_BUBBLES, LIGHT_BUBBLES, bubble_style
    from gui.palette import DARK, LIGHT

    host = QWidget()
    qtbot.addWidget(host)
    bubble = MessageBubble(3, "assistant", [3])
    QVBoxLayout(host).addWidget(bubble)
    bubble.set_text("Hello")
    for pal, colors in ((DARK, DARK_BUBBLES), (LIGHT, LIGHT_BUBBLES)):
        host.setStyleSheet(bubble_style(pal))
        host.resize(300, 120)
        host.show()
        image = bubble.grab().toImage()
        background = image.pixelColor(image.width() // 2, image.height() - 4).name()
        assert background == colors.assistant.lower()
        text = bubble._segment_widgets[0].palette().color(bubble.foregroundRole()).name()
        assert text == pal.foreground.lower()
