"""Repacked weights kept on disk (engine/model/tile_cache.py): a later load maps what an
earlier one repacked, and a damaged, stale, oversized or unwritable file never gives
wrong weights or a crash: the load repacks."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.model import tile_cache as tc
from engine.model.tile_cache import TileCache, delete_files, file_for
from kernels.quant.bench import random_blocks
from kernels.quant.tiles import repack_parts, tiles_supported
from tests.smaps import covering, maps_file_huge_pages

MB = 1 << 20


class _Model:
    """A stand-in model file and weights in it: parts of Q4_K / Q6_K rows, the cache's
    key their offsets in ``blob``."""

    def __init__(self, path, seed=0, rows=(64, 48)):
        rng = np.random.default_rng(seed)
        self.parts = [
            [random_blocks(Q.Q4_K, rows[0], 512, rng), random_blocks(Q.Q4_K, 16, 512, rng)],
            [random_blocks(Q.Q6_K, rows[1], 256, rng)],
        ]
        self.kinds = ["Q4_K", "Q6_K"]
        self.path = path
        path.write_bytes(b"".join(p.tobytes() for ps in self.parts for p in ps))
        self.offsets = {}
        at = 0
        for ps in self.parts:
            for p in ps:
                self.offsets[p.ctypes.data] = at
                at += p.nbytes

    def cache(self, directory, budget=64 * MB) -> TileCache:
        return TileCache(self.path, lambda a: self.offsets.get(a.ctypes.data), directory, budget)

    def load(self, cache: TileCache) -> list[np.ndarray]:
        return [cache.tiles(ps, kind) for ps, kind in zip(self.parts, self.kinds)]

    def expected(self) -> list[np.ndarray]:
        return [repack_parts(ps, kind) for ps, kind in zip(self.parts, self.kinds)]


def test_a_second_load_maps_the_tiles_the_first_repacked(tmp_path):
    model = _Model(tmp_path / "m.gguf")
    first = model.cache(tmp_path / "tiles")
    made = model.load(first)
    assert first.hits == 0
    first.save(wait=True)
    assert first.path.exists() and "kept on disk" in first.status
    second = model.cache(tmp_path / "tiles")
    mapped = model.load(second)
    assert second.hits == 2 and second.save() is None  # nothing left to write
    for a, b, want in zip(made, mapped, model.expected()):
        assert b.shape == want.shape and np.array_equal(a, want) and np.array_equal(b, want)
        assert b.ctypes.data % 64 == 0


def test_a_kept_tile_file_is_read_through_huge_pages(tmp_path):
    """The tile file is written in 64 MB writes from multiples of 64 MB (the page cache
    then holds it in 2 MB folios) and mapped with MADV_HUGEPAGE (what is not cached is
    read in 2 MB folios): a later load reads its tiles through huge pages, as good as all
    of them (one token's weights read 1.16x faster at the Llama-3.2-1B shape). Written a
    weight at a time, the 2 MB around each weight's start stayed in small folios."""
    if not maps_file_huge_pages(tmp_path):
        pytest.skip("this kernel keeps a file's cached pages in small folios here")
    model = _Model(tmp_path / "m.gguf", rows=(30000, 20000))
    first = model.cache(tmp_path / "tiles")
    model.load(first)
    first.save(wait=True)
    second = model.cache(tmp_path / "tiles")
    tiles = model.load(second)
    assert second.hits == 2
    (mapping,) = covering(tiles[0].ctypes.data, 1)
    assert mapping.path == str(second.path) and "hg" in mapping.flags
    whole = (second.path.stat().st_size // (2 * MB)) * 2 * MB
    assert whole >= 6 * 2 * MB  # weights across several 2 MB stretches
    assert mapping.kb["FilePmdMapped"] * 1024 >= 0.9 * whole
    for a, want in zip(tiles, model.expected()):
        assert np.array_equal(a, want)


def test_a_system_without_pwritev_writes_the_same_file(tmp_path, monkeypatch):
    """Where there is no ``os.pwritev`` (Windows) each piece is written with its own
    seek and write: the same bytes, read back by the next load."""
    model = _Model(tmp_path / "m.gguf", rows=(3000, 2000))
    first = model.cache(tmp_path / "a")
    model.load(first)
    first.save(wait=True)
    monkeypatch.setattr(tc, "_CHUNK", 1 << 20)  # writes cut inside weights, too
    monkeypatch.delattr(os, "pwritev")
    second = model.cache(tmp_path / "b")
    model.load(second)
    second.save(wait=True)
    assert second.path.read_bytes() == first.path.read_bytes()
    third = model.cache(tmp_path / "b")
    assert all(np.array_equal(a, b) for a, b in zip(model.load(third), model.expected()))
    assert third.hits == 2


def test_tiles_of_rows_in_another_order_are_kept_apart(tmp_path):
    """A weight tiled with its rows in an order (llama's q/k: kernels/quant/linear.py
    `_row_orders`) is another entry than the same bytes in file order: a cache written
    before (file order) is not mapped for it, and the next load maps the ordered tiles."""
    model = _Model(tmp_path / "m.gguf")
    parts = model.parts[0]
    orders = [np.random.default_rng(1).permutation(parts[0].shape[0]), None]
    first = model.cache(tmp_path / "tiles")
    plain = first.tiles(parts, "Q4_K")
    first.save(wait=True)
    second = model.cache(tmp_path / "tiles")
    ordered = second.tiles(parts, "Q4_K", orders=orders)
    assert second.hits == 0
    want = repack_parts([parts[0][orders[0]], parts[1]], "Q4_K")
    assert np.array_equal(ordered, want) and not np.array_equal(ordered, plain)
    second.save(wait=True)
    third = model.cache(tmp_path / "tiles")
    assert np.array_equal(third.tiles(parts, "Q4_K", orders=orders), want)
    assert np.array_equal(third.tiles(parts, "Q4_K"), plain) and third.hits == 2


def test_a_damaged_tile_file_is_deleted_and_the_weights_repacked(tmp_path):
    model = _Model(tmp_path / "m.gguf")
    cache = model.cache(tmp_path / "tiles")
    model.load(cache)
    cache.save(wait=True)
    with open(cache.path, "r+b") as f:  # one bit in the middle of the last weight's tiles
        _magic, length, _crc = tc._HEADER.unpack(f.read(tc._HEADER.size))
        last = json.loads(f.read(length))["weights"][-1]
        at = last["offset"] + int(np.prod(last["shape"])) // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 4]))
    again = model.cache(tmp_path / "tiles")
    assert "CRC" in again.status and not again.path.exists()
    tiles = model.load(again)
    assert again.hits == 0
    assert all(np.array_equal(a, b) for a, b in zip(tiles, model.expected()))
    again.save(wait=True)  # written again, whole
    assert model.cache(tmp_path / "tiles").hits == 0 and model.load(model.cache(tmp_path / "tiles"))


@pytest.mark.parametrize("damage", ["truncated", "header", "index"])
def test_a_cut_or_garbled_tile_file_is_not_used(tmp_path, damage):
    model = _Model(tmp_path / "m.gguf")
    cache = model.cache(tmp_path / "tiles")
    model.load(cache)
    cache.save(wait=True)
    data = bytearray(cache.path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 5000]
    elif damage == "header":
        data[:8] = b"NOTTILES"
    else:
        data[40] ^= 1  # inside the JSON index
    cache.path.write_bytes(bytes(data))
    again = model.cache(tmp_path / "tiles")
    assert "repacking" in again.status and not again.path.exists()
    tiles = model.load(again)
    assert again.hits == 0
    assert all(np.array_equal(a, b) for a, b in zip(tiles, model.expected()))


def test_a_model_file_rewritten_in_place_does_not_get_the_old_tiles(tmp_path):
    """Same path, same size and the same modification time (set back): the digest of
    its bytes tells them apart."""
    model = _Model(tmp_path / "m.gguf", seed=1)
    cache = model.cache(tmp_path / "tiles")
    model.load(cache)
    cache.save(wait=True)
    st = model.path.stat()
    other = _Model(tmp_path / "m.gguf", seed=2)  # new bytes, same layout
    os.utime(model.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_for(other.path, tmp_path / "tiles") == cache.path  # the same name...
    again = other.cache(tmp_path / "tiles")
    tiles = other.load(again)
    assert again.hits == 0  # ...but not its tiles
    assert all(np.array_equal(a, b) for a, b in zip(tiles, other.expected()))


def test_a_new_tile_file_deletes_the_models_superseded_ones(tmp_path, monkeypatch):
    """Tiles written under an earlier tile format (a Folio update) are never mapped
    again: writing the model's new file deletes them, and leaves another model's."""
    import engine.model.tile_cache as tc

    a, b = _Model(tmp_path / "a.gguf", seed=1), _Model(tmp_path / "b.gguf", seed=2)
    monkeypatch.setattr(tc, "TILES_FORMAT", "tiles-before")
    for m in (a, b):
        cache = m.cache(tmp_path / "tiles")
        m.load(cache)
        cache.save(wait=True)
    old_a, old_b = (file_for(m.path, tmp_path / "tiles") for m in (a, b))
    assert old_a.exists() and old_b.exists()
    monkeypatch.setattr(tc, "TILES_FORMAT", "tiles-after")
    cache = a.cache(tmp_path / "tiles")
    assert cache.path != old_a
    assert all(np.array_equal(t, want) for t, want in zip(a.load(cache), a.expected()))
    assert cache.hits == 0  # the earlier format's tiles are not read
    cache.save(wait=True)
    assert sorted(p.name for p in (tmp_path / "tiles").iterdir()) == sorted(
        [cache.path.name, old_b.name]
    )


def test_a_full_disk_leaves_no_file_and_says_so(tmp_path, monkeypatch):
    model = _Model(tmp_path / "m.gguf")
    cache = model.cache(tmp_path / "tiles")
    tiles = model.load(cache)

    def full(fd, pieces, offset):
        os.pwrite(fd, pieces[0][:100], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tc, "_pwritev", full)
    rebound = []
    cache.save(wait=True, then=rebound.append)
    assert rebound == []  # nothing to read from
    assert "No space left on device" in cache.status and "next load repacks" in cache.status
    assert list((tmp_path / "tiles").iterdir()) == []
    assert all(np.array_equal(a, b) for a, b in zip(tiles, model.expected()))


def test_tiles_over_the_budget_are_not_written_and_the_oldest_make_room(tmp_path):
    a, b, c = (_Model(tmp_path / f"{n}.gguf", seed=i) for i, n in enumerate("abc"))
    one = sum(t.nbytes for t in a.expected()) + 3 * 4096  # header and page padding
    budget = 2 * one + one // 2
    for m in (a, b):
        cache = m.cache(tmp_path / "tiles", budget)
        m.load(cache)
        cache.save(wait=True)
    os.utime(file_for(a.path, tmp_path / "tiles"), (1, 1))  # a used longest ago
    cache = c.cache(tmp_path / "tiles", budget)
    c.load(cache)
    cache.save(wait=True)
    left = {p.name for p in (tmp_path / "tiles").iterdir()}
    assert left == {file_for(m.path, tmp_path / "tiles").name for m in (b, c)}

    small = a.cache(tmp_path / "tiles", budget=one // 2)
    a.load(small)
    small.save(wait=True)
    assert "do not fit" in small.status and not small.path.exists()
    off = a.cache(tmp_path / "tiles", budget=0)
    a.load(off)
    assert off.save() is None and not off.path.exists()


def test_what_a_dead_process_left_half_written_is_removed(tmp_path):
    model = _Model(tmp_path / "m.gguf")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / "tiles").mkdir()
    dead = tmp_path / "tiles" / f"x.tiles{tc.PARTIAL}{gone.stdout.strip()}"
    ours = tmp_path / "tiles" / f"y.tiles{tc.PARTIAL}{os.getpid()}"
    dead.write_bytes(b"half")
    ours.write_bytes(b"being written")
    model.cache(tmp_path / "tiles")
    assert not dead.exists() and ours.exists()


def test_deleting_a_models_tiles_leaves_the_others(tmp_path):
    a, b = _Model(tmp_path / "a.gguf", seed=1), _Model(tmp_path / "b.gguf", seed=2)
    for m in (a, b):
        cache = m.cache(tmp_path / "tiles")
        m.load(cache)
        cache.save(wait=True)
    size = file_for(a.path, tmp_path / "tiles").stat().st_size
    assert delete_files(a.path, tmp_path / "tiles") == size
    assert [p.name for p in (tmp_path / "tiles").iterdir()] == [
        file_for(b.path, tmp_path / "tiles").name
    ]


@pytest.mark.skipif(
    not tiles_supported("Q4_K"), reason="this CPU has no AVX-512 VNNI: no tiles to keep"
)
def test_a_model_loaded_again_maps_its_tiles_and_computes_the_same_bits(tmp_path, monkeypatch):
    """A Q4_K_M model's second load takes every tiled weight from the file the first
    wrote, and its logits equal the first load's bit for bit."""
    from engine.model.loader import load_model
    from tests.engine.test_forward_tiny import FILE_MIXES, _folio_logits
    from tests.engine.tiny_models import make_hf_model, write_gguf

    monkeypatch.setenv("FOLIO_TILES_DIR", str(tmp_path / "tiles"))
    model = make_hf_model("qwen2", seed=5, tie_word_embeddings=False, hidden_size=256)
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=6)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1)
    )

    def logits(loaded):
        return _folio_logits(loaded, ids, chunks=(9, 1, 1))

    first = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    first.tile_cache.wait()
    assert first.tile_cache.hits == 0 and first.tile_cache.path.exists()
    second = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    tiled = sum(
        len(lin.repacked()) > 0
        for layer in second.model.layers
        for lin in (layer.qkv, layer.gate_up, layer.down)
    )
    assert second.tile_cache.hits >= tiled > 0
    assert torch.equal(logits(first), logits(second))


@pytest.mark.skipif(
    not tiles_supported("Q4_K"), reason="this CPU has no AVX-512 VNNI: no tiles to keep"
)
def test_a_first_load_reads_its_tiles_from_the_file_once_written(tmp_path, monkeypatch):
    """A load that repacked its weights reads them from the tile file once that is
    written (the page cache's copy: huge pages, shared), its repacked copies then freed;
    its logits do not change."""
    from engine.model.loader import load_model
    from tests.engine.test_forward_tiny import FILE_MIXES, _folio_logits
    from tests.engine.tiny_models import make_hf_model, write_gguf

    monkeypatch.setenv("FOLIO_TILES_DIR", str(tmp_path / "tiles"))
    model = make_hf_model("llama", seed=3, tie_word_embeddings=True, hidden_size=256)
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=4)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2)
    )
    saves = []  # the load's save, held back so the repacked arrays are read first
    real_save = TileCache.save
    monkeypatch.setattr(TileCache, "save", lambda cache, **kw: saves.append((cache, kw)))
    loaded = load_model(tmp_path / "m.gguf", load_tokenizer=False)
    linears = [
        lin
        for layer in loaded.model.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ] + [loaded.model.lm_head]

    def tiles():
        return [
            g.tiles for lin in linears for g in getattr(lin, "_groups", ()) if g.tiles is not None
        ]

    def files(arrays):
        return {m.path for a in arrays for m in covering(a.ctypes.data, a.nbytes) or []}

    repacked = tiles()
    assert len(repacked) >= 2 * len(loaded.model.layers) + 1  # the layers' and the head's
    if covering(0, 1) is not None:
        assert files(repacked) == {""}  # anonymous memory
    before = _folio_logits(loaded, ids, chunks=(9, 1, 1))
    ((cache, kw),) = saves
    during = []  # forwards running while the save swaps the arrays under them

    def forwards():
        while not done.is_set() or not during:
            during.append(_folio_logits(loaded, ids, chunks=(9, 1, 1)))

    done = threading.Event()
    runner = threading.Thread(target=forwards)
    runner.start()
    real_save(cache, wait=True, **kw)
    done.set()
    runner.join()
    assert during and all(torch.equal(x, before) for x in during)
    mapped = tiles()
    assert len(mapped) == len(repacked)
    assert not {a.ctypes.data for a in mapped} & {a.ctypes.data for a in repacked}
    assert all(np.array_equal(a, b) for a, b in zip(mapped, repacked))
    if covering(0, 1) is not None:
        assert files(mapped) == {str(cache.path)}
    del repacked
    assert torch.equal(_folio_logits(loaded, ids, chunks=(9, 1, 1)), before)


def test_deleting_a_model_deletes_its_tiles_and_says_how_much(tmp_path, monkeypatch):
    from engine.hub.library import LocalModel, delete_model

    monkeypatch.setenv("FOLIO_TILES_DIR", str(tmp_path / "tiles"))
    models = tmp_path / "models"
    models.mkdir()
    doomed, kept = _Model(models / "doomed.gguf", seed=1), _Model(models / "kept.gguf", seed=2)
    for m in (doomed, kept):
        cache = m.cache(None)
        m.load(cache)
        cache.save(wait=True)
    result = delete_model(LocalModel(doomed.path, "doomed", "gguf", "folio", 1), models)
    assert "of its repacked weights" in result.message
    assert [p.name for p in (tmp_path / "tiles").iterdir()] == [file_for(kept.path).name]
    assert not doomed.path.exists()


@pytest.mark.skipif(
    not tiles_supported("Q4_K"), reason="this CPU has no AVX-512 VNNI: no tiles to keep"
)
def test_a_first_load_says_it_repacks_and_a_second_does_not(tmp_path, monkeypatch):
    from engine.model.loader import load_model
    from tests.engine.test_forward_tiny import FILE_MIXES
    from tests.engine.tiny_models import make_hf_model, write_gguf

    monkeypatch.setenv("FOLIO_TILES_DIR", str(tmp_path / "tiles"))
    model = make_hf_model("llama", seed=3, tie_word_embeddings=False, hidden_size=256)
    write_gguf(model, tmp_path / "m.gguf", FILE_MIXES["Q4_K_M"], default=Q.Q4_K, seed=4)

    def steps() -> str:
        seen: list[str] = []
        loaded = load_model(
            tmp_path / "m.gguf", load_tokenizer=False, progress=lambda f, what: seen.append(what)
        )
        loaded.tile_cache.wait()
        return " | ".join(seen)

    first, second = steps(), steps()
    assert "layer 1/" in first and "repacking weights for this CPU (once" in first
    assert "layer 1/" in second and "repacking" not in second
