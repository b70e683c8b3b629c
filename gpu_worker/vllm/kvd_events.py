"""`StoredBlocks`: the kvd pages an engine adapter reported as stored, until kvd drops them.

The vLLM connector's scheduler half tells vLLM's KV event stream which blocks kvd stored
(`BlockStored`, keyed by vLLM's own block hashes). When kvd later evicts or drops such a
page, routers must hear `BlockRemoved` for the same vLLM hash. kvd announces removals by
its own page keys (kvd/cache/events.py) on a per-session stream (`KVDClient.subscribe_events`); this module keeps the
kvd key → vLLM hash of every block reported as stored (keys computed locally,
`KVDClient.page_keys`), follows the stream on a thread of its own, and turns the removals
of remembered keys into vLLM events. Keys it never reported (pages of other processes,
pages it only loaded) are ignored.

The stream follows the link's session: when the link reconnects, a new subscription
starts, resuming after the last batch seen when the daemon instance is the same.
Removals that happen while no stream is open are not heard of (a router then keeps a
stale entry, which costs a miss at worst). At most `max_tracked` keys are remembered,
the oldest forgotten first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque

from engine_client import BlockRemoved, KVDError
from gpu_worker.vllm.kvd_link import KVDLink

log = logging.getLogger(__name__)


class StoredBlocks:
    def __init__(self, link: KVDLink, max_tracked: int = 1 << 20) -> None:
        self.link = link
        self.max_tracked = max_tracked
        self._hashes: OrderedDict[bytes, object] = OrderedDict()  # kvd key -> the vLLM block hash reported
        self._removed: deque[bytes] = deque()  # kvd keys the stream reported removed, not yet matched
        self._stream = None
        self._thread: threading.Thread | None = None
        self._session = ""  # of the current subscription
        self._instance = ""
        self._next_seq: int | None = None  # the batch after the last one seen

    def remember(self, keys: list[bytes], hashes: list) -> None:
        """Blocks reported to vLLM as stored: kvd keys and the vLLM hashes they were reported under."""
        for key, block_hash in zip(keys, hashes):
            self._hashes[key] = block_hash
            self._hashes.move_to_end(key)
        while len(self._hashes) > self.max_tracked:
            self._hashes.popitem(last=False)

    def take_removed(self) -> list:
        """vLLM hashes of remembered blocks that kvd removed since the last call, oldest first."""
        hashes = []
        while self._removed:
            block_hash = self._hashes.pop(self._removed.popleft(), None)
            if block_hash is not None:
                hashes.append(block_hash)
        return hashes

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def follow(self) -> None:
        """Subscribes with the link's current session unless its stream is being read already
        (called every step before the workers save, so the stream is open before a page is stored)."""
        if self._thread is not None and self._thread.is_alive() and self._session == self.link.session:
            return
        resume = self._next_seq if self.link.instance == self._instance else None
        stream = self.link.attempt("subscribe to events", lambda kvd, ns: kvd.subscribe_events(resume))
        if stream is None:
            return
        if self._stream is not None:
            self._stream.cancel()
        self._stream, self._session, self._instance = stream, self.link.session, self.link.instance
        self._thread = threading.Thread(target=self._read, args=(stream,), name="kvd-events", daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        try:
            for batch in stream:
                self._next_seq = batch.seq + 1
                for event in batch.events:
                    if isinstance(event, BlockRemoved):
                        self._removed.extend(event.block_hashes)
        except KVDError as e:
            log.info("kvd event stream ended (%s); removals are heard again once the link reconnects", e)
