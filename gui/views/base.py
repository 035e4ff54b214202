"""What the memory views share: the chat colours and the palette they draw with."""

from __future__ import annotations

from PySide6.QtWidgets import QWidget

from gui.palette import ChatColors, Palette, palette_for


class ChatColoredView(QWidget):
    """A view drawn in per-chat colours and a light or dark palette. The panel passes
    its own so every view agrees; a view built alone makes its own."""

    def __init__(
        self,
        chats: ChatColors | None = None,
        palette: Palette | None = None,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        self.chats = chats if chats is not None else ChatColors(parent=self)
        self.palette_ = palette if palette is not None else palette_for()
