"""System-prompt presets: a few built in, and the user's own, kept with the app's
settings (QSettings) so every chat and every later session can pick them.

A preset only fills the chat's system prompt; the chat stores the text, not the
preset, so editing or deleting a preset never changes a chat already started.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QSettings, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QInputDialog,
    QMessageBox,
    QToolButton,
    QWidget,
)


@dataclass(frozen=True)
class Preset:
    name: str
    system_prompt: str
    builtin: bool = False


BUILTIN_PRESETS = (
    Preset(
        "Concise assistant",
        "You are a helpful assistant. Answer briefly and directly; use a list only when it "
        "helps, and say so when you are not sure.",
        True,
    ),
    Preset(
        "Coding helper",
        "You are an experienced programmer. Give working code in fenced Markdown blocks "
        "that name the language, explain it in a few sentences, and point out edge cases.",
        True,
    ),
    Preset(
        "Translator",
        "You are a translator. Translate each message into English, or, when it is already "
        "in English, into the language the user asks for. Reply with the translation only.",
        True,
    ),
    Preset(
        "Writing editor",
        "Improve the clarity, grammar and flow of the user's text, keeping its meaning and "
        "tone. Reply with the revised text, then a short list of the main changes.",
        True,
    ),
    Preset(
        "Explain simply",
        "Explain things in plain words a curious twelve-year-old would follow, with one "
        "everyday example.",
        True,
    ),
)

SETTINGS_KEY = "chat/system_prompt_presets"


class PresetStore:
    """The built-in presets and the user's, these kept under `SETTINGS_KEY` as JSON; with
    no settings (tests, a bare view) the user's live in memory only."""

    def __init__(self, settings: QSettings | None = None):
        self.settings = settings
        self._memory: list[Preset] = []

    def user_presets(self) -> list[Preset]:
        if self.settings is None:
            return list(self._memory)
        try:
            items = json.loads(str(self.settings.value(SETTINGS_KEY) or "[]"))
        except ValueError:
            return []  # a hand-edited file: the built-ins still work
        return [
            Preset(str(item["name"]), str(item["system_prompt"]))
            for item in items
            if isinstance(item, dict) and "name" in item and "system_prompt" in item
        ]

    def presets(self) -> list[Preset]:
        return [*BUILTIN_PRESETS, *self.user_presets()]

    def save(self, name: str, system_prompt: str) -> Preset:
        """Add a preset, or replace the user's preset of that name. A built-in's name is
        refused (ValueError): the built-ins are the same on every install."""
        name = name.strip()
        if not name:
            raise ValueError("A preset needs a name.")
        if any(p.name.casefold() == name.casefold() for p in BUILTIN_PRESETS):
            raise ValueError(f"“{name}” is a built-in preset; choose another name.")
        kept = [p for p in self.user_presets() if p.name.casefold() != name.casefold()]
        preset = Preset(name, system_prompt)
        self._write([*kept, preset])
        return preset

    def delete(self, name: str) -> None:
        self._write([p for p in self.user_presets() if p.name != name])

    def matching(self, system_prompt: str) -> Preset | None:
        """The preset whose text this is (whitespace at the ends aside), if any."""
        text = system_prompt.strip()
        return next((p for p in self.presets() if p.system_prompt.strip() == text), None)

    def _write(self, presets: list[Preset]) -> None:
        if self.settings is None:
            self._memory = presets
            return
        items = [{"name": p.name, "system_prompt": p.system_prompt} for p in presets]
        self.settings.setValue(SETTINGS_KEY, json.dumps(items))
        self.settings.sync()


class PresetPicker(QWidget):
    """A preset list that fills the system prompt, "Save as preset…" for the prompt
    being shown, and "Delete" for a preset of the user's. It follows the prompt: the
    preset it matches is shown, "Custom" when it matches none."""

    chosen = Signal(str)  # the system prompt of the preset the user picked

    def __init__(self, current_prompt: Callable[[], str], parent: QWidget | None = None):
        super().__init__(parent)
        self.store = PresetStore()
        self.current_prompt = current_prompt
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.combo = QComboBox()
        self.combo.setToolTip("Fill the system prompt from a preset")
        self.combo.setMinimumContentsLength(12)
        self.combo.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon
        )
        self.save_button = QToolButton()
        self.save_button.setText("Save as preset…")
        self.save_button.setToolTip("Keep this system prompt as a preset for other chats")
        self.delete_button = QToolButton()
        self.delete_button.setText("Delete preset")
        self.delete_button.setToolTip("Delete this preset (chats that use its text keep it)")
        layout.addWidget(self.combo)
        layout.addWidget(self.save_button)
        layout.addWidget(self.delete_button)
        layout.addStretch(1)
        self.combo.activated.connect(self._on_activated)
        self.save_button.clicked.connect(lambda: self.save_current())
        self.delete_button.clicked.connect(self.delete_current)
        self.refresh()

    def use_store(self, store: PresetStore) -> None:
        self.store = store
        self.refresh()

    def refresh(self) -> None:
        """Refill the list and select the preset the prompt matches."""
        self.combo.clear()
        self.combo.addItem("Custom", None)
        builtins = len(BUILTIN_PRESETS)
        for i, preset in enumerate(self.store.presets()):
            if i == builtins:
                self.combo.insertSeparator(self.combo.count())
            self.combo.addItem(preset.name, preset.name)
        self.show_prompt(self.current_prompt())

    def show_prompt(self, system_prompt: str) -> None:
        match = self.store.matching(system_prompt)
        index = self.combo.findData(match.name) if match is not None else 0
        self.combo.setItemText(0, "Custom" if system_prompt.strip() else "None")
        self.combo.setCurrentIndex(max(index, 0))
        self.delete_button.setEnabled(match is not None and not match.builtin)

    def choose(self, name: str) -> None:
        preset = next((p for p in self.store.presets() if p.name == name), None)
        if preset is not None:
            self.chosen.emit(preset.system_prompt)

    def _on_activated(self, index: int) -> None:
        name = self.combo.itemData(index)
        if name is not None:
            self.choose(name)

    def save_current(self, name: str | None = None) -> Preset | None:
        """Save the prompt being shown as a preset. With no ``name`` the user is asked,
        and told when the name is refused; a given name that is refused raises
        ValueError."""
        if name is None:
            name, ok = QInputDialog.getText(self, "Save as preset", "Preset name")
            if not ok:
                return None
            try:
                preset = self.store.save(name, self.current_prompt())
            except ValueError as exc:
                QMessageBox.warning(self, "Preset not saved", str(exc))
                return None
        else:
            preset = self.store.save(name, self.current_prompt())
        self.refresh()
        return preset

    def delete_current(self) -> None:
        name = self.combo.currentData()
        if name is not None:
            self.store.delete(name)
            self.refresh()
