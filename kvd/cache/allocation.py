"""Allocation: one allocate call's batch, its hits held, room made in steps, then committed
as new sequences, all or nothing.

``AllocationJob`` is ``KVCacheManager.allocate_batch`` in the shape of ``PublishJob``
(kvd/cache/publishing.py), so the servicer can let the event loop serve other calls while room
is made for a large batch:

1. the manager checks the call and matches each request against the index once
   (``KVCacheManager.allocation``); on creation the job checks the batch against the
   sequences there are and its room (``Room.check``: a batch that cannot fit fails here,
   before anything moves), then **holds** (acquires) its hits, so no page the batch is
   about to hit can be evicted to make room for it, by its own steps or by another call
   that runs between them;
2. ``steps`` frees the pages it still needs in parts (``Room.steps``: new extents built in
   the background, cached pages evicted a few dozen at a time);
3. ``commit`` checks the re-entries again (another call of the session may have taken or
   released an id between steps), takes its pages (``Room.grant``: whatever room other
   calls took meanwhile made in one piece) and creates the sequences on the held hits;
4. a job that does not commit (refused, cancelled, its session gone) releases its holds
   when it is closed (``with`` or ``close``): a failed batch leaves no reference behind.

While a job is open its held pages count as references of their own (the manager's
``allocations``, the ``jobs`` here), which the invariant audit (kvd/cache/invariants.py) adds
to what sequences and pins hold.

The job knows its collaborators by name, as ``PublishJob`` does: the pages (``PagePool``,
``Room``), the sequences (``SequenceTable``) and sessions (``SessionRegistry``), the events
(``EventLog``), the tier that hears of matches (``Tier``) and the namespace's counters; it
never sees the manager.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from itertools import chain

from kvd.cache.events import EventLog
from kvd.cache.requests import Batch, PreparedRequest, SequencePlan, WithEvictions
from kvd.cache.room import Room
from kvd.cache.sequences import Sequence, SequenceTable
from kvd.cache.sessions import Session, SessionRegistry
from kvd.core.counters import NamespaceCounters
from kvd.core.errors import FailedPrecondition
from kvd.core.eviction import release_order
from kvd.core.index import Match
from kvd.core.pool import PagePool
from kvd.core.types import PageId, SeqId, SequenceState
from kvd.tiers.tier import Miss, Tier


class AllocationJob:
    """One allocate call's batch: held on creation, committed once."""

    def __init__(
        self,
        session: Session,
        batch: Batch,
        matches: list[Match],
        *,
        pool: PagePool,
        room: Room,
        sequences: SequenceTable,
        sessions: SessionRegistry,
        events: EventLog,
        tier: Tier,
        counters: NamespaceCounters,
        jobs: set[AllocationJob],
    ) -> None:
        """``matches``: each request's hit, the job's own (it hands their lists to the new
        sequences); ``tier``: hears of the matches and hits (kvd/tiers/tier.py; ``NO_TIERS``
        without prefix reuse); ``counters``: the namespace's; ``jobs``: the open jobs, this
        one among them until it commits or closes."""
        self.session = session
        self.ns = batch.namespace
        self.prepared: list[PreparedRequest] = batch.requests
        self.matches = matches
        self.pool, self.room, self.sequences, self.sessions = pool, room, sequences, sessions
        self.events, self.tier, self.counters, self.jobs = events, tier, counters, jobs
        self.reentries = self._reentries()
        page_size = self.ns.page_size
        # Each request's new private pages, past its hit; the plan ``commit`` carries out.
        self.new_pages = [-(-p.num_tokens // page_size) - len(hit.pages) for p, hit in zip(self.prepared, matches)]
        self.need = sum(self.new_pages)
        room.check(self.ns, self.need, held=self.held())  # raises before anything moves
        for hit in matches:  # one request at a time: a page two requests hit is held twice
            pool.acquire_all(hit.pages)
        jobs.add(self)
        self._open = True

    def held(self) -> Iterator[PageId]:
        """The hits the job holds, request by request (read only when needed: a 50K-token
        hit is 3,125 pages)."""
        return chain.from_iterable(hit.pages for hit in self.matches)

    def __enter__(self) -> AllocationJob:
        """What the job evicts, and whatever calls served between its steps announce, is one
        event batch, as for a call in one piece (kvd/cache/events.py)."""
        self.events.hold()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self.events.end_hold()

    def steps(self) -> Iterator[Future | None]:
        """Frees the pages the batch still needs, in parts between which the caller lets the
        event loop serve other calls (``Room.steps``: a Future is an extent being built, to
        await; None, go on)."""
        assert self._open, "an allocation job stepped after it was committed or closed"
        if self.pool.free_count(self.ns.id) < self.need:
            yield from self.room.steps(self.ns, self.need)

    def commit(self) -> WithEvictions[list[SequencePlan]]:
        """The batch's sequences, on the held hits and new private pages; raises (and the
        job, once closed, releases its holds) when the room or the ids are gone."""
        assert self._open, "an allocation job committed twice or after it was closed"
        ns = self.ns
        self.sessions.get(self.session.id)  # its session may have ended between steps
        self.reentries = self._reentries()  # another call of the session may have taken an id
        granted = self.room.grant(ns, self.new_pages)
        self._open = False  # the holds become the sequences' references
        self.jobs.discard(self)
        plans = []
        for p, hit, reentry, private in zip(self.prepared, self.matches, self.reentries, granted):
            aux = b""
            if reentry is not None:
                aux = reentry.aux
                self.sequences.remove(reentry)
            hit_tokens = hit.tokens(ns.page_size)
            seq = Sequence(
                seq_id=SeqId(p.request.seq_id),
                namespace=ns.id,
                session=self.session.id,
                chain=p.chain,
                pages=hit.pages + private,
                num_tokens=p.num_tokens,
                tokens=bytearray(p.tokens),
                keys=hit.keys,
                shared_prefix_tokens=hit_tokens,
                extra_keys=p.request.extra_keys,
                aux=aux,
            )
            self.sequences.add(seq)
            self.counters.lookup_tokens += p.num_tokens
            self.counters.hit_tokens += hit_tokens
            plans.append(SequencePlan(seq.seq_id, hit.pages, private, hit_tokens, hit_tokens, p.num_tokens))
        for p, hit in zip(self.prepared, self.matches):
            self.tier.served(hit.pages, ns.page_size)
            self.tier.missed(Miss(ns, p.chain, p.request.extra_keys, p.tokens, hit.pages, hit.keys))
        return WithEvictions(plans, self.room.report_evictions(self.session))

    def close(self) -> None:
        """Releases the held hits of a job that did not commit (tail first, as a sequence's
        release does, so the chain's head stays the longest in the cache)."""
        if not self._open:
            return
        self._open = False
        self.jobs.discard(self)
        for hit in reversed(self.matches):
            self.pool.release_all(release_order(hit.pages))

    def _reentries(self) -> list[Sequence | None]:
        """Each request's id against the namespace's sequences: new (None), or an EVICTED
        sequence of this session that re-enters; anything else is refused."""
        sequences, ns = self.sequences, self.ns
        found = []
        for p in self.prepared:
            seq = sequences.find(ns.id, p.request.seq_id)
            if seq is not None:
                sequences.owned(ns.id, p.request.seq_id, self.session.id)
                if seq.state is not SequenceState.EVICTED:
                    raise FailedPrecondition(
                        f"sequence {p.request.seq_id!r} already exists ({seq.state.name}); release it or use another id"
                    )
            found.append(seq)
        return found
