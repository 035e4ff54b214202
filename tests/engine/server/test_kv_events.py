"""KV-cache events over ZMQ (docs/ENGINE.md §11): decoded with vLLM 0.26's own message
types, a subscriber that applies them holds exactly the engine's pool, replays give back
what a late subscriber missed, and live batches follow in sequence."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from engine.cache.kv_cache import CacheSettings
from engine.engine import Engine
from engine.generator.job import JobRequest
from engine.generator.sampler import SamplingSettings
from engine.server.kv_events import (
    END_SEQ,
    KVEventPublisher,
    block_hash,
    publish_engine_events,
    warn_if_exposed,
)
from tests.engine.server.vllm_events import vllm_types

PS = 16


# vLLM 0.26's wire types: the batch is an array, each event a map tagged by "type".
VLLM = vllm_types(array_like=False)
BlockStored, BlockRemoved, KVEventBatch = VLLM.BlockStored, VLLM.BlockRemoved, VLLM.KVEventBatch


DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def _request(prompt: list[int], new: int = 8) -> JobRequest:
    return JobRequest(
        prompt=prompt,
        max_new_tokens=new,
        sampling=SamplingSettings(temperature=0),
        stop_token_ids=(),
    )


def _replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """Every batch from ``start`` on, asked for as vLLM's subscriber does (a REQ-style
    envelope; a DEALER, since the answer is several messages)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    finally:
        sock.close(linger=0)


def _apply(mirror: dict[int, tuple[int | None, list[int]]], batch: KVEventBatch) -> None:
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            assert ev.block_size == PS and len(ev.token_ids) == PS * len(ev.block_hashes)
            for i, h in enumerate(ev.block_hashes):
                mirror[h] = (ev.parent_block_hash, ev.token_ids[i * PS : (i + 1) * PS])
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                mirror.pop(h, None)
        else:
            mirror.clear()


def _pool(engine: Engine) -> dict[int, tuple[int | None, list[int]]]:
    pages = engine.cache.pages
    return {
        block_hash(rec.hash): (
            None if rec.parent_hash is None else block_hash(rec.parent_hash),
            list(rec.tokens),
        )
        for rec in pages.pages
        if rec.has_content_hash
    }


@pytest.fixture
def published(tiny_chat):
    # 8 pages of 16 tokens: the prompts below evict each other's pages.
    engine = Engine(tiny_chat, CacheSettings(page_size=PS, token_budget=8 * PS)).start()
    publisher = publish_engine_events(
        engine, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv-events"
    )
    yield engine, publisher
    engine.shutdown()
    publisher.close()


def test_a_subscriber_replaying_the_events_holds_exactly_the_pool(published):
    engine, publisher = published
    shared = list(range(3, 3 + 2 * PS))  # two pages every prompt starts with
    for i in range(6):
        prompt = shared + [(7 * i + j) % 200 + 3 for j in range(PS + 5 + 9 * i % 20)]
        engine.submit(_request(prompt)).wait(timeout=60)
    publisher.flush()
    batches = _replay(publisher.replay_endpoint, 0)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    mirror: dict[int, tuple[int | None, list[int]]] = {}
    for _, batch in batches:
        assert batch.data_parallel_rank == 0
        _apply(mirror, batch)
    pool = _pool(engine)
    assert mirror == pool and len(pool) >= 2
    removed = [ev for _, b in batches for ev in b.events if isinstance(ev, BlockRemoved)]
    assert removed, "the prompts were meant to evict each other's pages"
    # The shared prefix: one chain, the second page's parent is the first.
    by_tokens = {tuple(tokens): h for h, (_, tokens) in pool.items()}
    first, second = by_tokens[tuple(shared[:PS])], by_tokens[tuple(shared[PS:])]
    assert pool[first][0] is None and pool[second][0] == first


def test_live_batches_follow_the_replayed_ones_in_sequence(published):
    engine, publisher = published
    engine.submit(_request(list(range(3, 3 + 3 * PS)))).wait(timeout=60)
    publisher.flush()
    before = _replay(publisher.replay_endpoint, 0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    try:
        # Until the subscription reaches the publisher (ZMQ's slow joiner), batches are
        # not delivered: send prompts until one arrives, then check the sequence.
        for i in range(50):
            probe = [3 + (i * 3 * PS + j) % 250 for j in range(3 * PS)]
            engine.submit(_request(probe, new=1)).wait(timeout=60)
            if sub.poll(200):
                break
        else:
            pytest.fail("no live batch arrived")
        # Subscribed now: every batch of the next prompt arrives, in sequence.
        prompt = [3 + (7 * j + 11) % 250 for j in range(3 * PS)]
        engine.submit(_request(prompt, new=1)).wait(timeout=60)
        publisher.flush()
        seqs, stored = [], []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            seqs.append(int.from_bytes(seq, "big"))
            events = DECODE.decode(payload).events
            stored += [ev.token_ids for ev in events if isinstance(ev, BlockStored)]
        assert seqs[0] >= len(before) and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert [prompt[i * PS : (i + 1) * PS] for i in range(3)] == stored[-3:]
    finally:
        sub.close(linger=0)


def test_a_replay_from_past_the_end_gives_only_the_end_marker(published):
    _, publisher = published
    assert _replay(publisher.replay_endpoint, 10**6) == []


def test_an_endpoint_that_cannot_be_bound_is_named():
    with pytest.raises(ValueError, match="cannot publish KV events on tcp://no-such-host:1"):
        KVEventPublisher("tcp://no-such-host:1")


def test_only_an_endpoint_other_machines_reach_warns(caplog):
    assert not warn_if_exposed("tcp://127.0.0.1:5557")
    assert not warn_if_exposed("ipc:///tmp/folio-events")
    assert warn_if_exposed("tcp://*:5557")
    assert "token ids of every prompt" in caplog.text


def test_serve_refuses_a_replay_socket_without_events(capsys):
    from folio.main import main

    assert main(["serve", "--kv-events-replay", "tcp://127.0.0.1:5558"]) != 0
    assert "--kv-events-replay needs --kv-events" in capsys.readouterr().err
