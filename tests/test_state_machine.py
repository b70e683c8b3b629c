"""A hypothesis state machine driving the core against a small model of what it must do.

Two sessions, two namespaces with different page sizes (4 tokens in 512 bytes, 8 in 1024)
and a budget of twelve small pages, so prefix hits, dedup, LRU eviction, extent reclaim,
on-hold eviction and exhaustion all happen (a ``pressure`` rule makes sure of the last ones). After every step
the invariants of docs/architecture.md hold (``kvd.cache.invariants.violations``) and the core agrees with
the model: which sequences exist, their owner, state, length, known tokens and aux state,
and which pins each session holds. A call the model says must fail raises exactly that
error class and changes nothing; ResourceExhausted is the one outcome the model does not
predict, and it too must change nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import allocate_in_steps, identity
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_manager import snapshot, toks

import kvd.core.pool
from kvd.cache import invariants, stats
from kvd.cache.manager import KVCacheManager, SequenceRequest
from kvd.core.errors import FailedPrecondition, InvalidArgument, KVDError, NotFound, PermissionDenied, ResourceExhausted
from kvd.core.types import PageState, SequenceState

PAGE_SIZES = (4, 8)  # namespace 0: 512-byte pages, namespace 1: 1024-byte pages
PAGE_BYTES = (512, 1024)
BUDGET = 12 * 512
EXTENT = 4 * 512
SEQ_IDS = ("a", "b", "c", "d", "e", "f")
PREFIXES = [list(range(k * 1000 + 10, k * 1000 + 34)) for k in range(2)]
VALID = {
    SequenceState.PREFILLED: {SequenceState.IN_DECODE, SequenceState.ON_HOLD, SequenceState.COMPLETED},
    SequenceState.IN_DECODE: {SequenceState.ON_HOLD, SequenceState.COMPLETED},
    SequenceState.ON_HOLD: {SequenceState.IN_DECODE, SequenceState.COMPLETED},  # EVICTED: the daemon's move
    SequenceState.EVICTED: {SequenceState.COMPLETED},
    SequenceState.COMPLETED: set(),
}

prompt_parts = st.tuples(
    st.sampled_from([0, 0, 0, 1]),  # mostly one shared prefix, so hits happen
    st.sampled_from([8, 12, 16, 24]) | st.integers(0, 24),
    st.lists(st.integers(0, 3), max_size=5),
)
prompts = prompt_parts.map(lambda parts: PREFIXES[parts[0]][: parts[1]] + parts[2])
sessions = st.integers(0, 1)
namespaces = st.integers(0, 1)
seq_ids = st.sampled_from(SEQ_IDS)


@dataclass(frozen=True)
class ModelSeq:
    session: str
    state: SequenceState
    num_tokens: int
    tokens: tuple[int, ...]  # known token ids
    aux: bytes


@dataclass(frozen=True)
class ModelPin:
    session: str
    ttl: float  # 0: until unpinned


class CoreMachine(RuleBasedStateMachine):
    make_manager = None  # set by the test: the conftest fixture

    def __init__(self) -> None:
        super().__init__()
        self.m = type(self).make_manager(budget_bytes=BUDGET, extent_bytes=EXTENT)
        self.ns = [self.m.catalog.register_namespace(identity(page_size=ps)).id for ps in PAGE_SIZES]
        self.sids: list[str] = []
        self.open: list[bool] = []
        self.events: list[tuple[int, str]] = []
        for i in range(2):
            self.sids.append("")
            self.open.append(False)
            self._open(i)
        self.seqs: dict[tuple[int, str], ModelSeq] = {}  # (namespace index, seq id)
        self.pins: dict[int, ModelPin] = {}
        self.writes = 0

    def teardown(self) -> None:
        self.m.close()

    # ---- helpers ------------------------------------------------------------------

    def _open(self, i: int) -> None:
        session = self.m.open_session(f"client-{i}", 100 + i)
        session.listener = lambda ns, ids: self.events.extend((ns, s) for s in ids)
        self.sids[i], self.open[i] = session.id, True

    def call(self, fn, expected: type[KVDError] | None, may_exhaust: bool = False):
        """Runs a core call; returns its result, or None when it raised as the model allows."""
        before = snapshot(self.m)
        try:
            result = fn()
        except KVDError as e:
            allowed = isinstance(e, expected) if expected else (may_exhaust and isinstance(e, ResourceExhausted))
            assert allowed, f"raised {type(e).__name__} ({e}); the model expected {expected and expected.__name__}"
            assert snapshot(self.m) == before, f"a failed call ({type(e).__name__}: {e}) changed state"
            assert self.events == [], "a failed call evicted sequences"
            return None
        assert expected is None, f"succeeded; the model expected {expected.__name__}"
        return result

    def replied(self, done, i: int, n: int):
        """The result of a call that may evict; the evictions its reply names are the caller's own
        sequences (others' owners hear of theirs through the listener) and join ``events``."""
        if done is None:
            return None
        for s in done.evicted:
            assert self.seqs[(n, s)].session == self.sids[i], f"a reply named another session's {s}"
        self.events.extend((self.ns[n], s) for s in done.evicted)
        return done.result

    def session_error(self, i: int) -> type[KVDError] | None:
        return None if self.open[i] else NotFound

    def owned_error(self, i: int, n: int, seq_id: str, live: bool = False) -> type[KVDError] | None:
        """The error of SequenceTable.owned (and, with live, of evicted sequences)."""
        ms = self.seqs.get((n, seq_id))
        if ms is None:
            return NotFound
        if ms.session != self.sids[i]:
            return PermissionDenied
        if live and ms.state is SequenceState.EVICTED:
            return FailedPrecondition
        return None

    def pick(self, data) -> tuple[int, int, str]:
        """(session index, namespace index, seq id): mostly an existing sequence and its owner."""
        if self.seqs and data.draw(st.integers(0, 5), label="existing"):
            n, s = data.draw(st.sampled_from(sorted(self.seqs)), label="sequence")
            owner = self.sids.index(self.seqs[(n, s)].session)
            i = owner if data.draw(st.integers(0, 9), label="owner") else 1 - owner
            return i, n, s
        return data.draw(sessions, label="session"), data.draw(namespaces, label="ns"), data.draw(seq_ids, label="id")

    def must_hit(self, n: int, tokens: list[int]) -> int:
        """Full pages a request must hit: the published prefix of a live sequence with equal tokens."""
        ps, raw = PAGE_SIZES[n], toks(tokens)
        best = 0
        for seq in self.m.sequences:
            if seq.namespace != self.ns[n]:
                continue
            k = min(seq.num_published, len(tokens) // ps)
            while k > best and bytes(seq.tokens[: k * ps * 4]) != raw[: k * ps * 4]:
                k -= 1
            best = max(best, k)
        return best

    def check_hits(self, n: int, tokens: list[int], pages: list[int]) -> None:
        """Every hit holds exactly the request's tokens behind exactly the previous hit."""
        ps = PAGE_SIZES[n]
        parent = None
        for i, page in enumerate(pages):
            content = self.m.pool.content(page)
            assert content is not None and content.tokens == toks(tokens[i * ps : (i + 1) * ps]), f"wrong hit {page}"
            assert content.parent == parent, f"hit {page} follows page {content.parent}, not {parent}"
            parent = page

    def fresh_private(self, pages: list[int]) -> None:
        for page in pages:
            assert self.m.pool.state(page) is PageState.PRIVATE and self.m.pool.refcount(page) == 1

    def write(self, pages: list[int]) -> None:
        """Stands in for prefill and decode writes: private pages only."""
        for page in pages:
            self.writes += 1
            self.m.arena.page_bytes_view(page)[:] = self.writes % 251

    # ---- rules --------------------------------------------------------------------

    @initialize(
        n=namespaces, batch=st.lists(st.tuples(seq_ids, prompts), min_size=1, max_size=2, unique_by=lambda r: r[0])
    )
    def seed(self, n, batch):
        """Starts every run with a few live sequences in each session."""
        for i in range(2):
            self.allocate(i, (n + i) % 2, [(s, p[:12]) for s, p in batch], bad=2, then_publish=True)

    @rule(
        i=sessions,
        n=namespaces,
        bad=st.integers(0, 11),
        then_publish=st.booleans(),
        batch=st.lists(st.tuples(seq_ids, prompts), min_size=1, max_size=3, unique_by=lambda r: r[0]),
        stepped=st.booleans(),
    )
    def allocate(self, i, n, batch, bad, then_publish=False, stepped=False):
        """``stepped``: room made in steps, as the daemon does (kvd/cache/allocation.py); its hits
        must be what lookup found, whatever it evicts."""
        if bad == 1:  # a duplicate id
            batch = batch + batch[:1]
        requests = [SequenceRequest(s, toks(p)) for s, p in batch]
        if bad == 0:  # a negative token id in the last request
            requests[-1] = SequenceRequest(batch[-1][0], toks(batch[-1][1] + [-1]))
        ids = [s for s, _ in batch]
        expected = self.session_error(i)
        if expected is None and bad in (0, 1):
            expected = InvalidArgument
        for s in ids:
            if expected is None and (n, s) in self.seqs:
                expected = self.owned_error(i, n, s) or (
                    None if self.seqs[(n, s)].state is SequenceState.EVICTED else FailedPrecondition
                )
        must = [self.must_hit(n, p) for _, p in batch]
        # allocate matches exactly as lookup does; lookup changes nothing (see the lookup rule)
        looked_up = [r.hit_pages for r in self.m.lookup(self.sids[i], self.ns[n], requests)] if expected is None else []
        allocate = allocate_in_steps if stepped else KVCacheManager.allocate
        plans = self.call(lambda: allocate(self.m, self.sids[i], self.ns[n], requests), expected, may_exhaust=True)
        plans = self.replied(plans, i, n)
        if plans is None:
            return
        ps = PAGE_SIZES[n]
        for (s, p), plan, least, hits in zip(batch, plans, must, looked_up):
            assert plan.seq_id == s and plan.num_tokens == len(p)
            assert plan.shared_pages == hits
            assert len(plan.pages) == -(-len(p) // ps)
            assert plan.shared_prefix_tokens == plan.suffix_start == len(plan.shared_pages) * ps
            assert len(plan.shared_pages) >= least, f"{s}: {len(plan.shared_pages)} hits, {least} were published"
            self.check_hits(n, p, plan.shared_pages)
            self.fresh_private(plan.private_pages)
            self.write(plan.private_pages)
            aux = f"{s}@{self.writes}".encode()
            self.m.set_aux(self.sids[i], self.ns[n], s, aux)
            self.seqs[(n, s)] = ModelSeq(self.sids[i], SequenceState.PREFILLED, len(p), tuple(p), aux)
        for s, _ in batch if then_publish else ():  # prefill done: its full pages become shareable
            self._publish(i, n, s, 0)

    @rule(i=sessions, n=namespaces, share=st.sampled_from([0.25, 0.5, 0.75, 1.0]), hold=st.booleans())
    def pressure(self, i, n, share, hold):
        """A large unrelated prompt: evicts what the policy allows (LRU, reclaim, on-hold), then goes."""
        running = [
            s
            for (m, s), ms in sorted(self.seqs.items())
            if m == n and ms.session == self.sids[i] and ms.state in (SequenceState.PREFILLED, SequenceState.IN_DECODE)
        ]
        if hold and running:  # the scheduler parks a sequence first
            self.m.set_state(self.sids[i], self.ns[n], running[0], SequenceState.ON_HOLD)
            self.seqs[(n, running[0])] = replace(self.seqs[(n, running[0])], state=SequenceState.ON_HOLD)
        pages = max(1, int(share * BUDGET // PAGE_BYTES[n]))
        tokens = toks(range(500, 500 + pages * PAGE_SIZES[n]))
        plans = self.call(
            lambda: self.m.allocate(self.sids[i], self.ns[n], [SequenceRequest("big", tokens)]),
            self.session_error(i),
            may_exhaust=True,
        )
        plans = self.replied(plans, i, n)
        if plans is not None:
            assert plans[0].shared_pages == [] and len(plans[0].private_pages) == pages
            self.fresh_private(plans[0].private_pages)
            assert self.m.release(self.sids[i], self.ns[n], ["big"]) == pages

    @rule(i=sessions, n=namespaces, p=prompts)
    def lookup(self, i, n, p):
        least = self.must_hit(n, p)
        before = snapshot(self.m)
        result = self.call(
            lambda: self.m.lookup(self.sids[i], self.ns[n], [SequenceRequest("probe", toks(p))]), self.session_error(i)
        )
        if result is not None:
            assert snapshot(self.m) == before, "lookup changed state"
            assert len(result[0].hit_pages) >= least
            self.check_hits(n, p, result[0].hit_pages)

    @rule(data=st.data(), pages=st.integers(-1, 7) | st.just(0))
    def publish(self, data, pages):
        self._publish(*self.pick(data), pages)

    def _publish(self, i, n, s, pages):
        ps = PAGE_SIZES[n]
        expected = self.session_error(i) or self.owned_error(i, n, s, live=True)
        ms = self.seqs.get((n, s))
        if expected is None and pages:
            if pages < 0 or pages * ps > ms.num_tokens:
                expected = InvalidArgument
            elif pages * ps > len(ms.tokens):
                expected = FailedPrecondition
        seq = self.m.sequences.find(self.ns[n], s)
        before = seq.num_published if seq else 0
        results = self.call(lambda: self.m.publish(self.sids[i], self.ns[n], [(s, pages * ps)]), expected)
        if results is None:
            return
        upto = pages if pages else min(ms.num_tokens, len(ms.tokens)) // ps
        [result] = results
        assert result.published_pages == max(0, upto - before)
        seq = self.m.sequences.find(self.ns[n], s)
        for rebind in result.rebinds:
            assert before <= rebind.position < seq.num_published
            assert seq.pages[rebind.position] == rebind.new_page != rebind.old_page
            assert self.m.pool.state(rebind.old_page) is PageState.FREE

    @rule(data=st.data(), grow=st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=2))
    def extend(self, data, grow):
        i, n, first = self.pick(data)
        ids = [first] + [data.draw(seq_ids | st.sampled_from([s for m, s in sorted(self.seqs) if m == n] or [first]))]
        items = [(s, k, given) for s, (k, given) in zip(ids, grow)]
        expected = self.session_error(i)
        if expected is None and len({s for s, _, _ in items}) < len(items):
            expected = InvalidArgument
        new_tokens = {s: [7] * k for s, k, given in items if given}
        for s, k, given in items:
            if expected is not None:
                break
            ms = self.seqs.get((n, s))
            expected = self.owned_error(i, n, s, live=True)
            if expected is None and ms.state not in (SequenceState.PREFILLED, SequenceState.IN_DECODE):
                expected = FailedPrecondition
            elif expected is None and k <= 0:
                expected = InvalidArgument
            elif expected is None and given and k and len(ms.tokens) != ms.num_tokens:
                expected = FailedPrecondition
        call_items = [(s, k, toks(new_tokens[s]) if given else None) for s, k, given in items]
        results = self.call(lambda: self.m.extend(self.sids[i], self.ns[n], call_items), expected, may_exhaust=True)
        results = self.replied(results, i, n)
        if results is None:
            return
        for (s, k, _given), result in zip(items, results):
            ms = self.seqs[(n, s)]
            ms = replace(ms, num_tokens=ms.num_tokens + k, tokens=ms.tokens + tuple(new_tokens.get(s, ())))
            self.seqs[(n, s)] = ms
            assert result.num_tokens == ms.num_tokens
            self.fresh_private(result.new_pages)
            self.write(result.new_pages)

    @rule(data=st.data(), dst=seq_ids)
    def fork(self, data, dst):
        i, n, src = self.pick(data)
        expected = self.session_error(i) or self.owned_error(i, n, src, live=True)
        if expected is None and (n, dst) in self.seqs:
            expected = FailedPrecondition
        plan = self.call(lambda: self.m.fork(self.sids[i], self.ns[n], src, dst), expected, may_exhaust=True)
        plan = self.replied(plan, i, n)
        if plan is None:
            return
        source = self.m.sequences.find(self.ns[n], src)
        assert plan.shared_pages == source.shared_pages
        assert len(plan.private_pages) == len(source.private_pages)
        self.fresh_private(plan.private_pages)
        for mine, theirs in zip(plan.private_pages, source.private_pages):
            assert np.array_equal(self.m.arena.page_bytes_view(mine), self.m.arena.page_bytes_view(theirs))
        self.seqs[(n, dst)] = replace(self.seqs[(n, src)], state=SequenceState.PREFILLED)
        self.write(plan.private_pages)  # dst diverges; src's pages must not change

    @rule(data=st.data(), more=st.lists(seq_ids, max_size=1))
    def release(self, data, more):
        i, n, s = self.pick(data)
        ids = [s] + more
        expected = self.session_error(i)
        if expected is None and len(set(ids)) < len(ids):
            expected = InvalidArgument
        for s in ids:
            expected = expected or self.owned_error(i, n, s)
        pages = sum(len(self.m.sequences.find(self.ns[n], s).pages) for s in ids) if expected is None else 0
        released = self.call(lambda: self.m.release(self.sids[i], self.ns[n], ids), expected)
        if released is not None:
            assert released == pages
            for s in ids:
                del self.seqs[(n, s)]

    @rule(data=st.data(), any_state=st.integers(0, 3))
    def set_state(self, data, any_state):
        i, n, s = self.pick(data)
        expected = self.session_error(i) or self.owned_error(i, n, s)
        ms = self.seqs.get((n, s))
        valid = sorted(VALID[ms.state], key=lambda x: x.value) if ms else []
        to = data.draw(st.sampled_from(valid) if valid and any_state else st.sampled_from(list(SequenceState)))
        if expected is None and to not in VALID[ms.state]:
            expected = FailedPrecondition
        previous = self.call(lambda: self.m.set_state(self.sids[i], self.ns[n], s, to), expected)
        if previous is None:
            return
        assert previous is ms.state
        if to is SequenceState.COMPLETED:
            del self.seqs[(n, s)]
        else:
            self.seqs[(n, s)] = replace(ms, state=to)

    @rule(i=sessions, n=namespaces, p=prompts, ttl=st.sampled_from([0.0, 10.0, 1000.0]))
    def pin(self, i, n, p, ttl):
        result = self.call(lambda: self.m.pin(self.sids[i], self.ns[n], toks(p), (), ttl), self.session_error(i))
        if result is not None:
            assert len(result.pages) >= self.must_hit(n, p)
            self.check_hits(n, p, result.pages)
            self.pins[result.pin_id] = ModelPin(self.sids[i], ttl)

    @precondition(lambda self: self.pins)
    @rule(i=sessions, data=st.data())
    def unpin(self, i, data):
        pin_id = data.draw(st.sampled_from(sorted(self.pins)) | st.just(10_000))
        pin = self.pins.get(pin_id)
        expected = self.session_error(i) or (
            NotFound if pin is None else PermissionDenied if pin.session != self.sids[i] else None
        )
        self.call(lambda: self.m.unpin(self.sids[i], pin_id), expected)
        if expected is None:
            del self.pins[pin_id]

    @rule(advance=st.sampled_from([1.0, 100.0, 10_000.0]))
    def expire_pins(self, advance):
        due = [p for p, pin in self.pins.items() if pin.ttl and pin.ttl <= advance]
        assert self.m.expire_pins(time.monotonic() + advance) == len(due)
        for p in due:
            del self.pins[p]

    @rule(i=sessions, roll=st.integers(0, 7))
    def close_session(self, i, roll):
        """Now and then closes a session or reopens a closed one; it mostly comes back at once."""
        if not self.open[i]:
            self._open(i)
            return
        if roll > 1:
            return
        sid = self.sids[i]
        self.m.close_session(sid)
        self.open[i] = False
        self.seqs = {k: v for k, v in self.seqs.items() if v.session != sid}
        self.pins = {k: v for k, v in self.pins.items() if v.session != sid}
        self.call(lambda: self.m.close_session(sid), NotFound)
        if roll:
            self._open(i)

    # ---- after every step ---------------------------------------------------------

    @invariant()
    def after_every_step(self):
        self.apply_evictions()
        assert invariants.violations(self.m) == []
        self.core_agrees_with_model()
        self.published_pages_are_unique_and_stats_add_up()

    def apply_evictions(self):
        """The listener names every sequence evicted under pressure; those were ON_HOLD."""
        for ns_id, s in self.events:
            key = (self.ns.index(ns_id), s)
            ms = self.seqs[key]
            assert ms.state is SequenceState.ON_HOLD, f"{s} evicted while {ms.state.name}"
            self.seqs[key] = replace(ms, state=SequenceState.EVICTED, num_tokens=0, tokens=())
        self.events.clear()

    def core_agrees_with_model(self):
        seen = {}
        for seq in self.m.sequences:
            n = self.ns.index(seq.namespace)
            seen[(n, seq.seq_id)] = ModelSeq(
                seq.session, seq.state, seq.num_tokens, tuple(np.frombuffer(bytes(seq.tokens), "<i4").tolist()), seq.aux
            )
            assert len(seq.pages) == -(-seq.num_tokens // PAGE_SIZES[n])
            # published pages hold the sequence's own tokens, chained (invariant 6)
            self.check_hits(n, list(np.frombuffer(bytes(seq.tokens), "<i4")), seq.shared_pages)
            assert [self.m.pool.content(p).key for p in seq.shared_pages] == seq.keys
        assert seen == self.seqs
        pins = {pin.id: ModelPin(pin.session, 0) for pin in self.m.pins}
        assert pins.keys() == self.pins.keys()
        assert all(self.pins[p].session == pins[p].session for p in pins)
        assert sorted(s.id for s in self.m.sessions) == sorted(sid for sid, o in zip(self.sids, self.open) if o)

    def published_pages_are_unique_and_stats_add_up(self):
        for ns_id in self.ns:
            # publish dedups: no two published pages hold the same content (physical == ideal)
            contents = [
                (c.tokens, c.parent, c.local)
                for p, s, _, _, n in self.m.pool.pages()
                if n == ns_id and s in (PageState.PUBLISHED, PageState.CACHED)
                for c in [self.m.pool.content(p)]
            ]
            assert len(set(contents)) == len(contents), "two published pages hold the same content"
        totals = stats.collect(self.m).totals
        assert totals.logical_pages == sum(len(s.pages) for s in self.m.sequences)
        assert totals.physical_pages <= totals.logical_pages
        assert totals.sequences == len(self.seqs)


# A failure shrinks for up to hypothesis' own limit of 5 minutes; let it finish.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("batch_pages", [kvd.core.pool.BATCH_PAGES, 1], ids=["pool-default", "pool-arrays"])
def test_core_state_machine(make_manager, monkeypatch, batch_pages):
    """Once as the daemon runs, once with every page batch on the pool's array path (the
    machine's batches are smaller than ``BATCH_PAGES``)."""
    monkeypatch.setattr(kvd.core.pool, "BATCH_PAGES", batch_pages)
    CoreMachine.make_manager = staticmethod(make_manager)
    try:
        run_state_machine_as_test(
            CoreMachine,
            settings=settings(
                max_examples=60,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        CoreMachine.make_manager = None
