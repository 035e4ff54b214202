"""System-prompt presets in the chat's "System prompt and sampling" panel: a built-in
fills the prompt and is saved with the chat; the user's own presets are kept with the
app's settings and come back in a new session; the picker follows the prompt."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings

from gui.chat.controller import ChatController
from gui.chat.presets import BUILTIN_PRESETS, Preset, PresetStore
from gui.chat.view import ChatView
from gui.store import Store
from tests.gui.test_chat import FakeBridge


@pytest.fixture
def view(qtbot, tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    controller = ChatController(store, FakeBridge())
    view = ChatView(store, controller)
    qtbot.addWidget(view)
    conv = store.create_conversation()
    view.show_conversation(conv.id)
    yield view
    view.save_settings()  # as the window does on close: no save left pending
    store.close()


def ini(tmp_path) -> QSettings:
    return QSettings(str(tmp_path / "folio.ini"), QSettings.Format.IniFormat)


def test_a_builtin_preset_fills_the_prompt_and_is_sent(view):
    picker = view.settings.presets
    names = [picker.combo.itemText(i) for i in range(picker.combo.count())]
    assert {"Concise assistant", "Coding helper", "Translator"} <= set(names)
    assert picker.combo.currentText() == "None"  # an empty prompt
    coding = next(p for p in BUILTIN_PRESETS if p.name == "Coding helper")
    picker.combo.activated.emit(picker.combo.findData("Coding helper"))  # the user's pick
    assert view.settings.system_prompt.toPlainText() == coding.system_prompt
    assert picker.combo.currentText() == "Coding helper"
    assert not picker.delete_button.isEnabled()  # built-ins stay
    view.save_settings()
    cid = view.conversation_id
    assert view.store.conversation(cid).system_prompt == coding.system_prompt
    request, _ = view.controller.request_for(
        cid, view.store.add_message(cid, None, "user", "hi"), 1
    )
    assert request.messages[0] == {"role": "system", "content": coding.system_prompt}
    view.settings.system_prompt.setPlainText(coding.system_prompt + " Use Python.")
    assert picker.combo.currentText() == "Custom"


def test_user_presets_persist_with_the_settings(view, tmp_path):
    view.settings.use_presets(PresetStore(ini(tmp_path)))
    picker = view.settings.presets
    view.settings.system_prompt.setPlainText("Answer like a pirate.")
    assert picker.save_current("Pirate") == Preset("Pirate", "Answer like a pirate.")
    assert picker.combo.currentText() == "Pirate" and picker.delete_button.isEnabled()
    with pytest.raises(ValueError, match="built-in"):
        picker.save_current("translator")
    # a later session: the preset is there, and picking it fills the prompt
    later = PresetStore(ini(tmp_path))
    assert later.user_presets() == [Preset("Pirate", "Answer like a pirate.")]
    view.settings.system_prompt.setPlainText("")
    view.settings.use_presets(later)
    picker.choose("Pirate")
    assert view.settings.system_prompt.toPlainText() == "Answer like a pirate."
    # saving under the same name replaces it; deleting removes it for good
    view.settings.system_prompt.setPlainText("Answer like a polite pirate.")
    picker.save_current("Pirate")
    assert PresetStore(ini(tmp_path)).user_presets() == [
        Preset("Pirate", "Answer like a polite pirate.")
    ]
    picker.delete_current()
    assert PresetStore(ini(tmp_path)).user_presets() == []
    assert picker.combo.findData("Pirate") == -1 and picker.combo.currentText() == "Custom"


def test_a_damaged_presets_setting_keeps_the_builtins(tmp_path):
    settings = ini(tmp_path)
    settings.setValue("chat/system_prompt_presets", "{not json")
    store = PresetStore(settings)
    assert store.user_presets() == [] and store.presets() == list(BUILTIN_PRESETS)
