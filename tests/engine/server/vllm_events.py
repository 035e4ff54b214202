"""vLLM's KV-event message types (vllm/distributed/kv_events.py) as msgspec structs, to
decode Folio's events and to encode recorded vLLM streams with. Two encodings are seen:
events as maps tagged by "type" (vLLM 0.26, what Folio publishes) and as arrays with the
tag first (`array_like=True`, vLLM's subscriber example)."""

# No `from __future__ import annotations`: msgspec resolves the fields of these
# function-local classes at runtime.

from types import SimpleNamespace

import msgspec


def vllm_types(array_like: bool = False) -> SimpleNamespace:
    """EventBatch, BlockStored, BlockRemoved, AllBlocksCleared and KVEventBatch (the
    batch that decodes its events into the three)."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(
        EventBatch=EventBatch,
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        KVEventBatch=KVEventBatch,
    )
