"""KV-cache events over ZMQ in vLLM's wire format, so a tool that follows a vLLM server's
cache (a KV-aware router, a cache dashboard) follows Folio's.

What goes on the wire (vLLM 0.26's `vllm.distributed.kv_events`, docs/ENGINE.md §11):

- a PUB socket sends one multipart message per batch: ``(topic, seq, payload)``, with
  ``seq`` an 8-byte big-endian counter from 0 and ``payload`` msgpack of the array
  ``[ts, events, data_parallel_rank]``;
- each event is a map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``) or
  ``AllBlocksCleared``;
- an optional ROUTER socket answers a replay request (an 8-byte big-endian start
  sequence number) with every buffered ``(seq, payload)`` from there, then ``(-1, b"")``.

A block hash is the first 8 bytes of the page's chained content hash as an unsigned
big-endian integer (vLLM's hashes are integers too). Only the device pool's pages are
reported: the host and disk tiers are Folio's own and have no vLLM medium that a
consumer would read as "can be reused without recomputing on this engine's device".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable

from engine.cache.page_table import CacheEvent, CacheEventKind

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hash(h: bytes) -> int:
    """A page's chained hash as vLLM's integer block hash."""
    return int.from_bytes(h[:8], "big")


def vllm_events(events: Iterable[CacheEvent], block_size: int, medium: str) -> list[dict]:
    """The page table's events as vLLM's. A page is stored when it gets its content hash
    (keyed for a prompt's context or completed by a prefill; a restore from a tier fills
    a page already keyed) and removed when it loses it (an eviction resets the page);
    a defragmentation move keeps the hash, and a host-tier push is not the pool."""
    out: list[dict] = []
    for ev in events:
        if ev.kind is CacheEventKind.STORED and ev.hash is not None:
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [block_hash(ev.hash)],
                    "parent_block_hash": None
                    if ev.parent_hash is None
                    else block_hash(ev.parent_hash),
                    "token_ids": list(ev.tokens),
                    "block_size": block_size,
                    "lora_id": None,
                    "medium": medium,
                    "lora_name": None,
                }
            )
        elif ev.kind is CacheEventKind.REMOVED and ev.hash is not None:
            out.append(
                {"type": "BlockRemoved", "block_hashes": [block_hash(ev.hash)], "medium": medium}
            )
        elif ev.kind is CacheEventKind.CLEARED:
            out.append({"type": "AllBlocksCleared"})
    return out


class KVEventPublisher:
    """One PUB socket (and a ROUTER for replays) on a thread of its own; `publish` only
    queues, so the engine thread never waits for a subscriber."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        max_queue: int = 100_000,
    ):
        """Binds ``endpoint`` (e.g. ``tcp://127.0.0.1:5557``); ValueError naming the
        endpoint when it cannot."""
        import msgpack
        import zmq

        self._zmq = zmq
        self._pack = msgpack.Packer()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            bad = endpoint if self._replay is None else replay_endpoint
            raise ValueError(f"cannot publish KV events on {bad}: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._topic = topic.encode()
        self._queue: queue.Queue[list[dict] | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self.dropped = 0  # batches not queued: the queue was full
        self._thread = threading.Thread(target=self._run, name="folio-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1

    def flush(self) -> None:
        """Wait until every batch published so far has been sent."""
        self._queue.join()

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                self._queue.task_done()
                return
            payload = self._pack.pack([time.time(), events, 0])
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._queue.task_done()

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def publish_engine_events(
    engine, endpoint: str, replay_endpoint: str | None = None, topic: str = ""
) -> KVEventPublisher:
    """Publish ``engine``'s device-pool events from now on (start it before the first
    job; a subscriber that joins later asks the replay socket for what it missed);
    close the publisher after the engine stops."""
    publisher = KVEventPublisher(endpoint, replay_endpoint, topic)
    pages = engine.cache.pages
    device = pages.storage.device.type if pages.storage is not None else "cpu"
    medium = "GPU" if device == "cuda" else device.upper()
    block_size = pages.page_size

    def forward(events: list[CacheEvent]) -> None:
        publisher.publish(vllm_events(events, block_size, medium))

    engine.add_cache_listener(forward)
    return publisher


def warn_if_exposed(endpoint: str) -> bool:
    """Events carry every prompt's token ids: say so when ``endpoint`` is reachable from
    other machines. True when it warned."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    if endpoint.startswith(("ipc://", "inproc://")) or host in ("127.0.0.1", "localhost", "[::1]"):
        return False
    log.warning(
        "KV-cache events on %s carry the token ids of every prompt: anyone who can reach "
        "it can read them (use tcp://127.0.0.1:PORT to keep them on this machine)",
        endpoint,
    )
    return True
