"""Page states and reference counts: the one class that changes a refcount.

``acquire`` and ``release`` are symmetric. A page's refcount is the number of sequence
references plus pins. Its state follows from the count and from whether it was published:

    FREE --allocate--> PRIVATE(1) --publish--> PUBLISHED(>=1) --release to 0--> CACHED
      ^                    |                                                      |
      +---release to 0-----+<-----------------------evict (LRU)-------------------+

The per-page data is in columns (kvd/core/page_columns.py), so a batch of pages (a 50K-token
hit pins 3,125) is checked and changed with a few array operations instead of a Python
loop; a batch under ``BATCH_PAGES`` (a decode step, one page of a publish) goes page by
page, which costs it less. Both ways change the same data the same way. An extent's pages
in use (PRIVATE or PUBLISHED) are the ones with a refcount.

CACHED pages sit in a per-namespace ``CachedQueue``; which one goes first is the
eviction policy's (kvd/core/eviction.py), not this module's.

Every page that is published, restored, unindexed or freed while published is reported
once, by the call that does it, to the pool's ``listener`` (kvd/core/listener.py): what
follows (a record, a KV event, a tier's copy) is the listener's, never a caller's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvd.core.counters import Counters
from kvd.core.eviction import CachedQueue, restore_order
from kvd.core.index import PageContent, PrefixIndex
from kvd.core.listener import SILENT, ChainPlace, PageListener
from kvd.core.page_columns import CACHED, FREE, PRIVATE, PUBLISHED, STATES, PageColumns
from kvd.core.types import NamespaceId, PageId, PageKey, PageState

BATCH_PAGES = 32  # batches of at least this many pages take the array path


@dataclass
class _NamespacePages:
    free: list[PageId]
    cached: CachedQueue


class PagePool:
    """States, refcounts, free lists and LRU of every host page of the daemon."""

    def __init__(self, counters: Counters) -> None:
        self._columns = PageColumns()
        # The prefix index of this pool's published pages. Only the pool inserts and removes
        # its entries: a page enters it when published (or restored) and leaves it in the same
        # call that evicts, frees or unindexes the page; everyone else matches.
        self.index = PrefixIndex(self._columns)
        # Hears every page published, restored, unindexed or freed while published; set once,
        # before the first page is published (kvd/cache/manager.py sets the cache's).
        self.listener: PageListener = SILENT
        self._orphans: list[PageContent] = []  # indexed pages that followed a page that left the index
        self._dropping = False  # _drop_orphans is running
        self._extents: dict[str, range] = {}  # slots of each extent's pages
        self._by_namespace: dict[NamespaceId, _NamespacePages] = {}
        self._counters = counters  # refcount changes and evictions are counted here

    # ---- extents ------------------------------------------------------------------

    def add_pages(
        self, namespace: NamespaceId, extent: str, first: PageId, count: int, held: np.ndarray | None = None
    ) -> None:
        """Adds a new extent's pages as FREE; those at the offsets ``held`` (a warm restart's,
        not verified yet) as PRIVATE with refcount 1, the reference the recovery holds until
        it restores or releases them (kvd/durability/reindexing.py)."""
        slots = self._extents[extent] = self._columns.add(first, count, namespace)
        free = np.ones(count, bool)
        if held is not None and len(held):
            free[held] = False
            self._columns.state[slots.start + held] = PRIVATE
            self._columns.refcount[slots.start + held] = 1
        # pop() hands out low ids first
        self._ns(namespace).free.extend((first + np.flatnonzero(free)[::-1]).tolist())

    def remove_pages(self, namespace: NamespaceId, extent: str, first: PageId, count: int) -> None:
        """Forgets an extent whose pages are all FREE."""
        assert self.extent_in_use(extent) == 0, f"extent {extent} removed while pages are in use"
        slots = self._extents.pop(extent)
        busy = np.flatnonzero(self._columns.state[slots.start : slots.stop] != FREE)
        assert not busy.size, (
            f"page {first + busy[0]} of extent {extent} removed while {self.state(first + busy[0]).value}"
        )
        self._columns.remove(first)
        gone = range(first, first + count)
        pages = self._ns(namespace)
        pages.free = [p for p in pages.free if p not in gone]

    def restore(self, recovered: list[tuple[ChainPlace, PageContent]]) -> None:
        """PRIVATE (held by the recovery, ``add_pages``) → CACHED (indexed, refcount 0) for pages
        a warm restart verified, of any namespace, parents first (each parent indexed already
        or in the same batch); each namespace's queued in eviction order (kvd/core/eviction.py)."""
        by_namespace: dict[NamespaceId, list[tuple[int, PageContent]]] = {}
        for place, content in recovered:
            self.index.insert(content, place.page_index)
            by_namespace.setdefault(place.ns.id, []).append((place.page_index, content))
        c = self._columns
        for namespace, indexed in by_namespace.items():
            contents = restore_order(indexed)
            slots = c.slots([content.page for content in contents])
            held = (c.state[slots] == PRIVATE) & (c.refcount[slots] == 1) & (c.namespace[slots] == namespace)
            assert held.all(), f"page {c.page[slots[~held][0]]} restored while {STATES[c.state[slots[~held][0]]]}"
            c.indexed[slots] = True
            c.state[slots] = CACHED
            c.refcount[slots] = 0
            c.publication[slots] += 1
            self._ns(namespace).cached.push(slots)
        for place, content in recovered:
            self.listener.restored(content, place)

    def extent_in_use(self, extent: str) -> int:
        """The extent's PRIVATE or PUBLISHED pages: those with a refcount."""
        slots = self._extents[extent]
        return int(np.count_nonzero(self._columns.refcount[slots.start : slots.stop]))

    # ---- queries ------------------------------------------------------------------

    def __contains__(self, page: PageId) -> bool:
        return page in self._columns

    def namespace_of(self, page: PageId) -> NamespaceId:
        return NamespaceId(self._columns.namespace_at[self._columns.slot(page)])

    def state(self, page: PageId) -> PageState:
        return STATES[self._columns.state_at[self._columns.slot(page)]]

    def refcount(self, page: PageId) -> int:
        return self._columns.refcount_at[self._columns.slot(page)]

    def pins(self, page: PageId) -> int:
        return self._columns.pins_at[self._columns.slot(page)]

    def content(self, page: PageId) -> PageContent | None:
        """What a PUBLISHED or CACHED page holds (built again from the index's run for an
        indexed one); None for any other page."""
        slot = self._slot_or_none(page)
        if slot is None:
            return None
        content = self._columns.content[slot]
        return self.index.content(page) if content is None and self._columns.indexed_at[slot] else content

    def key(self, page: PageId) -> PageKey | None:
        """A PUBLISHED or CACHED page's key (``content`` without building the rest); None for any
        other page."""
        slot = self._slot_or_none(page)
        content = None if slot is None else self._columns.content[slot]
        if content is None:
            return self.index.key_of(page) if slot is not None and self._columns.indexed_at[slot] else None
        return content.key

    def publication(self, page: PageId) -> int | None:
        """Which publish of its slot a PUBLISHED or CACHED page holds (``PageColumns.publication``):
        equal for as long as the page holds that content; None for any other page."""
        c, slot = self._columns, self._slot_or_none(page)
        return None if slot is None or c.state_at[slot] not in (PUBLISHED, CACHED) else c.publication_at[slot]

    def publications(self, pages: Sequence[PageId]) -> np.ndarray:
        """``publication`` of a batch of PUBLISHED or CACHED pages of live extents (uint32)."""
        c = self._columns
        slots = c.slots(pages)
        held = np.isin(c.state[slots], (PUBLISHED, CACHED))
        assert held.all(), f"page {c.page[slots[~held][0]]} is {STATES[c.state[slots[~held][0]]].value}"
        return c.publication[slots]

    def checksum(self, page: PageId) -> int | None:
        """A published page's sealed checksum; None before it is sealed, once its seal is gone,
        and for a page of no live extent."""
        c, slot = self._columns, self._slot_or_none(page)
        return None if slot is None or not c.sealed_at[slot] else c.checksum_at[slot]

    def _slot_or_none(self, page: PageId) -> int | None:
        """The page's slot; None for a page of no live extent."""
        try:
            return self._columns.slot(page)
        except KeyError:
            return None

    def sealed(self) -> list[tuple[PageId, int]]:
        """(page, checksum) of every sealed page, ascending by slot."""
        c = self._columns
        slots = np.flatnonzero(c.sealed[: c.capacity])
        return list(zip(c.page[slots].tolist(), c.checksum[slots].tolist()))

    def seal(self, page: PageId, checksum: int | None) -> None:
        """Records a published page's checksum (Integrity decides which, kvd/durability/integrity.py);
        None forgets it. A freed page's goes with it."""
        c = self._columns
        slot = c.slot(page)
        c.sealed_at[slot] = checksum is not None
        c.checksum_at[slot] = checksum or 0

    def is_indexed(self, page: PageId) -> bool:
        return self._columns.indexed_at[self._columns.slot(page)]

    def free_count(self, namespace: NamespaceId) -> int:
        return len(self._ns(namespace).free)

    def cached_count(self, namespace: NamespaceId) -> int:
        return len(self._ns(namespace).cached)

    def lru_order(self, namespace: NamespaceId) -> list[PageId]:
        """CACHED pages of a namespace, next eviction first."""
        return self._columns.page[self._ns(namespace).cached.slots()].tolist()

    def free_list(self, namespace: NamespaceId) -> list[PageId]:
        return list(self._ns(namespace).free)

    def pages(self) -> Iterator[tuple[PageId, PageState, int, int, NamespaceId]]:
        """(page id, state, refcount, pins, namespace) of every page, ascending by page id."""
        c = self._columns
        for first, slots in c.extents():
            at = slice(slots.start, slots.stop)
            rows = zip(c.state[at].tolist(), c.refcount[at].tolist(), c.pins[at].tolist(), c.namespace[at].tolist())
            for page, (state, refcount, pins, namespace) in enumerate(rows, start=first):
                yield PageId(page), STATES[state], refcount, pins, NamespaceId(namespace)

    # ---- transitions --------------------------------------------------------------

    def allocate(self, namespace: NamespaceId, count: int) -> list[PageId]:
        """``count`` pages FREE → PRIVATE with refcount 1. The caller made sure they exist."""
        if not count:  # most decode steps fit in the tail page
            return []
        c, free = self._columns, self._ns(namespace).free
        taken = free[len(free) - count :][::-1]
        del free[len(free) - count :]
        if count < BATCH_PAGES:
            for page in taken:
                slot = c.slot(page)
                if c.state_at[slot] != FREE or c.refcount_at[slot]:
                    self._refuse_allocation(page)
                c.state_at[slot] = PRIVATE
                c.refcount_at[slot] = 1
        else:
            slots = c.slots(taken)
            taken_wrong = np.flatnonzero((c.state[slots] != FREE) | (c.refcount[slots] != 0))
            if taken_wrong.size:
                self._refuse_allocation(taken[taken_wrong[0]])
            c.state[slots] = PRIVATE
            c.refcount[slots] = 1
        self._counters.of(namespace).refcount_increments += count
        return taken

    def _refuse_allocation(self, page: PageId) -> None:
        raise AssertionError(f"free list held page {page} in state {self.state(page).value}")

    def acquire(self, page: PageId, pin: bool = False) -> None:
        """One more reference to a published or cached page (a prefix hit, a fork, a pin)."""
        self.acquire_all((page,), pin)

    def acquire_all(self, pages: Sequence[PageId], pin: bool = False) -> None:
        """acquire() for each page of one namespace, each page at most once (a 50K-token hit
        pins ~3K pages). CACHED pages leave the cache; a page neither PUBLISHED nor CACHED in
        that namespace names a broken invariant."""
        if not pages:
            return
        c = self._columns
        if len(pages) < BATCH_PAGES:
            namespace = c.namespace_at[c.slot(pages[0])]
            for page in pages:
                slot = c.slot(page)
                if c.state_at[slot] != PUBLISHED or c.namespace_at[slot] != namespace:
                    self._revive(slot, namespace)
                c.refcount_at[slot] += 1
                if pin:
                    c.pins_at[slot] += 1
        else:
            slots = c.slots(pages)
            namespace = c.namespace_at[slots[0]]
            if (c.state[slots] != PUBLISHED).any() or (c.namespace[slots] != namespace).any():
                self._revive_all(slots, namespace)
            c.refcount[slots] += 1
            if pin:
                c.pins[slots] += 1
        self._counters.of(namespace).refcount_increments += len(pages)

    def _revive(self, slot: int, namespace: NamespaceId) -> None:
        """``_revive_all`` for one page."""
        c = self._columns
        if c.state_at[slot] == CACHED and c.namespace_at[slot] == namespace:
            c.state_at[slot] = PUBLISHED
            self._by_namespace[namespace].cached.left(1)
        else:
            self._revive_all(np.array([slot]), namespace)  # names what is wrong

    def _revive_all(self, slots: np.ndarray, namespace: NamespaceId) -> None:
        """Acquired pages that are not all PUBLISHED in ``namespace``: CACHED ones leave the
        cache (their queue entries stay behind); anything else is a broken invariant."""
        c = self._columns
        foreign = np.flatnonzero(c.namespace[slots] != namespace)
        assert not foreign.size, (
            f"page {c.page[slots[foreign[0]]]} of namespace {c.namespace[slots[foreign[0]]]} "
            f"acquired with pages of namespace {namespace}"
        )
        states = c.state[slots]
        unshared = np.flatnonzero((states != PUBLISHED) & (states != CACHED))
        assert not unshared.size, (
            f"page {c.page[slots[unshared[0]]]} acquired while {STATES[states[unshared[0]]].value}; "
            "only published pages are shared"
        )
        cached = slots[states == CACHED]
        c.state[cached] = PUBLISHED
        self._by_namespace[namespace].cached.left(len(cached))

    def release(self, page: PageId, pin: bool = False) -> None:
        """Drops one reference; at zero a private or unindexed page is freed, an indexed one cached."""
        self.release_all((page,), pin)

    def release_all(self, pages: Iterable[PageId], pin: bool = False) -> None:
        """release() for each page of one namespace, each at most once, in the given order
        (kvd/core/eviction.py's release_order). A release that must not happen names the broken
        invariant (in a batch of ``BATCH_PAGES`` or more, before anything changes)."""
        if not isinstance(pages, (list, tuple)):
            pages = list(pages)
        if not pages:
            return
        c = self._columns
        if len(pages) < BATCH_PAGES:
            namespace = c.namespace_at[c.slot(pages[0])]
            queue = self._by_namespace[namespace]
            for page in pages:
                slot = c.slot(page)
                count = c.refcount_at[slot]
                if count < 1 or c.namespace_at[slot] != namespace or (pin and c.pins_at[slot] < 1):
                    self._refuse_release(np.array([slot]), namespace, pin)
                c.refcount_at[slot] = count - 1
                if pin:
                    c.pins_at[slot] -= 1
                if count > 1:
                    continue
                if c.state_at[slot] == PUBLISHED and c.indexed_at[slot]:
                    self._cache_one(slot, queue)
                else:
                    self._free_one(slot, queue)
        else:
            slots = c.slots(pages)
            namespace = c.namespace_at[slots[0]]
            counts = c.refcount[slots]
            unpinned = pin and (c.pins[slots] < 1).any()
            if (counts < 1).any() or (c.namespace[slots] != namespace).any() or unpinned:
                self._refuse_release(slots, namespace, pin)
            counts -= 1
            c.refcount[slots] = counts
            if pin:
                c.pins[slots] -= 1
            gone = slots[counts == 0]
            if len(gone):
                self._unreferenced(gone, self._by_namespace[namespace])
        self._counters.of(namespace).refcount_decrements += len(pages)

    def _refuse_release(self, slots: np.ndarray, namespace: NamespaceId, pin: bool) -> None:
        """Names the broken invariant of a release that must not happen."""
        c = self._columns
        for slot in slots.tolist():
            page = c.page_at[slot]
            assert c.namespace_at[slot] == namespace, (
                f"page {page} of namespace {c.namespace_at[slot]} released with pages of namespace {namespace}"
            )
            assert c.refcount_at[slot] > 0, f"page {page} released with refcount 0 (double release)"
            assert not pin or c.pins_at[slot] > 0, f"page {page} unpinned but holds no pin"

    def _unreferenced(self, slots: np.ndarray, pages: _NamespacePages) -> None:
        """Pages whose last reference went, in release order: indexed published ones are
        cached, the rest freed."""
        c = self._columns
        cache = (c.state[slots] == PUBLISHED) & c.indexed[slots]
        if cache.all():  # a released hit: every page stays cached
            self._cache(slots, pages)
            return
        self._cache(slots[cache], pages)
        self._free(slots[~cache], pages)

    def publish(self, page: PageId, content: PageContent, place: ChainPlace, indexed: bool = True) -> None:
        """PRIVATE → PUBLISHED: the page is immutable from now on; indexed at its ``place`` in
        its chain, or left out of the index (``indexed`` False: a verified hash collision)."""
        c = self._columns
        slot = c.slot(page)
        assert c.state_at[slot] == PRIVATE and c.refcount_at[slot] == 1, (
            f"page {page} published while {self.state(page).value} with refcount {c.refcount_at[slot]}"
        )
        c.state_at[slot] = PUBLISHED
        c.indexed_at[slot] = indexed
        c.publication_at[slot] = (c.publication_at[slot] + 1) & 0xFFFFFFFF
        if indexed:
            self.index.insert(content, place.page_index)
        else:
            c.content[slot] = content
        self.listener.published((content,), (place,), indexed)

    def publish_chain(self, contents: list[PageContent], places: list[ChainPlace]) -> None:
        """``publish`` for consecutive pages of one chain, parents first, each indexed: a
        batch of ``BATCH_PAGES`` or more is checked and changed in a few array operations
        and joins the index as one run (a 50K-token publish is 3,125 pages)."""
        if len(contents) < BATCH_PAGES:
            for content, place in zip(contents, places):
                self.publish(content.page, content, place)
            return
        c = self._columns
        slots = c.slots([content.page for content in contents])
        wrong = np.flatnonzero((c.state[slots] != PRIVATE) | (c.refcount[slots] != 1))
        if wrong.size:
            self.publish(contents[wrong[0]].page, contents[wrong[0]], places[wrong[0]])  # names what is wrong
        c.state[slots] = PUBLISHED
        c.indexed[slots] = True
        c.publication[slots] += 1
        self.index.insert_chain(contents, places[0].page_index)
        self.listener.published(contents, places, True)

    def evict_many(self, namespace: NamespaceId, count: int) -> list[PageId]:
        """CACHED → FREE for the eviction policy's next ``count`` victims (all cached pages
        when fewer); returns them, in eviction order."""
        pages = self._ns(namespace)
        if min(count, len(pages.cached)) < BATCH_PAGES:
            evicted = []
            while len(evicted) < count and len(pages.cached):
                evicted.append(self._evict(pages.cached.victim(), pages))
            return evicted
        victims = pages.cached.victims(count)
        evicted = self._columns.page[victims].tolist()
        self._counters.of(namespace).evicted_pages += len(victims)
        self._free(victims, pages)
        return evicted

    def evict(self, page: PageId) -> None:
        """CACHED → FREE for one page out of the policy's order (an extent reclaimed), with
        the cached pages of its chain after it."""
        c = self._columns
        slot = c.slot(page)
        assert c.state_at[slot] == CACHED, f"page {page} evicted while {self.state(page).value}"
        pages = self._by_namespace[NamespaceId(c.namespace_at[slot])]
        pages.cached.left(1)
        self._evict(slot, pages)

    def unindex(self, page: PageId) -> None:
        """Takes a published page out of sharing (it failed its checksum): out of the index,
        with the pages of its chain after it; a CACHED one is freed now, a referenced one
        stays with its holders and is freed, never cached, on its last release."""
        c = self._columns
        slot = c.slot(page)
        assert c.state_at[slot] in (PUBLISHED, CACHED), f"page {page} unindexed while {self.state(page).value}"
        if c.indexed_at[slot]:
            self._unindex(page, slot)
        if c.state_at[slot] == CACHED:
            pages = self._by_namespace[NamespaceId(c.namespace_at[slot])]
            pages.cached.left(1)
            self._free_one(slot, pages)
        self._drop_orphans()

    def _drop_orphans(self) -> None:
        """The pages that followed one that left the index leave it too (a match walks from
        a chain's first page, so none could hit again): cached ones are evicted, referenced
        ones stay with their holders, unindexed. Eviction in the policy's order (a chain's
        tail first) leaves none. Called once a change is complete (after a batch is freed);
        the evictions it makes call it again, which returns at once: this loop drains them."""
        if self._dropping:
            return
        self._dropping = True
        try:
            self._drain_orphans()
        finally:
            self._dropping = False

    def _drain_orphans(self) -> None:
        c = self._columns
        while self._orphans:
            content = self._orphans.pop()
            slot = c.slot(content.page)
            if c.content[slot] is not content or not c.indexed_at[slot]:
                continue  # freed or unindexed meanwhile (in the same batch)
            if c.state_at[slot] == CACHED:
                pages = self._by_namespace[NamespaceId(c.namespace_at[slot])]
                pages.cached.left(1)
                self._evict(slot, pages)
            else:
                self._unindex(content.page, slot)

    def _evict(self, slot: int, pages: _NamespacePages) -> PageId:
        """A CACHED page out of its queue → FREE; returns it."""
        c = self._columns
        page: PageId = c.page_at[slot]
        assert c.state_at[slot] == CACHED, f"page {page} evicted while {self.state(page).value}"
        self._counters.of(NamespaceId(c.namespace_at[slot])).evicted_pages += 1
        self._free_one(slot, pages)
        return page

    def _cache(self, slots: np.ndarray, pages: _NamespacePages) -> None:
        """Pages with no reference that stay indexed → CACHED, queued in the given order."""
        if len(slots):
            self._columns.state[slots] = CACHED
            pages.cached.push(slots)

    def _cache_one(self, slot: int, pages: _NamespacePages) -> None:
        self._columns.state_at[slot] = CACHED
        pages.cached.push_one(slot)

    def _free(self, slots: np.ndarray, pages: _NamespacePages) -> None:
        """Pages with no reference that are PRIVATE, unindexed PUBLISHED or CACHED (out of their
        queue) → FREE, onto the free list in the given order; published ones are unpublished first."""
        if not len(slots):
            return
        c = self._columns
        ids = c.page[slots].tolist()
        for at in np.flatnonzero(c.state[slots] != PRIVATE).tolist():
            self._unpublish(ids[at], int(slots[at]))
        c.state[slots] = FREE
        c.indexed[slots] = False
        c.sealed[slots] = False
        pages.free += ids
        self._drop_orphans()

    def _free_one(self, slot: int, pages: _NamespacePages) -> None:
        c = self._columns
        page: PageId = c.page_at[slot]
        if c.state_at[slot] != PRIVATE:
            self._unpublish(page, slot)
        c.state_at[slot] = FREE
        c.indexed_at[slot] = False
        c.sealed_at[slot] = False
        pages.free.append(page)
        self._drop_orphans()

    def _unpublish(self, page: PageId, slot: int) -> None:
        """A published page is freed: reported while its content is still here, then out of
        the index (what followed it is dropped by the public method's ``_drop_orphans``), its
        content forgotten."""
        self.listener.unpublished(page)
        c = self._columns
        content = c.content[slot]
        c.content[slot] = None
        if c.indexed_at[slot]:
            self._leave_index(page, slot, self.index.key_of(page) if content is None else content.key)

    def _unindex(self, page: PageId, slot: int) -> None:
        """A published page leaves the index and stays published: what it holds is kept here
        from now on (``PageColumns.content``)."""
        c = self._columns
        content = c.content[slot]
        if content is None:
            content = c.content[slot] = self.index.content(page)
        c.indexed_at[slot] = False
        self._leave_index(page, slot, content.key)

    def _leave_index(self, page: PageId, slot: int, key: PageKey) -> None:
        """The page's index entry goes (its slot's ``indexed`` flag is the caller's); the
        indexed pages that followed it are orphans now, what they hold kept here until they
        leave it too (their runs no longer hold them)."""
        c = self._columns
        orphans = self.index.remove(page, key)
        for orphan in orphans:
            c.content[c.slot(orphan.page)] = orphan
        self._orphans += orphans
        self.listener.unindexed(page, key, NamespaceId(c.namespace_at[slot]))

    def _ns(self, namespace: NamespaceId) -> _NamespacePages:
        pages = self._by_namespace.get(namespace)
        if pages is None:
            pages = self._by_namespace[namespace] = _NamespacePages([], CachedQueue(self._columns))
        return pages
