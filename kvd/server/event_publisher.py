"""The ZMQ publisher of kvd's KV events, in vLLM's wire format (vllm/distributed/kv_events.py).

vLLM's own subscribers and KV-aware routers read it as they read an engine's events:

- a PUB socket sends each batch as ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian
  sequence number, gap-free unless a batch was dropped, ``payload`` the msgpack of vLLM's
  ``KVEventBatch``: ``[ts, events, data_parallel_rank]``, each event a map tagged with
  ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) holding vLLM's
  field names;
- an optional ROUTER socket answers replay requests: a subscriber that saw a gap sends
  the first sequence number it missed (8 bytes, big-endian, from a REQ or DEALER socket)
  and gets every buffered batch from there as ``[topic, seq, payload]``, then
  ``[b"", -1 (8 bytes, signed), b""]``.

Endpoints follow vLLM's rule: a wildcard (``tcp://*:5557``) or ``ipc://`` endpoint is
bound, any other is connected to. The first batch (seq 0) is ``AllBlocksCleared``: whatever
a router learnt from an earlier daemon on this endpoint is gone.

One publisher serves every tenant's ``EventLog`` (kvd/cache/events.py): the operator's router
sees the whole host. The event loop only numbers a batch and queues it (``put`` never
blocks); one thread encodes, sends and answers replays. A batch that finds the queue
full is dropped, and its sequence number with it, so subscribers see the gap.

This module (and zmq) is imported only when ``events_endpoint`` is set.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque

import msgpack
import numpy as np
import zmq

from kvd.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay answer
SEND_HWM = 100_000  # batches the PUB socket queues per subscriber before dropping (vLLM's default)
MAX_QUEUED = 100_000  # batches waiting for the thread before put() drops them (vLLM's default)
LINGER_MS = 500  # how long close() lets the last batches leave


class EventPublisherError(RuntimeError):
    """An endpoint cannot be bound or connected; the message names it."""


def _event(event: KVEvent) -> dict:
    """One event as vLLM's msgspec encodes it: tag first, fields without a default always,
    the others only when set."""
    if isinstance(event, BlockStored):
        doc = {
            "type": "BlockStored",
            "block_hashes": [bytes(k) for k in event.keys],
            "parent_block_hash": None if event.parent is None else bytes(event.parent),
            "token_ids": np.frombuffer(event.tokens, dtype="<i4").tolist(),
            "block_size": event.page_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            doc["extra_keys"] = event.extra_keys
        return doc
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [bytes(k) for k in event.keys], "medium": event.medium}
    assert isinstance(event, AllBlocksCleared), f"unknown KV event {event!r}"
    return {"type": "AllBlocksCleared"}


def encode(batch: EventBatch) -> bytes:
    """vLLM's KVEventBatch ``[ts, events, data_parallel_rank]``; kvd publishes as rank 0."""
    return msgpack.packb([batch.ts, [_event(e) for e in batch.events], 0], use_bin_type=True)


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket, replay ROUTER socket, and the thread that owns them."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "", buffer_batches: int = 1000) -> None:
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(SEND_HWM)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            if _is_bind_endpoint(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise EventPublisherError(f"cannot open KV events endpoint {endpoint} / {replay_endpoint!r}: {e}") from None
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(MAX_QUEUED)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)  # (seq, payload) for replay
        self._seq = 0
        self._dropped = 0
        # The thread sleeps in zmq.Poller on the replay socket and this pipe; put() writes a byte.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="kvd-events", daemon=True)
        self._thread.start()
        self.put(EventBatch(0, time.time(), (AllBlocksCleared(),)))
        log.info("KV events on %s%s", endpoint, f", replay on {replay_endpoint}" if replay_endpoint else "")

    # ---- the event loop's side -------------------------------------------------------

    def put(self, batch: EventBatch) -> None:
        """Numbers the batch (any tenant's) and queues it for the thread; never blocks."""
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                log.warning("KV events: %d batches wait to be sent; dropped %d batches", MAX_QUEUED, self._dropped)
            return
        self._wake()

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._close_sockets()
        self._ctx.term()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the thread is awake already

    def _close_sockets(self) -> None:
        self._pub.close(linger=LINGER_MS)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and ready.get(self._replay):
                self._answer_replays()
            if ready.get(self._wake_r):
                os.read(self._wake_r, 1 << 16)
                if not self._send_queued():
                    return

    def _send_queued(self) -> bool:
        """Sends every queued batch; False once the queue says to stop."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            seq, batch = item
            try:
                payload = encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - logged; subscribers see the gap and may replay
                log.exception("KV events: batch %d was not sent", seq)
                continue
            self._buffer.append((seq, payload))

    def _answer_replays(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: ignored a replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
