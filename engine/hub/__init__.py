"""The model manager's logic: find models on the Hugging Face Hub, download them, list local ones.

Qt-free and safe to drive from a GUI: long work (downloads) runs on
:class:`DownloadManager`'s worker thread and reports immutable
:class:`DownloadProgress` snapshots; every failure is a :class:`HubError` whose text
can be shown as is. See docs/ARCHITECTURE.md ("engine/hub") for the whole picture.

- ``remote``: search, a repository's GGUF files / safetensors folder, header peeks
- ``fit``: weights + KV cache against free RAM or VRAM (Fits / Tight / Won't fit)
- ``gguf_info``: what a GGUF header tells before download (architecture, quant, weight bytes)
- ``transfer``: one resumable, verified download, and what unfinished ones left on disk
- ``downloads``: the download queue and its worker thread
- ``library``: local models (models folder, HF cache, imports), delete, import
- ``token``: the access token for gated repositories
"""

from engine.hub.downloads import DownloadManager
from engine.hub.errors import (
    DiskFullError,
    DownloadCancelled,
    FileNotOnHubError,
    GatedRepoError,
    HubError,
    HubUnreachableError,
    ModelValidationError,
    RepoNotFoundError,
    UnsupportedModelError,
    VerificationError,
)
from engine.hub.fit import (
    CachePlan,
    Fit,
    FitEstimate,
    estimate_fit,
    free_memory,
    kv_bytes_per_token,
)
from engine.hub.gguf_info import GGUFSummary, quant_from_filename, summary_from_file
from engine.hub.library import (
    DeleteResult,
    LocalModel,
    delete_model,
    import_model,
    list_local_models,
    mark_used,
    reveal_in_file_manager,
    validate_model,
)
from engine.hub.remote import (
    HubFile,
    ModelCandidate,
    ModelShape,
    RepoListing,
    RepoSummary,
    SearchSort,
    candidate_fit,
    confirm_quant,
    fetch_hf_config,
    list_repo_models,
    peek_gguf,
    search_models,
    shape_from_hf_config,
    shape_from_summary,
)
from engine.hub.token import TokenSaved, clear_token, load_token, save_token
from engine.hub.transfer import (
    CancelToken,
    DownloadProgress,
    DownloadRequest,
    DownloadState,
    discard_partial,
    download_model,
    pending_downloads,
)

__all__ = [
    "CachePlan",
    "CancelToken",
    "DeleteResult",
    "DiskFullError",
    "DownloadCancelled",
    "DownloadManager",
    "DownloadProgress",
    "DownloadRequest",
    "DownloadState",
    "FileNotOnHubError",
    "Fit",
    "FitEstimate",
    "GGUFSummary",
    "GatedRepoError",
    "HubError",
    "HubFile",
    "HubUnreachableError",
    "LocalModel",
    "ModelCandidate",
    "ModelShape",
    "ModelValidationError",
    "RepoListing",
    "RepoNotFoundError",
    "RepoSummary",
    "SearchSort",
    "TokenSaved",
    "UnsupportedModelError",
    "VerificationError",
    "candidate_fit",
    "clear_token",
    "confirm_quant",
    "delete_model",
    "discard_partial",
    "download_model",
    "estimate_fit",
    "fetch_hf_config",
    "free_memory",
    "import_model",
    "kv_bytes_per_token",
    "list_local_models",
    "list_repo_models",
    "load_token",
    "mark_used",
    "peek_gguf",
    "pending_downloads",
    "quant_from_filename",
    "reveal_in_file_manager",
    "save_token",
    "search_models",
    "shape_from_hf_config",
    "shape_from_summary",
    "summary_from_file",
    "validate_model",
]
