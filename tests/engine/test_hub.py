"""The model manager's logic against a fake Hub on 127.0.0.1 (tests/engine/hub_server.py)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.hub import remote, transfer
from engine.hub.downloads import DownloadManager
from engine.hub.errors import (
    UNREACHABLE,
    DiskFullError,
    DownloadCancelled,
    FileNotOnHubError,
    GatedRepoError,
    HubUnreachableError,
    ModelValidationError,
    RepoNotFoundError,
    VerificationError,
)
from engine.hub.fit import (
    RUNTIME_BYTES_PER_VOCAB_TOKEN,
    TYPICAL_VOCAB,
    CachePlan,
    Fit,
    estimate_fit,
    kv_bytes_per_token,
    runtime_overhead_bytes,
)
from engine.hub.gguf_info import (
    quant_from_filename,
    summary_from_file,
    summary_from_metadata,
    summary_from_prefix,
)
from engine.hub.library import (
    delete_model,
    import_model,
    list_local_models,
    mark_used,
    validate_model,
)
from engine.hub.remote import (
    candidate_fit,
    list_repo_models,
    peek_gguf,
    search_models,
    shape_from_summary,
)
from engine.hub.token import load_token, save_token
from engine.hub.transfer import CancelToken, DownloadState, download_model, pending_downloads
from folio.main import main
from tests.engine.hub_server import COMMIT, FakeHub
from tests.smaps import huge_bytes_of, maps_file_huge_pages

GGUF_REPO = "folio-test/Tiny-GGUF"
ST_REPO = "folio-test/Tiny-Safetensors"


# --------------------------------------------------------------------------- fixtures


def tiny_gguf(
    path: Path, arch: str = "llama", layers: int = 2, vocab: int = 1024, qtype: Q = Q.Q8_0
) -> bytes:
    """A small but real GGUF file (~300 KB): header the loader accepts, random weights."""
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, ffn = 64, 4, 2, 128
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(
        int(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == Q.Q8_0 else gguf.LlamaFileType.ALL_F32)
    )
    w.add_tensor("token_embd.weight", rng.normal(size=(vocab, hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, shape in (
            ("attn_q", (hidden, hidden)),
            ("attn_k", (hidden // 2, hidden)),
            ("ffn_up", (ffn, hidden)),
        ):
            data = rng.normal(size=shape).astype(np.float32)
            if qtype == Q.Q8_0:
                w.add_tensor(
                    f"blk.{i}.{name}.weight", gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0
                )
            else:
                w.add_tensor(f"blk.{i}.{name}.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("gguf")
    return {
        "q8": tiny_gguf(d / "a.gguf"),
        "f32": tiny_gguf(d / "b.gguf", qtype=Q.F32),
        "phi": tiny_gguf(d / "c.gguf", arch="phi3"),
    }


def _safetensors_bytes() -> bytes:
    from safetensors.numpy import save

    return save({"model.embed_tokens.weight": np.zeros((8, 4), np.float16)})


@pytest.fixture
def hub(tmp_path, monkeypatch, gguf_bytes):
    """The fake Hub, with HF_ENDPOINT, the models folder, HF cache and settings in tmp_path."""
    server = FakeHub()
    server.add_repo(
        GGUF_REPO,
        {
            "README.md": b"# tiny\n",
            "tiny.Q8_0.gguf": gguf_bytes["q8"],
            "tiny-F32.gguf": gguf_bytes["f32"],
            "tiny-Q4_K_M-00001-of-00002.gguf": b"x" * 2000,
        },
        downloads=500,
        likes=3,
        last_modified="2024-05-01T00:00:00.000Z",
        gguf={"architecture": "llama", "context_length": 256, "total": 1000},
    )
    server.add_repo("folio-test/Phi-GGUF", {"phi.Q8_0.gguf": gguf_bytes["phi"]}, downloads=900, likes=1,
                    last_modified="2025-06-01T00:00:00.000Z", gguf={"architecture": "phi3"})  # fmt: skip
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
              "vocab_size": 8, "rms_norm_eps": 1e-5}  # fmt: skip
    server.add_repo(
        ST_REPO,
        {
            "config.json": json.dumps(config).encode(),
            "tokenizer.json": b'{"model": {}}',
            "model.safetensors": _safetensors_bytes(),
            "README.md": b"not downloaded",
            "onnx/model.onnx": b"o" * 3000,
        },
        downloads=10,
        likes=50,
        tags=("safetensors", "text-generation"),
        config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
        safetensors={"parameters": {"F16": 32}, "total": 32},
    )
    server.add_repo(
        "folio-test/Gated-GGUF", {"g.Q8_0.gguf": gguf_bytes["q8"]}, gated_token="hf_secret"
    )
    yield from server.serve_isolated(monkeypatch, tmp_path)


def models_dir(tmp_path: Path) -> Path:
    return tmp_path / "models"


# --------------------------------------------------------------------------- pure logic


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("gemma-3-270m-q4_k_m.gguf", "Q4_K_M"),
        ("Qwen3-0.6B-UD-Q3_K_XL.gguf", "Q3_K_XL"),
        ("model-IQ4_XS.gguf", "IQ4_XS"),
        ("llama-3.2-1b-instruct-bf16.gguf", "BF16"),
        ("tiny-f16.gguf", "F16"),
        ("phi-2.Q8_0.gguf", "Q8_0"),
        ("model.gguf", None),
    ],
)
def test_quant_from_filename(name, quant):
    assert quant_from_filename(name) == quant


def test_kv_bytes_per_token_matches_the_page_pool():
    import torch

    from engine.cache.formats import default_dense, kv_formats
    from engine.model.config import ModelConfig
    from kernels.kvquant import KVFormat

    # SmolLM2: 30 layers, 3 KV heads of 64; fp16 by default (fp32 on a CPU without F16C)
    assert kv_bytes_per_token(30, 3, 64, dense_bytes=4) == 30 * 3 * 64 * 2 * 4
    assert kv_bytes_per_token(30, 3, 64, 32, 32) == 30 * 3 * 64 * 2 * 4
    assert kv_bytes_per_token(30, 3, 64, 16, 16) == 30 * 3 * 64 * 2 * 2
    value = default_dense().itemsize
    assert kv_bytes_per_token(30, 3, 64) == 30 * 3 * 64 * 2 * value
    cfg = ModelConfig("llama", 10, 576, 1536, 30, 9, 3, 64, 1e-5, 1e4)
    assert kv_bytes_per_token(30, 3, 64) == cfg.kv_bytes_per_token()
    fp16 = KVFormat(dtype=torch.float16).bytes_per_token(3, 64)
    assert kv_bytes_per_token(30, 3, 64, dense_bytes=2) == 30 * 2 * fp16
    for k_bits, v_bits in ((2, 2), (4, 4), (8, 8), (4, None), (None, 3)):
        fmt_k, fmt_v = kv_formats(k_bits, v_bits)
        per_layer = fmt_k.bytes_per_token(3, 64) + fmt_v.bytes_per_token(3, 64)
        assert kv_bytes_per_token(30, 3, 64, k_bits, v_bits) == 30 * per_layer
    # About b/8 bytes per value plus a few fp16 parameters per group of 32.
    four = kv_bytes_per_token(30, 3, 64, 4, 4) / (30 * 2 * 3 * 64)
    assert 4 / 8 + 2 / 32 <= four <= 4 / 8 + 4 / 32
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_bytes_per_token(2, 2, 80, 4, 4)


def test_fit_labels_and_page_rounding():
    plan = CachePlan(context_tokens=1000, page_size=256)
    assert plan.cached_tokens == 1024
    kv = kv_bytes_per_token(30, 3, 64, 16, 16)
    gb = 10**9
    fit = estimate_fit(gb, kv, plan, free_bytes=4 * gb)
    assert fit.kv_bytes == kv * 1024 and fit.label == Fit.FITS
    assert estimate_fit(gb, kv, plan, free_bytes=fit.need_bytes + 1).label == Fit.TIGHT
    assert estimate_fit(gb, kv, plan, free_bytes=fit.need_bytes - 1).label == Fit.WONT_FIT
    # A 4-bit cache for a long context turns fp32's "won't fit" into "fits".
    long = CachePlan(context_tokens=131072)
    free = 5 * gb
    fp32 = kv_bytes_per_token(30, 3, 64, 32, 32)
    assert estimate_fit(gb, fp32, long, free_bytes=free).label == Fit.WONT_FIT
    assert (
        estimate_fit(gb, kv_bytes_per_token(30, 3, 64, 4, 4), long, free_bytes=free).label
        == Fit.FITS
    )
    assert estimate_fit(gb, kv, plan).free_bytes > 0  # real free RAM of this machine


def test_the_fit_prices_the_runtime_for_the_vocabulary():
    """The runtime's part of a fit grows with the model's vocabulary (the tokenizer's
    tables and the vocabulary's strings: Gemma 3's 262k tokens take 100 MB more than
    SmolLM2's 49k), priced at Llama 3's 128k where the vocabulary is unknown."""
    gb = 10**9
    plan = CachePlan(context_tokens=1024, page_size=256)
    kv = kv_bytes_per_token(30, 3, 64, 16, 16)
    small, unknown, big = (
        estimate_fit(gb, kv, plan, free_bytes=4 * gb, vocab_size=v) for v in (49_152, None, 262_144)
    )
    assert small.need_bytes < unknown.need_bytes < big.need_bytes
    assert big.need_bytes - small.need_bytes == RUNTIME_BYTES_PER_VOCAB_TOKEN * 212_992
    assert unknown.runtime_bytes == runtime_overhead_bytes(TYPICAL_VOCAB)
    assert big.need_bytes == gb + kv * 1024 + big.runtime_bytes
    # A vocabulary of 0 (a broken header) is priced as unknown, not as none.
    assert runtime_overhead_bytes(0) == unknown.runtime_bytes


def test_the_summary_reads_the_vocabulary_size(smollm2_path):
    assert summary_from_file(smollm2_path).vocab_size == 49_152
    assert remote.shape_from_summary(summary_from_file(smollm2_path)).vocab_size == 49_152
    base = {"general.architecture": "llama", "llama.block_count": 2}
    tokens = {**base, "tokenizer.ggml.tokens": ["a", "b", "c"]}
    assert summary_from_metadata(tokens, None, "t").vocab_size == 3
    assert summary_from_metadata({**tokens, "llama.vocab_size": 7}, None, "t").vocab_size == 7
    assert summary_from_metadata(base, None, "t").vocab_size is None
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert remote.shape_from_hf_config({**config, "vocab_size": 9}, None).vocab_size == 9


def test_header_prefix_parse_matches_the_file_reader(tmp_path, gguf_bytes):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes["q8"])
    full = summary_from_file(path)
    assert (full.architecture, full.num_layers, full.num_kv_heads, full.head_dim) == (
        "llama",
        2,
        2,
        16,
    )
    assert (
        full.file_type == "Q8_0" and full.tensor_types == {"F32": 2, "Q8_0": 6} and full.supported
    )
    prefix, complete = summary_from_prefix(gguf_bytes["q8"][:4096], "m.gguf")
    assert complete and prefix == full
    partial, complete = summary_from_prefix(gguf_bytes["q8"][:200], "m.gguf")
    assert not complete and partial.tensor_types is None
    assert not summary_from_file(_write(tmp_path / "p.gguf", gguf_bytes["phi"])).supported


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- discover


def test_search_sorts_and_filters(hub):
    by_downloads = search_models("", sort="downloads")
    assert [r.repo_id for r in by_downloads] == [
        "folio-test/Phi-GGUF",
        GGUF_REPO,
        "folio-test/Gated-GGUF",
    ]
    assert by_downloads[0].downloads == 900 and by_downloads[1].likes == 3
    assert [r.repo_id for r in search_models("tiny", sort="likes")] == [GGUF_REPO]
    assert search_models("", sort="last_modified")[0].repo_id == "folio-test/Phi-GGUF"
    assert [r.repo_id for r in search_models("", fmt="safetensors")] == [ST_REPO]
    assert search_models("nothing-like-this") == []
    sent = [r for r in hub.requests if r[1] == "/api/models"]
    assert sent, "the search went to the fake Hub through HF_ENDPOINT"


def test_repo_listing_quant_size_hash_and_problems(hub, gguf_bytes):
    listing = list_repo_models(GGUF_REPO)
    assert listing.revision == COMMIT and listing.architecture == "llama"
    by_name = {c.name: c for c in listing.candidates}
    assert set(by_name) == {"tiny.Q8_0.gguf", "tiny-F32.gguf", "tiny-Q4_K_M-00001-of-00002.gguf"}
    q8 = by_name["tiny.Q8_0.gguf"]
    assert q8.quant == "Q8_0" and q8.size == len(gguf_bytes["q8"]) and q8.supported
    assert q8.files[0].sha256 == hashlib.sha256(gguf_bytes["q8"]).hexdigest()
    assert by_name["tiny-F32.gguf"].quant == "F32"
    assert "split" in by_name["tiny-Q4_K_M-00001-of-00002.gguf"].problem
    phi = list_repo_models("folio-test/Phi-GGUF").candidates[0]
    assert "'phi3' is not supported" in phi.problem  # known before download

    st = list_repo_models(ST_REPO)
    (folder,) = st.candidates
    assert folder.kind == "safetensors" and folder.quant == "F16" and folder.supported
    assert {f.path for f in folder.files} == {"config.json", "tokenizer.json", "model.safetensors"}


def test_peek_reads_the_header_with_range_requests_only(hub, gguf_bytes, monkeypatch):
    monkeypatch.setattr(remote, "HEADER_READ_BYTES", 512)  # force several doubling reads
    summary = peek_gguf(GGUF_REPO, "tiny.Q8_0.gguf")
    assert (summary.architecture, summary.num_layers, summary.num_kv_heads, summary.head_dim) == (
        "llama",
        2,
        2,
        16,
    )
    assert summary.tensor_types == {"F32": 2, "Q8_0": 6} and summary.file_type == "Q8_0"
    served = hub.bytes_served[(GGUF_REPO, "tiny.Q8_0.gguf")]
    assert 0 < served < len(gguf_bytes["q8"]) // 10, "only the header was fetched"
    ranges = [r[2] for r in hub.requests if r[1].startswith("/cdn/") and r[0] == "GET"]
    assert ranges[0] == "bytes=0-511" and len(ranges) >= 2

    listing = list_repo_models(GGUF_REPO)
    q8 = listing.candidate("tiny.Q8_0.gguf")
    fit = candidate_fit(
        q8, shape_from_summary(summary), CachePlan(context_tokens=256), free_bytes=10**12
    )
    assert fit.label == Fit.FITS and fit.kv_bytes == 256 * kv_bytes_per_token(2, 2, 16)
    assert fit.weight_bytes == summary.weight_bytes
    assert (
        candidate_fit(q8, shape_from_summary(summary), CachePlan(), free_bytes=10**6).label
        == Fit.WONT_FIT
    )
    phi = peek_gguf("folio-test/Phi-GGUF", "phi.Q8_0.gguf")
    assert not phi.supported and "phi3" in phi.problem


# --------------------------------------------------------------------------- download


def test_download_completes_with_progress_and_verified_hash(hub, tmp_path, gguf_bytes):
    manager = DownloadManager(progress_interval_s=0)
    events = []
    manager.subscribe(events.append)
    listing = list_repo_models(GGUF_REPO)
    job = manager.enqueue(listing.candidate("tiny.Q8_0.gguf"))
    final = manager.wait(job, timeout=10)
    manager.close()
    assert final.state == DownloadState.DONE, final.message
    path = models_dir(tmp_path) / "folio-test--Tiny-GGUF" / "tiny.Q8_0.gguf"
    assert final.path == path and path.read_bytes() == gguf_bytes["q8"]
    stamp = json.loads(path.with_name(path.name + ".verified.json").read_text())
    assert (
        stamp["sha256"] == hashlib.sha256(gguf_bytes["q8"]).hexdigest()
        and stamp["repo_id"] == GGUF_REPO
    )
    states = [e.state for e in events]
    assert states[0] == DownloadState.QUEUED and states[-1] == DownloadState.DONE
    assert DownloadState.VERIFYING in states
    moving = [e.done_bytes for e in events if e.state == DownloadState.DOWNLOADING]
    assert moving == sorted(moving) and len(set(moving)) > 2, "progress advanced in steps"
    assert events[-1].done_bytes == events[-1].total_bytes == len(gguf_bytes["q8"])
    assert any(e.bytes_per_s for e in events)
    assert hub.bytes_served[(GGUF_REPO, "tiny.Q8_0.gguf")] == len(gguf_bytes["q8"])
    assert not list(path.parent.glob("*.incomplete")) and pending_downloads() == []


def test_dropped_connection_is_resumed_without_refetching(hub, gguf_bytes):
    size = len(gguf_bytes["q8"])
    hub.drop_after[(GGUF_REPO, "tiny.Q8_0.gguf")] = size // 2
    path = download_model(list_repo_models(GGUF_REPO).candidate("tiny.Q8_0.gguf"))
    assert path.read_bytes() == gguf_bytes["q8"]
    # Every byte crossed the wire once: the second request asked only for the rest.
    assert hub.bytes_served[(GGUF_REPO, "tiny.Q8_0.gguf")] == size
    ranges = [r[2] for r in hub.requests if r[1].startswith("/cdn/") and r[0] == "GET"]
    assert ranges == [None, f"bytes={size // 2}-"]


def test_wrong_hash_deletes_the_file_and_says_so(hub, tmp_path):
    hub.repos[GGUF_REPO].wrong_sha256.add("tiny.Q8_0.gguf")
    candidate = list_repo_models(GGUF_REPO).candidate("tiny.Q8_0.gguf")
    with pytest.raises(VerificationError, match="damaged.*deleted"):
        download_model(candidate)
    folder = models_dir(tmp_path) / "folio-test--Tiny-GGUF"
    assert not (folder / "tiny.Q8_0.gguf").exists() and not list(folder.glob("*.incomplete"))
    assert list_local_models(include_hf_cache=False) == []


def test_cancel_then_resume_completes(hub, gguf_bytes, tmp_path):
    size = len(gguf_bytes["q8"])
    release = threading.Event()
    hub.pause_at[(GGUF_REPO, "tiny.Q8_0.gguf")] = (size // 3, release)
    manager = DownloadManager(progress_interval_s=0)
    job = manager.enqueue(list_repo_models(GGUF_REPO).candidate("tiny.Q8_0.gguf"))
    assert hub.paused.wait(10)
    deadline = time.monotonic() + 10
    while manager.status(job).done_bytes < size // 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # the bytes sent before the pause reach the file
    manager.cancel(job)
    release.set()  # the next chunk arrives, sees the cancel and stops
    state = manager.wait(job, timeout=10)
    assert state.state == DownloadState.CANCELLED and isinstance(state.error, DownloadCancelled)
    partial = models_dir(tmp_path) / "folio-test--Tiny-GGUF" / "tiny.Q8_0.gguf.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept < size
    assert len(pending_downloads()) == 1  # what an app restart would offer to resume

    manager.resume(job)
    done = manager.wait(job, timeout=10)
    manager.close()
    assert done.state == DownloadState.DONE, done.message
    assert done.path.read_bytes() == gguf_bytes["q8"] and not partial.exists()
    ranges = [r[2] for r in hub.requests if r[1].startswith("/cdn/") and r[0] == "GET"]
    assert ranges[-1] == f"bytes={kept}-"


def test_disk_full_keeps_the_partial_and_a_restart_resumes(hub, gguf_bytes, tmp_path, monkeypatch):
    size = len(gguf_bytes["q8"])
    written = [0]
    real_write = transfer._write_chunk

    def fills_up(fh, data):
        if written[0] + len(data) > size // 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += len(data)
        real_write(fh, data)

    monkeypatch.setattr(transfer, "_write_chunk", fills_up)
    monkeypatch.setattr(transfer, "SPAN", 4096)  # writes of 4 KB: the disk fills mid-file
    candidate = list_repo_models(GGUF_REPO).candidate("tiny.Q8_0.gguf")
    with pytest.raises(DiskFullError) as info:
        download_model(candidate)
    message = str(info.value)
    assert "the disk is full" in message and "MB free" in message and "kept" in message
    assert info.value.partial.stat().st_size == written[0] > 0

    monkeypatch.setattr(transfer, "_write_chunk", real_write)
    # what the new session asks for (not the server's byte count: the first session's
    # server thread may still be pushing bytes into its socket as this one starts)
    before = len(hub.requests)
    manager = DownloadManager()  # a new session: resume what the last one left
    (job,) = manager.resume_pending()
    done = manager.wait(job, timeout=10)
    manager.close()
    assert done.state == DownloadState.DONE and done.path.read_bytes() == gguf_bytes["q8"]
    assert done.resumed_bytes == written[0]
    gets = [r for r in hub.requests[before:] if r[0] == "GET" and r[1].startswith("/cdn/")]
    assert gets and gets[0][2] == f"bytes={written[0]}-"  # only the bytes it lacked
    assert all(r[2] is not None for r in gets)  # never from the start again


def test_a_download_reaches_the_disk_in_2_mb_spans(hub, gguf_bytes, tmp_path):
    """Downloaded bytes are written in spans that end on 2 MB boundaries, so the page
    cache holds the file in 2 MB folios, mapped as huge pages (on CPUs without tiles the
    weights are read in place from it). Written as the network's chunks came, none were."""
    if not maps_file_huge_pages(tmp_path):
        pytest.skip("this kernel keeps a file's cached pages in small folios here")
    noise = np.random.default_rng(3).integers(0, 256, 9 << 20, dtype=np.uint8).tobytes()
    data = gguf_bytes["q8"] + noise
    hub.add_repo("folio-test/Big-GGUF", {"big.Q8_0.gguf": data})
    path = download_model(list_repo_models("folio-test/Big-GGUF").candidate("big.Q8_0.gguf"))
    assert path.read_bytes() == data
    whole = len(data) // transfer.SPAN * transfer.SPAN
    assert huge_bytes_of(path) >= whole - transfer.SPAN  # all but at most one 2 MB stretch


def test_cancel_token_stops_before_any_bytes(hub, tmp_path):
    token = CancelToken()
    token.cancel()
    with pytest.raises(DownloadCancelled):
        download_model(list_repo_models(GGUF_REPO).candidate("tiny.Q8_0.gguf"), cancel=token)
    assert hub.bytes_served[(GGUF_REPO, "tiny.Q8_0.gguf")] == 0


def test_safetensors_folder_download_is_listed_as_one_model(hub, tmp_path):
    folder = download_model(list_repo_models(ST_REPO).candidates[0])
    assert folder == models_dir(tmp_path) / "folio-test--Tiny-Safetensors"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and "verified" not in p.name) == [
        "config.json", "model.safetensors", "tokenizer.json",
    ]  # fmt: skip
    (model,) = list_local_models(include_hf_cache=False)
    assert (model.format, model.architecture, model.quant, model.repo_id) == (
        "safetensors",
        "llama",
        "F16",
        ST_REPO,
    )
    assert model.verified and model.loadable


# --------------------------------------------------------------------------- errors


def test_plain_errors_for_missing_gated_and_unreachable(hub, monkeypatch):
    with pytest.raises(RepoNotFoundError, match="was not found"):
        list_repo_models("folio-test/none")
    with pytest.raises(FileNotOnHubError, match="not a model in"):
        list_repo_models(GGUF_REPO).candidate("nope.gguf")
    with pytest.raises(FileNotOnHubError, match="was not found"):
        remote.resolve_file(GGUF_REPO, "nope.gguf", revision=COMMIT)
    with pytest.raises(GatedRepoError, match="gated.*token") as info:
        list_repo_models("folio-test/Gated-GGUF")
    assert info.value.repo_id == "folio-test/Gated-GGUF"

    saved = save_token("hf_secret")
    assert "plain text" in saved.warning and load_token() == "hf_secret"  # no keyring here
    assert oct(Path(saved.where).stat().st_mode & 0o777) == "0o600"
    gated = list_repo_models("folio-test/Gated-GGUF").candidates[0]
    assert download_model(gated).exists()

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(HubUnreachableError) as info:
        search_models("x")
    assert str(info.value) == UNREACHABLE


# --------------------------------------------------------------------------- my models


def _fake_hf_cache(cache: Path, repo_id: str, filename: str, data: bytes) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / filename).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap / filename


def test_inventory_delete_import_and_last_used(hub, tmp_path, gguf_bytes):
    downloaded = download_model(list_repo_models(GGUF_REPO).candidate("tiny.Q8_0.gguf"))
    cached = _fake_hf_cache(
        tmp_path / "hf" / "hub", "someone/Cached-GGUF", "c.F32.gguf", gguf_bytes["f32"]
    )
    (tmp_path / "elsewhere").mkdir()
    outside = _write(tmp_path / "elsewhere" / "mine.gguf", gguf_bytes["q8"])
    bad = _write(tmp_path / "elsewhere" / "broken.gguf", gguf_bytes["q8"][:1000])
    phi = _write(tmp_path / "elsewhere" / "phi.gguf", gguf_bytes["phi"])

    with pytest.raises(ModelValidationError, match="truncated"):
        import_model(bad)
    with pytest.raises(ModelValidationError, match="not supported"):
        import_model(phi)
    with pytest.raises(ModelValidationError, match="no config.json"):
        validate_model(tmp_path / "elsewhere")
    imported = import_model(outside)
    assert imported.architecture == "llama" and imported.quant == "Q8_0"

    models = {m.path: m for m in list_local_models()}
    assert set(models) == {downloaded, cached, outside}
    assert (
        models[downloaded].source == "folio"
        and models[downloaded].verified
        and models[downloaded].repo_id == GGUF_REPO
    )
    assert models[cached].source == "hf-cache" and models[cached].repo_id == "someone/Cached-GGUF"
    assert models[cached].quant == "F32" and models[cached].size_bytes == len(gguf_bytes["f32"])
    assert models[outside].source == "imported"

    mark_used(cached)
    first = list_local_models()[0]
    assert first.path == cached and first.last_used is not None

    freed = delete_model(models[downloaded])
    assert freed.freed_bytes >= len(gguf_bytes["q8"]) and "MB freed" in freed.message
    assert not downloaded.exists()
    freed = delete_model(models[cached])
    assert freed.freed_bytes == len(gguf_bytes["f32"]) and not any(
        (tmp_path / "hf" / "hub").rglob("*.gguf")
    )
    assert delete_model(models[outside]).freed_bytes == 0 and outside.exists()  # only forgotten
    assert list_local_models() == []


# --------------------------------------------------------------------------- CLI


def test_cli_search_files_download_list_delete(hub, tmp_path, gguf_bytes, capsys):
    assert main(["models", "search", "tiny"]) == 0
    out = capsys.readouterr().out
    assert GGUF_REPO in out and "Phi" not in out

    assert main(["models", "files", GGUF_REPO, "--context", "256"]) == 0
    out = capsys.readouterr().out
    assert "tiny.Q8_0.gguf" in out and "Q8_0 (checked)" in out and "Fits" in out and "split" in out

    assert main(["models", "files", GGUF_REPO, "--kv-bits", "4"]) == 0
    assert "head size 16 needs an unquantized KV cache" in capsys.readouterr().out

    assert main(["models", "files", GGUF_REPO, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {m["name"]: m["fit"] for m in data["models"]}["tiny-Q4_K_M-00001-of-00002.gguf"] is None

    assert main(["models", "download", GGUF_REPO, "tiny.Q8_0.gguf"]) == 0
    captured = capsys.readouterr()
    path = Path(captured.out.strip())
    assert path.read_bytes() == gguf_bytes["q8"] and "done" in captured.err

    assert main(["models", "list", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["path"] == str(path) and listed["quant"] == "Q8_0"

    assert main(["models", "delete", "tiny.Q8_0"]) == 0
    assert "MB freed" in capsys.readouterr().out and not path.exists()


def test_cli_errors_are_plain_words(hub, tmp_path, capsys, gguf_bytes):
    assert main(["models", "files", "folio-test/none"]) == 1
    assert "folio: repository folio-test/none was not found" in capsys.readouterr().err
    assert main(["models", "download", GGUF_REPO, "nope.gguf"]) == 1
    assert "nope.gguf is not a model in" in capsys.readouterr().err
    assert main(["models", "download", "folio-test/Phi-GGUF", "phi.Q8_0.gguf"]) == 1
    assert "'phi3' is not supported" in capsys.readouterr().err
    assert main(["models", "download", "folio-test/Gated-GGUF", "g.Q8_0.gguf"]) == 1
    assert "gated" in capsys.readouterr().err
    assert main(["models", "import", str(_write(tmp_path / "x.gguf", b"nope"))]) == 1
    assert "not a GGUF model file" in capsys.readouterr().err
    assert main(["models", "import", str(_write(tmp_path / "ok.gguf", gguf_bytes["q8"]))]) == 0
    assert "imported ok" in capsys.readouterr().out


def test_cli_fetch_default_keeps_its_behaviour(monkeypatch, tmp_path, capsys):
    import engine.model.fetch as fetch

    monkeypatch.setattr(fetch, "ensure_default_model", lambda: tmp_path / "default.gguf")
    assert main(["models", "fetch-default"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "default.gguf")
