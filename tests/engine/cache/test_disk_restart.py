"""The disk tier with a real (tiny) model across processes: a conversation of 2,000 tokens
answered in one process is restored from disk in the next, and the next reply's logits
equal a fresh prefill's; a writer killed at 20 points leaves a store whose intact pages
are used and whose torn tail is recomputed; two processes on one store at once both hit
and leave it whole."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import engine.cache.disk_tier as disk_tier
from engine.cache.disk_tier import DiskTier, list_stores, store_dir
from engine.cache.kv_cache import CacheSettings, KVCache
from engine.generator.generator import Generator
from engine.generator.job import JobRequest, JobState
from engine.generator.sampler import SamplingSettings
from engine.generator.settings import GeneratorSettings
from engine.model.loader import load_model
from engine.model.runner import SequenceRunner
from tests.child_process import ROOT, run_json
from tests.engine.cache.test_disk_tier import _GatedReads
from tests.engine.tiny_models import make_hf_model, write_gguf

PS = 64
TOKENS = 2000
REPLY = 24


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny-llama.gguf"
    model = make_hf_model("llama", seed=5, max_position_embeddings=4096)
    write_gguf(model, path, {"q": Q.Q4_K, "gate": Q.Q4_K, "up": Q.Q4_K}, default=Q.Q8_0)
    return path


def conversation(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _cache(loaded, disk: Path | None, tokens: int = 4096) -> KVCache:
    settings = CacheSettings(
        page_size=PS, token_budget=tokens, disk_dir=str(disk) if disk is not None else None
    )
    return KVCache.for_model(loaded, settings)


def _next_logits(loaded, cache: KVCache, tokens: list[int]) -> tuple[torch.Tensor, int, int]:
    """(logits of the last token, tokens found cached, pages read from disk)."""
    runner = SequenceRunner(loaded, cache, tokens)
    cached, disk_pages = runner.cached_tokens, runner.alloc.disk_pages
    logits = runner.step()
    runner.release()
    cache.pages.validate()
    return logits, cached, disk_pages


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# One chat answered by the engine, as `folio generate` would, in a process of its own.
_FIRST_PROCESS = textwrap.dedent(
    """
    import json, sys
    from engine.cache.kv_cache import CacheSettings
    from engine.engine import Engine
    from engine.generator.job import JobRequest
    from engine.generator.sampler import SamplingSettings
    from engine.model.loader import load_model
    from tests.engine.cache.test_disk_restart import PS, REPLY, TOKENS, conversation

    path, disk = sys.argv[1], sys.argv[2]
    loaded = load_model(path, load_tokenizer=False)
    settings = CacheSettings(page_size=PS, token_budget=4096, disk_dir=disk)
    with Engine(loaded, settings) as engine:
        request = JobRequest(
            prompt=conversation(TOKENS),
            max_new_tokens=REPLY,
            sampling=SamplingSettings(temperature=0),
            stop_token_ids=(),
        )
        result = engine.submit(request).wait(timeout=600)
    print(json.dumps({"reply": result.token_ids[0], "cached": result.cached_tokens}))
    """
)


def test_a_conversation_is_restored_from_disk_after_a_restart(model_path, tmp_path):
    disk = tmp_path / "kv"
    first = run_json(_FIRST_PROCESS, str(model_path), str(disk))
    assert first["cached"] == 0 and len(first["reply"]) == REPLY
    (store,) = list_stores(disk)
    assert store.model == model_path.stem and not store.in_use

    # The next turn, in this (new) process: the chat so far, then the user's next words.
    earlier = conversation(TOKENS) + first["reply"]
    tokens = earlier + conversation(40, seed=1)
    loaded = load_model(model_path, load_tokenizer=False)
    restored, cached, disk_pages = _next_logits(loaded, _cache(loaded, disk), tokens)
    # Every full page of the earlier conversation (its last token's K/V was never
    # computed: it was sampled, not fed back) came from disk.
    full_pages = (len(earlier) - 1) // PS
    assert disk_pages == full_pages and cached == full_pages * PS
    fresh, fresh_cached, _ = _next_logits(loaded, _cache(loaded, None), tokens)
    assert fresh_cached == 0
    # The same bound as chunked prefill against one pass (tests/engine/test_forward_tiny.py).
    assert _relative_error(restored, fresh) < 1e-4
    assert int(restored.argmax()) == int(fresh.argmax())


def test_a_prompt_ending_on_a_page_boundary_computes_only_its_last_token(model_path, tmp_path):
    # Sent again after a restart (a regenerated reply): the prompt's last page is whole,
    # so every row of it but the last token's comes from its record on disk too.
    disk = tmp_path / "kv"
    run_json(_FIRST_PROCESS, str(model_path), str(disk))
    tokens = conversation(TOKENS)[: (TOKENS // PS) * PS]
    loaded = load_model(model_path, load_tokenizer=False)
    restored, cached, disk_pages = _next_logits(loaded, _cache(loaded, disk), tokens)
    assert disk_pages == len(tokens) // PS and cached == len(tokens) - 1
    # The reference holds the same K/V bit for bit: the first process's prompt prefilled in
    # the engine's chunks (the rows a GEMM call gets change its rounding on some CPUs: AMX
    # bf16 tiles), kept in memory; the same prompt then takes 63 rows of its last page
    # from the in-memory sibling and computes its last token alone, as the restore does
    # (one token takes the small-batch kernels, whose rounding differs from a chunk's).
    cache = _cache(loaded, None)
    first = SequenceRunner(loaded, cache, conversation(TOKENS))
    chunk = GeneratorSettings().max_chunk_size // PS * PS
    while first.stored < TOKENS:
        first.step(min(chunk, TOKENS - first.stored))
    first.release()
    fresh, fresh_cached, fresh_disk = _next_logits(loaded, cache, tokens)
    assert fresh_cached == len(tokens) - 1 and fresh_disk == 0
    assert _relative_error(restored, fresh) < 1e-6
    assert int(restored.argmax()) == int(fresh.argmax())


def _greedy(prompt: list[int], new: int) -> JobRequest:
    return JobRequest(
        prompt=prompt,
        max_new_tokens=new,
        sampling=SamplingSettings(temperature=0),
        stop_token_ids=(),
    )


def _run_alone(loaded, request: JobRequest) -> list[int]:
    """The tokens ``request`` gets from a fresh cache with no disk tier."""
    gen = Generator(loaded, _cache(loaded, None))
    job = gen.submit(request)
    while not gen.idle:
        gen.iterate()
    return job.sequences[0].generated


def test_a_chain_on_disk_is_read_while_the_other_chats_step(model_path, tmp_path, monkeypatch):
    # Another chat is replying when a long one is reopened: the long chat's pages come
    # off the disk on the reader thread, the reply goes on meanwhile, and the reopened
    # chat then answers as it would alone without any cache.
    disk = tmp_path / "kv"
    run_json(_FIRST_PROCESS, str(model_path), str(disk))
    loaded = load_model(model_path, load_tokenizer=False)
    gen = Generator(loaded, _cache(loaded, disk))
    other = gen.submit(_greedy(conversation(40, seed=3), 48))
    while not other.sequences[0].generated:
        gen.iterate()
    gate = _GatedReads(monkeypatch)
    reopened = gen.submit(_greedy(conversation(TOKENS), 4))
    before = len(other.sequences[0].generated)
    for _ in range(3):
        gen.iterate()
    assert reopened.state is JobState.PENDING and "from disk" in reopened.wait_reason
    assert len(other.sequences[0].generated) == before + 3
    gate.open.set()
    while not gen.idle:
        gen.iterate()
    assert gate.calls == 1
    assert reopened.disk_pages == (TOKENS - 1) // PS
    gen.cache.close()
    monkeypatch.undo()
    assert reopened.sequences[0].generated == _run_alone(loaded, _greedy(conversation(TOKENS), 4))


_KILLED_WRITER = textwrap.dedent(
    """
    import pickle, sys
    from engine.cache.disk_tier import DiskTier
    from tests.engine.cache import kill_after_writing

    store, pages_file, cut = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(pages_file, "rb") as f:
        saved = pickle.load(f)
    kill_after_writing(cut)
    from tests.engine.cache.test_disk_restart import PageLayout
    tier = DiskTier(store, saved["fingerprint"], PageLayout(saved["layout"]))
    for h, parent, payload in saved["pages"]:
        tier.put(h, parent, payload, wait=True)
    tier.close()
    """
)


class PageLayout:
    """What DiskTier reads of a cache's storage (page size and format), rebuilt in a
    child from plain values so that it need not load the model."""

    def __init__(self, layout: dict):
        self.bytes_per_page = layout["bytes_per_page"]
        self._tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in layout["tensors"]]

    def page_tensors(self) -> list[torch.Tensor]:
        return self._tensors


KILL_POINTS = 20


@pytest.fixture(scope="module")
def written_chat(model_path, tmp_path_factory):
    """A chat's pages as the disk tier receives them, saved for the killed writers, and
    the tokens of the next turn."""
    loaded = load_model(model_path, load_tokenizer=False)
    cache = _cache(loaded, None)
    tokens = conversation(12 * PS + 10, seed=2)
    runner = SequenceRunner(loaded, cache, tokens)
    runner.step()
    runner.release()
    table = cache.pages
    hashes = table.context_hashes(tokens)
    by_hash = {rec.hash: rec for rec in table.pages}
    pages = [(h, by_hash[h].parent_hash, cache.storage.read_page(by_hash[h].index)) for h in hashes]
    layout = {
        "bytes_per_page": cache.storage.bytes_per_page,
        "tensors": [(tuple(t.shape), t.dtype) for t in cache.storage.page_tensors()],
    }
    path = tmp_path_factory.mktemp("chat") / "pages.pickle"
    with open(path, "wb") as f:
        pickle.dump({"fingerprint": cache.fingerprint, "layout": layout, "pages": pages}, f)
    nxt = tokens + conversation(20, seed=3)
    fresh, _, _ = _next_logits(loaded, _cache(loaded, None), nxt)
    return loaded, path, pages, nxt, fresh


@pytest.mark.parametrize("point", range(KILL_POINTS))
def test_a_writer_killed_anywhere_costs_only_the_torn_pages(written_chat, tmp_path, point):
    loaded, pages_file, pages, tokens, fresh = written_chat
    cache_probe = _cache(loaded, None, tokens=PS)
    record = disk_tier._REC_HEADER.size + cache_probe.storage.bytes_per_page
    # Spread over every record and index write of the chat, one random point per stretch.
    span = len(pages) * (record + 1024)
    cut = random.Random(point).randrange(
        point * span // KILL_POINTS, (point + 1) * span // KILL_POINTS
    )
    location = tmp_path / "kv"
    store = store_dir(location, cache_probe.fingerprint)
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(store), str(pages_file), str(max(cut, 1))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (-9, 0), done.stderr[-2000:]
    cache = _cache(loaded, location)
    tier = cache.disk
    assert tier is not None and tier.enabled
    tier.validate()
    intact = 0  # the leading pages that read back whole
    for h, _, payload in pages:
        if tier.read(h) != payload:
            break
        intact += 1
    logits, cached, disk_pages = _next_logits(loaded, _cache(loaded, location), tokens)
    assert disk_pages == intact and cached == intact * PS
    assert _relative_error(logits, fresh) < 1e-4


_SHARER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from engine.cache.kv_cache import CacheSettings, KVCache
    from engine.model.loader import load_model
    from engine.model.runner import SequenceRunner
    from tests.engine.cache.test_disk_restart import PS, conversation

    path, disk, seed, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    loaded = load_model(path, load_tokenizer=False)
    cache = KVCache.for_model(loaded, CacheSettings(page_size=PS, token_budget=4096, disk_dir=disk))
    writer = cache.disk.writable  # both hold the store open now: one writes, one reads
    (go.parent / f"ready-{seed}").touch()
    while not go.exists():  # both processes open the store before either goes on
        time.sleep(0.01)
    shared = SequenceRunner(loaded, cache, conversation(6 * PS + 1, seed=10))
    hit = shared.alloc.disk_pages
    shared.step()
    shared.release()
    own = SequenceRunner(loaded, cache, conversation(5 * PS + 1, seed=seed), job_id=1)
    own.step()
    own.release()
    cache.close()
    print(json.dumps({"hit": hit, "writer": writer}))
    """
)


def test_two_processes_on_one_store_both_hit_and_keep_it_whole(model_path, tmp_path):
    disk = tmp_path / "kv"
    loaded = load_model(model_path, load_tokenizer=False)
    cache = _cache(loaded, disk)
    seeded = SequenceRunner(loaded, cache, conversation(6 * PS + 1, seed=10))
    seeded.step()
    seeded.release()
    cache.close()

    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARER, str(model_path), str(disk), str(seed), str(go)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (11, 12)
    ]
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready-{seed}").exists() for seed in (11, 12)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    go.touch()  # only once both have opened the store
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["hit"] for r in results] == [6, 6]
    assert sorted(r["writer"] for r in results) == [False, True]  # one writer at a time

    # The store is whole: every record reads back verified, and the writer's own chat is
    # there beside the shared one.
    cache = _cache(loaded, disk)
    tier: DiskTier = cache.disk
    tier.validate()
    assert all(tier.read(h) is not None for h in list(tier.entries))
    assert tier.stats().dropped == 0
    found = []
    for seed in (11, 12):
        runner = SequenceRunner(loaded, cache, conversation(5 * PS + 1, seed=seed), job_id=seed)
        found.append(runner.alloc.disk_pages)
        runner.release()
    # All of a chat (the writer's; the reader's too if it took over in time) or none.
    assert set(found) <= {0, 5} and 5 in found
    cache.close()


def _hits_returning_to_the_first_chat(model_path, disk: Path | None) -> tuple[int, int]:
    """Chats of four system prompts (two full pages each) one after the other on a pool of
    three pages and a host tier of one page, then the first again: (its cached tokens, its
    pages read from disk)."""
    loaded = load_model(model_path, load_tokenizer=False)
    probe = _cache(loaded, None, tokens=PS)
    settings = CacheSettings(
        page_size=PS,
        token_budget=3 * PS,
        host_bytes=probe.storage.bytes_per_page,
        disk_dir=str(disk) if disk is not None else None,
    )
    cache = KVCache.for_model(loaded, settings)
    assert len(cache.pages.host_tier.slots) == 1
    chats = [conversation(2 * PS + 5, seed=20 + g) for g in range(4)]
    for job, tokens in enumerate([*chats, chats[0]]):
        runner = SequenceRunner(loaded, cache, tokens, job_id=job)
        cached, disk_pages = runner.cached_tokens, runner.alloc.disk_pages
        runner.step()
        runner.release()
        cache.pages.write_through()  # what the generator does when it drains
        if cache.disk is not None:
            cache.disk.flush()
    cache.pages.validate()
    cache.close()
    return cached, disk_pages


def test_the_disk_tier_keeps_what_the_host_tier_cannot(model_path, tmp_path):
    without = _hits_returning_to_the_first_chat(model_path, None)
    with_disk = _hits_returning_to_the_first_chat(model_path, tmp_path / "kv")
    assert without[0] < 2 * PS and without[1] == 0  # at most the host tier's one page
    assert with_disk == (2 * PS, 2)  # both pages, read back from disk


def test_a_quantized_cache_is_restored_byte_for_byte(model_path, tmp_path):
    """K at 4 bits and V at 8 (codes, scales and zeros in their own tensors): each page is
    read back into every one of its tensors, the same bytes the prefill stored, and the
    next turn's logits are bit for bit those of a cache that kept the pages in memory,
    and near a fresh prefill's in that format (which computes those pages' rows in a
    forward of another length: this model's Q8_0 parts multiply through a GEMM whose
    last bits depend on the row count, and a 4-bit K code can round the other way)."""
    from engine.model.calibration import calibration_for

    loaded = load_model(model_path, load_tokenizer=False)
    disk = tmp_path / "kv"

    def cache(disk_dir: Path | None) -> KVCache:
        settings = CacheSettings(
            page_size=PS,
            token_budget=4096,
            k_bits=4,
            v_bits=8,
            disk_dir=str(disk_dir) if disk_dir is not None else None,
        )
        return KVCache.for_model(loaded, settings, calibration_for(loaded, settings))

    earlier = conversation(6 * PS)  # whole pages: all of it is read back
    first = cache(disk)
    runner = SequenceRunner(loaded, first, earlier)
    runner.step()
    written = [first.storage.read_page(p) for p in runner.alloc.block_table[:6]]
    runner.release()
    first.close()

    again = cache(disk)
    assert len(again.storage.page_tensors()) > 2 * loaded.config.num_layers  # codes + params
    tokens = earlier + conversation(40, seed=1)
    runner = SequenceRunner(loaded, again, tokens)
    assert runner.alloc.disk_pages == 6
    assert [again.storage.read_page(p) for p in runner.alloc.block_table[:6]] == written
    restored = runner.step()
    runner.release()
    kept = cache(None)
    runner = SequenceRunner(loaded, kept, earlier)
    runner.step()
    runner.release()
    in_memory, cached, disk_pages = _next_logits(loaded, kept, tokens)
    assert (cached, disk_pages) == (len(earlier), 0)
    assert torch.equal(restored, in_memory)
    fresh, fresh_cached, _ = _next_logits(loaded, cache(None), tokens)
    assert fresh_cached == 0
    assert _relative_error(restored, fresh) < 1e-3
