"""The disk tier of one cache (one tenant): pages RAM gives up kept in a file on local disk,
promoted back into host memory when a prompt asks for them, and still there after a daemon
restart or a host reboot.

Writes are **write-back on eviction**: when RAM unpublishes a page (``unpublished``: evicted,
reclaimed, reset), its bytes are copied at once while they and their seal are still there
(the page is reused next) and written from the copy on the store's threads
(kvd/disk/store.py); the store checks the copy against the seal, so a page whose bytes
changed in host memory never reaches the disk. An eviction never waits for the disk: with
``backlog_bytes`` of copies already waiting, the page is not written (``skipped_pages``).
The trace study (bench/trace_sim.py, bench/RESULTS.md) chose it: on Mooncake's traces,
write-back serves the same hits as write-through at a fraction of the bytes written (a page
RAM still holds is hit there, so writing it at publish is spent unless it is evicted), and
costs the publish path nothing. A page promoted from the disk and evicted again is not
written again while the disk still holds it.

The tier's index (``_on_disk``) maps (namespace root, chain key) to the ``DiskPage`` that
holds it: built at start-up from the pages the store recovered (``DiskStore.open`` reads
every header; the daemon opens it before taking calls), then from each page written. When
a write finds the disk full, the policy (``LruPolicy``, kvd/disk/eviction.py) names the
pages to free, and the refused pages are written once more after the frees (still full:
``refused_pages``).

Hits: the tier is a ``FetchSource`` for the cache's fetch machinery (``Fetches``,
kvd/cache/fetches.py, shared with the remote tier): ``find`` walks the missing pages' chain
keys through the index, ``get`` reads the leading run into newly granted host pages
(``DiskStore.read``, which checks each page's checksum; a page that fails it is dropped
from the disk) and answers each page's header, which ``Fetches`` compares with what the
request expects before publishing the pages in chain order as CACHED. A page read back for
another tenant or namespace root never matches. A page rejected there is freed from the
disk (``reject``).

KV events (kvd/cache/events.py) keep a router's view of this host exact: a page becomes
findable on disk once its write is done (or at start-up, for the pages recovered) and is
announced ``BlockStored`` with medium ``STORAGE``; a page freed from the disk (to make room,
rejected, dropped by a failed read) is announced ``BlockRemoved`` with medium ``STORAGE``.
RAM's own events say the rest: the eviction that sent a page here was its ``BlockRemoved``
for ``CPU``, a promotion is a ``BlockStored`` for ``CPU`` (the disk keeps its copy).
Between an eviction and the write's end the page is on neither medium, and announced on
neither. A recovered page whose namespace no engine registered yet is announced with
namespace id 0 (the ZMQ stream carries no namespace).

Metrics beside the counters: bytes written and read, and the promotion latency (from the
reads' start to their pages back on the event loop, checked) as a histogram
(``Latencies``, kvd/cache/stats.py).

The launcher (kvd/server/daemon.py) attaches one to each tenant's cache before the remote
tier (RAM → disk → store): ``Tiers.missed`` asks the remote tier only when the disk brings
nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvd.cache.events import MEDIUM_STORAGE
from kvd.cache.fetches import Arrival, Done, Fetches, Found, PageHeader
from kvd.cache.holds import Holds
from kvd.cache.places import page_seal, recovered_places
from kvd.cache.stats import DiskStats, Latencies
from kvd.config import DiskConfig
from kvd.core.index import ChainSpec, ExtraKey, PageContent, page_key
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import Namespace
from kvd.core.types import NamespaceId, PageId, PageKey
from kvd.disk.eviction import LruPolicy
from kvd.disk.layout import BLOCK, DiskPage, PageIdentity
from kvd.disk.results import (
    PageRead,
    PageWrite,
    ReadFailure,
    ReadOk,
    Seal,
    WriteRefusal,
    Written,
)
from kvd.disk.store import Opened
from kvd.wire.codec import TOKEN_BYTES

if TYPE_CHECKING:
    from kvd.cache.manager import KVCacheManager

log = logging.getLogger(__name__)

DiskKey = tuple[bytes, PageKey]  # (namespace root, chain key)


@dataclass
class DiskTierCounters:
    written_pages: int = 0  # pages written to disk
    fetched_pages: int = 0  # pages read back, verified and published (promoted)
    hit_tokens: int = 0  # allocated prefix tokens served by promoted pages
    skipped_pages: int = 0  # evicted while the write backlog was full, or changed: not written
    refused_pages: int = 0  # not written: the disk full (after evicting), out of space, vanished
    evicted_pages: int = 0  # freed from the disk to make room
    rejected_pages: int = 0  # read back and failed a check: a miss, dropped from the disk
    errors: int = 0  # reads and writes that failed
    written_bytes: int = 0  # page bytes written
    read_bytes: int = 0  # page bytes read back (promotions, rejected pages included)
    promotions: Latencies = field(default_factory=Latencies)  # seconds each batch of reads took


class DiskTier:
    """One tenant's pages on disk: their index, the writes on their way, the promotions."""

    name = "the disk"

    def __init__(
        self, opened: Opened, scope: str, settings: DiskConfig, manager: KVCacheManager, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Built before the daemon takes any call, after a warm restart's pages are restored;
        ``opened`` is the tenant's store as ``DiskStore.open`` found it."""
        m = manager
        self.store = opened.store
        self.scope = scope
        self.backlog_limit = settings.backlog_bytes
        self.loop = loop
        self.arena, self.pool, self.integrity = m.arena, m.pool, m.integrity
        self.events, self.namespaces = m.events, m.namespaces
        self.counters = DiskTierCounters()
        self.policy = LruPolicy()
        self._holds = Holds(m.pool)
        self._placed: dict[PageId, ChainPlace] = recovered_places(m.pool, m.index, m.namespaces)
        self._on_disk: dict[DiskKey, DiskPage] = {}
        self._extra_keys: dict[DiskKey, tuple[ExtraKey, ...]] = {}  # of queued pages that have some: their events
        self._queued: list[PageWrite] = []
        self._backlog = 0  # bytes of copies queued or being written
        self._closed = False  # host memory is being unmapped: answers that come later are dropped
        self.fetches = Fetches(self, self._holds, self.counters, m.arena, m.pool, m.index, m.room, m.page_events)
        for page in sorted(opened.pages, key=lambda p: p.sequence):
            if page.identity.scope == scope:
                self._index(page)

    # ---- Tier -------------------------------------------------------------------------

    def published(self, content: PageContent, place: ChainPlace) -> None:
        self._placed[content.page] = place

    def submit(self) -> None:
        pass  # pages are written when RAM gives them up

    def unpublished(self, page: PageId) -> None:
        """Copies the page for the disk (its bytes and seal are still there), unless it came
        from the disk and is there still."""
        place = self._placed.pop(page, None)
        fetched = self.fetches.forget(page)
        content = self.pool.content(page)
        if place is None or place.parent_key is None:
            return
        key = (place.ns.root, content.key)
        if key in self._on_disk:
            return
        sealed = page_seal(self.integrity, self.arena, page)
        if sealed is None or fetched:
            return
        if self._backlog + place.ns.page_bytes > self.backlog_limit:
            self.counters.skipped_pages += 1
            return
        identity = PageIdentity(
            self.scope, place.ns.root, content.key, place.parent_key, place.page_index, content.local, content.tokens
        )
        copy = _aligned_copy(self.arena.page_bytes_view(page))
        self._backlog += copy.nbytes
        if not self._queued:
            self.loop.call_soon(self._write_queued)  # once the eviction's call is done: one batch
        self._queued.append(PageWrite(identity, copy, Seal(*sealed)))
        if place.extra_keys:
            self._extra_keys[key] = place.extra_keys

    def served(self, hits: list[PageId], page_size: int) -> None:
        self.fetches.served(hits, page_size)

    def missed(
        self,
        ns: Namespace,
        chain: ChainSpec,
        extra_keys: tuple[ExtraKey, ...],
        tokens: bytes,
        hits: list[PageId],
        hit_keys: list[PageKey],
    ) -> int:
        return self.fetches.missed(ns, chain, extra_keys, tokens, hits, hit_keys) if self._on_disk else 0

    def holds(self) -> Counter[PageId]:
        return self._holds.all()

    def stats(self) -> DiskStats:
        c, s = self.counters, self.store.counters()
        return DiskStats(
            state="on",
            pages=len(self._on_disk),
            bytes=sum(p.page_bytes for p in self._on_disk.values()),
            capacity_bytes=s.capacity_bytes,
            written_pages=c.written_pages,
            fetched_pages=c.fetched_pages,
            hit_tokens=c.hit_tokens,
            skipped_pages=c.skipped_pages,
            refused_pages=c.refused_pages,
            evicted_pages=c.evicted_pages,
            rejected_pages=c.rejected_pages,
            errors=c.errors,
            written_bytes=c.written_bytes,
            read_bytes=c.read_bytes,
            promotion_buckets=list(c.promotions.counts),
            promotion_seconds=c.promotions.seconds,
            backlog_bytes=self._backlog,
            recovered_pages=s.recovered_pages,
            direct_io=s.direct_io,
        )

    def close(self) -> None:
        """Waits for the transfers in flight (before host memory is unmapped); their answers
        are dropped: the cache is closing."""
        self._closed = True
        self.store.close()

    # ---- FetchSource (kvd/cache/fetches.py) ---------------------------------------------

    @property
    def up(self) -> bool:
        return True

    def find(self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range, done: Done) -> None:
        step = ns.page_size * TOKEN_BYTES
        found: Found = []
        for i in pages:
            page_tokens = tokens[i * step : (i + 1) * step]
            key = page_key(parent_key, i, page_tokens, chain.local_bytes(i))
            on_disk = self._on_disk.get((ns.root, key))
            if on_disk is None:
                break
            self.policy.hit((ns.root, key))
            found.append((on_disk, PageHeader(i, key, parent_key, chain.local_digest(i), page_tokens)))
            parent_key = key
        self.loop.call_soon(done, found, None)  # as the store's answer would: after the caller's call

    def get(self, ns: Namespace, found: Found, views: list[np.ndarray], done: Done) -> None:
        reads = [PageRead(on_disk.slot, view) for (on_disk, _), view in zip(found, views)]
        started = time.monotonic()
        self._when_done(self.store.read(reads), lambda results: done(self._arrivals(ns, found, results, started), None))

    def reject(self, on_disk: DiskPage) -> None:
        """The page read back is not the one the request expects: freed from the disk."""
        if self._forget(on_disk):
            self.store.free([on_disk.slot])

    def _arrivals(self, ns: Namespace, found: Found, results, started: float) -> list[PageHeader | Arrival]:
        """Each page's header as the disk has it, once its checksum held; a page the store
        dropped is forgotten."""
        self.counters.promotions.observe(time.monotonic() - started)
        got: list[PageHeader | Arrival] = []
        for (on_disk, _), result in zip(found, results):
            if isinstance(result, ReadOk):
                self.counters.read_bytes += result.page.page_bytes
                i = result.page.identity
                ours = i.scope == self.scope and i.namespace_root == ns.root
                got.append(
                    PageHeader(i.page_index, i.key, i.parent_key, i.local, i.tokens) if ours else Arrival.MISMATCHED
                )
                continue
            if result.dropped:
                self._forget(on_disk)
            if result.reason is ReadFailure.CORRUPT:
                got.append(Arrival.MISMATCHED)
            else:
                got.append(Arrival.FAILED)
        return got

    # ---- writing ------------------------------------------------------------------------

    def _write_queued(self, retry: bool = False, queued: list[PageWrite] | None = None) -> None:
        if queued is None:
            queued, self._queued = self._queued, []
        if queued:
            self._when_done(self.store.write(queued), lambda results: self._written(queued, results, retry))

    def _written(self, writes: list[PageWrite], results, retry: bool) -> None:
        """Indexes the pages written; the disk full, frees the policy's victims and writes
        the refused pages once more."""
        full: list[PageWrite] = []
        for write, result in zip(writes, results):
            if not isinstance(result, Written) and result.reason is WriteRefusal.FULL and not retry:
                full.append(write)
                continue
            extra_keys = self._extra_keys.pop((write.identity.namespace_root, write.identity.key), ())
            if isinstance(result, Written):
                self.counters.written_pages += 1
                self.counters.written_bytes += result.page.page_bytes
                self._index(result.page, extra_keys)
            elif result.reason is WriteRefusal.CHANGED:
                self.counters.skipped_pages += 1
            elif result.reason is WriteRefusal.IO_ERROR:
                self.counters.errors += 1
            elif result.reason is not WriteRefusal.CLOSED:
                self.counters.refused_pages += 1
            self._backlog -= write.view.nbytes
        if not full:
            return
        victims = [self._unindex(key) for key in self.policy.victims(len(full))]
        self.counters.evicted_pages += len(victims)
        self._when_done(self.store.free([v.slot for v in victims]), lambda _: self._write_queued(True, full))

    def _index(self, page: DiskPage, extra_keys: tuple[ExtraKey, ...] = ()) -> None:
        """A page on disk becomes findable (and is announced); an older copy of the same page
        is freed."""
        key = (page.identity.namespace_root, page.identity.key)
        older = self._on_disk.get(key)
        self._on_disk[key] = page
        self.policy.admitted(key)
        if older is not None:
            self.store.free([older.slot])
            return
        i = page.identity
        page_size = len(i.tokens) // TOKEN_BYTES
        parent = PageKey(i.parent_key) if i.page_index else None
        ns = self._namespace_id(i.namespace_root)
        self.events.stored(ns, page_size, i.page_index, i.key, parent, i.tokens, extra_keys, medium=MEDIUM_STORAGE)

    def _unindex(self, key: DiskKey) -> DiskPage:
        """A page on disk stops being findable (and is announced so)."""
        page = self._on_disk.pop(key)
        self.events.removed(self._namespace_id(key[0]), key[1], medium=MEDIUM_STORAGE)
        return page

    def _forget(self, on_disk: DiskPage) -> bool:
        key = (on_disk.identity.namespace_root, on_disk.identity.key)
        if self._on_disk.get(key) != on_disk:
            return False
        self._unindex(key)
        self.policy.forget(key)
        return True

    def _namespace_id(self, root: bytes) -> NamespaceId:
        """The id of the namespace ``root`` roots in this daemon; 0 while no engine registered it."""
        ns = self.namespaces.by_root(root)
        return NamespaceId(0) if ns is None else ns.id

    def _answered(self, then, results) -> None:
        if not self._closed:
            then(results)

    def _when_done(self, future: Future, then) -> None:
        """``then(results)`` on the event loop once the store's call is done."""

        def back(done: Future) -> None:
            if not self._closed:
                self.loop.call_soon_threadsafe(self._answered, then, done.result())

        future.add_done_callback(back)


def _aligned_copy(view: np.ndarray) -> np.ndarray:
    """A copy of a page at a block-aligned address: written with direct I/O as it is, never
    through the store's bounce buffer (kvd/disk/slot_file.py)."""
    room = np.empty(view.nbytes + BLOCK, dtype=np.uint8)
    start = -room.ctypes.data % BLOCK
    copy = room[start : start + view.nbytes]
    copy[:] = view
    return copy
