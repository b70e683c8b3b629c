"""Storing: which published pages go to the remote store, and offering them again.

Write-behind: ``published`` holds each newly published, indexed page (one more reference,
through the pool) and ``submit`` hands them to the link's worker in batches (``put``,
kvd/remote/jobs.py), which writes each page's header (kvd/remote/format.py) and puts
header and page straight from shared memory; the outcome releases the holds on the event
loop and announces the pages the store accepted (KV events, medium REMOTE). Pages a fetch
brought in are not stored again. While the link is not up, or the backlog holds
``backlog_bytes`` already, a published page is not stored (counted, nothing local changes).
With policy "evict" a page goes to the store only when it leaves host memory: its bytes
are copied as it is evicted (the one copy of the tier: the page is reused at once) and
stored from the copy, which must still match the page's seal (kvd/durability/integrity.py),
so a page whose bytes changed in host memory never reaches the store.

Every published page the tier knows of has its place recorded (``ChainPlace``): published
here, fetched, or, for a warm restart's pages, as they are restored (a page 0's parent key
is its chain root, which records do not keep: known only without request-wide extra keys).

Offering again: Mooncake's master keeps the store's index in memory, so a master that
restarts has lost every page. Each time the link turns UP (connected first, or back after
an outage) every placed, indexed page is offered again: the pages in use first, then the
cached ones in eviction order (so that holding them leaves the LRU order as it was), a
batch at a time and at most ``reoffer_bytes_per_second``; the worker asks the store which
of a batch it still holds and sends only the others (``reoffered_pages``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable

from kvd.cache.events import MEDIUM_REMOTE, EventLog
from kvd.config import RemoteConfig
from kvd.core.arena import Arena
from kvd.core.eviction import release_order
from kvd.core.index import PageContent
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import NamespaceRegistry
from kvd.core.pool import PagePool
from kvd.core.types import PageId
from kvd.durability.integrity import Integrity
from kvd.remote.format import PageHeader, store_key
from kvd.remote.jobs import MAX_BATCH_PAGES, Put, TierJobs, Unsent, put
from kvd.remote.ledger import RemoteCounters
from kvd.remote.mooncake_store import PutOutcome
from kvd.tiers.holds import Holds
from kvd.tiers.places import page_seal
from kvd.wire.codec import TOKEN_BYTES

# A batch of pages offered again holds at most this long's worth of the re-offer rate, so a
# fetch submitted meanwhile waits behind little of it on the worker.
REOFFER_BATCH_SECONDS = 0.25


class WriteBehind:
    """One tier's pages on their way to the store, and the pages it knows the place of."""

    def __init__(
        self,
        jobs: TierJobs,
        holds: Holds,
        counters: RemoteCounters,
        settings: RemoteConfig,
        arena: Arena,
        pool: PagePool,
        integrity: Integrity,
        events: EventLog,
        namespaces: NamespaceRegistry,
    ) -> None:
        """Built before the daemon takes any call and before a warm restart's pages are
        restored (``restored``)."""
        self.jobs = jobs
        self.holds = holds
        self.counters = counters
        self.arena = arena
        self.pool = pool
        self.integrity = integrity  # the seals a page's bytes must match to be stored from a copy
        self.events = events  # pages the store accepted are announced (medium REMOTE)
        self.namespaces = namespaces
        self.backlog_bytes = settings.backlog_bytes
        self.policy = settings.policy  # "publish": store when published; "evict": when evicted
        self.reoffer_rate = settings.reoffer_bytes_per_second
        self._queued: list[Put] = []
        # Published pages whose place in their chain is known: what storing them needs.
        self._placed: dict[PageId, ChainPlace] = {}
        self._reoffer: list[PageId] = []  # pages left to offer again, the next one last
        self._reoffering = False  # a batch offered again is in flight, or the next one is scheduled

    # ---- write-behind ---------------------------------------------------------------

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        """A warm restart's page: offered when the store comes back up, stored when evicted
        (policy "evict"); not without its parent's key (a page 0 of an unknown root)."""
        if place.parent_key is not None:
            self._placed[content.page] = place

    def published(self, content: PageContent, place: ChainPlace, fetched: bool) -> None:
        """A page was just published and indexed: store it (with policy "evict", only once
        it is evicted), unless it was ``fetched`` from the store."""
        self._placed[content.page] = place
        if self.policy == "evict" or fetched:
            return
        if not self.jobs.up or self.holds.bytes + place.ns.page_bytes > self.backlog_bytes:
            self.counters.skipped_pages += 1
            return
        self._queued.append(self._held_put(content, place))

    def unpublished(self, page: PageId, fetched: bool) -> None:
        """The page stops being published (evicted, reclaimed, reset or dropped); its bytes and
        seal are still there. With policy "evict" it goes to the store now, unless it was
        ``fetched`` from there."""
        place = self._placed.pop(page, None)
        if self.policy == "evict" and place is not None and not fetched:
            self._evicted(page, place)

    def submit(self) -> None:
        """Hands the pages queued since the last call to the worker, in batches."""
        queued, self._queued = self._queued, []
        for start in range(0, len(queued), MAX_BATCH_PAGES):
            batch = queued[start : start + MAX_BATCH_PAGES]
            staging = self.jobs.staging_for(max(len(p.header.tokens) for p in batch) // TOKEN_BYTES)
            self.jobs.run(
                lambda store, b=batch, s=staging: put(store, b, s), lambda r, e, b=batch: self._stored(b, r, e)
            )

    def _held_put(self, content: PageContent, place: ChainPlace, sealed=None, reoffer: bool = False) -> Put:
        """A put of a published page straight from shared memory, held until its outcome."""
        self.holds.hold([content.page], place.ns.page_bytes)
        header = PageHeader(place.page_index, content.key, place.parent_key, content.local, content.tokens)
        view = self.arena.page_bytes_view(content.page)
        key = store_key(self.jobs.scope, place.ns.root, content.key)
        return Put(key, content.page, view, header, place.ns, place.extra_keys, sealed, reoffer)

    def _stored(self, batch: list[Put], outcomes, error) -> None:
        """A write-behind batch's outcome: its pages were published in chain order, so the
        holds go tail first (the tier's may be a page's last reference)."""
        self._count(batch, outcomes, error)
        self._drop(release_order(batch))

    def _count(self, batch: list[Put], outcomes, error) -> None:
        """Counts a put batch's outcomes and announces the pages the store accepted."""
        if error is not None:
            self.counters.errors += 1
            self.counters.skipped_pages += sum(1 for item in batch if not item.reoffer)
        else:
            for item, outcome in zip(batch, outcomes):
                if outcome is PutOutcome.STORED:
                    self.counters.stored_pages += 1
                    self.counters.reoffered_pages += item.reoffer
                    self._announce(item)
                elif outcome is Unsent.CHANGED:
                    self.counters.skipped_pages += 1
                elif outcome is not Unsent.PRESENT:
                    self.counters.refused_pages += 1

    def _drop(self, puts: Iterable[Put]) -> None:
        """Drops the holds of puts whose outcome came, in the given order."""
        for item in puts:
            if item.page is None:
                self.holds.bytes -= item.view.nbytes
            else:
                self.holds.release([item.page], item.view.nbytes)

    def _announce(self, item: Put) -> None:
        """A KV event (medium REMOTE) for a page the store accepted: routers may send its
        prompts to any host of the fleet. The store evicts without telling its clients, so no
        REMOTE removal follows; such an entry costs a router at worst a local miss."""
        header = item.header
        parent = header.parent_key if header.page_index else None
        self.events.stored(
            item.ns.id,
            item.ns.page_size,
            header.page_index,
            header.key,
            parent,
            header.tokens,
            item.extra_keys,
            medium=MEDIUM_REMOTE,
        )

    def _evicted(self, page: PageId, place: ChainPlace) -> None:
        """With policy "evict": a sealed page leaves host memory, so its bytes are copied now
        (its memory is reused next) and stored from the copy, once the copy matches the
        page's seal. A page dropped for a failed checksum has no seal left: never stored."""
        sealed = self._seal(page)
        if sealed is None:
            return
        ns = place.ns
        if not self.jobs.up or self.holds.bytes + ns.page_bytes > self.backlog_bytes:
            self.counters.skipped_pages += 1
            return
        content = self.pool.content(page)
        copy = self.arena.page_bytes_view(page).copy()
        header = PageHeader(place.page_index, content.key, place.parent_key, content.local, content.tokens)
        self.holds.bytes += copy.nbytes
        if not self._queued:
            asyncio.get_running_loop().call_soon(self.submit)  # once the eviction's call is done: one batch
        key = store_key(self.jobs.scope, ns.root, content.key)
        self._queued.append(Put(key, None, copy, header, ns, place.extra_keys, sealed))

    def _seal(self, page: PageId) -> tuple[bytes, int] | None:
        return page_seal(self.integrity, self.arena, page)

    # ---- offering again ---------------------------------------------------------------

    def store_came_back(self) -> None:
        """The link turned UP: the store may have lost everything (a restarted master keeps
        nothing), so every published page held here is offered again."""
        if self.policy != "publish":  # pages in host memory were never in the store
            return
        self._reoffer = self._offer_order()
        self._reoffer.reverse()
        if not self._reoffering:
            self._offer_next()

    def _offer_order(self) -> list[PageId]:
        """The pages to offer again: first those in use now, the hottest (each chain's tail
        first), then cached ones in eviction order (the namespaces' queues interleaved). A
        batch's holds are dropped in its order (``_offered``): a page whose last other
        reference went meanwhile is cached tail first, and cached pages re-enter their queue
        in the order they left it, so offering leaves the LRU order as it was; offering the
        most recently released first would reverse it."""
        cached = [self.pool.lru_order(ns.id) for ns in self.namespaces.all()]
        in_use = self._placed.keys() - set(itertools.chain.from_iterable(cached))
        in_use = sorted(in_use, key=lambda page: self._placed[page].page_index, reverse=True)
        oldest = (page for group in itertools.zip_longest(*cached) for page in group if page is not None)
        return in_use + [page for page in oldest if page in self._placed]

    def _offer_next(self) -> None:
        """Hands the worker the next batch to offer again: as many pages as the rate allows in
        ``REOFFER_BATCH_SECONDS`` (one at least), within the backlog; the next batch follows
        its outcome, no sooner than the bytes it sent allow at the rate."""
        self._reoffering = False
        if not self.jobs.up:
            self._reoffer.clear()  # the next UP offers everything again
            return
        batch: list[Put] = []
        batch_bytes = 0
        while self._reoffer and len(batch) < MAX_BATCH_PAGES:
            page = self._reoffer[-1]
            place, content = self._placed.get(page), self.pool.content(page)
            if place is None or content is None or not self.pool.is_indexed(page):
                self._reoffer.pop()  # no longer published, or no longer findable
                continue
            more = batch_bytes + place.ns.page_bytes
            if self.holds.bytes + place.ns.page_bytes > self.backlog_bytes or (
                batch and more > self.reoffer_rate * REOFFER_BATCH_SECONDS
            ):
                break
            self._reoffer.pop()
            batch.append(self._held_put(content, place, self._seal(page), reoffer=True))
            batch_bytes = more
        if not batch:
            if self._reoffer:  # the backlog is full: write-behind puts release it soon
                self._offer_later(REOFFER_BATCH_SECONDS)
            return
        started = time.monotonic()
        staging = self.jobs.staging_for(max(len(p.header.tokens) for p in batch) // TOKEN_BYTES)
        self._reoffering = True
        self.jobs.run(
            lambda store: put(store, batch, staging, missing_only=True),
            lambda outcomes, error: self._offered(batch, outcomes, error, started),
        )

    def _offered(self, batch: list[Put], outcomes, error, started: float) -> None:
        """A re-offered batch's outcome; the next batch once the bytes sent allow it."""
        self._count(batch, outcomes, error)
        self._drop(batch)
        self._reoffering = False
        if error is None and self._reoffer:  # after an error the link is down: the next UP starts over
            sent = sum(item.view.nbytes for item, outcome in zip(batch, outcomes) if isinstance(outcome, PutOutcome))
            self._offer_later(max(0.0, started + sent / self.reoffer_rate - time.monotonic()))

    def _offer_later(self, delay: float) -> None:
        self._reoffering = True
        asyncio.get_running_loop().call_later(delay, self._offer_next)
