"""The page map and the prefix tree rebuilt from a recorded vLLM KV-event stream: batches
encoded with vLLM's own message types (msgspec structs, as vLLM defines them), sent
through a real ZMQ PUB socket and replay ROUTER on 127.0.0.1 (in both encodings:
tests/engine/server/vllm_events.py), followed by the remote
engine's subscriber; the views' models equal what the stream implies."""

from __future__ import annotations

import random
import time

import msgspec
import numpy as np
import pytest
import zmq

from engine.cache.page import PageState
from engine.remote.block_pool import BlockPool, decode_batch
from engine.remote.subscriber import EventSubscriber
from gui.palette import ChatColors
from gui.views.page_map_model import PageMapModel
from gui.views.prefix_tree_model import PrefixTreeModel
from tests.engine.server.vllm_events import vllm_types

BS = 16  # block size
BLOCKS = 64  # the server's pool (vLLM's cache_config_info num_gpu_blocks)


def recorded_stream(seed: int, array_like: bool) -> tuple[list[bytes], dict]:
    """A server's life in batches: prompts sharing prefixes stored block by block (several
    hashes in one event, parents chained), evictions, a CPU-offload medium the pool must
    not mix in, a clear half way. Returns the encoded batches and, computed alongside, the
    pool they leave: hash -> (parent hash, token ids)."""
    t = vllm_types(array_like)
    EventBatch, Stored, Removed, Cleared = (
        t.EventBatch,
        t.BlockStored,
        t.BlockRemoved,
        t.AllBlocksCleared,
    )
    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    held: dict[int, tuple[int | None, list[int]]] = {}
    batches: list[bytes] = []
    roots = [[rng.randrange(50_000) for _ in range(BS)] for _ in range(3)]
    for step in range(40):
        events = []
        if step == 20:
            events.append(Cleared())
            held.clear()
        # A prompt: a shared first block, then its own blocks.
        first = roots[step % 3]
        chain = [first] + [
            [rng.randrange(50_000) for _ in range(BS)] for _ in range(rng.randint(1, 4))
        ]
        parent, hashes, tokens = None, [], []
        for block in chain:
            h = hash((parent, tuple(block))) & (2**63 - 1)
            hashes.append(h)
            tokens.extend(block)
            parent = h
        start = 0 if hashes[0] not in held else 1  # a cached first block is not stored again
        parent_hash = None if start == 0 else hashes[0]
        events.append(Stored(hashes[start:], parent_hash, tokens[start * BS :], BS, None, "GPU"))
        p = parent_hash
        for i, h in enumerate(hashes[start:], start):
            held[h] = (p, tokens[i * BS : (i + 1) * BS])
            p = h
        # The same blocks offloaded to CPU: another medium, not the device pool.
        events.append(Stored(hashes[-1:], None, tokens[-BS:], BS, None, "CPU"))
        if len(held) > 24:  # evict leaves, oldest first, as a pool under pressure does
            parents = {p for p, _ in held.values()}
            leaves = [h for h in held if h not in parents][: rng.randint(1, 3)]
            events.append(Removed(leaves, "GPU"))
            for h in leaves:
                del held[h]
        events.append(Removed(hashes[-1:], "CPU"))
        batches.append(enc.encode(EventBatch(float(step), events, 0)))
    return batches, held


def expected_key(h: int) -> int:
    """vLLM's integer hash as the views key pages: its 8 big-endian bytes read little-endian
    (docs: engine/remote/block_pool.py)."""
    return int.from_bytes(h.to_bytes(8, "big"), "little")


class Publisher:
    """vLLM's publisher in miniature: PUB (topic, seq, payload) and a replay ROUTER."""

    def __init__(self):
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sent: list[bytes] = []

    def send(self, payload: bytes, drop: bool = False) -> None:
        """``drop``: numbered and kept for replays but not sent, as a PUB socket drops
        batches past a slow subscriber's high-water mark."""
        seq = len(self.sent)
        self.sent.append(payload)
        if not drop:
            self.pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))

    def answer_replays(self, timeout_ms: int = 100) -> None:
        while self.router.poll(timeout_ms):
            client, _, start = self.router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), len(self.sent)):
                self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), self.sent[seq]))
            self.router.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


def follow(batches: list[bytes], before_join: int) -> BlockPool:
    """Publish ``before_join`` batches, then start the subscriber (which asks the replay
    socket for them), then publish the rest live, two of them lost on the way; the pool
    once it has seen them all."""
    pool = BlockPool(num_blocks=BLOCKS)
    pub = Publisher()
    seen = []

    def apply(seq, events):
        seen.append(seq)
        pool.apply(events)

    sub = EventSubscriber(pub.endpoint, apply, pub.replay_endpoint, topic="kv")
    try:
        for payload in batches[:before_join]:
            pub.send(payload)  # nobody hears these live
        sub.start()
        pub.answer_replays(2000)
        deadline = time.monotonic() + 20
        lost = {before_join + 3, before_join + 9}
        for seq, payload in enumerate(batches[before_join:], before_join):
            pub.send(payload, drop=seq in lost)
            pub.answer_replays(5)  # the gap is filled by a replay
        while len(seen) < len(batches) and time.monotonic() < deadline:
            pub.answer_replays(20)
        assert seen == list(range(len(batches))), "every batch once, in order"
        return pool
    finally:
        sub.close()
        pub.close()


def tree_nodes(tree: PrefixTreeModel) -> dict:
    nodes = tree.nodes()
    return {
        k: (n.parent if n.parent in nodes else None, n.state, n.fill, list(n.tokens[: n.fill]))
        for k, n in nodes.items()
    }


@pytest.mark.parametrize("array_like", [False, True], ids=["map-events", "array-events"])
def test_views_rebuilt_from_a_vllm_stream_equal_what_it_implies(array_like):
    batches, held = recorded_stream(seed=5, array_like=array_like)
    pool = follow(batches, before_join=7)
    snap = pool.snapshot(version=1)
    assert snap.num_pages == BLOCKS and snap.page_size == BS
    assert "no physical page index" in snap.note

    # Page map: one cached, full cell per held block; its parent the parent block's cell.
    pm = PageMapModel.from_snapshot(snap, ChatColors())
    cached = np.flatnonzero(pm.state == PageState.CACHED)
    assert len(cached) == len(held)
    assert np.count_nonzero(pm.state == PageState.FREE) == BLOCKS - len(held)
    by_key = {int(pm.hash_prefix[c]): int(c) for c in cached}
    assert set(by_key) == {expected_key(h) for h in held}
    for h, (parent, tokens) in held.items():
        cell = by_key[expected_key(h)]
        assert pm.fill[cell] == BS and snap.page_tokens[cell] == tokens
        want = by_key.get(expected_key(parent), -1) if parent in held else -1
        assert pm.parent[cell] == want

    # Prefix tree: a node per held block, chained as the stream chained them.
    tree = PrefixTreeModel()
    tree.set_snapshot(snap)
    expected = {
        ("h", expected_key(h)): (
            ("h", expected_key(p)) if p in held else None,
            PageState.CACHED,
            BS,
            tokens,
        )
        for h, (p, tokens) in held.items()
    }
    assert tree_nodes(tree) == expected
    assert tree.branch_points(), "prompts sharing a first block fork after it"


def test_a_batch_that_is_not_vllms_is_refused_in_words():
    with pytest.raises(ValueError, match="not msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(ValueError, match=r"not \[ts, events"):
        decode_batch(msgspec.msgpack.encode({"ts": 1}))
    # A kind this Folio does not know is passed over, not fatal.
    _, events = decode_batch(msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}], 0]))
    pool = BlockPool()
    pool.apply(events)
    assert pool.blocks == {}


def test_a_subscriber_to_a_bad_endpoint_is_named():
    with pytest.raises(ValueError, match="cannot subscribe to KV events at 'tcp://no port'"):
        EventSubscriber("tcp://no port", lambda seq, ev: None)
