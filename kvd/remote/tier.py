"""The remote tier of one manager (one tenant): which pages go to the store, which come back.

Store (write-behind): ``published`` holds each newly published, indexed page (one more
reference, through the pool) and ``submit`` hands them to the link's worker in batches;
the worker writes each page's header (kvd/remote/format.py) and puts header and page
straight from shared memory; the outcome releases the holds on the event loop. Pages a
fetch brought in are not stored again. While the link is not up, or the backlog holds
``backlog_bytes`` already, a published page is not stored (counted, nothing local changes).
With policy "evict" a page goes to the store only when it leaves host memory: its bytes
are copied as it is evicted (the one copy of this module: the page is reused at once) and
stored from the copy, which must still match the page's seal (kvd/durability/integrity.py), so a
page whose bytes changed in host memory never reaches the store.

Fetch: ``missed`` is called by lookups and allocations whose prompt has full pages past
its local hit. It holds the local hit and asks the worker for the keys of the missing
pages and one batched existence query; the leading run of pages found gets newly
allocated local pages (PRIVATE, held by the tier; as many as the namespace has without
evicting anything but its own cached pages: ``Room.spare``), the worker reads the values into them
and checks each header's checksum, the loop checks token ids, parent key, extra-key
digest and page index against the request, and publishes the pages that pass, in chain
order, as CACHED: the next lookup hits them locally. The first page that fails ends the
chain there; pages not landed are freed. A fetch is asynchronous: while it is in flight,
lookups of the same prompt report ``remote_pending_tokens``, and the client asks again.

A page that did not arrive (the store could not transfer it: the host holding it died,
or it went meanwhile) is an error, counted in ``errors`` and asked for again by a later
lookup; a page whose bytes arrived but fail a check is rejected (``rejected_pages``) and
its key is never fetched again.

Offering again: Mooncake's master keeps the store's index in memory, so a master that
restarts has lost every page. Each time the link turns UP (connected first, or back after
an outage) the tier offers every published page it holds (published here, fetched, or
recovered by a warm restart) again: the pages in use first, then the cached ones in
eviction order (so that holding them leaves the LRU order as it was), a batch at a time
and at most ``reoffer_bytes_per_second``; the worker asks the store which of a batch it
still holds and sends only the others (``reoffered_pages``). A recovered page 0 is offered
only when its chain root is known: shared-memory records keep no request-wide extra keys.

Every hold is a pool reference (kvd/core/pool.py), so a page the store is reading or writing
is never evicted or reused; ``holds`` lists them for kvd/cache/invariants.py.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvd.cache.events import MEDIUM_REMOTE, EventLog
from kvd.cache.page_events import PageEvents
from kvd.cache.room import Room
from kvd.cache.stats import RemoteStats
from kvd.config import RemoteConfig
from kvd.core.arena import Arena
from kvd.core.errors import ResourceExhausted
from kvd.core.eviction import release_order
from kvd.core.index import ChainSpec, ExtraKey, PageContent, PrefixIndex, chain_spec, page_key
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import Namespace, NamespaceRegistry
from kvd.core.pool import PagePool
from kvd.core.records import page_checksum
from kvd.core.types import PageId, PageKey
from kvd.durability.integrity import Integrity
from kvd.remote.format import PageHeader, header_bytes, read_header, store_key, write_header
from kvd.remote.link import RemoteLink
from kvd.remote.mooncake_store import GetOutcome, PutOutcome
from kvd.wire.codec import TOKEN_BYTES

if TYPE_CHECKING:
    from kvd.cache.manager import KVCacheManager

log = logging.getLogger(__name__)

MAX_BATCH_PAGES = 256  # pages per store call: bounds the header staging area
MAX_REJECTED_KEYS = 4096  # store keys whose value failed its checks, never fetched again
# A prompt whose fetch just ended is not looked up in the store again this soon: the client
# that asks again learns that nothing more is coming instead of starting another fetch.
RECHECK_SECONDS = 1.0
MAX_RECENT_FETCHES = 4096
# A batch of pages offered again holds at most this long's worth of the re-offer rate, so a
# fetch submitted meanwhile waits behind little of it on the worker.
REOFFER_BATCH_SECONDS = 0.25


@dataclass
class RemoteCounters:
    stored_pages: int = 0  # pages the store accepted
    fetched_pages: int = 0  # pages fetched, verified and published locally
    hit_tokens: int = 0  # allocated prefix tokens served by fetched pages
    refused_pages: int = 0  # puts the store refused (full or otherwise): the page stays local only
    skipped_pages: int = 0  # published while the link was down or the backlog full: not stored
    rejected_pages: int = 0  # fetched pages whose header or checksum did not match: a miss
    errors: int = 0  # store calls that failed (the master unreachable, a page that did not arrive)
    reoffered_pages: int = 0  # offered again after the store came back, and accepted (in stored_pages too)


class _Unsent(enum.Enum):
    """Why the worker did not send a page it was handed."""

    CHANGED = "changed"  # the page's bytes no longer match its seal: never stored
    PRESENT = "present"  # offered again, and the store holds it still


@dataclass(frozen=True)
class _Put:
    key: str
    page: PageId | None  # the page held for the put; None: ``view`` is a copy of an evicted page
    view: np.ndarray  # the page's bytes: in shared memory, or a copy
    header: PageHeader
    ns: Namespace
    extra_keys: tuple[ExtraKey, ...]  # the publishing sequence's, for the page's REMOTE event
    sealed: tuple[bytes, int] | None = None  # record fields and checksum the bytes must match to be stored
    reoffer: bool = False  # offered again after the store came back


@dataclass
class _Fetch:
    """One prompt's missing pages on their way from the store."""

    ns: Namespace
    chain: ChainSpec
    extra_keys: tuple[ExtraKey, ...]  # as requested, for the KV events of the pages that land
    tokens: bytes
    hits: list[PageId]  # the local hit, held until the fetch ends
    parent_key: bytes  # the key of the last hit page, or the chain root
    pending_tokens: int
    expected: list[tuple[str, PageHeader]] = field(default_factory=list)
    landing: list[PageId] = field(default_factory=list)  # PRIVATE pages held by the tier


class RemoteTier:
    def __init__(
        self,
        link: RemoteLink,
        scope: str,
        settings: RemoteConfig,
        arena: Arena,
        pool: PagePool,
        index: PrefixIndex,
        integrity: Integrity,
        room: Room,
        events: EventLog,
        pages: PageEvents,
        namespaces: NamespaceRegistry,
    ) -> None:
        """Built before the daemon takes any call (``beside``): the pages a warm restart
        recovered are all the published pages there are, and each one's parent is still
        the page its record names."""
        self.link = link
        self.scope = scope  # the tenant: tenants never share pages through the store
        self.arena = arena
        self.pool = pool
        self.index = index
        self.integrity = integrity
        self.room = room
        self.events = events  # pages the store accepted are announced (medium REMOTE)
        self.pages = pages  # fetched pages are published like any: their seals and events follow
        self.namespaces = namespaces
        self.backlog_bytes = settings.backlog_bytes
        self.policy = settings.policy  # "publish": store when published; "evict": when evicted
        self.reoffer_rate = settings.reoffer_bytes_per_second
        self.counters = RemoteCounters()
        self._queued: list[_Put] = []
        self._held: Counter[PageId] = Counter()  # pool references the tier holds
        self._held_bytes = 0
        self._fetches: dict[tuple, _Fetch] = {}  # by (namespace, chain root, full-page token ids)
        self._recent: OrderedDict[tuple, float] = OrderedDict()  # fetches that ended: when to look again
        self._fetched: set[PageId] = set()  # published pages that came from the store
        # Published pages whose place in their chain is known: what storing them needs.
        self._placed: dict[PageId, ChainPlace] = _recovered_places(pool, index, namespaces)
        # Store keys whose value failed its checks: a fetch stops before them (read by the worker).
        self._rejected: OrderedDict[str, None] = OrderedDict()
        self._staging = np.zeros((MAX_BATCH_PAGES, 0), dtype=np.uint8)  # headers: [pages, header bytes]
        self._reoffer: list[PageId] = []  # pages left to offer again, the next one last
        self._reoffering = False  # a batch offered again is in flight, or the next one is scheduled
        link.on_up.append(self._store_came_back)

    @classmethod
    def beside(cls, manager: KVCacheManager, link: RemoteLink, scope: str, settings: RemoteConfig) -> RemoteTier:
        """The tier of one tenant's cache (``manager``, which calls it as its ``Tier``);
        ``scope`` keeps this tenant's pages apart from other tenants' in the store."""
        m = manager
        return cls(
            link, scope, settings, m.arena, m.pool, m.index, m.integrity, m.room, m.events, m.page_events, m.namespaces
        )

    # ---- store ----------------------------------------------------------------------

    def published(self, content: PageContent, place: ChainPlace) -> None:
        """A page was just published and indexed: store it (with policy "evict", only once
        it is evicted), unless it came from the store."""
        self._placed[content.page] = place
        if self.policy == "evict" or content.page in self._fetched:
            return
        if not self.link.up or self._held_bytes + place.ns.page_bytes > self.backlog_bytes:
            self.counters.skipped_pages += 1
            return
        self._queued.append(self._held_put(content, place))

    def _held_put(self, content: PageContent, place: ChainPlace, sealed=None, reoffer: bool = False) -> _Put:
        """A put of a published page straight from shared memory, held until its outcome."""
        self._hold([content.page], place.ns.page_bytes)
        header = PageHeader(place.page_index, content.key, place.parent_key, content.local, content.tokens)
        view = self.arena.page_bytes_view(content.page)
        key = store_key(self.scope, place.ns.root, content.key)
        return _Put(key, content.page, view, header, place.ns, place.extra_keys, sealed, reoffer)

    def submit(self) -> None:
        """Hands the pages queued since the last call to the worker, in batches."""
        queued, self._queued = self._queued, []
        for start in range(0, len(queued), MAX_BATCH_PAGES):
            batch = queued[start : start + MAX_BATCH_PAGES]
            staging = self._staging_for(max(len(p.header.tokens) for p in batch) // TOKEN_BYTES)
            self._run(lambda store, b=batch, s=staging: _put(store, b, s), lambda r, e, b=batch: self._stored(b, r, e))

    def _stored(self, batch: list[_Put], outcomes, error) -> None:
        """A write-behind batch's outcome: its pages were published in chain order, so the
        holds go tail first (the tier's may be a page's last reference)."""
        self._count(batch, outcomes, error)
        self._drop(release_order(batch))

    def _count(self, batch: list[_Put], outcomes, error) -> None:
        """Counts a put batch's outcomes and announces the pages the store accepted."""
        if error is not None:
            self.counters.errors += 1
            self.counters.skipped_pages += sum(1 for put in batch if not put.reoffer)
        else:
            for put, outcome in zip(batch, outcomes):
                if outcome is PutOutcome.STORED:
                    self.counters.stored_pages += 1
                    self.counters.reoffered_pages += put.reoffer
                    self._announce(put)
                elif outcome is _Unsent.CHANGED:
                    self.counters.skipped_pages += 1
                elif outcome is not _Unsent.PRESENT:
                    self.counters.refused_pages += 1

    def _drop(self, puts: Iterable[_Put]) -> None:
        """Drops the holds of puts whose outcome came, in the given order."""
        for put in puts:
            if put.page is None:
                self._held_bytes -= put.view.nbytes
            else:
                self._release([put.page], put.view.nbytes)

    def _announce(self, put: _Put) -> None:
        """A KV event (medium REMOTE) for a page the store accepted: routers may send its
        prompts to any host of the fleet. The store evicts without telling its clients, so no
        REMOTE removal follows; such an entry costs a router at worst a local miss."""
        header = put.header
        parent = header.parent_key if header.page_index else None
        self.events.stored(
            put.ns.id,
            put.ns.page_size,
            header.page_index,
            header.key,
            parent,
            header.tokens,
            put.extra_keys,
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
        if not self.link.up or self._held_bytes + ns.page_bytes > self.backlog_bytes:
            self.counters.skipped_pages += 1
            return
        content = self.pool.content(page)
        copy = self.arena.page_bytes_view(page).copy()
        header = PageHeader(place.page_index, content.key, place.parent_key, content.local, content.tokens)
        self._held_bytes += copy.nbytes
        if not self._queued:
            asyncio.get_running_loop().call_soon(self.submit)  # once the eviction's call is done: one batch
        key = store_key(self.scope, ns.root, content.key)
        self._queued.append(_Put(key, None, copy, header, ns, place.extra_keys, sealed))

    def _seal(self, page: PageId) -> tuple[bytes, int] | None:
        """The page's record fields and checksum, which its bytes must match; None before it
        is sealed, or once its seal is gone."""
        checksum = self.integrity.checksums.get(page)
        if checksum is None:
            return None
        extent = self.arena.extent_of(page)
        return extent.meta.covered(page - extent.first_page), checksum

    # ---- offering again ---------------------------------------------------------------

    def _store_came_back(self) -> None:
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
        if not self.link.up:
            self._reoffer.clear()  # the next UP offers everything again
            return
        batch: list[_Put] = []
        batch_bytes = 0
        while self._reoffer and len(batch) < MAX_BATCH_PAGES:
            page = self._reoffer[-1]
            place, content = self._placed.get(page), self.pool.content(page)
            if place is None or content is None or not self.pool.is_indexed(page):
                self._reoffer.pop()  # no longer published, or no longer findable
                continue
            more = batch_bytes + place.ns.page_bytes
            if self._held_bytes + place.ns.page_bytes > self.backlog_bytes or (
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
        staging = self._staging_for(max(len(p.header.tokens) for p in batch) // TOKEN_BYTES)
        self._reoffering = True
        self._run(
            lambda store: _put(store, batch, staging, missing_only=True),
            lambda outcomes, error: self._offered(batch, outcomes, error, started),
        )

    def _offered(self, batch: list[_Put], outcomes, error, started: float) -> None:
        """A re-offered batch's outcome; the next batch once the bytes sent allow it."""
        self._count(batch, outcomes, error)
        self._drop(batch)
        self._reoffering = False
        if error is None and self._reoffer:  # after an error the link is down: the next UP starts over
            sent = sum(put.view.nbytes for put, outcome in zip(batch, outcomes) if isinstance(outcome, PutOutcome))
            self._offer_later(max(0.0, started + sent / self.reoffer_rate - time.monotonic()))

    def _offer_later(self, delay: float) -> None:
        self._reoffering = True
        asyncio.get_running_loop().call_later(delay, self._offer_next)

    # ---- fetch ----------------------------------------------------------------------

    def missed(
        self,
        ns: Namespace,
        chain: ChainSpec,
        extra_keys: tuple[ExtraKey, ...],
        tokens: bytes,
        hits: list[PageId],
        hit_keys: list[PageKey],
    ) -> int:
        """A prompt's full pages past its local hit: starts fetching them unless a fetch of the
        same prompt is in flight. Returns the tokens a fetch in flight may still bring."""
        page_bytes = ns.page_size * TOKEN_BYTES
        full_pages = len(tokens) // page_bytes
        if len(hits) >= full_pages:
            return 0
        ident = (ns.id, chain.root, tokens[: full_pages * page_bytes])
        fetch = self._fetches.get(ident)
        if fetch is not None:
            return fetch.pending_tokens
        if not self.link.up or self._recent.get(ident, 0.0) > time.monotonic():
            return 0
        parent_key = hit_keys[-1] if hit_keys else chain.root
        fetch = _Fetch(ns, chain, extra_keys, ident[2], list(hits), parent_key, (full_pages - len(hits)) * ns.page_size)
        self._fetches[ident] = fetch
        self._hold(fetch.hits, 0)
        first = len(hits)
        self._run(
            lambda store: _find(store, self.scope, fetch, first, full_pages, self._rejected),
            lambda found, error: self._found(ident, found, error),
        )
        return fetch.pending_tokens

    def _found(self, ident: tuple, found, error) -> None:
        fetch = self._fetches[ident]
        if error is not None or not found:
            self.counters.errors += error is not None
            self._end(ident)
            return
        ns = fetch.ns
        room = min(len(found), self.room.spare(ns))
        try:
            if not room:
                raise ResourceExhausted("no spare pages")
            self.room.ensure_free(ns, room)
        except ResourceExhausted:
            log.info("namespace %d: no room for %d pages from the remote store; not fetched", ns.id, len(found))
            self._end(ident)
            return
        found = found[:room]
        fetch.expected = found
        fetch.landing = self.pool.allocate(ns.id, len(found))
        for page in fetch.landing:
            self._held[page] += 1
        fetch.pending_tokens = len(found) * ns.page_size
        views = [self.arena.page_bytes_view(page) for page in fetch.landing]
        staging = self._staging_for(ns.page_size)
        self._run(
            lambda store: _get(store, found, views, staging),
            lambda headers, error: self._arrived(ident, headers, error),
        )

    def _arrived(self, ident: tuple, got, error) -> None:
        """Publishes the fetched pages that match the request, in chain order, as CACHED."""
        fetch = self._fetches[ident]
        ns = fetch.ns
        self.counters.errors += error is not None
        parent = fetch.hits[-1] if fetch.hits else None
        landed: list[PageId] = []
        for n, (key, want) in enumerate(fetch.expected if error is None else []):
            page = fetch.landing[n]
            if got[n] is GetOutcome.FAILED:
                self.counters.errors += 1
                log.error(
                    "namespace %d: page %d of a prompt did not arrive from the remote store (the host holding "
                    "it may be gone); not served, asked for again by a later lookup",
                    ns.id,
                    want.page_index,
                )
                break
            if got[n] != want:
                self.counters.rejected_pages += 1
                self._rejected[key] = None
                if len(self._rejected) > MAX_REJECTED_KEYS:
                    self._rejected.popitem(last=False)
                log.warning(
                    "namespace %d: page %d of a prompt fetched from the remote store does not match its key; "
                    "not served",
                    ns.id,
                    want.page_index,
                )
                break
            existing = self.index.lookup(want.key)
            if existing is not None:  # published here meanwhile
                if not existing.matches(want.tokens, parent, want.local):
                    break
                parent = existing.page
                continue
            content = PageContent(page, want.key, want.tokens, parent, want.local)
            self._fetched.add(page)  # never stored again (``published``)
            self.pool.publish(page, content, ChainPlace(ns, want.page_index, want.parent_key, fetch.extra_keys))
            landed.append(page)
            parent = page
        self.counters.fetched_pages += len(landed)
        self.pages.submit()
        self._end(ident)

    def _end(self, ident: tuple) -> None:
        """Drops a fetch's holds: landed pages become CACHED, the rest are freed."""
        fetch = self._fetches.pop(ident)
        self._recent[ident] = time.monotonic() + RECHECK_SECONDS
        self._recent.move_to_end(ident)
        while len(self._recent) > MAX_RECENT_FETCHES or next(iter(self._recent.values())) < time.monotonic():
            self._recent.popitem(last=False)
        self._release(list(release_order(fetch.landing)), 0)
        self._release(list(release_order(fetch.hits)), 0)

    # ---- what the manager asks --------------------------------------------------------

    def served(self, hits: list[PageId], page_size: int) -> None:
        """An allocation's prefix hit: counts the tokens of pages that came from the store."""
        if self._fetched:
            self.counters.hit_tokens += page_size * sum(1 for page in hits if page in self._fetched)

    def unpublished(self, page: PageId) -> None:
        """The page stops being published (evicted, reclaimed, reset or dropped); its bytes and
        seal are still there. With policy "evict" it goes to the store now, unless it came
        from there."""
        place = self._placed.pop(page, None)
        fetched = page in self._fetched
        self._fetched.discard(page)
        if self.policy == "evict" and place is not None and not fetched:
            self._evicted(page, place)

    def holds(self) -> Counter[PageId]:
        """Pool references the tier holds, by page (kvd/cache/invariants.py)."""
        return Counter(+self._held)

    def stats(self) -> RemoteStats:
        """The link's state, outages and resets, and this tier's counters (kvd/cache/stats.py)."""
        link = self.link
        return RemoteStats(state=link.state.value, outages=link.outages, resets=link.resets, **asdict(self.counters))

    # ---- internals --------------------------------------------------------------------

    def _hold(self, pages: list[PageId], page_bytes: int) -> None:
        self.pool.acquire_all(pages)
        for page in pages:
            self._held[page] += 1
        self._held_bytes += page_bytes * len(pages)

    def _release(self, pages: list[PageId], page_bytes: int) -> None:
        self.pool.release_all(pages)
        for page in pages:
            self._held[page] -= 1
            if not self._held[page]:
                del self._held[page]
        self._held_bytes -= page_bytes * len(pages)

    def _staging_for(self, page_size: int) -> np.ndarray:
        """The header staging area, large enough for pages of ``page_size`` tokens."""
        if self._staging.shape[1] < header_bytes(page_size):
            self._staging = np.zeros((MAX_BATCH_PAGES, header_bytes(page_size)), dtype=np.uint8)
        return self._staging

    def _run(self, job, done) -> None:
        regions = [(e.pages.ctypes.data, e.plan.size) for e in self.arena.extents()]
        if self._staging.nbytes:
            regions.append((self._staging.ctypes.data, self._staging.nbytes))
        self.link.run(self.scope, frozenset(regions), job, done)


def _recovered_places(pool: PagePool, index: PrefixIndex, namespaces: NamespaceRegistry) -> dict[PageId, ChainPlace]:
    """Where each page a warm restart recovered sits in its chain: how many parents it has
    (each page is walked once) and its parent's key. Page 0's parent key is its chain root,
    which records do not keep: it is known only for a chain without request-wide extra keys
    (LoRA, cache salt) nor a multimodal item on page 0, whose local digest is then that of
    the namespace's plain root."""
    places: dict[PageId, ChainPlace] = {}
    depth: dict[PageId, int] = {}
    plain = {ns.id: chain_spec(ns.root, ns.page_size, ()) for ns in namespaces.all()}
    for _, at in index.items():
        walk = []  # the page and its ancestors not walked yet, deepest first
        while at is not None and at not in depth:
            walk.append(at)
            at = pool.content(at).parent
        page_index = -1 if at is None else depth[at]
        for page in reversed(walk):
            page_index += 1
            depth[page] = page_index
            content, ns = pool.content(page), namespaces.get(pool.namespace_of(page))
            if content.parent is not None:
                places[page] = ChainPlace(ns, page_index, pool.content(content.parent).key)
            elif content.local == plain[ns.id].local_digest(0):
                places[page] = ChainPlace(ns, page_index, plain[ns.id].root)
    return places


# ---- jobs, on the link's worker thread ------------------------------------------------


def _put(store, batch: list[_Put], staging: np.ndarray, missing_only: bool = False) -> list[PutOutcome | _Unsent]:
    """Writes each page's header and stores header and page; with ``missing_only`` only the
    pages the store does not hold (PRESENT for the others). A page whose bytes no longer
    match its seal (they changed in host memory) is not stored: CHANGED."""
    present = store.exists([put.key for put in batch]) if missing_only else [False] * len(batch)
    keys, parts, outcomes = [], [], []
    for n, (put, there) in enumerate(zip(batch, present)):
        if there:
            outcomes.append(_Unsent.PRESENT)
            continue
        if put.sealed is not None and page_checksum(put.sealed[0], put.view) != put.sealed[1]:
            outcomes.append(_Unsent.CHANGED)
            continue
        size = header_bytes(len(put.header.tokens) // TOKEN_BYTES)
        write_header(staging[n, :size], put.header, put.view)
        keys.append(put.key)
        parts.append(([staging[n].ctypes.data, put.view.ctypes.data], [size, put.view.nbytes]))
        outcomes.append(n)
    stored = iter(store.put(keys, parts) if keys else [])
    return [next(stored) if isinstance(n, int) else n for n in outcomes]


def _find(
    store, scope: str, fetch: _Fetch, first: int, last: int, rejected: OrderedDict[str, None]
) -> list[tuple[str, PageHeader]]:
    """The store keys and expected headers of the leading run of missing pages the store holds,
    up to the first key whose value was rejected before."""
    ns, chain = fetch.ns, fetch.chain
    step = ns.page_size * TOKEN_BYTES
    wanted = []
    parent_key = fetch.parent_key
    for i in range(first, last):
        tokens = fetch.tokens[i * step : (i + 1) * step]
        key = page_key(parent_key, i, tokens, chain.local_bytes(i))
        name = store_key(scope, ns.root, key)
        if name in rejected:
            break
        wanted.append((name, PageHeader(i, key, parent_key, chain.local_digest(i), tokens)))
        parent_key = key
    if not wanted:
        return []
    found = store.exists([k for k, _ in wanted])
    run = next((n for n, there in enumerate(found) if not there), len(found))
    return wanted[:run]


def _get(
    store, found: list[tuple[str, PageHeader]], views: list[np.ndarray], staging: np.ndarray
) -> list[PageHeader | GetOutcome]:
    """For each fetched page: its header, once its checksum holds for the bytes that arrived;
    FAILED when nothing arrived; MISMATCHED when what arrived is not a page of this size or
    fails its checksum."""
    size = header_bytes(len(found[0][1].tokens) // TOKEN_BYTES)
    got: list[PageHeader | GetOutcome] = []
    for start in range(0, len(found), MAX_BATCH_PAGES):
        chunk = found[start : start + MAX_BATCH_PAGES]
        parts = [
            ([staging[n].ctypes.data, views[start + n].ctypes.data], [size, views[start + n].nbytes])
            for n in range(len(chunk))
        ]
        for n, outcome in enumerate(store.get([k for k, _ in chunk], parts)):
            if outcome is GetOutcome.ARRIVED:
                outcome = read_header(staging[n, :size], views[start + n]) or GetOutcome.MISMATCHED
            got.append(outcome)
    return got
