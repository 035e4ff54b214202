"""The Discover tab: search the Hub, list a repository's models, say whether each fits.

The fit is priced for the KV cache the user has chosen (page size, K/V bits, token
budget: the settings the next load will use) against the RAM free now. Layers and
heads come from one GGUF header read (a Range request of a few hundred KB) or the
repository's config.json; every quantization of a repository shares them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from engine.cache.formats import width_name
from engine.cache.kv_cache import DEFAULT_TOKEN_BUDGET, CacheSettings
from engine.hub.errors import HubError
from engine.hub.fit import (
    COMFORT_FRACTION,
    CachePlan,
    FitEstimate,
    kv_bytes_per_token,
)
from engine.hub.fit import free_memory as system_free_memory
from engine.hub.remote import (
    ModelCandidate,
    ModelShape,
    RepoListing,
    RepoSummary,
    SearchSort,
    candidate_fit,
    confirm_quant,
    fetch_hf_config,
    hub_endpoint,
    list_repo_models,
    peek_gguf,
    search_models,
    shape_from_hf_config,
    shape_from_summary,
)
from engine.units import format_bytes
from gui.models.common import (
    busy_bar,
    chip,
    fmt_count,
    make_table,
    message_label,
    plain_error,
    set_message,
    table_item,
)
from gui.worker import TaskRunner

SORTS = (("Most downloads", SearchSort.DOWNLOADS), ("Most likes", SearchSort.LIKES),
         ("Recently updated", SearchSort.UPDATED))  # fmt: skip
FORMATS = (("GGUF", "gguf"), ("safetensors", "safetensors"))
SEARCH_LIMIT = 40
DEVICE = "cpu"  # where a model loads unless the window says otherwise (DiscoverTab.device)


@dataclass(frozen=True)
class RepoDetails:
    """A repository's listing plus the layer/head counts read for the fit."""

    listing: RepoListing
    candidates: tuple[ModelCandidate, ...]
    shapes: dict[str, ModelShape]  # candidate name -> shape (header weights when peeked)
    dims: ModelShape | None  # layers and heads shared by the repository's GGUF files
    note: str = ""  # why the fit is rough (header not read), in plain words


def fetch_details(repo_id: str) -> RepoDetails:
    """Runs on a pool thread: the listing, then one header peek for layers and heads."""
    listing = list_repo_models(repo_id)
    candidates = list(listing.candidates)
    shapes: dict[str, ModelShape] = {}
    dims = None
    note = ""
    try:
        first = next((c for c in candidates if c.kind == "gguf" and c.supported), None)
        if first is not None:
            summary = peek_gguf(repo_id, first.name, revision=listing.revision)
            candidates = [confirm_quant(c, summary) if c is first else c for c in candidates]
            shapes[first.name] = shape_from_summary(summary)
            dims = dataclasses.replace(shapes[first.name], weight_bytes=None)
        folder = next((c for c in candidates if c.kind == "safetensors"), None)
        if folder is not None:
            config = fetch_hf_config(repo_id, revision=listing.revision)
            shapes[folder.name] = shape_from_hf_config(config, None)
    except HubError as exc:
        # Still worth listing: the fit falls back to the file size and says so.
        note = f"header not read ({exc}); the fit counts the weights only"
    return RepoDetails(listing, tuple(candidates), shapes, dims, note)


def cache_plan(settings: CacheSettings, shape: ModelShape | None) -> tuple[CachePlan, str]:
    """The CachePlan for the cache the user chose; a byte budget becomes tokens per model."""
    tokens = settings.token_budget
    note = ""
    if settings.byte_budget is not None:
        tokens = None
        if shape is not None and shape.kv_known:
            dims = (shape.num_layers, shape.kv_heads, shape.head_dim)
            try:
                per_token = kv_bytes_per_token(*dims, settings.k_bits, settings.v_bits)
            except ValueError:  # head size not a multiple of 32: unquantized fallback
                per_token = kv_bytes_per_token(*dims)
            tokens = max(settings.page_size, settings.byte_budget // per_token)
        else:
            note = f"cache budget in MB, model shape unknown: priced for {DEFAULT_TOKEN_BUDGET:,} tokens"
    plan = CachePlan(
        context_tokens=tokens or DEFAULT_TOKEN_BUDGET,
        page_size=settings.page_size,
        k_bits=settings.k_bits,
        v_bits=settings.v_bits,
    )
    return plan, note


def fit_arithmetic(fit: FitEstimate, plan: CachePlan, extra_note: str = "") -> str:
    """The tooltip of a fit chip: every term of the sum, so the label can be checked."""
    k, v = width_name(plan.k_bits), width_name(plan.v_bits)
    lines = [f"weights {format_bytes(fit.weight_bytes)}"]
    if fit.kv_bytes:
        per_token = fit.kv_bytes // plan.cached_tokens
        lines.append(
            f"+ KV cache {format_bytes(fit.kv_bytes)} = {plan.cached_tokens:,} tokens"
            f" × {per_token:,} B (K {k}, V {v}, pages of {plan.page_size})"
        )
    lines.append(f"+ runtime {format_bytes(fit.runtime_bytes)}")
    free = format_bytes(fit.free_bytes) if fit.free_bytes is not None else "unknown"
    where = "RAM" if fit.device == "cpu" else f"memory on {fit.device}"
    lines.append(f"= needs {format_bytes(fit.need_bytes)}   (free {where} now: {free})")
    lines.append(
        f"Fits: at most {COMFORT_FRACTION:.0%} of free memory · Tight: up to all of it"
        " · Won't fit: more"
    )
    for note in (fit.note, extra_note):
        if note:
            lines.append(f"Note: {note}")
    return "\n".join(lines)


class DiscoverTab(QWidget):
    """Search → results → a repository's files with fit chips → Download."""

    download_requested = Signal(object)  # ModelCandidate

    def __init__(
        self,
        cache_settings: Callable[[], CacheSettings],
        parent: QWidget | None = None,
        device: Callable[[], str] | None = None,
    ):
        super().__init__(parent)
        self.cache_settings = cache_settings
        # Where a model would run ("cpu", "cuda:0": the Engine settings' device, resolved)
        self.device: Callable[[], str] = device or (lambda: DEVICE)
        # Replaceable (tests pin it): bytes free for a model now (RAM, or free VRAM on a
        # GPU), None when unknown.
        self.free_memory: Callable[[], int | None] = lambda: system_free_memory(self.device())
        self.runner = TaskRunner(self, describe_error=plain_error, thread_name="folio-hub")
        self.results: list[RepoSummary] = []
        self.details: RepoDetails | None = None
        self.fits: dict[str, FitEstimate] = {}

        layout = QVBoxLayout(self)
        row = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search the Hugging Face Hub, e.g. SmolLM2 or Qwen3")
        self.query.setClearButtonEnabled(True)
        self.sort = QComboBox()
        for text, sort in SORTS:
            self.sort.addItem(text, sort)
        self.format = QComboBox()
        for text, fmt in FORMATS:
            self.format.addItem(text, fmt)
        self.search_button = QPushButton("Search")
        self.search_button.setDefault(False)
        self.search_button.setAutoDefault(False)
        row.addWidget(self.query, 1)
        row.addWidget(self.sort)
        row.addWidget(self.format)
        row.addWidget(self.search_button)
        layout.addLayout(row)
        self.busy = busy_bar()
        layout.addWidget(self.busy)
        self.message = message_label()
        layout.addWidget(self.message)

        self.results_table = make_table(["Repository", "Downloads", "Likes", "Updated"])
        header = self.results_table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in (1, 2, 3):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)

        files_panel = QWidget()
        files_layout = QVBoxLayout(files_panel)
        files_layout.setContentsMargins(0, 0, 0, 0)
        self.repo_label = QLabel("Select a repository to see its models.")
        self.repo_label.setWordWrap(True)
        files_layout.addWidget(self.repo_label)
        self.files_table = make_table(["Model file", "Quant", "Size", "Fit", "Note"])
        header = self.files_table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in (1, 2, 3):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.Interactive)
        self.files_table.setColumnWidth(4, 260)
        self.files_table.setMinimumHeight(120)
        files_layout.addWidget(self.files_table, 1)
        bottom = QHBoxLayout()
        self.plan_label = QLabel()
        self.plan_label.setObjectName("plan_label")
        self.plan_label.setStyleSheet("color: palette(placeholder-text);")
        bottom.addWidget(self.plan_label, 1)
        self.download_button = QPushButton("Download")
        self.download_button.setEnabled(False)
        self.download_button.setAutoDefault(False)
        bottom.addWidget(self.download_button)
        files_layout.addLayout(bottom)

        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(self.results_table)
        splitter.addWidget(files_panel)
        splitter.setStretchFactor(0, 1)
        splitter.setStretchFactor(1, 1)
        layout.addWidget(splitter, 1)

        self.query.returnPressed.connect(self.search)
        self.search_button.clicked.connect(self.search)
        self.sort.currentIndexChanged.connect(lambda _: self.results and self.search())
        self.format.currentIndexChanged.connect(lambda _: self.results and self.search())
        self.results_table.itemSelectionChanged.connect(self._on_repo_selected)
        self.files_table.itemSelectionChanged.connect(self._update_download_button)
        self.files_table.cellDoubleClicked.connect(lambda *_: self.download_selected())
        self.download_button.clicked.connect(self.download_selected)
        self.runner.busy_changed.connect(self.busy.setVisible)
        self.runner.busy_changed.connect(lambda busy: self.search_button.setEnabled(not busy))

    # -- search -----------------------------------------------------------------------

    def search(self) -> None:
        query = self.query.text().strip()
        sort, fmt = self.sort.currentData(), self.format.currentData()
        set_message(self.message, f"Searching {hub_endpoint()}…")
        self.runner.run(
            "search",
            lambda: search_models(query, sort=sort, fmt=fmt, limit=SEARCH_LIMIT),
            self._show_results,
            self._show_error,
        )

    def _show_results(self, results: list[RepoSummary]) -> None:
        self.results = results
        table = self.results_table
        table.blockSignals(True)
        table.setRowCount(0)
        for r in results:
            row = table.rowCount()
            table.insertRow(row)
            name = r.repo_id + ("  (gated: needs a token)" if r.gated else "")
            table.setItem(row, 0, table_item(name, tooltip=r.repo_id))
            table.setItem(row, 1, table_item(fmt_count(r.downloads), True, f"{r.downloads or 0:,}"))
            table.setItem(row, 2, table_item(fmt_count(r.likes), True, f"{r.likes or 0:,}"))
            when = r.last_modified.date().isoformat() if r.last_modified else "?"
            table.setItem(row, 3, table_item(when, True))
        table.blockSignals(False)
        self._clear_files("Select a repository to see its models.")
        if results:
            set_message(self.message, f"{len(results)} repositories")
        else:
            set_message(self.message, "No repositories match; try fewer words or another format.")

    def _show_error(self, message: str) -> None:
        set_message(self.message, message, "error")

    # -- one repository ---------------------------------------------------------------

    def _on_repo_selected(self) -> None:
        rows = self.results_table.selectionModel().selectedRows()
        if not rows:
            return
        self.select_repo(self.results[rows[0].row()].repo_id)

    def select_repo(self, repo_id: str) -> None:
        self._clear_files(f"{repo_id}: reading the file list and one model header…")
        set_message(self.message, "")
        self.runner.run(
            "listing", lambda: fetch_details(repo_id), self._show_details, self._listing_failed
        )

    def _listing_failed(self, message: str) -> None:
        self._clear_files("")
        self._show_error(message)

    def _clear_files(self, text: str) -> None:
        self.details = None
        self.fits = {}
        self.files_table.setRowCount(0)
        self.repo_label.setText(text)
        self.plan_label.setText("")
        self._update_download_button()

    def _show_details(self, details: RepoDetails) -> None:
        self.details = details
        listing = details.listing
        facts = [listing.repo_id]
        if listing.architecture:
            facts.append(listing.architecture)
        if listing.context_length:
            facts.append(f"trained for {listing.context_length:,} tokens")
        if listing.gated:
            facts.append("gated")
        self.repo_label.setText(" · ".join(facts))
        if not details.candidates:
            self.repo_label.setText(
                f"{listing.repo_id} holds no GGUF file and no safetensors model Folio can load."
            )
        self.refresh_fits()

    def refresh_fits(self) -> None:
        """(Re)price every candidate: on a new listing, or when the cache settings changed."""
        details = self.details
        if details is None:
            return
        settings = self.cache_settings()
        free = self.free_memory()
        table = self.files_table
        table.setRowCount(0)
        self.fits = {}
        plan = None
        for c in details.candidates:
            row = table.rowCount()
            table.insertRow(row)
            shape = details.shapes.get(c.name, details.dims if c.kind == "gguf" else None)
            quant = (c.quant or "?") + (" ✓" if c.quant_confirmed else "")
            name = c.name if c.kind == "gguf" else f"{c.name} (safetensors folder)"
            table.setItem(row, 0, table_item(name, tooltip="\n".join(f.path for f in c.files)))
            quant_tip = (
                "checked against the file's header" if c.quant_confirmed else "from the file name"
            )
            table.setItem(row, 1, table_item(quant, tooltip=quant_tip))
            table.setItem(row, 2, table_item(format_bytes(c.size), True))
            if c.problem:
                table.setCellWidget(row, 3, chip("Can't run", c.problem))
                note = table_item(c.problem, tooltip=c.problem)
            else:
                plan, plan_note = cache_plan(settings, shape)
                fit = candidate_fit(
                    c,
                    shape,
                    plan,
                    self.device(),
                    free_bytes=free,
                    parameters=details.listing.parameters,
                )
                self.fits[c.name] = fit
                tip = fit_arithmetic(fit, plan, "; ".join(filter(None, (plan_note, details.note))))
                table.setCellWidget(row, 3, chip(fit.label.value, tip))
                note = table_item(fit.note or details.note, tooltip=tip)
            table.setItem(row, 4, note)
        table.resizeColumnToContents(3)
        if plan is not None:
            k, v = f"{width_name(plan.k_bits)} K", f"{width_name(plan.v_bits)} V"
            free_text = format_bytes(free) if free is not None else "unknown"
            self.plan_label.setText(
                f"Fit for {plan.context_tokens:,} cached tokens ({k}, {v}, pages of"
                f" {plan.page_size}) with {free_text} of RAM free. Change it in Engine settings."
            )
        if details.candidates:
            table.selectRow(next((i for i, c in enumerate(details.candidates) if c.supported), 0))
        self._update_download_button()

    # -- download ---------------------------------------------------------------------

    def selected_candidate(self) -> ModelCandidate | None:
        if self.details is None:
            return None
        rows = self.files_table.selectionModel().selectedRows()
        if not rows or rows[0].row() >= len(self.details.candidates):
            return None
        return self.details.candidates[rows[0].row()]

    def select_candidate(self, name: str) -> None:
        for i, c in enumerate(self.details.candidates if self.details else ()):
            if c.name == name:
                self.files_table.selectRow(i)
                return
        raise KeyError(name)

    def _update_download_button(self) -> None:
        c = self.selected_candidate()
        self.download_button.setEnabled(c is not None and c.supported)
        size = f" ({format_bytes(c.size)})" if c is not None and c.size else ""
        self.download_button.setText(
            f"Download {c.quant or ''}{size}".replace("  ", " ") if c else "Download"
        )
        if c is None:
            self.download_button.setToolTip("")
        elif c.problem:
            self.download_button.setToolTip(f"Folio cannot run this model: {c.problem}")
        else:
            self.download_button.setToolTip(f"Download {c.name} ({format_bytes(c.size)})")

    def download_selected(self) -> None:
        c = self.selected_candidate()
        if c is None or not c.supported:
            return
        self.download_requested.emit(c)
        set_message(self.message, f"{c.name} queued: see the Downloads tab.")
