"""The cache policy: what each client call does to pages, sequences, pins and sessions
(what acts on a namespace's published pages as a whole, apart from any session, is
``Catalog``: kvd/cache/catalog.py).

Every public method validates the whole request first and raises a ``KVDError`` before
changing anything; only then does it act. All methods run on the daemon's event loop,
one at a time, so a lookup and the pin of its hits happen in one atomic step.

Data lives elsewhere: page states and refcounts in ``PagePool``, keys in ``PrefixIndex``,
shared memory in ``Arena`` (new extents from ``ExtentSupply``), page tables in
``SequenceTable``, leases in ``SessionRegistry``, pins in ``PinTable``, event counts in
``Counters``; request checks in kvd/cache/requests.py; new pages for a call, and what to give
up for them, from ``Room``; checksums in ``Integrity``;
the KV events routers hear in ``EventLog``. What follows a page being published, indexed,
unindexed or freed (its record, its KV event, the tiers) is ``PageEvents``'s, which the
pool tells (kvd/cache/page_events.py); the tiers below the cache plug in at ``Tiers.attach``
(kvd/tiers/tier.py), built from what ``tier_ports`` lends them (kvd/cache/ports.py).
A warm restart's findings arrive through ``Catalog.restore`` (kvd/durability/recovery.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kvd.cache.allocation import AllocationJob
from kvd.cache.aux_state import AuxBudget
from kvd.cache.catalog import Catalog
from kvd.cache.events import EventLog, Subscription
from kvd.cache.page_events import PageEvents
from kvd.cache.pins import PinTable
from kvd.cache.ports import TierPorts
from kvd.cache.prewarm import PROMPTS_PER_STEP, PrewarmResult, Prewarms
from kvd.cache.publishing import PublishJob
from kvd.cache.requests import (
    STEP_SECONDS,
    TOKEN_BYTES,
    Batch,
    ExtendResult,
    Limits,
    LookupResult,
    PinResult,
    PreparedRequest,
    PublishResult,
    SequencePlan,
    SequenceRequest,
    SequenceStatus,
    WithEvictions,
    check_batch,
    check_call,
    check_extend,
    check_seq_id,
    check_token_lists,
    prepare,
    publish_pages,
)
from kvd.cache.room import Room
from kvd.cache.sequences import Sequence, SequenceTable
from kvd.cache.sessions import Session, SessionRegistry
from kvd.cache.token_buffers import TokenBuffer
from kvd.config import AUX_BYTES
from kvd.core.arena import Arena, ExtentPlan
from kvd.core.counters import Counters
from kvd.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvd.core.eviction import release_order
from kvd.core.index import ExtraKey, Match
from kvd.core.namespaces import Namespace, NamespaceIdentity, NamespaceRegistry
from kvd.core.pool import PagePool
from kvd.core.supply import ExtentSupply
from kvd.core.types import SeqId, SequenceState, SessionId
from kvd.durability.integrity import Integrity
from kvd.tiers.tier import NO_TIERS, Miss, Tiers


class KVCacheManager:
    def __init__(
        self,
        arena: Arena,
        prefix_reuse: bool,
        limits: Limits | None = None,
        aux_budget: int = AUX_BYTES,
        events: EventLog | None = None,
    ) -> None:
        """``aux_budget``: bytes of non-KV state all sequences may hold together, on the daemon's
        heap beside the arena's budget; ``limits.max_aux_bytes`` bounds one sequence's;
        ``events``: the KV events log of this cache (kvd/cache/events.py)."""
        self.arena = arena
        self.prefix_reuse = prefix_reuse
        self.limits = limits or Limits()
        self.namespaces = NamespaceRegistry()
        self.events = events or EventLog()
        self.counters = Counters()
        self.pool = PagePool(self.counters)  # owns the index's entries
        self.index = self.pool.index
        self.integrity = Integrity(arena, self.pool, self.counters)
        self.tiers = Tiers()  # none until the launcher attaches one (kvd/server/daemon.py)
        self.page_events = PageEvents(self.integrity, self.events, self.tiers)
        self.pool.listener = self.page_events
        self.sequences = SequenceTable()
        self.sessions = SessionRegistry()
        self.pins = PinTable(self.pool)
        self.supply = ExtentSupply(arena, self.pool)
        self.room = Room(arena, self.pool, self.supply, self.sequences, self.sessions, self.counters, self.integrity)
        self.catalog = Catalog(arena, self.namespaces, self.pool, self.integrity, self.supply, self.counters)
        self.room.give_up_recovery = self.catalog.give_up_recovery
        # non-KV state of all sequences
        self.aux = AuxBudget(aux_budget, self.limits.max_aux_bytes, self.sequences)
        self.allocations: set[AllocationJob] = set()  # open jobs: their held hits are references
        self.prewarms = Prewarms(self.room, self.tiers, self.pins, self.match_prefix)

    def tier_ports(self) -> TierPorts:
        """What a tier built for this cache may use (kvd/cache/ports.py)."""
        return TierPorts(
            self.arena,
            self.pool,
            self.index,
            self.room,
            self.page_events,
            self.integrity,
            self.events,
            self.namespaces,
        )

    def close(self, unlink: bool = True) -> None:
        self.supply.close()
        self.integrity.close()
        self.arena.close(unlink=unlink)

    # ---- sessions -----------------------------------------------------------------

    def open_session(self, client_name: str, pid: int) -> Session:
        return self.sessions.open(client_name, pid)

    def close_session(self, session_id: SessionId, daemon_stopping: bool = False) -> None:
        """Drops every sequence and pin of the session."""
        session = self.sessions.get(session_id)
        owned = self.sequences.of_session(session.id)
        released = (len(owned), self.pins.drop_session(session.id))
        for seq in owned:
            self._drop(seq)
        self.sessions.remove(session, daemon_stopping, released)

    def session(self, session_id: str) -> Session:
        """The open session, or ``NotFound``: every call of a session checks it here first."""
        return self.sessions.get(session_id)

    def close_by_client(self, session_id: str) -> None:
        """CloseSession: the session's stream ends next, and the log says its client closed it."""
        self.sessions.get(session_id).closed_by_client = True

    def subscribe_events(self, session_id: str, from_seq: int | None) -> Subscription:
        """The session's tenant's KV events from now on, after the buffered ones from
        ``from_seq`` (kvd/cache/events.py)."""
        self.sessions.get(session_id)
        return self.events.subscribe(from_seq)

    def register_namespace(self, session_id: str, identity: NamespaceIdentity) -> Namespace:
        """``Catalog.register_namespace`` for a session."""
        self.sessions.get(session_id)
        return self.catalog.register_namespace(identity)

    def extents(self, session_id: str, namespace_id: int) -> list[ExtentPlan]:
        """``Catalog.extents`` for a session: the extents it maps to read and write pages."""
        self.sessions.get(session_id)
        return self.catalog.extents(namespace_id)

    def token_buffer(self, session_id: str) -> TokenBuffer | None:
        """The session's token buffer, None before it opens one (kvd/cache/token_buffers.py)."""
        return self.sessions.get(session_id).token_buffer

    def open_token_buffer(self, session_id: str, size: int) -> TokenBuffer:
        """A new token buffer for the session, replacing its earlier one (kvd/cache/token_buffers.py);
        at most the bytes of the largest call's token ids."""
        session = self.sessions.get(session_id)
        most = self.limits.max_call_tokens * TOKEN_BYTES
        if not 0 < size <= most:
            raise InvalidArgument(f"a token buffer holds 1 to {most} bytes (the largest call's token ids), not {size}")
        buffer = TokenBuffer.create(self.arena.name_prefix, size, self.arena.group)
        self.sessions.set_token_buffer(session, buffer)
        return buffer

    # ---- allocation ---------------------------------------------------------------

    def batch(self, namespace_id: int, requests: list[SequenceRequest], unique: bool = True) -> Batch:
        """The requests of an allocate (``unique`` ids) or a lookup, checked (``check_call``,
        ``Batch.of``)."""
        check_call(self.limits, requests)
        return Batch.of(self.limits, self.namespaces.get(namespace_id), requests, unique)

    def allocate(
        self, session_id: str, namespace_id: int, requests: list[SequenceRequest]
    ) -> WithEvictions[list[SequencePlan]]:
        """``allocate_batch`` of the requests, checked here."""
        self.sessions.get(session_id)
        return self.allocate_batch(session_id, self.batch(namespace_id, requests))

    def allocate_batch(self, session_id: str, batch: Batch) -> WithEvictions[list[SequencePlan]]:
        """Prefix hits pinned and private pages allocated for a batch, all or nothing, in one
        piece (``allocation`` and its commit).

        An EVICTED id re-enters: a new PREFILLED sequence under that id, with its aux state."""
        with self.allocation(session_id, batch) as job:
            return job.commit()

    def allocation(self, session_id: str, batch: Batch) -> AllocationJob:
        """The batch matched once, its room checked and its hits held (kvd/cache/allocation.py);
        raises before anything changes. The caller makes room in its ``steps`` (or not),
        then commits it, and closes it in any case (``with``)."""
        session = self.sessions.get(session_id)
        ns = batch.namespace
        return AllocationJob(
            session,
            batch,
            [self.match_prefix(ns, p) for p in batch.requests],
            pool=self.pool,
            room=self.room,
            sequences=self.sequences,
            sessions=self.sessions,
            events=self.events,
            tier=self.tiers if self.prefix_reuse else NO_TIERS,  # no matching, nothing for a tier to hear
            counters=self.counters.of(ns.id),
            jobs=self.allocations,
        )

    def lookup(self, session_id: str, namespace_id: int, requests: list[SequenceRequest]) -> list[LookupResult]:
        """The same matching as allocate, without pinning or allocating anything. With a tier
        below the cache, full pages past the local hit are fetched in the background (``Tiers.missed``) and
        ``remote_pending_tokens`` says how many may still come: ask again later."""
        self.sessions.get(session_id)
        batch = self.batch(namespace_id, requests, unique=False)
        return [x for part in self.lookup_parts(session_id, batch, float("inf")) for x in part]

    def lookup_parts(
        self, session_id: str, batch: Batch, seconds: float = STEP_SECONDS
    ) -> Iterator[list[LookupResult]]:
        """``lookup``'s results in parts of about ``seconds`` of matching each. A lookup
        changes nothing, so the caller may let other calls run between parts (4,096
        sequences with LoRA keys: ~12 ms); each result is what matching found when its part ran."""
        self.sessions.get(session_id)
        ns = batch.namespace
        part, deadline = [], time.perf_counter() + seconds
        for p in batch.requests:
            r = p.request
            found, pending = self.match_prefix(ns, p), 0
            if self.prefix_reuse:
                pending = self.tiers.missed(Miss(ns, p.chain, r.extra_keys, p.tokens, found.pages, found.keys))
            part.append(LookupResult(r.seq_id, found.pages, found.tokens(ns.page_size), pending))
            if time.perf_counter() > deadline:
                yield part
                part, deadline = [], time.perf_counter() + seconds
        yield part

    def namespace_named(self, namespace_id: int | None, identity: NamespaceIdentity | None) -> Namespace:
        """The registered namespace of an id or of an identity (a router knows the model, not
        the id); an identity never registered here is ``NotFound``, and registers nothing."""
        if identity is None:
            return self.namespaces.get(namespace_id or 0)
        ns = self.namespaces.find(identity)
        if ns is None:
            raise NotFound(
                f"no engine registered model {identity.model!r} (revision {identity.revision!r}) with this "
                "identity in this cache: nothing of it can be prewarmed"
            )
        return ns

    def prewarm(self, ns: Namespace, requests: list[SequenceRequest]) -> list[PrewarmResult]:
        """``prewarm_parts`` of the requests, checked here, at once (in-process callers)."""
        batch = self.batch(ns.id, requests, unique=False)
        return [x for part in self.prewarm_parts(batch) for x in part]

    def prewarm_parts(self, batch: Batch) -> Iterator[list[PrewarmResult]]:
        """The promotion of the prompts' full pages past their local hits from the tiers below,
        within the namespace's budget (kvd/cache/prewarm.py); needs no session. The batch is
        checked like a lookup's before any prompt is queued; then ``PROMPTS_PER_STEP`` prompts
        a part, between which the caller may let other calls run."""
        if not self.prefix_reuse:
            raise FailedPrecondition("prefix reuse is off in this daemon: nothing is matched, nothing is prewarmed")
        prompts = batch.requests
        for first in range(0, len(prompts), PROMPTS_PER_STEP):
            yield self.prewarms.request(batch.namespace, prompts[first : first + PROMPTS_PER_STEP])

    def publish(self, session_id: str, namespace_id: int, items: list[tuple[str, int]]) -> list[PublishResult]:
        """``publish_job`` done at once (in-process callers)."""
        return self.publish_job(session_id, namespace_id, items).run()

    def publish_job(self, session_id: str, namespace_id: int, items: list[tuple[str, int]]) -> PublishJob:
        """Makes full private pages immutable and shareable; dedups against equal published pages.

        ``items`` holds (seq_id, num_tokens); num_tokens 0 publishes every full page whose
        token ids are known, otherwise exactly the pages covering the first num_tokens.
        The whole request is checked here, before any page changes; the returned job
        publishes in steps (kvd/cache/publishing.py), so the loop serves other calls meanwhile.
        """
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        check_batch(self.limits, [seq_id for seq_id, _ in items])
        targets = []
        for seq_id, num_tokens in items:
            seq = self._live(ns, seq_id, session)
            upto = publish_pages(seq, num_tokens, ns.page_size)
            targets.append((seq, upto if self.prefix_reuse else 0))
        return PublishJob(ns, self.pool, self.index, self.sequences, self.events, self.page_events, targets)

    def extend(
        self, session_id: str, namespace_id: int, items: list[tuple[str, int, bytes | None]]
    ) -> WithEvictions[list[ExtendResult]]:
        """Room for more tokens (decode), always in private pages; all or nothing.

        One call per decode step for the whole batch, so the per-item work stays small: most
        items add one token that fits in the tail page and allocate nothing."""
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        limits, page_size = self.limits, ns.page_size
        check_batch(limits, [seq_id for seq_id, _, _ in items])
        check_token_lists(limits, ns, [(seq_id, tokens) for seq_id, _, tokens in items if tokens])
        plans = []
        for seq_id, num_tokens, tokens in items:
            seq = self._live(ns, seq_id, session)
            total = check_extend(limits, seq, num_tokens, tokens)
            plans.append((seq, total, tokens, -(-total // page_size) - len(seq.pages)))
        granted = self.room.grant(ns, [new_pages for _, _, _, new_pages in plans])
        results = []
        for (seq, total, tokens, _), pages in zip(plans, granted):
            seq.pages.extend(pages)
            seq.num_tokens = total
            if tokens:
                seq.tokens += tokens
            results.append(ExtendResult(seq.seq_id, pages, total))
        return WithEvictions(results, self.room.report_evictions(session))

    def fork(self, session_id: str, namespace_id: int, src_id: str, dst_id: str) -> WithEvictions[SequencePlan]:
        """dst shares src's published pages; src's private pages (its partial tail) are copied."""
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        src = self._live(ns, src_id, session)
        check_seq_id(self.limits, dst_id)
        if self.sequences.find(ns.id, dst_id) is not None:
            raise FailedPrecondition(f"cannot fork into {dst_id!r}: that sequence already exists")
        self.aux.check_room(len(src.aux))
        shared = src.shared_pages
        copies = src.private_pages
        [private] = self.room.grant(ns, [len(copies)], protect=src)
        self.pool.acquire_all(shared)
        for page, dst_page in zip(copies, private):
            self.arena.copy_page(page, dst_page)
        dst = Sequence(
            seq_id=SeqId(dst_id),
            namespace=ns.id,
            session=session.id,
            chain=src.chain,
            pages=shared + private,
            num_tokens=src.num_tokens,
            tokens=bytearray(src.tokens),
            keys=list(src.keys),
            shared_prefix_tokens=len(shared) * ns.page_size,
            aux=src.aux,
            extra_keys=src.extra_keys,
        )
        self.sequences.add(dst)
        plan = SequencePlan(
            dst.seq_id, list(shared), private, dst.shared_prefix_tokens, dst.shared_prefix_tokens, dst.num_tokens
        )
        return WithEvictions(plan, self.room.report_evictions(session))

    def release(self, session_id: str, namespace_id: int, seq_ids: list[str]) -> int:
        """Drops the sequences; returns how many page references were released."""
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        check_batch(self.limits, seq_ids)
        seqs = [self.sequences.owned(ns.id, s, session.id) for s in seq_ids]
        released = 0
        for seq in seqs:
            released += len(seq.pages)
            self._drop(seq)
        return released

    def set_state(self, session_id: str, namespace_id: int, seq_id: str, state: SequenceState) -> SequenceState:
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        return self._set_state(self.sequences.owned(ns.id, seq_id, session.id), state)

    def set_states(
        self, session_id: str, namespace_id: int, seq_ids: list[str], state: SequenceState
    ) -> list[SequenceState]:
        """Moves every sequence of the batch to `state`, or none of them (a refused transition
        raises before any changes); returns their previous states in order."""
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        check_batch(self.limits, seq_ids)
        seqs = [self.sequences.owned(ns.id, s, session.id) for s in seq_ids]
        for seq in seqs:
            self.sequences.check_transition(seq, state)
        return [self._set_state(seq, state) for seq in seqs]

    def _set_state(self, seq: Sequence, state: SequenceState) -> SequenceState:
        previous = seq.state
        self.sequences.set_state(seq, state)  # raises on an invalid transition
        if state is SequenceState.COMPLETED:
            self._drop(seq)
        return previous

    def describe(self, session_id: str, namespace_id: int, seq_ids: list[str]) -> list[SequenceStatus]:
        """The sequences' states and sizes, read without changing anything; all or nothing."""
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        check_batch(self.limits, seq_ids, unique=False)
        return [SequenceStatus.of(self.sequences.owned(ns.id, s, session.id)) for s in seq_ids]

    def set_aux(self, session_id: str, namespace_id: int, seq_id: str, data: bytes) -> None:
        """Stores the sequence's non-KV state (never shared; a fork copies it). It may be set in
        any state, EVICTED included: it is not KV, and it stays through re-entry (kvd/cache/aux_state.py)."""
        session = self.sessions.get(session_id)
        self.aux.set(self.sequences.owned(self.namespaces.get(namespace_id).id, seq_id, session.id), data)

    def get_aux(self, session_id: str, namespace_id: int, seq_id: str) -> bytes:
        session = self.sessions.get(session_id)
        return self.sequences.owned(self.namespaces.get(namespace_id).id, seq_id, session.id).aux

    # ---- pins ---------------------------------------------------------------------

    def pin(
        self, session_id: str, namespace_id: int, tokens: bytes, extra_keys: tuple[ExtraKey, ...], ttl_seconds: float
    ) -> PinResult:
        """Keeps the cached pages of a prefix from eviction until unpinned, expired or the session
        ends. Its full pages past them that a tier below holds are prewarmed (kvd/cache/prewarm.py),
        and the pin extends to them once they land: ``pending_tokens`` says how many may come."""
        session = self.sessions.get(session_id)
        ns = self.namespaces.get(namespace_id)
        if not ttl_seconds >= 0 or ttl_seconds == float("inf"):
            raise InvalidArgument(f"pin ttl must be a finite number of seconds ≥ 0, got {ttl_seconds}")
        p = prepare(self.limits, ns, SequenceRequest("pin", tokens, extra_keys))
        pages = self.match_prefix(ns, p).pages
        expires = time.monotonic() + ttl_seconds if ttl_seconds else None
        pin = self.pins.take(session.id, ns.id, pages, expires)
        pending = self.prewarms.request(ns, [p], pin.id)[0].pending_tokens if self.prefix_reuse else 0
        return PinResult(pin.id, list(pages), len(pages) * ns.page_size, pending)

    def unpin(self, session_id: str, pin_id: int) -> None:
        self.pins.drop(self.pins.of(self.sessions.get(session_id).id, pin_id))

    def expire_pins(self, now: float) -> int:
        """Drops the pins whose time to live ran out (the daemon's sweep calls this)."""
        return self.pins.expire(now)

    def _live(self, ns: Namespace, seq_id: str, session: Session) -> Sequence:
        seq = self.sequences.owned(ns.id, seq_id, session.id)
        if seq.state is SequenceState.EVICTED:
            raise FailedPrecondition(
                f"sequence {seq_id!r} was evicted under memory pressure; allocate it again to re-enter"
            )
        return seq

    def _drop(self, seq: Sequence) -> None:
        self.pool.release_all(release_order(seq.take_pages()))
        self.sequences.remove(seq)

    # ---- internals: matching ---------------------------------------------------

    def match_prefix(self, ns: Namespace, p: PreparedRequest) -> Match:
        """The request's longest run of full-page hits (a hit needs equal tokens, parent and
        extras); a miss without prefix reuse. Its lists are new: the caller's to keep."""
        if not self.prefix_reuse:
            return Match([], [])
        return self.index.match(p.chain, p.tokens, ns.page_size * TOKEN_BYTES, p.num_tokens // ns.page_size)
