"""Discover models on the Hugging Face Hub: search, a repository's loadable models, headers.

Everything goes through ``huggingface_hub`` (``HfApi.list_models``, ``HfApi.model_info``
with file metadata, ``get_hf_file_metadata`` for a file's size, ETag and download
location, its HTTP session for Range reads). The endpoint is read from ``HF_ENDPOINT``
at *call* time and passed explicitly, because huggingface_hub reads it once at import.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.hub.errors import HubError, HubUnreachableError, explain
from engine.hub.fit import CachePlan, FitEstimate, estimate_fit, kv_bytes_per_token
from engine.hub.gguf_info import (
    GGUFSummary,
    is_split_gguf,
    quant_from_filename,
    summary_from_prefix,
)
from engine.hub.token import load_token

__all__ = [
    "HubFile",
    "ModelCandidate",
    "ModelShape",
    "RemoteFile",
    "RepoListing",
    "RepoSummary",
    "SearchSort",
    "candidate_fit",
    "fetch_hf_config",
    "http_timeout",
    "hub_endpoint",
    "list_repo_models",
    "peek_gguf",
    "resolve_file",
    "search_models",
    "shape_from_hf_config",
]

DEFAULT_ENDPOINT = "https://huggingface.co"
HEADER_READ_BYTES = 2 * 1024**2  # first Range read; doubled until the header fits
MAX_HEADER_BYTES = 64 * 1024**2  # a 262k-token vocabulary makes headers of ~10 MB
# huggingface_hub's shared HTTP client waits for ever unless told otherwise.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0  # the longest one socket read may wait for a byte
# A header read (a few MB) taking longer than this is from a server too slow to be worth
# waiting on: a trickle of one byte every few seconds never trips the read timeout.
RANGE_TIMEOUT_S = 60.0

# Files a safetensors model folder needs (engine/model/loader.py, engine/model/tokenizer/); the
# rest of a repository (other formats, images, ONNX, ...) is not downloaded.
FOLDER_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
)
_DENSE_SAFETENSORS_TYPES = {"F16", "BF16", "F32"}
# Quant types whose projections Folio keeps packed (kernels/int4.py); the rest are
# dequantized to fp32 at load.
_INT4_KEPT = {"Q4_0", "Q4_1", "Q4_K"}


def http_timeout() -> tuple[float, float, float, float]:
    """(connect, read, write, pool) seconds for the HTTP client, read at call time (tests shrink them)."""
    return CONNECT_TIMEOUT_S, READ_TIMEOUT_S, READ_TIMEOUT_S, CONNECT_TIMEOUT_S


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _token(token: str | None) -> str | None:
    # None lets huggingface_hub use its own token (HF_TOKEN, `hf auth login`).
    return token if token is not None else load_token()


def _api(endpoint: str | None, token: str | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub_endpoint(endpoint), token=_token(token))


# --------------------------------------------------------------------------- search


class SearchSort(StrEnum):
    DOWNLOADS = "downloads"
    LIKES = "likes"
    UPDATED = "last_modified"


@dataclass(frozen=True)
class RepoSummary:
    repo_id: str
    downloads: int | None
    likes: int | None
    last_modified: datetime | None
    gated: bool
    formats: tuple[str, ...]  # "gguf", "safetensors" (from the repo's tags)
    pipeline_tag: str | None = None


def search_models(
    query: str = "",
    *,
    sort: SearchSort | str = SearchSort.DOWNLOADS,
    fmt: str = "gguf",
    limit: int = 30,
    endpoint: str | None = None,
    token: str | None = None,
) -> list[RepoSummary]:
    """Repositories matching ``query`` holding ``fmt`` ("gguf" or "safetensors") weights."""
    if fmt not in ("gguf", "safetensors"):
        raise ValueError(f"format must be 'gguf' or 'safetensors', not {fmt!r}")
    sort = SearchSort(sort)
    _check_reachable(hub_endpoint(endpoint))
    api = _api(endpoint, token)
    try:
        infos = list(
            api.list_models(
                search=query or None,
                filter=fmt,
                sort=sort.value,
                limit=limit,
                expand=["downloads", "likes", "lastModified", "gated", "tags", "pipeline_tag"],
            )
        )
    except Exception as exc:
        raise explain(exc) from exc
    out = []
    for info in infos:
        tags = set(info.tags or ())
        out.append(
            RepoSummary(
                repo_id=info.id,
                downloads=info.downloads,
                likes=info.likes,
                last_modified=info.last_modified,
                gated=bool(info.gated),
                formats=tuple(f for f in ("gguf", "safetensors") if f in tags or f == fmt),
                pipeline_tag=info.pipeline_tag,
            )
        )
    return out


def _check_reachable(endpoint: str, timeout_s: float = 5.0) -> None:
    """Fail fast when offline: list_models retries a refused connection for about 23 s."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(f"{endpoint}/api/models", params={"limit": 1}, timeout=timeout_s)
    except Exception as exc:
        raise explain(exc) from exc


# --------------------------------------------------------------------------- listing


@dataclass(frozen=True)
class HubFile:
    """One file of a repository, with the hash the download is checked against."""

    path: str
    size: int | None
    sha256: str | None = None  # LFS files: the sha256 of the content
    blob_id: str | None = None  # git blob sha1 (checks non-LFS files: config, tokenizer)


@dataclass(frozen=True)
class ModelShape:
    """What the fit arithmetic needs; None where not known."""

    num_layers: int | None
    kv_heads: int | None
    head_dim: int | None
    weight_bytes: int | None  # resident after loading
    vocab_size: int | None = None  # sizes the runtime's part of the estimate

    @property
    def kv_known(self) -> bool:
        return None not in (self.num_layers, self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class ModelCandidate:
    """One thing a user can download and load: a GGUF file, or a safetensors folder."""

    repo_id: str
    revision: str  # the commit the listing came from: downloads are pinned to it
    kind: str  # "gguf" or "safetensors"
    name: str  # the GGUF file name, or the repository name for a folder
    files: tuple[HubFile, ...]
    quant: str | None  # from the file name (GGUF) or the weights' dtype (safetensors)
    size: int | None
    problem: str | None = None  # why Folio cannot run it, known before download
    quant_confirmed: bool = False  # True once a GGUF header's general.file_type agreed

    @property
    def supported(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    revision: str
    gated: bool
    architecture: str | None  # from the Hub's GGUF or config metadata
    context_length: int | None
    candidates: tuple[ModelCandidate, ...]
    parameters: int | None = None  # safetensors parameter count, when the Hub knows it
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def candidate(self, name: str) -> ModelCandidate:
        for c in self.candidates:
            if c.name == name or (c.kind == "gguf" and c.files[0].path == name):
                return c
        names = ", ".join(c.name for c in self.candidates) or "none"
        from engine.hub.errors import FileNotOnHubError

        raise FileNotOnHubError(f"{name} is not a model in {self.repo_id} (models there: {names})")


def list_repo_models(
    repo_id: str,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> RepoListing:
    """The GGUF files (and the safetensors folder, if any) of one repository."""
    api = _api(endpoint, token)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        raise explain(exc, repo_id) from exc
    commit = info.sha or revision or "main"
    files = [
        HubFile(
            s.rfilename,
            s.size if s.size is not None else (s.lfs.size if s.lfs else None),
            s.lfs.sha256 if s.lfs else None,
            s.blob_id,
        )
        for s in info.siblings or ()
    ]
    gguf_meta = info.gguf or {}
    config = info.config or {}
    arch = gguf_meta.get("architecture") or config.get("model_type")
    candidates = [
        _gguf_candidate(repo_id, commit, f, gguf_meta)
        for f in files
        if f.path.lower().endswith(".gguf")
    ]
    folder = _folder_candidate(repo_id, commit, files, info)
    if folder is not None:
        candidates.append(folder)
    return RepoListing(
        repo_id=repo_id,
        revision=commit,
        gated=bool(info.gated),
        architecture=arch,
        context_length=gguf_meta.get("context_length"),
        candidates=tuple(candidates),
        parameters=info.safetensors.total if info.safetensors else None,
    )


def _gguf_candidate(repo_id: str, commit: str, f: HubFile, gguf_meta: dict) -> ModelCandidate:
    from engine.model.config import SUPPORTED_ARCHITECTURES

    base = f.path.rsplit("/", 1)[-1]
    problem = None
    arch = gguf_meta.get("architecture")
    if is_split_gguf(base):
        problem = "split into several files, which Folio cannot load yet; choose a single-file quantization"
    elif base.lower().startswith("mmproj"):
        problem = "a vision projector, not a language model"
    elif arch and arch not in SUPPORTED_ARCHITECTURES:
        problem = f"architecture {arch!r} is not supported; Folio runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    return ModelCandidate(
        repo_id, commit, "gguf", f.path, (f,), quant_from_filename(base), f.size, problem
    )


def _folder_candidate(
    repo_id: str, commit: str, files: list[HubFile], info: Any
) -> ModelCandidate | None:
    from engine.model.config import _HF_MODEL_TYPES, SUPPORTED_ARCHITECTURES

    top = [f for f in files if "/" not in f.path]
    wanted = [f for f in top if any(fnmatch.fnmatch(f.path, p) for p in FOLDER_PATTERNS)]
    names = {f.path for f in wanted}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        return None
    problem = None
    dtypes = set((info.safetensors.parameters or {}) if info.safetensors else ())
    model_type = (info.config or {}).get("model_type")
    if model_type and model_type not in _HF_MODEL_TYPES:
        problem = f"architecture {model_type!r} is not supported; Folio runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    elif dtypes - _DENSE_SAFETENSORS_TYPES:
        problem = (
            f"the weights are stored as {', '.join(sorted(dtypes - _DENSE_SAFETENSORS_TYPES))}; "
            f"Folio reads fp16, bf16 or fp32 safetensors (or choose a GGUF repository)"
        )
    quant = "/".join(sorted(dtypes)) if dtypes else None
    size = sum(f.size or 0 for f in wanted)
    return ModelCandidate(
        repo_id, commit, "safetensors", repo_id.split("/")[-1], tuple(wanted), quant, size, problem
    )


# --------------------------------------------------------------------------- file access


@dataclass(frozen=True)
class RemoteFile:
    """Where a file's bytes are and what they are, from a HEAD on its resolve URL."""

    url: str  # the download location (a CDN for LFS files)
    size: int | None
    etag: str | None  # X-Linked-Etag (the LFS sha256) or the ETag (git blob id)
    commit: str | None
    same_origin: bool  # whether the location is on the Hub itself (keep the token)


def resolve_file(
    repo_id: str,
    filename: str,
    *,
    revision: str = "main",
    endpoint: str | None = None,
    token: str | None = None,
) -> RemoteFile:
    from urllib.parse import urljoin, urlsplit

    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    ep = hub_endpoint(endpoint)
    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=ep)
    try:
        meta = get_hf_file_metadata(url, token=_token(token), endpoint=ep)
    except Exception as exc:
        raise explain(exc, repo_id, filename) from exc
    location = urljoin(url, meta.location) if meta.location else url
    if urlsplit(location).scheme not in ("http", "https"):
        raise HubError(
            f"{repo_id}/{filename}: the Hub points its download to {location!r}, which is not "
            f"a web address; Folio downloads only over http(s): check HF_ENDPOINT, or report "
            f"the repository"
        )
    return RemoteFile(
        location, meta.size, meta.etag, meta.commit_hash, _origin(location) == _origin(url)
    )


def _origin(url: str) -> tuple[str, str]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def request_headers(token: str | None, same_origin: bool = True) -> dict[str, str]:
    """huggingface_hub's headers (user agent, token); no token for a CDN, no compression."""
    from huggingface_hub.utils import build_hf_headers

    headers = dict(build_hf_headers(token=_token(token)))
    if not same_origin:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets in the file
    return headers


def read_range(remote: RemoteFile, start: int, end: int, token: str | None = None) -> bytes:
    """Bytes ``start..end`` (inclusive) of a remote file through an HTTP Range request.

    Reads no further than ``end`` even from a server that ignores Range and sends the
    whole file, and gives up on one that has not delivered within RANGE_TIMEOUT_S.
    """
    from huggingface_hub.utils import get_session, hf_raise_for_status

    headers = request_headers(token, remote.same_origin)
    headers["Range"] = f"bytes={start}-{end}"
    deadline = time.monotonic() + RANGE_TIMEOUT_S
    want = end + 1 - start
    data = bytearray()
    with get_session().stream(
        "GET", remote.url, headers=headers, follow_redirects=True, timeout=http_timeout()
    ) as response:
        hf_raise_for_status(response)
        skip = start if response.status_code == 200 else 0  # Range ignored: it starts at 0
        for chunk in response.iter_bytes():
            if skip:
                chunk, skip = chunk[skip:], max(0, skip - len(chunk))
            data += chunk[: want - len(data)]
            if len(data) >= want:
                break
            if time.monotonic() > deadline:
                raise HubUnreachableError(
                    f"the Hub sends too slowly ({len(data):,} of {want:,} bytes in "
                    f"{RANGE_TIMEOUT_S:g} s): check your connection or try again later; "
                    f"local models still work"
                )
    return bytes(data)


def peek_gguf(
    repo_id: str,
    filename: str,
    *,
    revision: str = "main",
    endpoint: str | None = None,
    token: str | None = None,
    max_bytes: int = MAX_HEADER_BYTES,
) -> GGUFSummary:
    """Architecture, layers, heads and tensor types of a remote GGUF file, from its header alone.

    Reads the first MB of the file with Range requests (doubling until the tensor
    directory is complete or ``max_bytes`` is reached): the weights are not downloaded.
    """
    remote = resolve_file(repo_id, filename, revision=revision, endpoint=endpoint, token=token)
    limit = min(max_bytes, remote.size) if remote.size else max_bytes
    data = b""
    want = min(HEADER_READ_BYTES, limit)
    try:
        while True:
            data += read_range(remote, len(data), want - 1, token)
            summary, complete = summary_from_prefix(data, f"{repo_id}/{filename}")
            if complete or len(data) >= limit or len(data) < want:
                return summary
            want = min(2 * want, limit)
    except Exception as exc:
        raise explain(exc, repo_id, filename) from exc


def confirm_quant(candidate: ModelCandidate, summary: GGUFSummary) -> ModelCandidate:
    """The candidate with its quant checked against the header, and any problem found there."""
    quant, confirmed = candidate.quant, candidate.quant_confirmed
    if summary.file_type:
        confirmed = quant is None or summary.file_type == quant
        quant = summary.file_type
    return replace(
        candidate,
        quant=quant,
        quant_confirmed=confirmed,
        problem=candidate.problem or summary.problem,
    )


def fetch_hf_config(
    repo_id: str, *, revision: str = "main", endpoint: str | None = None, token: str | None = None
) -> dict[str, Any]:
    """A safetensors repository's config.json (a few KB), for its layer and head counts."""
    import json

    remote = resolve_file(repo_id, "config.json", revision=revision, endpoint=endpoint, token=token)
    try:
        return json.loads(read_range(remote, 0, (remote.size or 1 << 20) - 1, token))
    except Exception as exc:
        raise explain(exc, repo_id, "config.json") from exc


def shape_from_hf_config(config: dict[str, Any], weight_bytes: int | None) -> ModelShape:
    cfg = config.get("text_config", config) if config.get("model_type") == "gemma3" else config
    heads = cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden and heads else None)
    return ModelShape(
        cfg.get("num_hidden_layers"),
        cfg.get("num_key_value_heads") or heads,
        head_dim,
        weight_bytes,
        cfg.get("vocab_size"),
    )


def shape_from_summary(summary: GGUFSummary) -> ModelShape:
    return ModelShape(
        summary.num_layers,
        summary.num_kv_heads,
        summary.head_dim,
        summary.weight_bytes,
        summary.vocab_size,
    )


@functools.cache
def _bits_per_weight(quant: str) -> float | None:
    base = quant.upper()
    for suffix in ("_XL", "_S", "_M", "_L"):
        if base.startswith("Q") and "_K" in base and base.endswith(suffix):
            base = base.removesuffix(suffix)
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[base]]
    except KeyError:
        return None
    return size * 8 / block


def estimate_file_weight_bytes(
    candidate: ModelCandidate, parameters: int | None = None
) -> int | None:
    """Resident weight bytes from the file size and quant alone (no header read).

    Q4_0 / Q4_1 / Q4_K projections stay packed (about file size); other types are
    dequantized to fp32, i.e. file size x 32 / bits-per-weight. Safetensors are loaded
    as fp32: 4 bytes per parameter.
    """
    if candidate.size is None:
        return None
    if candidate.kind == "safetensors":
        weights = sum(f.size or 0 for f in candidate.files if f.path.endswith(".safetensors"))
        return parameters * 4 if parameters else weights * 2  # fp16/bf16 -> fp32
    quant = (candidate.quant or "").upper()
    bpw = _bits_per_weight(quant) if quant else None
    if bpw is None:
        return candidate.size
    base = quant.split("_")[0] + "_" + quant.split("_")[1] if "_" in quant else quant
    if base in _INT4_KEPT:
        return int(candidate.size * 5.0 / bpw)  # int4 codes + bf16 scale and min per 32
    return int(candidate.size * 32 / bpw)


def candidate_fit(
    candidate: ModelCandidate,
    shape: ModelShape | None,
    plan: CachePlan,
    device: str = "cpu",
    free_bytes: int | None = None,
    parameters: int | None = None,
) -> FitEstimate:
    """Fits / Tight / Won't fit for one candidate; ``shape`` from :func:`peek_gguf` or config.json.

    Quantizations of one repository share layers and heads, so one header read serves
    every file of the list; weight bytes come from the file's own header when its
    summary is passed, else from its size and quant.
    """
    weights = shape.weight_bytes if shape is not None and shape.weight_bytes else None
    note = ""
    if weights is None:
        weights = estimate_file_weight_bytes(candidate, parameters) or 0
        note = "weights estimated from the file size"
    kv = None
    if shape is not None and shape.kv_known:
        dims = (shape.num_layers, shape.kv_heads, shape.head_dim)
        try:
            kv = kv_bytes_per_token(*dims, plan.k_bits, plan.v_bits, plan.dense_bytes)
        except ValueError:
            # A head size that is no multiple of 32 cannot use a quantized cache: price
            # the unquantized one the engine would fall back to, and say so.
            kv = kv_bytes_per_token(*dims, dense_bytes=plan.dense_bytes)
            note = "; ".join(
                filter(None, (note, f"head size {shape.head_dim} needs an unquantized KV cache"))
            )
    vocab = shape.vocab_size if shape is not None else None
    return estimate_fit(weights, kv, plan, device, free_bytes, note, vocab)
