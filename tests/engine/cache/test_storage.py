"""PagedKVStorage: format-agnostic copies and sizing."""

from __future__ import annotations

import pytest
import torch

from engine.cache import PagedKVStorage, dense_allocator


def quantized_allocator(num_pages: int, page_size: int) -> dict[str, torch.Tensor]:
    """Shaped like a 4-bit format: packed codes and one fp16 scale per 32 values."""
    return {
        "codes": torch.zeros(num_pages, page_size, 64, dtype=torch.int32),
        "scales": torch.zeros(num_pages, page_size, 8, dtype=torch.float16),
    }


def _randomize(storage: PagedKVStorage, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in storage.k + storage.v:
        for t in layer.values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            else:
                t.copy_(torch.randint(0, 2**30, t.shape, generator=gen, dtype=t.dtype))


@pytest.fixture(params=["dense", "quantized"])
def storage(request) -> PagedKVStorage:
    alloc = dense_allocator(3, 64) if request.param == "dense" else quantized_allocator
    s = PagedKVStorage(2, 6, 16, alloc)
    _randomize(s)
    return s


def test_copy_page_copies_every_layer_and_tensor(storage):
    src = storage.read_page(1)
    other = storage.read_page(0)
    storage.copy_page(1, 4)
    assert storage.read_page(4) == src
    assert storage.read_page(1) == src and storage.read_page(0) == other


def test_copy_rows_copies_only_the_first_rows(storage):
    before = storage.read_page(2)
    storage.copy_rows(1, 2, 5)
    assert storage.read_page(2, rows=5) == storage.read_page(1, rows=5)
    for layer in storage.k + storage.v:
        for t in layer.values():
            assert not torch.equal(t[2, 5:], t[1, 5:])
    assert storage.read_page(2) != before


def test_move_cycle_rotates_with_length_plus_one_copies(storage):
    pages = [storage.read_page(i) for i in range(storage.num_pages)]
    copies = storage.move_cycle([0, 3, 5])  # 0 -> 3 -> 5 -> 0
    assert copies == 4 and storage.page_copies == 4
    assert storage.read_page(3) == pages[0]
    assert storage.read_page(5) == pages[3]
    assert storage.read_page(0) == pages[5]
    assert storage.read_page(1) == pages[1]


def test_sizes():
    dense = PagedKVStorage(30, 4, 256, dense_allocator(3, 64))
    # 30 layers x 3 heads x 64 x (K, V) x 4 bytes: 46 KB per token (docs/ENGINE.md §9)
    assert dense.bytes_per_token == 30 * 3 * 64 * 2 * 4
    assert dense.nbytes() == 4 * dense.bytes_per_page
    per_page = PagedKVStorage.bytes_per_page_for(30, 256, dense_allocator(3, 64))
    assert per_page == dense.bytes_per_page
    by_bytes = PagedKVStorage.from_byte_budget(2, 10_000, 16, dense_allocator(1, 8))
    assert by_bytes.num_pages == 10_000 // (2 * 2 * 16 * 8 * 4)
    by_tokens = PagedKVStorage.from_token_budget(2, 100, 16, dense_allocator(1, 8))
    assert by_tokens.num_pages == 7


def test_bad_allocator_shape_is_refused():
    def wrong(num_pages, page_size):
        return {"data": torch.zeros(page_size, num_pages)}

    with pytest.raises(ValueError, match="expected"):
        PagedKVStorage(1, 4, 16, wrong)


def test_copy_between_storages(storage):
    other = PagedKVStorage(2, 2, 16, storage.allocator)
    other.copy_page_between(storage, 3, 1)
    assert other.read_page(1) == storage.read_page(3)


def test_kvquant_formats_with_different_k_and_v_bits():
    kvquant = pytest.importorskip("kernels.kvquant")
    from engine.cache import HostTier, kvformat_allocator

    k_fmt, v_fmt = kvquant.KVFormat(bits=8), kvquant.KVFormat(bits=4)
    storage = PagedKVStorage(
        2, 4, 16, kvformat_allocator(k_fmt, 2, 64), kvformat_allocator(v_fmt, 2, 64)
    )
    assert storage.bytes_per_token == 2 * (
        k_fmt.bytes_per_token(2, 64) + v_fmt.bytes_per_token(2, 64)
    )
    _randomize(storage)
    tier = HostTier(2 * storage.bytes_per_page, storage)
    tier.push(b"q" * 16, None, [0] * 16, storage, 1)
    tier.restore(b"q" * 16, storage, 3)
    assert storage.read_page(3) == storage.read_page(1)
    before = [storage.read_page(i) for i in range(4)]
    storage.move_cycle([0, 2])
    assert storage.read_page(2) == before[0] and storage.read_page(0) == before[2]
