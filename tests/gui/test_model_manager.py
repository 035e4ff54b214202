"""The Models window against the fake Hub of tests/engine/hub_server.py (offscreen Qt)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from PySide6.QtWidgets import QMessageBox

from engine import paths
from engine.cache.disk_tier import list_stores
from engine.cache.kv_cache import CacheSettings
from engine.hub.downloads import DownloadManager
from engine.hub.errors import UNREACHABLE
from engine.hub.transfer import DownloadState
from engine.units import format_bytes
from gui.model_manager import DISCOVER, DOWNLOADS, MY_MODELS, ModelManager
from gui.models.downloads import BAR_STEPS
from tests.engine.hub_server import FakeHub
from tests.engine.test_hub import tiny_gguf

GGUF_REPO = "folio-test/Tiny-GGUF"
BROKEN_REPO = "folio-test/Broken-GGUF"
Q8 = "tiny.Q8_0.gguf"
SPLIT = "tiny-Q4_K_M-00001-of-00002.gguf"
TIMEOUT = 10_000


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "a.gguf")


@pytest.fixture
def hub(tmp_path, monkeypatch, model_bytes):
    server = FakeHub()
    server.add_repo(
        GGUF_REPO,
        {"README.md": b"# tiny\n", Q8: model_bytes, SPLIT: b"x" * 2000},
        downloads=500,
        likes=3,
        gguf={"architecture": "llama", "context_length": 256},
    )
    server.add_repo(
        BROKEN_REPO,
        {"broken.Q8_0.gguf": model_bytes},
        downloads=20,
        likes=9,
        gguf={"architecture": "llama"},
        wrong_sha256={"broken.Q8_0.gguf"},
    )
    yield from server.serve_isolated(monkeypatch, tmp_path)


def make_dialog(qtbot) -> ModelManager:
    # A 256-token cache of 16-token pages; progress on every chunk so the test sees it.
    dialog = ModelManager(
        cache_settings=lambda: CacheSettings(page_size=16, token_budget=256),
        manager=DownloadManager(progress_interval_s=0),
    )
    dialog.discover.free_memory = lambda: 10**12
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


@pytest.fixture
def dialog(qtbot, hub):
    d = make_dialog(qtbot)
    yield d
    d.shutdown()


def search(qtbot, dialog: ModelManager, text: str = "") -> list[str]:
    dialog.discover.query.setText(text)
    dialog.discover.search_button.click()
    qtbot.waitUntil(lambda: not dialog.discover.runner.busy, timeout=TIMEOUT)
    return [r.repo_id for r in dialog.discover.results]


def open_repo(qtbot, dialog: ModelManager, repo_id: str) -> dict[str, str]:
    """Select ``repo_id`` in the results; its files' fit chips, by file name."""
    tab = dialog.discover
    row = [r.repo_id for r in tab.results].index(repo_id)
    tab.results_table.selectRow(row)
    qtbot.waitUntil(lambda: tab.details is not None, timeout=TIMEOUT)
    return {
        c.name: tab.files_table.cellWidget(i, 3).text()
        for i, c in enumerate(tab.details.candidates)
    }


def download(
    qtbot, dialog: ModelManager, repo_id: str, name: str, before: Callable[[], None] = lambda: None
) -> int:
    search(qtbot, dialog)
    open_repo(qtbot, dialog, repo_id)
    before()  # e.g. a pause in the transfer, set after the header peek has read the file
    dialog.discover.select_candidate(name)
    assert dialog.discover.download_button.isEnabled()
    dialog.discover.download_button.click()
    qtbot.waitUntil(lambda: len(dialog.downloads.order) == 1, timeout=TIMEOUT)
    return dialog.downloads.order[0]


def state_text(dialog: ModelManager, job_id: int) -> str:
    return dialog.downloads.table.item(dialog.downloads.row_of(job_id), 4).text()


# --------------------------------------------------------------------------- discover


def test_search_shows_results_and_files_with_fit_labels(qtbot, dialog, hub):
    assert search(qtbot, dialog) == [GGUF_REPO, BROKEN_REPO]  # most downloads first
    table = dialog.discover.results_table
    assert table.rowCount() == 2 and table.item(0, 0).text() == GGUF_REPO
    assert table.item(0, 1).text() == "500"
    dialog.discover.sort.setCurrentIndex(1)  # most likes: a new search
    qtbot.waitUntil(lambda: dialog.discover.results[0].repo_id == BROKEN_REPO, timeout=TIMEOUT)
    assert search(qtbot, dialog, "tiny") == [GGUF_REPO]

    chips = open_repo(qtbot, dialog, GGUF_REPO)
    assert chips == {Q8: "Fits", SPLIT: "Can't run"}
    files = dialog.discover.files_table
    assert files.item(0, 1).text() == "Q8_0 ✓"  # confirmed by the header peek
    tip = files.cellWidget(0, 3).toolTip()
    assert "256 tokens" in tip and "KV cache" in tip and "runtime" in tip
    assert dialog.discover.fits[Q8].kv_bytes > 0  # layers and heads came from the header
    dialog.discover.select_candidate(SPLIT)
    assert not dialog.discover.download_button.isEnabled()
    assert "split" in files.cellWidget(1, 3).toolTip()

    # Less free memory than the model needs: the same file no longer fits.
    dialog.discover.free_memory = lambda: 10**6
    dialog.discover.refresh_fits()
    assert files.cellWidget(0, 3).text() == "Won't fit"
    # The Engine settings' device is a GPU: the fit is against its free memory
    assert dialog.discover.fits[Q8].device == "cpu"
    dialog.discover.device = lambda: "cuda:0"
    dialog.discover.refresh_fits()
    assert dialog.discover.fits[Q8].device == "cuda:0"
    assert f"free memory on cuda:0 now: {format_bytes(10**6)}" in files.cellWidget(0, 3).toolTip()


def test_unreachable_hub_shows_plain_words(qtbot, dialog, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert search(qtbot, dialog, "tiny") == []
    message = dialog.discover.message
    assert message.text() == UNREACHABLE and message.property("kind") == "error"
    dialog.discover.select_repo(GGUF_REPO)
    qtbot.waitUntil(lambda: not dialog.discover.runner.busy, timeout=TIMEOUT)
    assert message.text() == UNREACHABLE and dialog.discover.details is None


# --------------------------------------------------------------------------- downloads


def test_download_completes_and_appears_in_my_models(qtbot, dialog, hub, model_bytes, tmp_path):
    job = download(qtbot, dialog, GGUF_REPO, Q8)
    assert dialog.tabs.tabText(DOWNLOADS).startswith("Downloads")
    qtbot.waitUntil(lambda: state_text(dialog, job) == "Done", timeout=TIMEOUT)
    bar = dialog.downloads.rows[job].bar
    assert bar.value() == bar.maximum() == BAR_STEPS and "100%" in bar.text()
    target = tmp_path / "models" / "folio-test--Tiny-GGUF" / Q8
    assert target.read_bytes() == model_bytes

    dialog.tabs.setCurrentIndex(MY_MODELS)
    library = dialog.library
    qtbot.waitUntil(lambda: library.select_path(target), timeout=TIMEOUT)
    row = library.table.currentRow()
    assert library.table.item(row, 1).text() == "GGUF"
    assert library.table.item(row, 2).text() == "Q8_0"
    assert library.table.item(row, 6).text() == "Folio"
    with qtbot.waitSignal(dialog.load_requested, timeout=1000) as loaded:
        library.load_button.click()
    assert loaded.args == [target]


def test_cancel_then_resume_completes(qtbot, dialog, hub, model_bytes, tmp_path):
    release = threading.Event()

    def pause() -> None:
        hub.pause_at[(GGUF_REPO, Q8)] = (len(model_bytes) // 3, release)

    job = download(qtbot, dialog, GGUF_REPO, Q8, before=pause)
    assert hub.paused.wait(10)
    qtbot.waitUntil(lambda: dialog.downloads.last[job].done_bytes > 0, timeout=TIMEOUT)
    widgets = dialog.downloads.rows[job]
    assert widgets.cancel.isEnabled() and not widgets.resume.isEnabled()
    widgets.cancel.click()
    release.set()  # the next chunk arrives, sees the cancel and stops
    qtbot.waitUntil(lambda: state_text(dialog, job) == "Cancelled", timeout=TIMEOUT)
    partial = tmp_path / "models" / "folio-test--Tiny-GGUF" / (Q8 + ".incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < len(model_bytes)
    assert 0 < widgets.bar.value() < BAR_STEPS

    assert widgets.resume.isEnabled()
    widgets.resume.click()
    qtbot.waitUntil(lambda: state_text(dialog, job) == "Done", timeout=TIMEOUT)
    assert widgets.bar.value() == BAR_STEPS and not partial.exists()
    ranges = [r[2] for r in hub.requests if r[1].startswith("/cdn/") and r[0] == "GET"]
    assert ranges[-1] == f"bytes={kept}-"  # only the missing bytes were fetched


def test_unfinished_download_of_an_earlier_run_resumes_on_open(qtbot, hub, model_bytes, tmp_path):
    from engine.hub.remote import list_repo_models

    release = threading.Event()
    hub.pause_at[(GGUF_REPO, Q8)] = (len(model_bytes) // 2, release)
    earlier = DownloadManager(progress_interval_s=0)
    job = earlier.enqueue(list_repo_models(GGUF_REPO).candidate(Q8))
    assert hub.paused.wait(10)
    earlier.cancel(job)
    release.set()
    assert earlier.wait(job, 10).state == DownloadState.CANCELLED
    earlier.close()

    dialog = make_dialog(qtbot)  # showing it resumes what the earlier "run" left
    try:
        qtbot.waitUntil(lambda: len(dialog.downloads.order) == 1, timeout=TIMEOUT)
        (job,) = dialog.downloads.order
        qtbot.waitUntil(lambda: state_text(dialog, job) == "Done", timeout=TIMEOUT)
        assert (tmp_path / "models" / "folio-test--Tiny-GGUF" / Q8).read_bytes() == model_bytes
    finally:
        dialog.shutdown()


def test_verification_failure_shows_its_message(qtbot, dialog, tmp_path):
    job = download(qtbot, dialog, BROKEN_REPO, "broken.Q8_0.gguf")
    qtbot.waitUntil(lambda: state_text(dialog, job) == "Failed", timeout=TIMEOUT)
    message = dialog.downloads.errors
    assert "damaged" in message.text() and "SHA-256" in message.text()
    assert message.property("kind") == "error"
    assert "damaged" in dialog.downloads.table.item(0, 4).toolTip()
    assert not (tmp_path / "models" / "folio-test--Broken-GGUF" / "broken.Q8_0.gguf").exists()
    widgets = dialog.downloads.rows[job]
    assert widgets.resume.isEnabled() and widgets.discard.isEnabled()
    widgets.discard.click()
    assert dialog.downloads.table.rowCount() == 0 and not dialog.downloads.errors.text()


# --------------------------------------------------------------------------- my models


def put_model(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "models" / "folio-test--Tiny-GGUF" / Q8
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return path


def test_delete_asks_then_reports_the_freed_bytes(
    qtbot, dialog, model_bytes, tmp_path, monkeypatch
):
    path = put_model(tmp_path, model_bytes)
    dialog.tabs.setCurrentIndex(MY_MODELS)
    library = dialog.library
    qtbot.waitUntil(lambda: library.select_path(path), timeout=TIMEOUT)

    asked: list[str] = []

    def answer(choice):
        def question(parent, title, text, *args):
            asked.append(text)
            return choice

        return question

    monkeypatch.setattr(QMessageBox, "question", answer(QMessageBox.StandardButton.No))
    library.delete_button.click()
    assert path.exists() and format_bytes(len(model_bytes)) in asked[0]

    monkeypatch.setattr(QMessageBox, "question", answer(QMessageBox.StandardButton.Yes))
    library.delete_button.click()
    assert not path.exists()
    freed = format_bytes(len(model_bytes), "MB")
    assert library.message.text() == f"Deleted {path.stem}: {freed} freed."
    qtbot.waitUntil(lambda: library.table.rowCount() == 0, timeout=TIMEOUT)


def test_deleting_a_model_deletes_its_prompt_cache(qtbot, hub, model_bytes, tmp_path, monkeypatch):
    """Its stores at the default location (delete_model's, once) and at the app's own
    location go; another model's stay; the message says how much of each was freed, and
    that the store the loaded model is writing stays."""
    from tests.gui.test_disk_cache import disk_store

    custom = tmp_path / "my-kv"
    dialog = ModelManager(
        cache_settings=lambda: CacheSettings(page_size=16, disk_dir=str(custom)),
        manager=DownloadManager(progress_interval_s=0),
    )
    qtbot.addWidget(dialog)
    path = put_model(tmp_path, model_bytes)
    other = tmp_path / "other.gguf"
    for location, pages in ((paths.kv_cache_dir(), 8), (custom, 4)):
        disk_store(location, path, pages).close()
        disk_store(location, other, 2).close()
    loaded = disk_store(paths.kv_cache_dir(), path, 1, page_size=32)  # this engine's, in use
    kept = format_bytes(
        next(st.bytes for st in list_stores(paths.kv_cache_dir()) if st.in_use), "MB"
    )
    mine = {
        loc: [st for st in list_stores(loc) if st.model == path.stem]
        for loc in (paths.kv_cache_dir(), custom)
    }
    dialog.tabs.setCurrentIndex(MY_MODELS)
    library = dialog.library
    qtbot.waitUntil(lambda: library.select_path(path), timeout=TIMEOUT)
    library.delete_selected(confirm=False)
    assert not path.exists()
    default_mb = format_bytes(mine[paths.kv_cache_dir()][0].bytes, "MB")
    custom_mb = format_bytes(mine[custom][0].bytes, "MB")
    assert library.message.text() == (
        f"Deleted {path.stem}: {format_bytes(len(model_bytes), 'MB')} freed and {default_mb} of"
        f" its prompt cache; also {custom_mb} of its prompt cache in {custom}; its prompt cache"
        f" in use ({kept}) stays while the model is loaded:"
        " Engine settings ▸ Clear disk cache frees it once another model runs."
    )
    assert [st.model for st in list_stores(custom)] == ["other"]
    left = list_stores(paths.kv_cache_dir())
    assert sorted(st.model for st in left) == ["other", path.stem] and loaded.directory.exists()
    loaded.close()
    dialog.shutdown()


def test_import_shows_validation_errors_and_lists_a_good_model(
    qtbot, dialog, model_bytes, tmp_path
):
    dialog.tabs.setCurrentIndex(MY_MODELS)
    library = dialog.library
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, not a model")
    assert library.import_path(bad) is None
    assert "not a GGUF model file" in library.message.text()
    assert library.message.property("kind") == "error"
    folder = tmp_path / "empty-folder"
    folder.mkdir()
    assert library.import_path(folder) is None
    assert "no config.json" in library.message.text()

    good = tmp_path / "elsewhere" / "mine.gguf"
    good.parent.mkdir()
    good.write_bytes(model_bytes)
    assert library.import_path(good) is not None
    qtbot.waitUntil(lambda: library.select_path(good), timeout=TIMEOUT)
    assert library.table.item(library.table.currentRow(), 6).text() == "Imported"


def test_token_is_saved_and_says_where(qtbot, dialog, tmp_path):
    dialog.token.setText("hf_secret")
    dialog.token_button.click()
    text = dialog.token_message.text()
    assert str(tmp_path / "config" / "settings.json") in text or "keyring" in text
    assert dialog.token.text() == ""  # not left on screen
    from engine.hub.token import load_token

    assert load_token() == "hf_secret"
    dialog.token.setText("   ")
    dialog.token_button.click()
    assert "empty" in dialog.token_message.text()


def test_main_window_opens_one_models_window(qtbot, hub, tmp_path, monkeypatch):
    from PySide6.QtCore import QSettings

    from gui.main_window import MainWindow
    from gui.store import Store

    store = Store(tmp_path / "chats.sqlite3")
    window = MainWindow(store, QSettings(str(tmp_path / "f.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(window)
    file_menu = window.menuBar().actions()[0].menu()
    action = next(a for a in file_menu.actions() if a.text().startswith("&Models"))
    assert action.shortcut().toString() == "Ctrl+M"
    loads: list[Path] = []
    monkeypatch.setattr(window, "load_model", loads.append)
    try:
        action.trigger()
        first = window.model_manager
        assert first.isVisible() and first.tabs.currentIndex() == DISCOVER
        first.close()
        assert not first.isVisible()
        action.trigger()
        assert window.model_manager is first and first.isVisible()
        first.library.load_requested.emit(Path("/models/x.gguf"))
        assert loads == [Path("/models/x.gguf")]
    finally:
        window.model_manager.shutdown()
        window.close()
        store.close()
