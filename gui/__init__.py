"""Folio's desktop app (PySide6). Depends on `engine`; the engine never imports Qt.

`gui.bridge.EngineBridge` is the only object that talks to the engine; `gui.app.main`
is the entry point behind `folio` and `folio app`.
"""
