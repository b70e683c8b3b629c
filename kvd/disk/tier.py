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
costs the publish path nothing. A page evicted again while the disk still holds it is not
written again; the disk's policy counts it as used (as the study does). With ``[disk]
min_uses`` above 1, a page is written only once it has had that many uses
(kvd/disk/admission.py).

The tier's index (``_on_disk``) maps (namespace root, chain key) to the ``DiskPage`` that
holds it: built at start-up from the pages the store recovered (``DiskStore.open`` reads
every header; the daemon opens it before taking calls), then from each page written. The
policy (``[disk] policy``: ARC or LRU, kvd/disk/eviction.py, the same classes the trace
study replays) holds as many pages as the file has slots of the first page size the tier
sees; each page is admitted before it is written, and the pages it gives up for it are
freed first. One batch is written at a time (the pages evicted meanwhile form the next), so
a page given up is on disk already or in the batch being admitted (then not written), and
no write takes the slots freed for another's retry. A write the disk still refuses as full
(pages of several sizes share the file) frees as many more of the policy's victims among
the pages whose slots the refused pages can use (kvd/disk/reclaim.py: pages of their size,
or whole chunks of another) and is tried once more (still full: ``refused_pages``). A page
hit on disk (``find``) is used in the policy's eyes. At a graceful stop the pages host
memory still holds are written too, through the same path (kvd/disk/stop_writes.py).

Hits: the tier is a ``FetchSource`` for the cache's fetch machinery (``Fetches``,
kvd/cache/fetches.py, shared with the remote tier), asked only when the disk holds the
prompt's first page missing (else ``missed`` answers 0 at once, and the remote tier below
hears of the miss in the same call): ``find`` walks the missing pages' chain keys through the index
(and through ``_copies``, the pages still on their way to disk, whose write's copy ``get``
copies into the host page once it matches its seal: an eviction is never a miss while its
write waits), ``get`` reads the leading run into newly granted host pages
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
neither (a promotion may still copy it from the write's copy). A recovered page whose
namespace no engine registered yet is announced with namespace id 0 (the ZMQ stream carries
no namespace).

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
from collections.abc import Callable, Iterator
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
from kvd.core.records import page_checksum
from kvd.core.types import NamespaceId, PageId, PageKey
from kvd.disk import reclaim
from kvd.disk.admission import UseCounts
from kvd.disk.eviction import POLICIES, EvictionPolicy
from kvd.disk.layout import BLOCK, DiskPage, PageIdentity, SlotClass
from kvd.disk.results import (
    NotWritten,
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
    recheck_after_landing = False  # the index answers at once: a prompt asked again is promoted again

    def __init__(
        self, opened: Opened, scope: str, settings: DiskConfig, manager: KVCacheManager, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Built before the daemon takes any call, after a warm restart's pages are restored;
        ``opened`` is the tenant's store as ``DiskStore.open`` found it."""
        m = manager
        self.store = opened.store
        self.scope = scope
        self.backlog_limit = settings.backlog_bytes
        self.settings = settings
        self.loop = loop
        self.arena, self.pool, self.integrity = m.arena, m.pool, m.integrity
        self.events, self.namespaces = m.events, m.namespaces
        self.counters = DiskTierCounters()
        self.policy: EvictionPolicy | None = None  # sized by the first page size seen (_sized)
        self.uses: UseCounts | None = None  # with min_uses > 1
        self._holds = Holds(m.pool)
        self._placed: dict[PageId, ChainPlace] = recovered_places(m.pool, m.index, m.namespaces)
        self._on_disk: dict[DiskKey, DiskPage] = {}
        self._extra_keys: dict[DiskKey, tuple[ExtraKey, ...]] = {}  # of queued pages that have some: their events
        self._queued: list[PageWrite] = []
        self._backlog = 0  # bytes of copies queued or being written
        self._writing = False  # a batch is on its way to the disk
        self._copies: dict[DiskKey, PageWrite] = {}  # queued or being written: hits read the copy meanwhile
        self._closed = False  # host memory is being unmapped: answers that come later are dropped
        self.fetches = Fetches(
            self,
            self._holds,
            self.counters,
            m.arena,
            m.pool,
            m.index,
            m.room,
            m.page_events,
        )
        freed: list[DiskPage] = []
        for page in sorted(opened.pages, key=lambda p: p.sequence):
            if page.identity.scope == scope:
                key = _key(page.identity)
                if key not in self._sized(page.page_class):
                    freed += self._admit(key)
                self._index(page)
        self.store.free([p.slot for p in freed])

    # ---- Tier -------------------------------------------------------------------------

    def published(self, content: PageContent, place: ChainPlace) -> None:
        self._placed[content.page] = place
        if self.policy is None:
            self._sized(SlotClass(place.ns.page_bytes, place.ns.page_size))
        if self.uses is not None and not self.fetches.brought(content.page):
            self.uses.used((place.ns.root, content.key))

    def submit(self) -> None:
        pass  # pages are written when RAM gives them up

    def unpublished(self, page: PageId) -> None:
        """Copies the page for the disk (its bytes and seal are still there), unless the disk
        has it (then it counts as used there) or it has had fewer than ``min_uses`` uses."""
        place = self._placed.pop(page, None)
        self.fetches.forget(page)
        if place is None or place.parent_key is None:
            return
        key = (place.ns.root, self.pool.content(page).key)
        policy = self._sized(SlotClass(place.ns.page_bytes, place.ns.page_size))
        if key in policy:  # on disk, or on its way there
            policy.hit(key)
            return
        if self.uses is not None and not self.uses.enough(key):
            return
        write = self._write_of(page, place)
        if write is None:
            return
        if self._backlog + place.ns.page_bytes > self.backlog_limit:
            self.counters.skipped_pages += 1
            return
        copy = _aligned_copy(write.view)
        self._backlog += copy.nbytes
        if not self._queued:
            self.loop.call_soon(self._write_queued)  # once the eviction's call is done: one batch
        self._queued.append(write := PageWrite(write.identity, copy, write.seal))
        self._copies[key] = write
        self._keep_extra_keys(write, place)

    def served(self, hits: list[PageId], page_size: int) -> None:
        self.fetches.served(hits, page_size)
        if self.uses is not None:
            for page in hits:
                place = self._placed.get(page)
                if place is not None:
                    self.uses.used((place.ns.root, self.pool.content(page).key))

    def missed(
        self,
        ns: Namespace,
        chain: ChainSpec,
        extra_keys: tuple[ExtraKey, ...],
        tokens: bytes,
        hits: list[PageId],
        hit_keys: list[PageKey],
    ) -> int:
        """Starts a promotion only when the disk holds the first page missing: a prompt the
        disk cannot help is answered 0 at once, and is not kept from the disk for the fetch
        machinery's recheck delay (``RECHECK_SECONDS``) when its pages reach the disk meanwhile,
        nor after a promotion that landed pages (the next ask finds them in host memory)."""
        full = len(tokens) // (ns.page_size * TOKEN_BYTES)
        parent_key = hit_keys[-1] if hit_keys else chain.root
        if next(self._run(ns, chain, tokens, parent_key, range(len(hits), full)), None) is None:
            return 0
        return self.fetches.missed(ns, chain, extra_keys, tokens, hits, hit_keys)

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

    # ---- a graceful stop (kvd/disk/stop_writes.py) -------------------------------------------

    def unwritten(self) -> list[PageWrite]:
        """The sealed published pages host memory holds and the disk does not (nor is writing),
        in the order host memory would evict them (cached pages next eviction first, then the
        referenced ones); each write's view is the page itself, unchanged while no call runs."""
        namespaces = {place.ns.id for place in self._placed.values()}
        lru = [page for ns in sorted(namespaces) for page in self.pool.lru_order(ns)]
        order = {page: n for n, page in enumerate(lru)}
        writes = []
        for page in sorted(self._placed, key=lambda page: order.get(page, len(order))):
            place = self._placed[page]
            write = self._write_of(page, place)
            if write is not None and _key(write.identity) not in self._sized(write.page_class):
                writes.append(write)
                self._keep_extra_keys(write, place)
        return writes

    def write(self, writes: list[PageWrite]) -> None:
        """Writes pages as write-backs are, after them (admitted to the policy: a full disk
        evicts); their views stay unchanged until ``backlog_bytes`` is 0."""
        self._backlog += sum(w.view.nbytes for w in writes)
        self._queued += writes
        self._write_queued()

    @property
    def backlog_bytes(self) -> int:
        """Bytes of pages queued for the disk or being written."""
        return self._backlog

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
        found: Found = list(self._run(ns, chain, tokens, parent_key, pages))
        for _, header in found:
            self._policy.hit((ns.root, header.key))
        self.loop.call_soon(done, found, None)  # as the store's answer would: after the caller's call

    def _run(
        self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range
    ) -> Iterator[tuple[DiskPage | PageWrite, PageHeader]]:
        """The leading run of ``pages`` on disk or on their way there, each with the header
        the request expects."""
        step = ns.page_size * TOKEN_BYTES
        for i in pages:
            page_tokens = tokens[i * step : (i + 1) * step]
            key = page_key(parent_key, i, page_tokens, chain.local_bytes(i))
            on_disk = self._on_disk.get((ns.root, key)) or self._copies.get((ns.root, key))
            if on_disk is None:
                return
            yield on_disk, PageHeader(i, key, parent_key, chain.local_digest(i), page_tokens)
            parent_key = key

    def get(self, ns: Namespace, found: Found, views: list[np.ndarray], done: Done) -> None:
        """Reads the pages on disk; a page still on its way there is copied from its write's
        copy at once (on the loop, as the eviction copied it) once that matches its seal."""
        on_disk: list[tuple[int, PageRead]] = []
        copied: dict[int, PageHeader | Arrival] = {}
        for n, ((entry, _), view) in enumerate(zip(found, views)):
            if isinstance(entry, DiskPage):
                on_disk.append((n, PageRead(entry.slot, view)))
            else:
                copied[n] = _copied(entry, view)
        started = time.monotonic()

        def arrived(results) -> None:
            reads = [found[n] for n, _ in on_disk]
            headers = self._arrivals(ns, reads, results, started) if reads else []
            read = dict(zip((n for n, _ in on_disk), headers))
            done([read[n] if n in read else copied[n] for n in range(len(found))], None)

        self._when_done(self.store.read([r for _, r in on_disk]), arrived, lambda error: done(None, error))

    def reject(self, entry: DiskPage | PageWrite) -> None:
        """The page read back is not the one the request expects: freed from the disk (a
        write's copy: not read again)."""
        if isinstance(entry, PageWrite):
            self._drop_copy(entry)
        elif self._forget(entry):
            self.store.free([entry.slot])

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

    def _write_of(self, page: PageId, place: ChainPlace) -> PageWrite | None:
        """Writing a published page to disk: a view of it with its seal; None when it is not
        sealed or its chain's parent is not known (a page a warm restart recovered)."""
        sealed = None if place.parent_key is None else page_seal(self.integrity, self.arena, page)
        if sealed is None:
            return None
        content = self.pool.content(page)
        identity = PageIdentity(
            self.scope, place.ns.root, content.key, place.parent_key, place.page_index, content.local, content.tokens
        )
        return PageWrite(identity, self.arena.page_bytes_view(page), Seal(*sealed))

    def _write_queued(self) -> None:
        """Admits the queued pages to the policy and writes those it still holds once the
        pages it gave up for them are freed: one batch at a time, so every page the policy
        gives up is on disk (its slot freed before the write) or in this very batch (not
        written). Pages queued meanwhile wait for the next batch."""
        if self._writing or not self._queued:
            return
        self._writing = True
        queued, self._queued = self._queued, []
        keys = dict.fromkeys(_key(write.identity) for write in queued)  # each once: a page may be queued twice
        freed = [page for key in keys if key not in self._policy for page in self._admit(key)]
        batch = []
        for write in queued:
            if _key(write.identity) in self._policy:
                batch.append(write)
            else:  # given up for a page after it in the batch
                self.counters.evicted_pages += 1
                self._backlog -= write.view.nbytes
                self._extra_keys.pop(_key(write.identity), None)
                self._drop_copy(write)
        self._free_then_write(freed, batch, retry=False)

    def _free_then_write(self, freed: list[DiskPage], batch: list[PageWrite], retry: bool) -> None:
        """Frees ``freed``, then writes ``batch``. A store call that raised (a bug, logged)
        leaves the batch unwritten, as an I/O error would: the next batch still goes."""

        def failed(_: BaseException) -> None:
            self._written(batch, [NotWritten(WriteRefusal.IO_ERROR)] * len(batch), retry)

        def write(_=None) -> None:
            self._when_done(self.store.write(batch), lambda results: self._written(batch, results, retry), failed)

        if freed:
            self._when_done(self.store.free([p.slot for p in freed]), write, failed)
        else:
            write()

    def _written(self, writes: list[PageWrite], results, retry: bool) -> None:
        """Indexes the pages written; the disk full, frees as many more of the policy's
        victims among the pages whose slots the refused ones can use (kvd/disk/reclaim.py)
        and writes the refused pages once more; then the next batch."""
        full: list[PageWrite] = []
        for write, result in zip(writes, results):
            if not isinstance(result, Written) and result.reason is WriteRefusal.FULL and not retry:
                full.append(write)
                continue
            extra_keys = self._extra_keys.pop(_key(write.identity), ())
            if isinstance(result, Written):
                self.counters.written_pages += 1
                self.counters.written_bytes += result.page.page_bytes
                self._index(result.page, extra_keys)
            else:
                self._policy.forget(_key(write.identity))  # not on disk
                if result.reason is WriteRefusal.CHANGED:
                    self.counters.skipped_pages += 1
                elif result.reason is WriteRefusal.IO_ERROR:
                    self.counters.errors += 1
                elif result.reason is not WriteRefusal.CLOSED:
                    self.counters.refused_pages += 1
            self._backlog -= write.view.nbytes
            self._drop_copy(write)
        if full:
            keys = [_key(write.identity) for write in full]
            for key in keys:
                self._policy.forget(key)
            victims = []  # for each size in turn: a page named for one is gone for the next
            for page_class, count in Counter(write.page_class for write in full).items():
                victims += reclaim.victims(self._policy, self._on_disk, page_class, count, self.settings.chunk_bytes)
            freed = self._on_disk_of(victims)
            freed += [page for key in keys for page in self._admit(key)]  # none: room was made
            self._free_then_write(freed, full, retry=True)
            return
        self._writing = False
        self._write_queued()

    @property
    def _policy(self) -> EvictionPolicy:
        assert self.policy is not None, "a page on disk, or on its way, before any page size was seen"
        return self.policy

    def _sized(self, page_class: SlotClass) -> EvictionPolicy:
        """The policy, made for as many pages of ``page_class`` as the file holds when it is
        first called (pages of other sizes count one page each)."""
        if self.policy is None:
            capacity = self.store.holds_at_most(page_class)
            self.policy = POLICIES[self.settings.policy](capacity)
            if self.settings.min_uses > 1:
                self.uses = UseCounts(self.settings.min_uses, remembered=2 * capacity)
            log.info(
                "disk tier%s: %s of %d pages of %d bytes; pages written from their use %d on",
                self._of_tenant, self.settings.policy.upper(), capacity,
                page_class.page_bytes, self.settings.min_uses,
            )  # fmt: skip
        return self.policy

    def _admit(self, key: DiskKey) -> list[DiskPage]:
        """The page under ``key`` is held by the policy from now on; the pages on disk it gave
        up for it, forgotten here (to be freed)."""
        return self._on_disk_of(self._policy.admit(key))

    def _on_disk_of(self, victims: list) -> list[DiskPage]:
        freed = [self._unindex(key) for key in victims if key in self._on_disk]
        self.counters.evicted_pages += len(freed)
        return freed

    def _keep_extra_keys(self, write: PageWrite, place: ChainPlace) -> None:
        """The extra keys of a page on its way to the disk, for the KV event once it is written."""
        if place.extra_keys:
            self._extra_keys[_key(write.identity)] = place.extra_keys

    def _drop_copy(self, write: PageWrite) -> None:
        key = _key(write.identity)
        if self._copies.get(key) is write:
            del self._copies[key]

    def _index(self, page: DiskPage, extra_keys: tuple[ExtraKey, ...] = ()) -> None:
        """A page on disk (the policy holds it) becomes findable (and is announced); an older
        copy of the same page is freed."""
        key = _key(page.identity)
        assert key in self._policy, f"page {key[1].hex()} is on disk, and the disk's policy does not hold it"
        older = self._on_disk.get(key)
        self._on_disk[key] = page
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
        key = _key(on_disk.identity)
        if self._on_disk.get(key) != on_disk:
            return False
        self._unindex(key)
        self._policy.forget(key)
        return True

    @property
    def _of_tenant(self) -> str:
        """For log lines: " of tenant NAME", or nothing for the implicit tenant."""
        return f" of tenant {self.scope}" if self.scope else ""

    def _namespace_id(self, root: bytes) -> NamespaceId:
        """The id of the namespace ``root`` roots in this daemon; 0 while no engine registered it."""
        ns = self.namespaces.by_root(root)
        return NamespaceId(0) if ns is None else ns.id

    def _answered(self, done: Future, then, failed) -> None:
        if self._closed:
            return
        error = done.exception()
        if error is None:
            then(done.result())
            return
        log.error("disk tier%s: a call to the store raised (a bug)", self._of_tenant, exc_info=error)
        failed(error)

    def _when_done(self, future: Future, then, failed: Callable[[BaseException], None]) -> None:
        """``then(results)`` on the event loop once the store's call is done; ``failed(error)``
        when it raised instead (a bug, not a disk fault: those are results), logged with its
        traceback."""

        def back(done: Future) -> None:
            if not self._closed:
                self.loop.call_soon_threadsafe(self._answered, done, then, failed)

        future.add_done_callback(back)


def _key(identity: PageIdentity) -> DiskKey:
    return identity.namespace_root, identity.key


def _copied(write: PageWrite, view: np.ndarray) -> PageHeader | Arrival:
    """A write's copy into a host page: its header, or MISMATCHED when the copy does not
    match the seal it was taken under."""
    view[:] = write.view
    assert write.seal is not None, "the tier's writes carry their seal"
    if page_checksum(write.seal.covered, view) != write.seal.checksum:
        return Arrival.MISMATCHED
    i = write.identity
    return PageHeader(i.page_index, i.key, i.parent_key, i.local, i.tokens)


def _aligned_copy(view: np.ndarray) -> np.ndarray:
    """A copy of a page at a block-aligned address: written with direct I/O as it is, never
    through the store's bounce buffer (kvd/disk/slot_file.py)."""
    room = np.empty(view.nbytes + BLOCK, dtype=np.uint8)
    start = -room.ctypes.data % BLOCK
    copy = room[start : start + view.nbytes]
    copy[:] = view
    return copy
