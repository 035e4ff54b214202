"""A subscriber to a server's KV-cache events (vLLM's ZMQ protocol, docs/ENGINE.md §11):
a SUB socket for live batches and, when the server has one, its replay socket for what
was published before we joined or lost on the way.

On start it subscribes first, then asks the replay socket for everything from sequence 0,
so no batch falls between the two; live batches that arrive meanwhile wait and are
applied after the replay, those the replay already gave skipped. A gap in the live
sequence (a PUB socket drops batches a slow subscriber cannot take) is filled the same
way. Without a replay socket a gap is counted, and the pool may miss blocks until the
server clears it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from engine.remote.block_pool import decode_batch

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_MS = 5000

Apply = Callable[[int, list[dict[str, Any]]], None]


class EventSubscriber:
    """Runs on a thread of its own; `apply(seq, events)` is called there, in sequence
    order, once per batch."""

    def __init__(
        self,
        endpoint: str,
        apply: Apply,
        replay_endpoint: str | None = None,
        topic: str = "",
    ):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._apply = apply
        self.last_seq = -1
        self.gaps = 0  # batches known lost (no replay socket to ask)
        self.bad = 0  # batches that could not be decoded
        self.error = ""  # why the subscriber stopped, if it did on its own
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            raise ValueError(f"cannot subscribe to KV events at {endpoint!r}: {exc}") from None
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._thread = threading.Thread(target=self._run, name="folio-kv-subscriber", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sub.close(linger=0)

    # -- the subscriber's thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.replay_endpoint:
                self._replay(0)
            while not self._stop.is_set():
                if self._sub.poll(100):
                    self._live(self._sub.recv_multipart())
        except Exception as exc:  # noqa: BLE001 - reported, never raised into the app
            self.error = f"KV events from {self.endpoint} stopped: {exc}"
            log.exception("KV-event subscriber")

    def _live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.bad += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq <= self.last_seq:
            return  # given by a replay already
        if seq > self.last_seq + 1:
            if self.replay_endpoint:
                self._replay(self.last_seq + 1)
                if seq <= self.last_seq:
                    return
            else:
                self.gaps += seq - self.last_seq - 1
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            _, events = decode_batch(payload)
        except ValueError:
            self.bad += 1
            log.warning("KV events: batch %d could not be decoded", seq)
        else:
            self._apply(seq, events)
        self.last_seq = seq

    def _replay(self, start: int) -> None:
        """Every buffered batch from ``start`` on, as vLLM's subscriber asks for them."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while not self._stop.is_set():
                if not sock.poll(REPLAY_TIMEOUT_MS):
                    log.warning("KV events: no replay from %s", self.replay_endpoint)
                    return
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    self.bad += 1
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq > self.last_seq:
                    self._deliver(seq, payload)
        finally:
            sock.close(linger=0)
