"""`RemovalFeed`: kvd's event stream as the vLLM connector's scheduler half hears it.

It follows the stream of the link's session on a thread of its own (its removals only:
the daemon sends no batch of stores, which would cost the scheduler process a parse each)
and hands the kvd keys of every page kvd evicts or drops to its listeners: the scheduler
half's holds (gpu_worker/vllm/lookahead.py: a hold whose page went is not offered) and,
with vLLM's KV events on, its `BlockEvents` (gpu_worker/vllm/block_events.py: routers
hear `BlockRemoved`).

The stream follows the link's session: when the link reconnects, a new subscription
starts, resuming after the last batch seen when the daemon instance is the same.
Removals that happen while no stream is open are not heard of (a router then keeps a
stale entry, which costs a miss at worst; a hold of that session ended with it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine_client import BlockRemoved, KVDError
from gpu_worker.vllm.kvd_link import KVDLink

log = logging.getLogger(__name__)


class RemovalFeed:
    def __init__(self, link: KVDLink, listeners: list[Callable[[list[bytes]], None]]) -> None:
        self.link = link
        self.listeners = listeners
        self._stream = None
        self._thread: threading.Thread | None = None
        self._session = ""  # of the current subscription
        self._instance = ""
        self._next_seq: int | None = None  # the batch after the last one seen

    def follow(self) -> None:
        """Subscribes with the link's current session unless its stream is being read already
        (called by the link's thread before each batch of calls, so the stream is open
        before a hold is taken or a page is stored)."""
        if self._thread is not None and self._thread.is_alive() and self._session == self.link.session:
            return
        resume = self._next_seq if self.link.instance == self._instance else None
        stream = self.link.attempt(
            "subscribe to events", lambda kvd, ns: kvd.subscribe_events(resume, removals_only=True)
        )
        if stream is None:
            return
        if self._stream is not None:
            self._stream.cancel()
        self._stream, self._session, self._instance = stream, self.link.session, self.link.instance
        self._thread = threading.Thread(target=self._read, args=(stream,), name="kvd-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _read(self, stream) -> None:
        try:
            for batch in stream:
                self._next_seq = batch.seq + 1
                for event in batch.events:
                    if isinstance(event, BlockRemoved):
                        for listener in self.listeners:
                            listener(event.block_hashes)
        except KVDError as e:
            log.info("kvd event stream ended (%s); removals are heard again once the link reconnects", e)
