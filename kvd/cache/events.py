"""KV events: which pages a tenant's cache holds, told to KV-aware routers as it changes.

Routers (vLLM's router, llm-d's kv-cache manager, Dynamo's KV indexer) learn where
prefixes live from engines' KV events; kvd tells them about its own pages the same way,
in vLLM's vocabulary: ``BlockStored`` when pages become findable (a publish, a warm
restart's recovery), ``BlockRemoved`` when they stop being findable (eviction, an extent
reclaimed for another namespace, ``reset_prefix_cache``, a page that failed its
checksum), ``AllBlocksCleared`` when everything a publisher announced is gone (a
publisher's start, kvd/server/event_publisher.py). A block hash is the page's kvd key; token ids
and the page size come with every stored page, so a router that keys prefixes by its own
hash of the token ids indexes kvd's pages too.

``EventLog`` is the one place events are made, one per tenant:

- ``PageEvents`` (kvd/cache/page_events.py), which the pool tells, reports each page as it
  is indexed (``stored``) and as it leaves the index (``removed``); consecutive pages of
  one chain merge into one event;
- the events of one turn of the event loop (one call: a publish, an allocation that
  evicted, a reset) close as one ``EventBatch`` with the next sequence number, never
  one per page; a call that runs in steps over many turns (``hold`` … ``end_hold``)
  closes its batch when it ends;
- closed batches go to the consumers (the ZMQ publisher, gRPC subscriptions) and stay in
  a bounded buffer for replay.

With no consumer the log is inactive: it records nothing and numbers nothing, so a
daemon nobody listens to pays one attribute check per page. When the last consumer
leaves, its buffer goes and one sequence number is skipped, so whoever resumes later
sees the gap.

``medium`` is "CPU" for kvd's host pages; a remote tier reports its own pages through the
same calls with ``medium="REMOTE"``, the disk tier with ``medium="STORAGE"`` (vLLM's name
for a secondary tier on storage, which its own file-system offloading tier announces).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvd.core.index import ExtraKey
from kvd.core.types import NamespaceId, PageKey
from kvd.wire.enums import ExtraKind

MEDIUM_CPU = "CPU"  # kvd's host pages
MEDIUM_REMOTE = "REMOTE"  # pages of a remote store tier
MEDIUM_STORAGE = "STORAGE"  # pages of the disk tier (vllm/distributed/kv_events.py's MEDIUM_STORAGE)


@dataclass
class BlockStored:
    """Pages that follow one another in one chain became findable: ``keys[0]``'s parent is
    ``parent`` (None: the chain's first page), each next key's parent the key before it."""

    namespace: NamespaceId
    keys: list[PageKey]
    parent: PageKey | None
    tokens: bytearray  # the pages' token ids, little-endian int32, page_size per key
    page_size: int
    medium: str
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None  # per page, vLLM's untagged extra keys; None: none at all


@dataclass
class BlockRemoved:
    """Pages of one namespace stopped being findable."""

    namespace: NamespaceId
    keys: list[PageKey]
    medium: str


@dataclass
class AllBlocksCleared:
    """Everything announced before this is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """The events of one call, numbered: a consumer that sees seq jump has missed batches."""

    seq: int
    ts: float  # time.time() when the batch closed
    events: tuple[KVEvent, ...]


class Consumer(Protocol):
    def put(self, batch: EventBatch) -> None:
        """Takes a closed batch; must not block the event loop."""


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def event_extras(extra_keys: tuple[ExtraKey, ...], page_index: int, page_size: int) -> tuple | None:
    """The extra keys vLLM publishes for one block, untagged, in its order: the LoRA name,
    (multimodal identifier, offset in the block) for each item the block overlaps, and the
    cache salt on the first block. None when there are none."""
    start, end = page_index * page_size, (page_index + 1) * page_size
    lora = [_text(k.value) for k in extra_keys if k.kind == ExtraKind.LORA]
    mm = sorted(
        (k.offset, _text(k.value))
        for k in extra_keys
        if k.kind == ExtraKind.MULTIMODAL and k.offset < end and k.offset + k.length > start
    )
    salt = [_text(k.value) for k in extra_keys if k.kind == ExtraKind.CACHE_SALT] if page_index == 0 else []
    keys = (*lora, *((ident, offset - start) for offset, ident in mm), *salt)
    return keys or None


class Subscription:
    """One gRPC subscriber's batches not yet sent, at most ``limit``: a subscriber that
    falls further behind is ended (``overrun``) rather than grow the daemon."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.overrun = False
        self.closed = False
        self._batches: deque[EventBatch] = deque()
        self._ready = asyncio.Event()

    def put(self, batch: EventBatch) -> None:
        if self.closed:
            return
        if len(self._batches) >= self.limit:
            self.overrun = True
            self.close()
            return
        self._batches.append(batch)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def get(self) -> EventBatch | None:
        """The next batch; None once closed and drained (an overrun ends at once)."""
        while not self._batches and not self.closed:
            self._ready.clear()
            await self._ready.wait()
        if self._batches and not self.overrun:
            return self._batches.popleft()
        return None


class EventLog:
    """The KV events of one tenant's cache: pending ones of this call, closed batches for replay."""

    def __init__(self, buffer_batches: int = 1000) -> None:
        self.buffer_batches = buffer_batches
        # Runs a callable once the current call is done (the server sets loop.call_soon);
        # None: batches close only on flush().
        self.schedule: Callable[[Callable[[], None]], object] | None = None
        self._consumers: list[Consumer] = []
        self._pending: list[KVEvent] = []
        self._buffer: deque[EventBatch] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._flush_scheduled = False
        self._held = 0  # calls running in steps (``hold``)

    @property
    def active(self) -> bool:
        return bool(self._consumers)

    # ---- what the cache reports ------------------------------------------------------

    def stored(
        self,
        namespace: NamespaceId,
        page_size: int,
        page_index: int,
        key: PageKey,
        parent: PageKey | None,
        tokens: bytes,
        extra_keys: tuple[ExtraKey, ...] = (),
        medium: str = MEDIUM_CPU,
    ) -> None:
        """Page ``page_index`` of a chain (key ``key``, parent key ``parent``) became findable."""
        if not self._consumers:
            return
        lora = next((_text(k.value) for k in extra_keys if k.kind == ExtraKind.LORA), None)
        extras = event_extras(extra_keys, page_index, page_size) if extra_keys else None
        last = self._pending[-1] if self._pending else None
        if (
            isinstance(last, BlockStored)
            and last.namespace == namespace
            and last.medium == medium
            and last.lora_name == lora
            and parent is not None
            and last.keys[-1] == parent
        ):
            if extras is not None and last.extra_keys is None:
                last.extra_keys = [None] * len(last.keys)
            if last.extra_keys is not None:
                last.extra_keys.append(extras)
            last.keys.append(key)
            last.tokens += tokens
        else:
            self._add(
                BlockStored(
                    namespace,
                    [key],
                    parent,
                    bytearray(tokens),
                    page_size,
                    medium,
                    lora,
                    None if extras is None else [extras],
                )
            )

    def removed(self, namespace: NamespaceId, key: PageKey, medium: str = MEDIUM_CPU) -> None:
        """The page under ``key`` is no longer findable."""
        if not self._consumers:
            return
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.namespace == namespace and last.medium == medium:
            last.keys.append(key)
        else:
            self._add(BlockRemoved(namespace, [key], medium))

    def cleared(self) -> None:
        """Everything announced before is gone."""
        if self._consumers:
            self._add(AllBlocksCleared())

    def _add(self, event: KVEvent) -> None:
        self._pending.append(event)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self.schedule is not None and not self._flush_scheduled and not self._held:
            self._flush_scheduled = True
            self.schedule(self._flush_when_free)

    def _flush_when_free(self) -> None:
        self._flush_scheduled = False
        if not self._held:  # else the last held call's end closes the batch
            self.flush()

    def hold(self) -> None:
        """A call that runs in steps and lets the loop turn between them (a publish, an
        allocation's eviction, kvd/cache/publishing.py) closes its events as one batch when it
        ends (``end_hold``, in any case), as a call in one piece does; events of calls served
        between its steps join that batch, in the order they happened."""
        self._held += 1

    def end_hold(self) -> None:
        self._held -= 1
        if self._pending:
            self._schedule_flush()

    # ---- batches ---------------------------------------------------------------------

    def flush(self) -> EventBatch | None:
        """Closes the pending events as one batch and hands it to every consumer."""
        self._flush_scheduled = False
        if not self._pending or not self._consumers:
            self._pending = []
            return None
        batch = EventBatch(self._next_seq, time.time(), tuple(self._pending))
        self._next_seq += 1
        self._pending = []
        self._buffer.append(batch)
        for consumer in list(self._consumers):
            consumer.put(batch)
        return batch

    def attach(self, consumer: Consumer) -> None:
        """Adds a consumer of every batch from now on."""
        self._consumers.append(consumer)

    def subscribe(self, from_seq: int | None = None) -> Subscription:
        """A subscription to the batches from now on, after the buffered ones with seq ≥
        ``from_seq`` (a resuming subscriber's next seq: its first batch says whether it missed any)."""
        self.flush()  # what happened before the subscription belongs to the past, not to it
        sub = Subscription(self.buffer_batches)
        if from_seq is not None:
            for batch in self._buffer:
                if batch.seq >= from_seq:
                    sub.put(batch)
        self.attach(sub)
        return sub

    def detach(self, consumer: Consumer) -> None:
        """Removes a consumer; with the last one gone the log forgets its buffer and skips a
        sequence number, since it records nothing until the next one comes."""
        self._consumers.remove(consumer)
        if not self._consumers:
            self._pending = []
            self._buffer.clear()
            self._next_seq += 1
