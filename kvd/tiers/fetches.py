"""Fetches: a prompt's pages past its local hit, brought from a tier's source (the remote
store, kvd/remote/fetching.py; the local disk, kvd/disk/source.py), one machinery for both.

``missed`` is called by lookups and allocations whose prompt has full pages past its local
hit. It holds the local hit and asks the source (``FetchSource.find``) for the leading run
of missing pages it holds, each with the header the request expects; that run gets newly
allocated local pages (PRIVATE, held by the tier; as many as the namespace has without
evicting anything but its own cached pages: ``Room.grant_spare``), the source reads them
into the pages and checks each one's checksum (``get``); back on the loop (``_arrived``)
each page's header must equal what the request expects (token ids, parent key, extra-key
digest, page index), and the pages that pass are published in chain order like any page
(their records, seals and KV events follow, ``PageEvents``, kvd/cache/page_events.py) and become CACHED:
the next lookup hits them locally. The first page that fails ends the chain there; pages
not landed are freed. A page published here meanwhile wins (the fetched copy is freed). A
fetch is asynchronous: while it is in flight, lookups of the same prompt report
``remote_pending_tokens``, and the client asks again.

A page that did not arrive (``Arrival.FAILED``: the store could not transfer it, the disk
could not read it) is an error, counted in ``errors``; a page whose bytes arrived but fail a
check is rejected (``rejected_pages``) and the source hears of it (``reject``: the store
never fetches its key again, the disk frees it).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from kvd.core.arena import Arena
from kvd.core.eviction import release_order
from kvd.core.index import ChainSpec, PageContent, PrefixIndex
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import Namespace
from kvd.core.pool import PagePool
from kvd.core.types import PageId, PageKey
from kvd.tiers.holds import Holds
from kvd.tiers.tier import Miss

log = logging.getLogger(__name__)

# A prompt whose fetch just ended is not looked up in the source again this soon: the client
# that asks again learns that nothing more is coming instead of starting another fetch. A
# source that knows at once whether it holds a prompt's next page (the disk's index) asks for
# the delay only after a fetch that brought nothing (``FetchSource.recheck_after_landing``
# False), so the same prompt asked again later is promoted again, and a fetch cut short is
# continued.
RECHECK_SECONDS = 1.0
MAX_RECENT_FETCHES = 4096


@dataclass(frozen=True)
class PageHeader:
    """What a fetched page claims to be (in the store's value, kvd/remote/format.py; on
    disk, kvd/diskstore/layout.py); compared with what the request expects."""

    page_index: int
    key: PageKey
    parent_key: bytes
    local: bytes  # b"" when the page has no local extra bytes
    tokens: bytes


class Arrival(enum.Enum):
    FAILED = "failed"  # nothing arrived: not served, asked for again by a later lookup
    MISMATCHED = "mismatched"  # what arrived is not the page asked for (size, checksum)


Found = list[tuple[Any, PageHeader]]  # the source's key of each page found, and its expected header
Done = Callable[[Any, BaseException | None], None]  # (outcome, error), called on the event loop


class FetchSource(Protocol):
    """Where a tier's fetches read pages from; every call answers later, on the event loop."""

    name: str  # for logs: "the remote store", "the disk"
    # Whether a fetch that landed pages keeps the prompt from the source for RECHECK_SECONDS
    # (the store: a lookup there is a round trip) or not (the disk: its index answers at once).
    recheck_after_landing: bool

    @property
    def up(self) -> bool:
        """Whether the source may be asked now."""

    def find(self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range, done: Done) -> None:
        """``done(found)``: the leading run of ``pages`` (chain indexes; the first one's parent
        key is ``parent_key``) the source holds, with the header each must have."""

    def get(self, ns: Namespace, found: Found, views: list[np.ndarray], done: Done) -> None:
        """``done(got)``: reads the pages into ``views``; per page its header, once its
        checksum holds, or an ``Arrival``."""

    def reject(self, key: Any) -> None:
        """The page under ``key`` arrived and failed its checks: never fetch it again."""


class SpareRoom(Protocol):
    """Where a fetch gets its landing pages (``Room``, kvd/cache/room.py)."""

    def grant_spare(self, ns: Namespace, most: int) -> list[PageId]:
        """Up to ``most`` new PRIVATE pages, without evicting anything but the namespace's cached pages."""


class Publications(Protocol):
    """What follows a fetch's pages being published (``PageEvents``, kvd/cache/page_events.py)."""

    def submit(self) -> None:
        """A call's pages are all published: what they queued may go now."""


class FetchCounters(Protocol):
    fetched_pages: int
    hit_tokens: int
    rejected_pages: int
    errors: int


@dataclass
class _Fetch:
    """One prompt's missing pages on their way from the source."""

    miss: Miss  # its local hit held until the fetch ends; its extra keys for the KV events of the pages that land
    pending_tokens: int
    expected: Found = field(default_factory=list)
    landing: list[PageId] = field(default_factory=list)  # PRIVATE pages held by the tier


class Fetches:
    """One tier's fetches in flight, and which published pages came from its source."""

    def __init__(
        self,
        source: FetchSource,
        holds: Holds,
        counters: FetchCounters,
        arena: Arena,
        pool: PagePool,
        index: PrefixIndex,
        room: SpareRoom,
        pages: Publications,
    ) -> None:
        self.source = source
        self.holds = holds
        self.counters = counters
        self.arena = arena
        self.pool = pool
        self.index = index
        self.room = room
        self.pages = pages  # fetched pages are published like any: their seals and events follow
        self._fetches: dict[tuple, _Fetch] = {}  # by (namespace, chain root, full-page token ids)
        self._recent: OrderedDict[tuple, float] = OrderedDict()  # fetches that ended: when to look again
        self._fetched: set[PageId] = set()  # published pages that came from the source

    def missed(self, miss: Miss) -> int:
        """A prompt's full pages past its local hit: starts fetching them unless a fetch of the
        same prompt is in flight. Returns the tokens a fetch in flight may still bring."""
        ns, missing = miss.ns, miss.missing
        if not missing:
            return 0
        ident = (ns.id, miss.chain.root, miss.full_page_tokens)
        fetch = self._fetches.get(ident)
        if fetch is not None:
            return fetch.pending_tokens
        if not self.source.up or self._recent.get(ident, 0.0) > time.monotonic():
            return 0
        fetch = _Fetch(replace(miss, hits=list(miss.hits)), len(missing) * ns.page_size)  # the hit as it is now
        self._fetches[ident] = fetch
        self.holds.hold(fetch.miss.hits, 0)
        self.source.find(
            ns, miss.chain, ident[2], miss.parent_key, missing, lambda found, error: self._found(ident, found, error)
        )
        return fetch.pending_tokens

    def brought(self, page: PageId) -> bool:
        """Whether the published page came from the source."""
        return page in self._fetched

    def forget(self, page: PageId) -> bool:
        """The page stops being published; returns whether it came from the source."""
        fetched = page in self._fetched
        self._fetched.discard(page)
        return fetched

    def served(self, hits: list[PageId], page_size: int) -> None:
        """An allocation's prefix hit: counts the tokens of pages that came from the source."""
        if self._fetched:
            self.counters.hit_tokens += page_size * sum(1 for page in hits if page in self._fetched)

    def _found(self, ident: tuple, found, error) -> None:
        """The leading run of missing pages the source holds: read into new local pages, as
        many as the namespace spares."""
        fetch = self._fetches[ident]
        if error is not None or not found:
            self.counters.errors += error is not None
            self._end(ident)
            return
        ns = fetch.miss.ns
        fetch.landing = self.room.grant_spare(ns, len(found))
        if not fetch.landing:
            log.info("namespace %d: no room for %d pages from %s; not fetched", ns.id, len(found), self.source.name)
            self._end(ident)
            return
        self.holds.take(fetch.landing)
        found = found[: len(fetch.landing)]
        fetch.expected = found
        fetch.pending_tokens = len(found) * ns.page_size
        views = [self.arena.page_bytes_view(page) for page in fetch.landing]
        self.source.get(ns, found, views, lambda headers, error: self._arrived(ident, headers, error))

    def _arrived(self, ident: tuple, got, error) -> None:
        """Publishes the fetched pages that match the request, in chain order, as CACHED."""
        fetch = self._fetches[ident]
        ns = fetch.miss.ns
        self.counters.errors += error is not None
        parent = fetch.miss.hits[-1] if fetch.miss.hits else None
        landed: list[PageId] = []
        for n, (key, want) in enumerate(fetch.expected if error is None else []):
            page = fetch.landing[n]
            if got[n] is Arrival.FAILED:
                self.counters.errors += 1
                log.error(
                    "namespace %d: page %d of a prompt did not arrive from %s; not served, asked for again "
                    "by a later lookup",
                    ns.id,
                    want.page_index,
                    self.source.name,
                )
                break
            if got[n] != want:
                self.counters.rejected_pages += 1
                self.source.reject(key)
                log.warning(
                    "namespace %d: page %d of a prompt fetched from %s does not match its key; not served",
                    ns.id,
                    want.page_index,
                    self.source.name,
                )
                break
            existing = self.index.lookup(want.key)
            if existing is not None:  # published here meanwhile
                if not existing.matches(want.tokens, parent, want.local):
                    break
                parent = existing.page
                continue
            content = PageContent(page, want.key, want.tokens, parent, want.local)
            self._fetched.add(page)  # never stored again in its source
            self.pool.publish(page, content, ChainPlace(ns, want.page_index, want.parent_key, fetch.miss.extra_keys))
            landed.append(page)
            parent = page
        self.counters.fetched_pages += len(landed)
        self.pages.submit()
        self._end(ident, landed=bool(landed))

    def _end(self, ident: tuple, landed: bool = False) -> None:
        """Drops a fetch's holds: landed pages become CACHED, the rest are freed."""
        fetch = self._fetches.pop(ident)
        if self.source.recheck_after_landing or not landed:
            self._recent[ident] = time.monotonic() + RECHECK_SECONDS
            self._recent.move_to_end(ident)
        while self._recent and (
            len(self._recent) > MAX_RECENT_FETCHES or next(iter(self._recent.values())) < time.monotonic()
        ):
            self._recent.popitem(last=False)
        self.holds.release(list(release_order(fetch.landing)), 0)
        self.holds.release(list(release_order(fetch.miss.hits)), 0)
