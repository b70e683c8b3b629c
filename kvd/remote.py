"""The remote tier of one manager (one tenant): which pages go to the store, which come back.

Store (write-behind): ``published`` holds each newly published, indexed page (one more
reference, through the pool) and ``submit`` hands them to the link's worker in batches;
the worker writes each page's header (kvd/remote_format.py) and puts header and page
straight from shared memory; the outcome releases the holds on the event loop. Pages a
fetch brought in are not stored again. While the link is not up, or the backlog holds
``backlog_bytes`` already, a published page is not stored (counted, nothing local changes).
With policy "evict" a page goes to the store only when it leaves host memory: its bytes
are copied as it is evicted (the one copy of this module: the page is reused at once) and
stored from the copy, which must still match the page's seal (kvd/integrity.py), so a
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

Every hold is a pool reference (kvd/pool.py), so a page the store is reading or writing
is never evicted or reused; ``holds`` lists them for kvd/invariants.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvd.arena import Arena
from kvd.errors import ResourceExhausted
from kvd.events import MEDIUM_REMOTE, EventLog
from kvd.eviction import release_order
from kvd.index import ChainSpec, ExtraKey, PageContent, PrefixIndex, page_key
from kvd.integrity import Integrity
from kvd.meta import page_checksum
from kvd.mooncake_store import GetOutcome, PutOutcome
from kvd.namespaces import Namespace
from kvd.pool import PagePool
from kvd.remote_format import PageHeader, header_bytes, read_header, store_key, write_header
from kvd.remote_link import RemoteLink
from kvd.room import Room
from kvd.types import PageId, PageKey
from kvd.wire.codec import TOKEN_BYTES

log = logging.getLogger(__name__)

MAX_BATCH_PAGES = 256  # pages per store call: bounds the header staging area
MAX_REJECTED_KEYS = 4096  # store keys whose value failed its checks, never fetched again
# A prompt whose fetch just ended is not looked up in the store again this soon: the client
# that asks again learns that nothing more is coming instead of starting another fetch.
RECHECK_SECONDS = 1.0
MAX_RECENT_FETCHES = 4096


@dataclass
class RemoteCounters:
    stored_pages: int = 0  # pages the store accepted
    fetched_pages: int = 0  # pages fetched, verified and published locally
    hit_tokens: int = 0  # allocated prefix tokens served by fetched pages
    refused_pages: int = 0  # puts the store refused (full or otherwise): the page stays local only
    skipped_pages: int = 0  # published while the link was down or the backlog full: not stored
    rejected_pages: int = 0  # fetched pages whose header or checksum did not match: a miss
    errors: int = 0  # store calls that failed (the master unreachable, a page that did not arrive)


@dataclass(frozen=True)
class _Put:
    key: str
    page: PageId | None  # the page held for the put; None: ``view`` is a copy of an evicted page
    view: np.ndarray  # the page's bytes: in shared memory, or a copy
    header: PageHeader
    ns: Namespace
    extra_keys: tuple[ExtraKey, ...]  # the publishing sequence's, for the page's REMOTE event
    sealed: tuple[bytes, int] | None = None  # a copy's record fields and checksum: stored only if they match


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
        arena: Arena,
        pool: PagePool,
        index: PrefixIndex,
        integrity: Integrity,
        room: Room,
        events: EventLog,
        backlog_bytes: int,
        policy: str = "publish",
    ) -> None:
        self.link = link
        self.scope = scope  # the tenant: tenants never share pages through the store
        self.arena = arena
        self.pool = pool
        self.index = index
        self.integrity = integrity
        self.room = room
        self.events = events  # pages that land here are announced like any page indexed here
        self.backlog_bytes = backlog_bytes
        self.policy = policy  # "publish": store when published; "evict": when evicted
        self.counters = RemoteCounters()
        self._queued: list[_Put] = []
        self._held: Counter[PageId] = Counter()  # pool references the tier holds
        self._held_bytes = 0
        self._fetches: dict[tuple, _Fetch] = {}  # by (namespace, chain root, full-page token ids)
        self._recent: OrderedDict[tuple, float] = OrderedDict()  # fetches that ended: when to look again
        self._fetched: set[PageId] = set()  # published pages that came from the store
        # "evict": where each page sits in its chain (page index, parent key) and its extra keys
        self._evictable: dict[PageId, tuple[Namespace, int, bytes, tuple[ExtraKey, ...]]] = {}
        # Store keys whose value failed its checks: a fetch stops before them (read by the worker).
        self._rejected: OrderedDict[str, None] = OrderedDict()
        self._staging = np.zeros((MAX_BATCH_PAGES, 0), dtype=np.uint8)  # headers: [pages, header bytes]

    # ---- store ----------------------------------------------------------------------

    def published(
        self, ns: Namespace, content: PageContent, page_index: int, parent_key: bytes, extra_keys: tuple[ExtraKey, ...]
    ) -> None:
        """A page was just published and indexed: store it (or, with policy "evict", remember
        where it sits in its chain), unless it came from the store."""
        if content.page in self._fetched:
            return
        if self.policy == "evict":
            self._evictable[content.page] = (ns, page_index, parent_key, extra_keys)
            return
        if not self.link.up or self._held_bytes + ns.page_bytes > self.backlog_bytes:
            self.counters.skipped_pages += 1
            return
        self._hold([content.page], ns.page_bytes)
        header = PageHeader(page_index, content.key, parent_key, content.local, content.tokens)
        view = self.arena.page_bytes_view(content.page)
        key = store_key(self.scope, ns.root, content.key)
        self._queued.append(_Put(key, content.page, view, header, ns, extra_keys))

    def submit(self) -> None:
        """Hands the pages queued since the last call to the worker, in batches."""
        queued, self._queued = self._queued, []
        for start in range(0, len(queued), MAX_BATCH_PAGES):
            batch = queued[start : start + MAX_BATCH_PAGES]
            staging = self._staging_for(max(len(p.header.tokens) for p in batch) // TOKEN_BYTES)
            self._run(lambda store, b=batch, s=staging: _put(store, b, s), lambda r, e, b=batch: self._stored(b, r, e))

    def _stored(self, batch: list[_Put], outcomes, error) -> None:
        if error is not None:
            self.counters.errors += 1
            self.counters.skipped_pages += len(batch)
        else:
            for put, outcome in zip(batch, outcomes):
                if outcome is PutOutcome.STORED:
                    self.counters.stored_pages += 1
                    self._announce(put)
                elif outcome is None:  # an evicted page's copy no longer matched its seal
                    self.counters.skipped_pages += 1
                else:
                    self.counters.refused_pages += 1
        for put in batch:
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

    def _evicted(self, page: PageId) -> None:
        """With policy "evict": a sealed page leaves host memory, so its bytes are copied now
        (its memory is reused next) and stored from the copy, once the copy matches the
        page's seal. A page dropped for a failed checksum has no seal left: never stored."""
        where = self._evictable.pop(page, None)
        checksum = self.integrity.checksums.get(page)
        if where is None or checksum is None:
            return
        ns, page_index, parent_key, extra_keys = where
        if not self.link.up or self._held_bytes + ns.page_bytes > self.backlog_bytes:
            self.counters.skipped_pages += 1
            return
        content = self.pool.content(page)
        extent = self.arena.extent_of(page)
        copy = extent.page_bytes_view(page).copy()
        sealed = (extent.meta.covered(page - extent.first_page), checksum)
        header = PageHeader(page_index, content.key, parent_key, content.local, content.tokens)
        self._held_bytes += copy.nbytes
        if not self._queued:
            asyncio.get_running_loop().call_soon(self.submit)  # once the eviction's call is done: one batch
        self._queued.append(
            _Put(store_key(self.scope, ns.root, content.key), None, copy, header, ns, extra_keys, sealed)
        )

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
            self.pool.publish(page, content, indexed=True)
            self.index.insert(content, want.page_index)
            self.integrity.describe(content, want.page_index)
            parent_key = want.parent_key if want.page_index else None
            self.events.stored(
                ns.id, ns.page_size, want.page_index, want.key, parent_key, want.tokens, fetch.extra_keys
            )
            self._fetched.add(page)
            landed.append(page)
            parent = page
        self.counters.fetched_pages += len(landed)
        self.integrity.submit()
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
        seal are still there."""
        self._fetched.discard(page)
        if self.policy == "evict":
            self._evicted(page)

    def holds(self) -> Counter[PageId]:
        """Pool references the tier holds, by page (kvd/invariants.py)."""
        return Counter(+self._held)

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


# ---- jobs, on the link's worker thread ------------------------------------------------


def _put(store, batch: list[_Put], staging: np.ndarray) -> list[PutOutcome | None]:
    """Writes each page's header and stores header and page; None for a copy that no longer
    matches its seal (its bytes changed in host memory before the eviction): not stored."""
    keys, parts, outcomes = [], [], []
    for n, put in enumerate(batch):
        if put.sealed is not None and page_checksum(put.sealed[0], put.view) != put.sealed[1]:
            outcomes.append(None)
            continue
        size = header_bytes(len(put.header.tokens) // TOKEN_BYTES)
        write_header(staging[n, :size], put.header, put.view)
        keys.append(put.key)
        parts.append(([staging[n].ctypes.data, put.view.ctypes.data], [size, put.view.nbytes]))
        outcomes.append(n)
    stored = store.put(keys, parts) if keys else []
    by_position = dict(zip((n for n in outcomes if n is not None), stored))
    return [None if n is None else by_position[n] for n in outcomes]


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
