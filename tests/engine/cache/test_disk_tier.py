"""Disk tier (docs/ENGINE.md §10): pages that outlive the process, checked on every read,
a store that heals after torn writes and refuses another model's pages, a byte budget
kept tail first, one writer at a time, and a tier that turns itself off when it cannot
write."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import engine.cache.disk_tier as disk_tier
from engine.cache import PageTable
from engine.cache.disk_tier import DiskTier, store_dir
from engine.cache.page import CacheFingerprint, chain_hash
from engine.cache.storage import PagedKVStorage, dense_allocator
from tests.child_process import ROOT
from tests.engine.cache import assert_prefix_content, fill, make_storage

PS = 16
MODEL = "test-model"
FP = CacheFingerprint(MODEL, PS)


def _tier(location: Path, storage: PagedKVStorage, **kwargs) -> DiskTier:
    return DiskTier(store_dir(location, FP), FP, storage, **kwargs)


def _table(location: Path, num_pages: int = 8, **kwargs) -> PageTable:
    storage = make_storage(num_pages, PS)
    return PageTable(num_pages, PS, FP, storage, disk_tier=_tier(location, storage, **kwargs))


def _conversation(table: PageTable, seq: list[int], job_id: int = 1) -> None:
    """Prefill ``seq`` on ``table``, finish the job and write its pages through."""
    job = table.allocate(job_id, seq, 0)
    fill(table, job, seq, len(seq) - 1)
    table.release(job)
    table.write_through()
    table.disk_tier.flush()


def _segments(location: Path) -> list[Path]:
    return sorted(store_dir(location, FP).glob("seg-*.kv"))


SEQ = list(range(5 * PS + 1))  # five full context pages


def test_pages_come_back_after_a_restart(tmp_path):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    assert first.disk_tier.stats().pages == 5
    first.disk_tier.close()

    again = _table(tmp_path)
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 5 and job.cached_tokens == 5 * PS
    assert_prefix_content(again, job, SEQ)
    assert again.counters.disk_restores == 5
    assert again.snapshot().disk.hits == 5 and again.stats().pages_disk == 5
    again.validate()


def test_a_chain_is_read_straight_into_its_pool_pages(tmp_path, monkeypatch):
    """With no read ahead, each record goes from the file into its page's own memory: no
    buffered chain read, no copy into the page afterwards."""
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    again = _table(tmp_path)

    def no_copy(*args, **kwargs):
        raise AssertionError("a page was copied in, not read in place")

    monkeypatch.setattr(DiskTier, "_read_chain", no_copy)
    monkeypatch.setattr(PagedKVStorage, "write_page", no_copy)
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 5 and job.cached_tokens == 5 * PS
    assert job.disk_bytes == 5 * again.storage.bytes_per_page
    assert_prefix_content(again, job, SEQ)
    again.validate()


@pytest.mark.parametrize("damage", ["last buffer", "torn"])
def test_a_record_read_in_several_calls_is_checked_whole(tmp_path, monkeypatch, damage):
    """A page of more buffers than one preadv takes is read in several calls, and the
    checksum covers every buffer: damage in the last one, or a file that ends inside the
    record, still drops the page."""
    monkeypatch.setattr(disk_tier, "_IOV_MAX", 2)  # header + 4 tensors: three calls
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    segment = _segments(tmp_path)[0]
    record = _record_offset(3) - _record_offset(2)
    if damage == "last buffer":
        _damage(segment, _record_offset(3) - 3)  # inside record 2's last tensor
    else:
        os.truncate(segment, _record_offset(3) - 3)
    again = _table(tmp_path)
    assert len(again.storage.page_tensors()) + 1 > 2 * disk_tier._IOV_MAX
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 2 and job.disk_bytes == 2 * (record - disk_tier._REC_HEADER.size)
    assert_prefix_content(again, job, SEQ)
    fill(again, job, SEQ, len(SEQ) - 1)
    assert_prefix_content(again, job, SEQ)
    again.release(job)
    again.validate()


def test_a_pool_that_is_not_host_memory_is_filled_by_copies(tmp_path, monkeypatch):
    """A GPU pool's pages cannot be read into: the chain is read into buffers, then
    copied into the pages, with the same checks."""
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    _damage(_segments(tmp_path)[0], _record_offset(4) + disk_tier._REC_HEADER.size + 8)
    again = _table(tmp_path)
    monkeypatch.setattr(PagedKVStorage, "addressable", property(lambda self: False))
    copies = again.storage.page_copies
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 4 and again.storage.page_copies == copies + 4
    assert_prefix_content(again, job, SEQ)
    assert again.disk_tier.stats().dropped == 1


def test_without_an_index_the_segments_are_scanned(tmp_path):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    (store_dir(tmp_path, FP) / "index.bin").unlink()
    again = _table(tmp_path)
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 5
    assert_prefix_content(again, job, SEQ)


def test_a_page_evicted_from_the_device_is_read_back_from_disk(tmp_path):
    table = _table(tmp_path, num_pages=6)
    seq = list(range(3 * PS + 1))
    job = table.allocate(1, seq, 0)
    fill(table, job, seq, len(seq) - 1)
    table.release(job)
    other = list(range(500, 500 + 6 * PS))  # takes every page: the first chat is evicted
    job = table.allocate(2, other, 0)
    fill(table, job, other, len(other) - 1)
    table.release(job)
    assert table.counters.disk_spills == 3  # spilled at eviction, no write-through yet
    table.disk_tier.flush()
    job = table.allocate(3, seq, 0)
    assert job.disk_pages == 3 and job.cached_tokens == 3 * PS
    assert_prefix_content(table, job, seq)
    table.validate()


def _damage(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


def _record_offset(n: int) -> int:
    """Where the n-th record (from 0) of a fresh segment starts."""
    record = disk_tier._REC_HEADER.size + make_storage(1, PS).bytes_per_page
    return disk_tier._SEG_HEADER.size + n * record


@pytest.mark.parametrize("where", ["payload", "header"])
@pytest.mark.parametrize("with_index", [True, False])
def test_a_bit_flip_drops_that_page_and_it_is_recomputed(tmp_path, where, with_index):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    inside = disk_tier._REC_HEADER.size + 40 if where == "payload" else 10
    _damage(_segments(tmp_path)[0], _record_offset(2) + inside)
    if not with_index:
        (store_dir(tmp_path, FP) / "index.bin").unlink()

    again = _table(tmp_path)
    job = again.allocate(1, SEQ, 0)
    # Pages 0 and 1 come from disk; page 2 is damaged, so it and the rest are recomputed.
    assert job.disk_pages == 2 and job.cached_tokens == 2 * PS
    assert_prefix_content(again, job, SEQ)
    assert again.disk_tier.stats().dropped == 1
    fill(again, job, SEQ, len(SEQ) - 1)
    assert_prefix_content(again, job, SEQ)
    again.release(job)
    again.validate()


def test_a_truncated_segment_keeps_its_whole_records(tmp_path):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    segment = _segments(tmp_path)[0]
    os.truncate(segment, _record_offset(4) + 100)  # the fifth record is torn
    again = _table(tmp_path)
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 4
    assert_prefix_content(again, job, SEQ)
    assert segment.stat().st_size == _record_offset(4)  # the writer cut the torn tail
    # Recomputed, written again, and the next start finds all five.
    fill(again, job, SEQ, len(SEQ) - 1)
    again.release(job)
    again.write_through()
    again.disk_tier.close()
    third = _table(tmp_path)
    assert third.allocate(1, SEQ, 0).disk_pages == 5


def test_an_index_pointing_past_the_file_end_is_not_believed(tmp_path):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    tier = first.disk_tier
    entry = next(iter(tier.entries.values()))
    entry.offset = 10**9
    tier._write_index()
    tier.close()
    again = _table(tmp_path)
    assert again.disk_tier.stats().dropped == 1
    # The segment was scanned again instead: every record is found where it really is.
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 5
    assert_prefix_content(again, job, SEQ)


def test_a_store_of_another_model_or_format_is_refused(tmp_path):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    # Another model's store copied where this model's belongs.
    other_fp = CacheFingerprint("other-model", PS)
    other_dir = store_dir(tmp_path, other_fp)
    other_dir.mkdir()
    for path in _segments(tmp_path):
        (other_dir / path.name).write_bytes(path.read_bytes())
    storage = make_storage(8, PS)
    other = DiskTier(other_dir, other_fp, storage)
    assert len(other) == 0 and other.stats().dropped == 1
    assert not list(other_dir.glob("seg-*.kv"))  # the foreign segment is gone
    other.close()
    # The same model with another page format (wider heads).
    wider = PagedKVStorage(2, 8, PS, dense_allocator(1, 4))
    tier = DiskTier(store_dir(tmp_path, FP), FP, wider)
    assert len(tier) == 0 and tier.stats().dropped == 1
    table = PageTable(8, PS, FP, wider, disk_tier=tier)
    assert table.allocate(1, SEQ, 0).disk_pages == 0


def _chain(tier: DiskTier, storage: PagedKVStorage, first_token: int, pages: int) -> list[bytes]:
    """Write a chain of ``pages`` pages (random payloads) one by one; returns its hashes."""
    hashes, parent = [], None
    payload = storage.read_page(0)
    for i in range(pages):
        tokens = range(first_token + i * PS, first_token + (i + 1) * PS)
        h = chain_hash(parent or FP.root_digest(), list(tokens))
        assert tier.put(h, parent, payload)
        tier.flush()
        assert tier.nbytes() <= tier.budget + tier.segment_bytes
        tier.validate()
        hashes.append(h)
        parent = h
    return hashes


def test_over_budget_the_tails_go_first(tmp_path):
    storage = make_storage(1, PS)
    record = disk_tier._REC_HEADER.size + storage.bytes_per_page
    tier = _tier(tmp_path, storage, byte_budget=40 * record, segment_bytes=8 * record)
    old = _chain(tier, storage, 0, 20)
    new = _chain(tier, storage, 10_000, 30)  # 50 pages into a 40-page budget
    assert tier.evictions > 0
    kept_old = [h in tier for h in old]
    assert all(h in tier for h in new)  # the older chat pays
    assert kept_old[0] and kept_old == sorted(kept_old, reverse=True)  # a prefix of it stays
    assert len(_segments(tmp_path)) <= 40 // 8 + 1
    tier.close()


def test_one_chain_longer_than_the_budget_keeps_its_head(tmp_path):
    storage = make_storage(1, PS)
    record = disk_tier._REC_HEADER.size + storage.bytes_per_page
    tier = _tier(tmp_path, storage, byte_budget=30 * record, segment_bytes=6 * record)
    chain = _chain(tier, storage, 0, 60)
    kept = [h in tier for h in chain]
    reachable = kept.index(False)
    # Tail first: the chain keeps its first pages, as many as a segment below the budget.
    assert reachable >= 30 - 2 * 6
    assert all(kept[:reachable])
    tier.close()


def test_a_second_process_reads_and_takes_over_when_the_writer_goes(tmp_path):
    writer = _table(tmp_path)
    reader = _table(tmp_path)
    assert writer.disk_tier.writable and not reader.disk_tier.writable
    assert "another Folio process" in reader.disk_tier.status
    _conversation(writer, SEQ)
    assert not reader.disk_tier.put(b"x" * 16, None, b"")  # a reader never writes
    job = reader.allocate(1, SEQ, 0)  # refreshes: finds what the writer appended
    assert job.disk_pages == 5
    assert_prefix_content(reader, job, SEQ)
    reader.release(job)
    writer.disk_tier.close()
    reader.disk_tier.refresh()
    assert reader.disk_tier.writable and reader.disk_tier.status == ""
    reader.disk_tier.close()


def test_an_unwritable_location_turns_the_tier_off(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    table = _table(blocker / "cache")
    tier = table.disk_tier
    assert not tier.enabled and tier.status.startswith("off: cannot use")
    assert "disk cache off" in caplog.text
    job = table.allocate(1, SEQ, 0)  # the table works on without it
    fill(table, job, SEQ, len(SEQ) - 1)
    table.release(job)
    assert table.write_through() == 0
    table.validate()


def test_a_full_disk_turns_the_tier_off_and_nothing_else_fails(tmp_path, monkeypatch):
    def full(_fd, _data):
        raise OSError(errno.ENOSPC, "No space left on device")

    table = _table(tmp_path)
    monkeypatch.setattr(disk_tier, "_write_all", full)
    _conversation(table, SEQ)
    tier = table.disk_tier
    assert not tier.enabled and "No space left" in tier.status
    assert tier.stats().status == tier.status
    job = table.allocate(2, SEQ, 0)  # still served from the device pool
    assert job.hit_pages == 5
    table.release(job)
    table.validate()


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys
    from tests.engine.cache.test_disk_tier import FP, PS, payload_of, chain_hashes, _tier
    from tests.engine.cache import kill_after_writing, make_storage

    location, cut, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kill_after_writing(cut)
    storage = make_storage(1, PS)
    tier = _tier(location, storage)
    log = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    parent = None
    for i, h in enumerate(chain_hashes()):
        tier.put(h, parent, payload_of(i, storage.bytes_per_page))
        tier.flush()  # the record, then the index: a fixed order of writes
        os.write(log, h.hex().encode() + b"\\n")
        parent = h
    """
)

KILL_PAGES = 8


def payload_of(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


def chain_hashes() -> list[bytes]:
    hashes, parent = [], FP.root_digest()
    for i in range(KILL_PAGES):
        parent = chain_hash(parent, list(range(i * PS, (i + 1) * PS)))
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("seed", range(5))
def test_a_writer_killed_mid_write_leaves_every_whole_page_usable(tmp_path, seed):
    storage = make_storage(1, PS)
    record = disk_tier._REC_HEADER.size + storage.bytes_per_page
    # Records and index rewrites interleave; cut anywhere in the first five records' span.
    cut = random.Random(seed).randrange(1, 5 * (record + 400))
    progress = tmp_path / "progress"
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path), str(cut), str(progress)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -9, done.stderr[-2000:]
    finished = progress.read_text().split() if progress.exists() else []
    hashes = chain_hashes()
    tier = _tier(tmp_path, storage)
    tier.validate()
    # Every page the writer finished is there; at most the one it was writing besides.
    present = [h for h in hashes if h in tier]
    assert {h.hex() for h in present} >= set(finished)
    assert len(present) <= len(finished) + 1
    for i, h in enumerate(hashes):
        if h in tier:
            assert tier.read(h) == payload_of(i, storage.bytes_per_page)
    # The store takes new pages after the torn one and keeps them across a restart.
    parent = present[-1] if present else None
    nxt = hashes[len(present)]
    assert tier.put(nxt, parent, payload_of(len(present), storage.bytes_per_page))
    tier.close()
    again = _tier(tmp_path, storage)
    assert nxt in again and again.read(nxt) == payload_of(len(present), storage.bytes_per_page)
    again.close()


def _labelled_store(location: Path, model_file: Path, fingerprint: CacheFingerprint) -> Path:
    storage = make_storage(1, PS)
    tier = DiskTier(
        store_dir(location, fingerprint),
        fingerprint,
        storage,
        label={"model": model_file.stem, "path": str(model_file.resolve())},
    )
    h = chain_hash(fingerprint.root_digest(), list(range(PS)))
    assert tier.put(h, None, storage.read_page(0))
    tier.close()
    return store_dir(location, fingerprint)


def test_deleting_a_model_deletes_its_stores_only(tmp_path, monkeypatch):
    from engine.hub.library import LocalModel, delete_model

    location = tmp_path / "kv"
    monkeypatch.setenv("FOLIO_KV_CACHE_DIR", str(location))
    models = tmp_path / "models"
    models.mkdir()
    doomed, kept = models / "doomed.gguf", models / "kept.gguf"
    for f in (doomed, kept):
        f.write_bytes(b"GGUF" + bytes(100))
    # Two stores of the doomed model (two page formats), one of the other.
    gone = [
        _labelled_store(location, doomed, CacheFingerprint("doomed", PS)),
        _labelled_store(location, doomed, CacheFingerprint("doomed", PS, k_bits=8)),
    ]
    other = _labelled_store(location, kept, CacheFingerprint("kept", PS))
    stores = {s.directory: s for s in disk_tier.list_stores(location)}
    assert set(stores) == {*gone, other}
    assert all(s.pages == 1 and not s.in_use for s in stores.values())

    model = LocalModel(doomed, "doomed", "gguf", "folio", 104)
    result = delete_model(model, models)
    assert result.cache_freed_bytes == sum(stores[d].bytes for d in gone)
    assert "of its prompt cache" in result.message
    assert [s.directory for s in disk_tier.list_stores(location)] == [other]
    assert not doomed.exists() and kept.exists()


def test_a_store_in_use_is_not_deleted(tmp_path):
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"x")
    storage = make_storage(1, PS)
    tier = DiskTier(store_dir(tmp_path, FP), FP, storage, label={"path": str(model_file)})
    freed, busy = disk_tier.delete_stores(tmp_path, model_file)
    assert (freed, busy) == (0, 1) and store_dir(tmp_path, FP).exists()
    tier.close()
    freed, busy = disk_tier.delete_stores(tmp_path, model_file)
    assert busy == 0 and freed > 0 and not store_dir(tmp_path, FP).exists()


def test_snapshot_lists_the_records_as_chains_and_is_rebuilt_only_on_change(tmp_path, monkeypatch):
    table = _table(tmp_path)
    _conversation(table, SEQ)
    snap = table.snapshot().disk_records
    device = table.snapshot()
    full = device.hash_prefix[device.fill == PS]
    assert sorted(snap.hash_prefix.tolist()) == sorted(full.tolist())
    # Oldest use first, each page after its parent: the chain reads root to tail.
    assert snap.parent_prefix[0] == 0
    assert snap.parent_prefix[1:].tolist() == snap.hash_prefix[:-1].tolist()
    assert snap.changes == table.disk_tier.changes
    assert table.disk_tier.snapshot() is snap  # nothing moved: the same object
    monkeypatch.setattr(disk_tier, "SNAPSHOT_INTERVAL_S", 0.0)
    other = list(range(1000, 1000 + 2 * PS + 1))
    _conversation(table, other, job_id=2)
    grown = table.disk_tier.snapshot()
    assert len(grown.hash_prefix) == 7 and grown.changes == table.disk_tier.changes
    table.disk_tier.close()


class _GatedReads:
    """os.preadv for the disk tier that blocks until ``open`` is set, counting calls (of
    the store's segment files only: the model's embedding rows are read with it too)."""

    def __init__(self, monkeypatch):
        import threading

        self.open = threading.Event()
        self.calls = 0
        real = os.preadv

        def preadv(fd, buffers, offset):
            if not os.readlink(f"/proc/self/fd/{fd}").endswith(".kv"):
                return real(fd, buffers, offset)
            self.calls += 1
            assert self.open.wait(10), "the test never let the read go"
            return real(fd, buffers, offset)

        monkeypatch.setattr(disk_tier.os, "preadv", preadv)


def test_a_chain_read_ahead_is_taken_by_the_allocation_without_reading_again(tmp_path, monkeypatch):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    again = _table(tmp_path)
    gate = _GatedReads(monkeypatch)
    assert again.read_ahead(SEQ)  # started, and held at the gate
    # The reads run outside the tier's lock: the engine thread's calls go on meanwhile.
    assert again.disk_tier._lock.acquire(timeout=5)
    again.disk_tier._lock.release()
    assert again.snapshot().disk.pages == 5
    assert again.read_ahead(SEQ)  # still running: the job keeps waiting
    gate.open.set()
    while again.read_ahead(SEQ):
        pass
    job = again.allocate(1, SEQ, 0)
    assert gate.calls == 1  # one batched read, ahead; the allocation read nothing
    assert job.disk_pages == 5 and job.cached_tokens == 5 * PS
    assert_prefix_content(again, job, SEQ)
    again.validate()


def test_nothing_is_read_ahead_for_a_chain_the_pool_or_the_disk_lacks(tmp_path):
    table = _table(tmp_path)
    assert not table.read_ahead(SEQ)  # an empty store
    _conversation(table, SEQ)
    assert not table.read_ahead(SEQ)  # every page still in the pool


def test_a_compaction_during_a_read_ahead_neither_breaks_it_nor_drops_records(
    tmp_path, monkeypatch
):
    first = _table(tmp_path)
    _conversation(first, SEQ)
    first.disk_tier.close()
    again = _table(tmp_path)
    tier = again.disk_tier
    gate = _GatedReads(monkeypatch)
    assert again.read_ahead(SEQ)
    # The writer moves every record to a new segment and deletes the old one while the
    # read is held: the read goes on through its own descriptor of the deleted file.
    with tier._lock:
        (old,) = list(tier.segments.values())
        tier._active = tier._new_segment().id
        tier._compact(old)
    assert not any(p.name == old.name for p in _segments(tmp_path))
    gate.open.set()
    job = again.allocate(1, SEQ, 0)
    assert job.disk_pages == 5
    assert_prefix_content(again, job, SEQ)
    assert tier.dropped == 0 and len(tier) == 5
    again.validate()
