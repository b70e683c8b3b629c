"""Room: new pages for a namespace within the host budget, or a refusal before anything moves.

Every caller that needs pages gets them here: ``grant`` for a call (all or nothing: an
allocation's commit, an extend, a fork), ``grant_spare`` for a speculative fill (a fetch
from the remote store, kvd/tiers/fetches.py: as many as the namespace spares). Both make
the room, take the pages off the free list as PRIVATE, and (``grant``) start building the
namespace's next extent ahead when its free pages run low.

When a namespace needs more free pages than it has, room is made in this order:

1. a new extent, while the budget has bytes no extent holds (kvd/core/supply.py builds them)
   and /dev/shm has room for it (when it refuses one, the next steps make the room);
2. the namespace's next CACHED page in the eviction policy's order (kvd/core/eviction.py);
3. an extent of another namespace that holds no referenced page: its budget moves here;
4. an ON_HOLD sequence of the namespace, chosen by kvd/core/eviction.py's ``held_victim``.

``check`` counts what all of that could free and raises ``ResourceExhausted`` when it is
not enough, so a call that cannot fit fails before evicting anything. The evicted
sequences' owners hear of them once the call is done (``report_evictions``): the caller's
own ids go in its reply, every other owner's on its session stream. The manager decides
what a request needs; this module decides what to give up for it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

from kvd.cache.requests import STEP_SECONDS
from kvd.cache.sequences import Sequence, SequenceTable
from kvd.cache.sessions import Session, SessionRegistry
from kvd.core.arena import Arena, Extent
from kvd.core.counters import Counters
from kvd.core.errors import ResourceExhausted
from kvd.core.eviction import held_victim, release_order
from kvd.core.namespaces import Namespace
from kvd.core.pool import PagePool
from kvd.core.supply import ExtentSupply
from kvd.core.types import NamespaceId, PageId, PageState, SeqId, SessionId
from kvd.durability.integrity import Integrity

log = logging.getLogger(__name__)

EVICT_PAGES = 32  # cached pages ``steps`` evicts between two looks at the clock (~0.1 ms)


class Room:
    def __init__(
        self,
        arena: Arena,
        pool: PagePool,
        supply: ExtentSupply,
        sequences: SequenceTable,
        sessions: SessionRegistry,
        counters: Counters,
        integrity: Integrity,
    ) -> None:
        self.arena = arena
        self.pool = pool
        self.supply = supply
        self.sequences = sequences
        self.sessions = sessions  # the owners of evicted sequences hear of them on their streams
        self.counters = counters  # read for the log line of what was evicted
        self.integrity = integrity  # its sealer may still read the pages of an extent reclaimed
        self._evicted: list[Sequence] = []  # on-hold sequences evicted since ``report_evictions``
        # Frees pages a warm restart's recovery holds unverified (namespace, count) -> how
        # many: the room of last resort (kvd/cache/catalog.py sets it).
        self.give_up_recovery: Callable[[NamespaceId, int], int] = lambda namespace, count: 0

    def grant(self, ns: Namespace, counts: list[int], protect: Sequence | None = None) -> list[list[PageId]]:
        """``counts[i]`` new PRIVATE pages for the i-th taker of one call, all or nothing: room
        made in one piece (``ensure_free``: when it fails after evicting, as when /dev/shm
        refuses an extent it counted on, every owner of what it evicted hears of it, the
        caller too), then the namespace's next extent built ahead when its free pages run low.
        ``protect``: an on-hold sequence the caller is working on, never evicted for it."""
        try:
            self.ensure_free(ns, sum(counts), protect)
        except ResourceExhausted:
            self.report_evictions(None)
            raise
        pages = [self.pool.allocate(ns.id, count) for count in counts]
        self.supply.provision(ns)
        return pages

    def grant_spare(self, ns: Namespace, most: int) -> list[PageId]:
        """Up to ``most`` new PRIVATE pages for a speculative fill: as many as the namespace
        has without giving up anything but its own cached pages (``spare``); none when it
        spares none."""
        count = min(most, self.spare(ns))
        if not count:
            return []
        try:
            self.ensure_free(ns, count)
        except ResourceExhausted:
            return []
        return self.pool.allocate(ns.id, count)

    def report_evictions(self, caller: Session | None) -> list[SeqId]:
        """Hands out the on-hold sequences evicted since the last report, once the call that
        evicted them is done: the ids of the caller's own are returned for its reply; every
        other owner hears of its own on its session stream."""
        evicted, self._evicted = self._evicted, []
        own: list[SeqId] = []
        others: dict[tuple[SessionId, NamespaceId], list[SeqId]] = {}
        for seq in evicted:
            if caller is not None and seq.session == caller.id:
                own.append(seq.seq_id)
            else:
                others.setdefault((seq.session, seq.namespace), []).append(seq.seq_id)
        for (session_id, ns_id), seq_ids in others.items():
            listener = self.sessions.get(session_id).listener
            if listener is not None:
                listener(ns_id, seq_ids)
        return own

    def ensure_free(self, ns: Namespace, need: int, protect: Sequence | None = None) -> None:
        """Makes ``need`` pages free in the namespace, or raises before evicting anything.

        ``protect``: an on-hold sequence the caller is working on, never evicted for it."""
        self.check(ns, need, protect)
        counters = self.counters.of(ns.id)
        evicted_before, held_evicted = counters.evicted_pages, 0
        while self.pool.free_count(ns.id) < need:
            held_evicted += self._make_room(ns, need, protect)
        if counters.evicted_pages > evicted_before or held_evicted:
            log.info(
                "namespace %d: evicted %d cached pages and %d on-hold sequences to make room for %d pages",
                ns.id,
                counters.evicted_pages - evicted_before,
                held_evicted,
                need,
            )

    def steps(self, ns: Namespace, need: int, seconds: float = STEP_SECONDS) -> Iterator[Future | None]:
        """Makes ``need`` pages free as ``ensure_free`` would, in parts between which the
        caller lets the event loop serve other calls: yields a Future while an extent is
        built in the background (await it: it never raises for a full /dev/shm, and cached
        pages are evicted after such a refusal), None after evicting cached pages for about
        ``seconds`` (yield the loop, then go on). Stops early when what is left needs more
        than new extents and cached pages (reclaiming, on-hold sequences): ``ensure_free``
        does that, and whatever other calls took meanwhile, when the caller's call runs."""
        evicted = 0
        while True:
            self.supply.adopt_built()  # a build that finished counts before another starts
            if self.pool.free_count(ns.id) >= need:
                break
            build = self.supply.build_ahead(ns)
            if build is not None:
                yield build
                if build.exception() is not None:
                    break  # ensure_free builds on the request path and reports the error
                continue
            if not self.pool.cached_count(ns.id):
                break
            deadline = time.perf_counter() + seconds
            while self.pool.free_count(ns.id) < need and self.pool.cached_count(ns.id):
                evicted += len(self.pool.evict_many(ns.id, min(EVICT_PAGES, need - self.pool.free_count(ns.id))))
                if time.perf_counter() > deadline:
                    break
            yield None
        if evicted:
            log.info("namespace %d: evicted %d cached pages to make room for %d pages", ns.id, evicted, need)

    def check(self, ns: Namespace, need: int, protect: Sequence | None = None, held: Iterable[PageId] = ()) -> None:
        """Raises unless ``need`` pages can be made free; ``held``: cached pages about to be acquired
        (read only when the free pages do not suffice)."""
        self.supply.adopt_built()
        if self.pool.free_count(ns.id) >= need:
            return
        held = frozenset(held)
        available = self._available(ns, protect, held)
        if need > available and self.give_up_recovery(ns.id, need - available):
            available = self._available(ns, protect, held)
        if need > available:
            raise ResourceExhausted(
                f"namespace {ns.id} needs {need} more pages of {ns.page_bytes} bytes; only {available} can be "
                f"freed within the host budget of {self.arena.budget_bytes} bytes"
                + (f" ({self.arena.shm_note})" if self.arena.shm_note else "")
            )

    def _available(self, ns: Namespace, protect: Sequence | None, held: frozenset[PageId]) -> int:
        """Pages that can be made free for the namespace (``check``)."""
        return (
            self._own(ns)
            - self._cached(held)
            + self.arena.pages_within(sum(e.plan.footprint for e in self._reclaimable(ns)), ns.page_bytes, ns.page_size)
            + self._freeable_on_hold(ns, protect, held)
        )

    def _cached(self, pages: Iterable[PageId]) -> int:
        """How many of ``pages`` are cached (about to be held: not to be given up for room)."""
        return sum(1 for page in pages if self.pool.state(page) is PageState.CACHED)

    def spare(self, ns: Namespace, held: Iterable[PageId] = ()) -> int:
        """Pages the namespace can get by giving up nothing but its own cached pages: free ones,
        new extents within the budget, cached ones. What a speculative fill (a fetch from a
        tier, kvd/tiers/fetches.py) may take; it never evicts a sequence or another namespace.
        ``held``: pages the fill will hold (a prompt's hit): cached, they are not to be given up."""
        self.supply.adopt_built()
        return self._own(ns) - self._cached(held)

    def _own(self, ns: Namespace) -> int:
        """The namespace's own pages for the asking, as of the last adopted build: free ones,
        those being built, new extents within the budget, cached ones (``spare``; ``check``
        adds what reclaiming and on-hold sequences would give)."""
        return (
            self.pool.free_count(ns.id)
            + self.supply.building_pages(ns.id)
            + self.arena.creatable_pages(ns.page_bytes, ns.page_size)
            + self.pool.cached_count(ns.id)
        )

    def _freeable_on_hold(self, ns: Namespace, protect: Sequence | None, held: frozenset[PageId]) -> int:
        """Pages that evicting every on-hold sequence (but ``protect``) would free or make evictable:
        their private pages, and published pages no one else references."""
        on_hold_refs: Counter[PageId] = Counter()
        private = 0
        for seq in self.sequences.on_hold(ns.id):
            if seq is not protect:
                private += len(seq.private_pages)
                on_hold_refs.update(seq.shared_pages)
        return private + sum(
            1 for page, refs in on_hold_refs.items() if refs == self.pool.refcount(page) and page not in held
        )

    def _make_room(self, ns: Namespace, need: int, protect: Sequence | None) -> int:
        """One step towards ``need`` free pages, in the module's order (a new extent, the
        cached pages still missing, a reclaimed extent or an on-hold sequence); returns the
        number of on-hold sequences it evicted (0 or 1)."""
        refusals = self.arena.shm_refusals
        if self.supply.add_extent(ns):
            return 0
        if self.arena.shm_refusals != refusals:
            self.check(ns, need, protect)  # without the budget /dev/shm cannot back, it may not fit
        if self.pool.cached_count(ns.id):  # all that are missing at once: evicting adds no budget for an extent
            self.pool.evict_many(ns.id, need - self.pool.free_count(ns.id))
            return 0
        reclaimable = self._reclaimable(ns)
        if reclaimable:
            self._reclaim(reclaimable[0])
            return 0
        victim = held_victim(self.sequences.on_hold(ns.id), protect)
        assert victim is not None, f"namespace {ns.id}: ran out of room after the capacity check passed"
        self.sequences.evict(victim)  # ON_HOLD → EVICTED: its pages go, its owner is told
        self.pool.release_all(release_order(victim.take_pages()))
        self._evicted.append(victim)
        return 1

    def _reclaimable(self, ns: Namespace) -> list[Extent]:
        """Other namespaces' extents holding no referenced page: their budget can move."""
        return [e for e in self.arena.extents() if e.plan.namespace != ns.id and self.pool.extent_in_use(e.name) == 0]

    def _reclaim(self, extent: Extent) -> None:
        self.integrity.apply(wait=True)  # the sealer may still read this extent's pages
        first, count = extent.first_page, extent.num_pages
        ns_id = extent.plan.namespace
        evicted_before = self.counters.of(ns_id).evicted_pages
        for page in map(PageId, range(first, first + count)):
            # each goes with the cached pages of its chain after it, elsewhere too (cached as
            # well: a referenced page's whole prefix is referenced): none could hit again
            if self.pool.publication(page) is not None:  # PUBLISHED or CACHED
                self.pool.evict(page)
        self.pool.remove_pages(ns_id, extent.name, first, count)
        self.arena.release(extent)
        log.info(
            "reclaimed extent %s (%d pages) for another namespace, evicting %d cached pages of chains through it",
            extent.name,
            count,
            self.counters.of(ns_id).evicted_pages - evicted_before,
        )
