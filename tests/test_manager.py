"""Unit tests of the cache's calls: a KVCacheManager over real shared memory, no process
boundary (tests/cores.py). Refcounts are tested beside the pool (test_pool.py), eviction
beside the room (test_room.py), publishing in test_publishing.py.
"""

from __future__ import annotations

import time
from concurrent import futures

import numpy as np
import pytest
from conftest import STATE_STEPS, budget_for, identity
from cores import PAGE_BYTES, PAGE_SIZE, Core, check, evict, prompt, req, settle, snapshot, toks

from kvd.cache import invariants, stats
from kvd.cache.manager import Limits, PublishResult, SequenceRequest
from kvd.core.arena import leftover_segments
from kvd.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvd.core.types import PageState, SequenceState

# ---- allocate_with_prefix -----------------------------------------------------------


def test_fresh_prompt_gets_private_pages_in_free_list_order(make_manager):
    c = Core(make_manager)
    plan = c.alloc1("a", prompt(0, 10))
    assert (plan.shared_pages, plan.private_pages) == ([], [0, 1, 2])
    assert (plan.shared_prefix_tokens, plan.suffix_start, plan.num_tokens) == (0, 0, 10)
    assert c.m.pool.state(0) is PageState.PRIVATE and c.refcounts([0, 1, 2]) == [1, 1, 1]
    check(c.m)


def test_allocate_hits_the_longest_run_of_full_pages(make_manager):
    c = Core(make_manager)
    a = prompt(0, 12)
    c.alloc1("a", a)
    assert c.publish("a")[0].published_pages == 3
    plan = c.alloc1("b", a[:8] + prompt(100, 6))
    assert (plan.shared_pages, plan.private_pages) == ([0, 1], [3, 4])
    assert (plan.shared_prefix_tokens, plan.suffix_start, plan.num_tokens) == (8, 8, 14)
    # a mismatch in page 1 ends the run even though page 2 matches again
    plan = c.alloc1("c", a[:4] + prompt(200, 4) + a[8:12])
    assert (plan.shared_pages, plan.private_pages) == ([0], [5, 6])
    assert c.refcounts([0, 1, 2]) == [3, 2, 1]
    check(c.m)


def test_partial_last_page_is_always_private(make_manager):
    c = Core(make_manager)
    a = prompt(0, 10)
    c.alloc1("a", a)
    assert c.publish("a")[0].published_pages == 2  # page 2 holds 2 tokens: stays private
    assert c.m.pool.state(2) is PageState.PRIVATE
    with pytest.raises(InvalidArgument, match="only full pages"):
        c.publish("a", num_tokens=10)
    plan = c.alloc1("b", a)
    assert (plan.shared_pages, plan.private_pages, plan.suffix_start) == ([0, 1], [3], 8)
    assert c.refcounts([2, 3]) == [1, 1]
    check(c.m)


def test_full_hit_shares_every_page(make_manager):
    c = Core(make_manager)
    a = prompt(0, 8)
    c.alloc1("a", a)
    c.publish("a")
    plan = c.alloc1("b", a)
    assert (plan.shared_pages, plan.private_pages) == ([0, 1], [])
    assert plan.shared_prefix_tokens == plan.suffix_start == plan.num_tokens == 8
    assert c.seq("b").num_published == 2
    check(c.m)


def test_hits_are_pinned_before_room_is_made(make_manager):
    c = Core(make_manager, pages=4)
    a = prompt(0, 8)
    c.alloc1("a", a)
    c.publish("a")
    c.release("a")
    assert c.lru() == [1, 0]
    # the cached hits of b cannot be evicted to make room for c in the same batch
    with pytest.raises(ResourceExhausted):
        c.alloc(req("c", prompt(50, 12)), req("b", a + [9]))
    plans = c.alloc(req("c", prompt(50, 4)), req("b", a + [9]))
    assert [(p.shared_pages, p.private_pages) for p in plans] == [([], [2]), ([0, 1], [3])]
    assert c.lru() == [] and c.refcounts([0, 1]) == [1, 1]
    check(c.m)


def test_batch_that_does_not_fit_changes_nothing(make_manager):
    c = Core(make_manager, pages=6)
    a, b = prompt(0, 8), prompt(100, 4)
    c.alloc(req("a", a), req("b", b))  # pages 0, 1 | 2
    c.publish("a", "b")
    c.release("a", "b")
    assert c.lru() == [1, 0, 2]
    c.alloc1("live", prompt(200, 6))  # pages 3, 4; free: 5
    before = snapshot(c.m)
    # 2 hits on the oldest cached pages, then 1 + 3 pages needed: 1 free + 1 cached is too little
    with pytest.raises(ResourceExhausted, match="needs 4 more pages"):
        c.alloc(req("x", a + [1]), req("y", prompt(300, 12)))
    assert snapshot(c.m) == before
    check(c.m)


OK = req("ok", [1, 2])
BAD_BATCHES = {  # (batch, error, message); vocab_size 100, at most 2 sequences per batch
    "ragged token bytes": (
        [OK, SequenceRequest("bad", b"\x01\x00\x00\x00\x02")],
        InvalidArgument,
        "not a multiple of 4",
    ),
    "negative token id": ([OK, req("bad", [1, -3])], InvalidArgument, "token id -3 at position 1"),
    "token id at vocab_size": (
        [OK, req("bad", [99, 100])],
        InvalidArgument,
        r"token id 100 at position 1 is out of range \[0, 100\)",
    ),
    "duplicate seq id": ([OK, req("ok", [3])], InvalidArgument, "appears twice"),
    "empty seq id": ([OK, req("", [3])], InvalidArgument, "1 to 256 characters"),
    "oversize batch": ([req(f"s{i}", [i]) for i in range(3)], InvalidArgument, "batch of 3 sequences"),
    "sequence of another session": ([OK, req("theirs", [3])], PermissionDenied, "another session"),
    "existing sequence": ([OK, req("mine", [3])], FailedPrecondition, "already exists"),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_request_anywhere_in_a_batch_changes_nothing(make_manager, case):
    c = Core(make_manager, vocab_size=100)
    c.m.limits = Limits(max_batch_sequences=2)
    other = c.m.open_session("other", 2).id
    c.alloc1("mine", prompt(0, 6))
    c.publish("mine")
    c.alloc(req("theirs", prompt(0, 5)), sid=other)
    batch, error, message = BAD_BATCHES[case]
    before = snapshot(c.m)
    with pytest.raises(error, match=message):
        c.alloc(*batch)
    assert snapshot(c.m) == before
    check(c.m)


def test_unknown_namespace_or_session_is_not_found(make_manager):
    c = Core(make_manager)
    before = snapshot(c.m)
    with pytest.raises(NotFound, match="namespace 7 is not registered"):
        c.m.allocate(c.sid, 7, [req("a", [1])])
    with pytest.raises(NotFound, match="unknown session"):
        c.m.allocate("0" * 32, c.ns, [req("a", [1])])
    assert snapshot(c.m) == before


# ---- fork ---------------------------------------------------------------------------


def test_fork_shares_published_pages_and_copies_the_tail(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 10))  # 0 1 | 2
    c.publish("a")
    pattern = np.arange(PAGE_BYTES, dtype=np.uint32).astype(np.uint8)
    c.m.arena.page_bytes_view(2)[:] = pattern
    c.m.set_aux(c.sid, c.ns, "a", b"recurrent-state")
    plan = c.fork("a", "b")
    assert (plan.shared_pages, plan.private_pages) == ([0, 1], [3])
    assert (plan.shared_prefix_tokens, plan.suffix_start, plan.num_tokens) == (8, 8, 10)
    assert np.array_equal(c.m.arena.page_bytes_view(3), pattern)
    assert c.m.get_aux(c.sid, c.ns, "b") == b"recurrent-state"
    assert c.refcounts([0, 1, 2, 3]) == [2, 2, 1, 1]
    check(c.m)
    # independent afterwards
    c.m.arena.page_bytes_view(3)[:] = 7
    assert np.array_equal(c.m.arena.page_bytes_view(2), pattern)
    c.m.set_aux(c.sid, c.ns, "b", b"other")
    assert c.m.get_aux(c.sid, c.ns, "a") == b"recurrent-state"
    c.extend(("b", 3, toks([1, 2, 3])))
    assert c.seq("a").num_tokens == 10 and c.seq("a").pages == [0, 1, 2]
    assert c.seq("b").num_tokens == 13 and c.seq("b").pages == [0, 1, 3, 4]
    c.release("a")
    assert c.refcounts([0, 1]) == [1, 1] and c.m.pool.state(2) is PageState.FREE
    check(c.m)


def test_fork_errors_change_nothing(make_manager):
    c = Core(make_manager)
    other = c.m.open_session("other", 2).id
    c.alloc(req("a", prompt(0, 6)), req("b", [1]))
    c.alloc(req("theirs", [1]), sid=other)
    before = snapshot(c.m)
    for src, dst, error in [
        ("a", "b", FailedPrecondition),
        ("a", "theirs", FailedPrecondition),
        ("zz", "c", NotFound),
        ("a", "", InvalidArgument),
    ]:
        with pytest.raises(error):
            c.fork(src, dst)
    with pytest.raises(PermissionDenied):
        c.fork("theirs", "c")
    assert snapshot(c.m) == before


def test_fork_of_an_on_hold_sequence_evicts_others_not_it(make_manager):
    c = Core(make_manager, pages=4)
    c.alloc(req("a", prompt(0, 6)), req("h", prompt(100, 8)))  # a: 0 1, h: 2 3
    c.m.set_state(c.sid, c.ns, "a", SequenceState.ON_HOLD)  # a is the oldest on hold
    c.m.set_state(c.sid, c.ns, "h", SequenceState.ON_HOLD)
    c.m.arena.page_bytes_view(0)[:] = 8
    c.m.arena.page_bytes_view(1)[:] = 9
    plan = c.fork("a", "b")
    assert c.replied == [["h"]] and c.seq("a").state is SequenceState.ON_HOLD
    assert plan.private_pages == [2, 3]
    assert [int(c.m.arena.page_bytes_view(p).min()) for p in (2, 3)] == [8, 9]
    assert [int(c.m.arena.page_bytes_view(p).max()) for p in (2, 3)] == [8, 9]
    check(c.m)


def test_fork_of_an_on_hold_sequence_never_evicts_it(make_manager):
    c = Core(make_manager, pages=3)
    c.alloc(req("a", prompt(0, 6)), req("busy", [1]))  # a: 0 1, busy: 2
    c.m.set_state(c.sid, c.ns, "a", SequenceState.ON_HOLD)
    before = snapshot(c.m)
    with pytest.raises(ResourceExhausted):
        c.fork("a", "b")
    assert snapshot(c.m) == before and c.evicted == []


# ---- extend -------------------------------------------------------------------------


def test_extend_adds_private_pages_only(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 8))
    c.publish("a")
    results = [c.extend(("a", n, None))[0] for n in (1, 3, 1)]
    assert [(r.new_pages, r.num_tokens) for r in results] == [([2], 9), ([], 12), ([3], 13)]
    assert [c.m.pool.state(p) for p in c.seq("a").pages] == [PageState.PUBLISHED] * 2 + [PageState.PRIVATE] * 2
    check(c.m)


def test_extend_is_all_or_nothing(make_manager):
    c = Core(make_manager, pages=4)
    c.alloc(req("a", prompt(0, 4)), req("b", prompt(10, 4)), req("h", [1]))
    c.m.set_state(c.sid, c.ns, "h", SequenceState.IN_DECODE)
    c.m.set_state(c.sid, c.ns, "h", SequenceState.ON_HOLD)
    before = snapshot(c.m)
    bad = [
        ([("a", 4, None), ("b", 5, None)], ResourceExhausted),  # 1 + 2 pages, only 1 free + h's page
        ([("a", 1, None), ("h", 1, None)], FailedPrecondition),
        ([("a", 1, None), ("b", 0, None)], InvalidArgument),
        ([("a", 1, None), ("b", 2, toks([1]))], InvalidArgument),
        ([("a", 1, None), ("b", 1, toks([-1]))], InvalidArgument),
        ([("a", 1, None), ("a", 1, None)], InvalidArgument),
        ([("a", 1, None), ("zz", 1, None)], NotFound),
    ]
    for items, error in bad:
        with pytest.raises(error):
            c.m.extend(c.sid, c.ns, items)
        assert snapshot(c.m) == before, items
    results = c.extend(("a", 4, None), ("b", 1, None))  # 2 pages: free 3, evict h
    assert [r.new_pages for r in results] == [[2], [3]]
    assert c.replied == [["h"]]
    check(c.m)


def test_extend_records_token_ids_so_decode_pages_can_be_published(make_manager):
    c = Core(make_manager)
    a = prompt(0, 8)
    c.alloc1("a", a)
    c.publish("a")
    c.extend(("a", 4, toks([90, 91, 92, 93])))
    assert bytes(c.seq("a").tokens) == toks(a + [90, 91, 92, 93])
    assert c.publish("a")[0].published_pages == 1
    assert c.alloc1("b", a + [90, 91, 92, 93]).shared_pages == [0, 1, 2]
    check(c.m)


def test_token_ids_cannot_follow_a_gap(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 4))
    c.extend(("a", 4, None))
    before = snapshot(c.m)
    with pytest.raises(FailedPrecondition, match="never given"):
        c.extend(("a", 1, toks([5])))
    with pytest.raises(FailedPrecondition, match="unknown"):
        c.publish("a", num_tokens=8)
    assert snapshot(c.m) == before
    assert c.publish("a")[0].published_pages == 1  # only the pages whose ids are known
    check(c.m)


# ---- set_state ----------------------------------------------------------------------

VALID = {  # the README's table: ON_HOLD → EVICTED is the daemon's, never a client's
    SequenceState.PREFILLED: {SequenceState.IN_DECODE, SequenceState.ON_HOLD, SequenceState.COMPLETED},
    SequenceState.IN_DECODE: {SequenceState.ON_HOLD, SequenceState.COMPLETED},
    SequenceState.ON_HOLD: {SequenceState.IN_DECODE, SequenceState.COMPLETED},
    SequenceState.EVICTED: {SequenceState.COMPLETED},
    SequenceState.COMPLETED: set(),
}


def to_state(c: Core, seq_id: str, state: SequenceState) -> None:
    """Moves the PREFILLED ``seq_id`` to ``state`` the way a client and the daemon would."""
    for step in STATE_STEPS[state]:
        c.m.set_state(c.sid, c.ns, seq_id, step)
    if state is SequenceState.EVICTED:
        evict(c, seq_id)


def test_the_full_life_cycle(make_manager):
    c = Core(make_manager, pages=16)
    c.alloc1("a", prompt(0, 6))
    chain = [
        SequenceState.IN_DECODE,
        SequenceState.ON_HOLD,
        SequenceState.IN_DECODE,
        SequenceState.ON_HOLD,
    ]
    previous = SequenceState.PREFILLED
    for state in chain:
        assert c.m.set_state(c.sid, c.ns, "a", state) is previous
        assert c.seq("a").state is state
        previous = state
        check(c.m)
    evict(c, "a")
    check(c.m)
    assert c.m.set_state(c.sid, c.ns, "a", SequenceState.COMPLETED) is SequenceState.EVICTED
    assert c.seq("a") is None
    with pytest.raises(NotFound):
        c.m.set_state(c.sid, c.ns, "a", SequenceState.IN_DECODE)


@pytest.mark.parametrize("start", list(VALID), ids=lambda s: s.name)
@pytest.mark.parametrize("target", list(SequenceState), ids=lambda s: s.name)
def test_every_transition(make_manager, start, target):
    c = Core(make_manager, pages=16)
    c.alloc1("a", prompt(0, 6))
    c.publish("a")
    to_state(c, "a", start)
    if target not in VALID[start]:
        before = snapshot(c.m)
        error, words = (
            (NotFound, "already released or completed")
            if start is SequenceState.COMPLETED
            else (FailedPrecondition, f"cannot go from {start.name} to {target.name}")
        )
        with pytest.raises(error, match=words):
            c.m.set_state(c.sid, c.ns, "a", target)
        assert snapshot(c.m) == before
        return
    assert c.m.set_state(c.sid, c.ns, "a", target) is start
    if target is SequenceState.COMPLETED:
        assert c.seq("a") is None and c.m.sequences.of_session(c.sid) == []
    else:
        assert c.seq("a").state is target
    check(c.m)


def test_completed_releases_the_sequence(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 6))
    c.publish("a")
    c.m.set_state(c.sid, c.ns, "a", SequenceState.IN_DECODE)
    c.m.set_state(c.sid, c.ns, "a", SequenceState.COMPLETED)
    assert c.m.pool.state(0) is PageState.CACHED and c.m.pool.state(1) is PageState.FREE
    assert c.seq("a") is None and len(c.m.sequences) == 0
    with pytest.raises(NotFound):
        c.m.get_aux(c.sid, c.ns, "a")
    check(c.m)


def test_set_state_on_another_sessions_sequence_is_denied(make_manager):
    c = Core(make_manager)
    other = c.m.open_session("other", 2).id
    c.alloc1("a", [1])
    with pytest.raises(PermissionDenied):
        c.m.set_state(other, c.ns, "a", SequenceState.COMPLETED)
    assert c.seq("a").state is SequenceState.PREFILLED


def test_set_states_moves_a_batch_or_nothing(make_manager):
    c = Core(make_manager)
    for s in ("a", "b", "c"):
        c.alloc1(s, prompt(ord(s), 6))
    c.m.set_state(c.sid, c.ns, "c", SequenceState.IN_DECODE)
    before = snapshot(c.m)
    with pytest.raises(FailedPrecondition, match="'c' cannot go from IN_DECODE to IN_DECODE"):
        c.m.set_states(c.sid, c.ns, ["a", "b", "c"], SequenceState.IN_DECODE)
    assert snapshot(c.m) == before and c.seq("a").state is SequenceState.PREFILLED
    with pytest.raises(InvalidArgument, match="appears twice"):
        c.m.set_states(c.sid, c.ns, ["a", "a"], SequenceState.IN_DECODE)
    assert snapshot(c.m) == before
    assert c.m.set_states(c.sid, c.ns, ["a", "b"], SequenceState.IN_DECODE) == [SequenceState.PREFILLED] * 2
    assert c.m.set_states(c.sid, c.ns, ["a", "b", "c"], SequenceState.COMPLETED) == [SequenceState.IN_DECODE] * 3
    assert len(c.m.sequences) == 0
    check(c.m)


# ---- pins ---------------------------------------------------------------------------


def pinned(c, ids, ttl=0.0, sid=None):
    return c.m.pin(sid or c.sid, c.ns, toks(ids), (), ttl)


def test_a_pinned_prefix_survives_pressure_with_no_sequence_on_it(make_manager):
    c = Core(make_manager, pages=4)
    a = prompt(0, 8)
    c.alloc1("a", a)
    c.publish("a")
    pin = pinned(c, a + [1, 2])
    assert (pin.pages, pin.tokens) == ([0, 1], 8)
    c.release("a")
    assert c.refcounts([0, 1]) == [1, 1] and c.lru() == []
    assert c.m.pool.state(0) is PageState.PUBLISHED and c.m.pool.pins(0) == 1
    with pytest.raises(ResourceExhausted):
        c.alloc1("b", prompt(100, 16))
    c.alloc1("b", prompt(100, 8))
    assert c.lookup(a) == [0, 1]
    assert stats.collect(c.m).totals.pinned_pages == 2
    check(c.m)
    c.m.unpin(c.sid, pin.pin_id)
    assert c.lru() == [1, 0]
    with pytest.raises(NotFound, match="pin"):
        c.m.unpin(c.sid, pin.pin_id)
    c.release("b")
    c.alloc1("c", prompt(200, 16))  # now the prefix goes
    assert c.lookup(a) == []
    check(c.m)


def test_pins_expire_after_their_ttl(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 4))
    c.publish("a")
    c.release("a")
    forever = pinned(c, prompt(0, 4))
    brief = pinned(c, prompt(0, 4), ttl=10)
    assert c.refcounts([0]) == [2]
    assert c.m.expire_pins(time.monotonic() + 5) == 0
    assert c.m.expire_pins(time.monotonic() + 11) == 1
    assert c.refcounts([0]) == [1] and c.m.pool.pins(0) == 1
    assert [pin.id for pin in c.m.pins.held_by(c.sid)] == [forever.pin_id]
    with pytest.raises(NotFound):
        c.m.unpin(c.sid, brief.pin_id)
    assert c.m.expire_pins(time.monotonic() + 1e9) == 0
    c.m.unpin(c.sid, forever.pin_id)
    assert c.lru() == [0]
    check(c.m)


def test_closing_a_session_releases_its_pins_and_sequences(make_manager):
    c = Core(make_manager)
    other = c.m.open_session("other", 2).id
    c.alloc1("a", prompt(0, 10))
    c.publish("a")
    c.alloc(req("b", prompt(0, 10)), sid=other)
    pinned(c, prompt(0, 8), sid=other)
    assert c.refcounts([0, 1]) == [3, 3]
    c.m.close_session(other)
    assert c.refcounts([0, 1]) == [1, 1] and len(c.m.sequences) == 1
    with pytest.raises(NotFound, match="unknown session"):
        c.m.unpin(other, 1)
    c.m.close_session(c.sid)
    assert c.lru() == [1, 0] and len(c.m.sessions) == 0
    assert stats.collect(c.m).totals.pinned_pages == 0
    check(c.m)


def test_pin_errors(make_manager):
    c = Core(make_manager)
    other = c.m.open_session("other", 2).id
    c.alloc1("a", prompt(0, 4))
    c.publish("a")
    pin = pinned(c, prompt(0, 4))
    before = snapshot(c.m)
    with pytest.raises(PermissionDenied, match="another session"):
        c.m.unpin(other, pin.pin_id)
    for ttl in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="ttl"):
            pinned(c, prompt(0, 4), ttl=ttl)
    with pytest.raises(InvalidArgument):
        pinned(c, [-1])
    assert snapshot(c.m) == before
    assert pinned(c, prompt(50, 4)).pages == []  # nothing cached: an empty pin


# ---- prefix reuse off ---------------------------------------------------------------


def test_without_prefix_reuse_nothing_is_shared(make_manager):
    c = Core(make_manager, prefix_reuse=False)
    a = prompt(0, 10)
    c.alloc1("a", a)
    assert c.publish("a") == [PublishResult("a", 0, [])]
    c.alloc(req("b", a), req("c", a))
    assert [c.seq(s).pages for s in "abc"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert c.lookup(a) == [] and len(c.m.index) == 0
    assert pinned(c, a).pages == []
    c.m.arena.page_bytes_view(0)[:] = 3
    plan = c.fork("a", "d")
    assert (plan.shared_pages, plan.private_pages) == ([], [9, 10, 11])
    assert np.array_equal(c.m.arena.page_bytes_view(9), c.m.arena.page_bytes_view(0))
    c.extend(("d", 4, toks([1, 2, 3, 4])))
    assert c.publish("d")[0].published_pages == 0
    s = stats.collect(c.m).totals
    assert s.logical_pages == s.physical_pages == 13 and s.host_pages_saved == 0
    assert (s.shared_pages, s.cached_pages, s.hit_tokens, s.lookup_tokens) == (0, 0, 0, 30)
    c.release("a", "b", "c", "d")
    assert c.lru() == [] and stats.collect(c.m).totals.free_pages == c.m.catalog.extents(c.ns)[0].num_pages
    check(c.m)


# ---- stats --------------------------------------------------------------------------


def test_stats_in_a_small_scenario(make_manager):
    assert stats.STAT_FIELDS == (
        "logical_pages",
        "physical_pages",
        "shared_pages",
        "private_pages",
        "cached_pages",
        "pinned_pages",
        "free_pages",
        "host_pages_saved",
        "host_bytes_saved",
        "refcount_increments",
        "refcount_decrements",
        "lookup_tokens",
        "hit_tokens",
        "evicted_pages",
        "corrupted_pages",
        "sessions",
        "sequences",
    )
    c = Core(make_manager, pages=64)
    c.m.open_session("idle", 2)
    a = prompt(0, 10)
    c.alloc1("a", a)  # 0 1 2
    c.publish("a")
    c.alloc1("b", a)  # 0 1 | 3
    pinned(c, a[:4])  # page 0
    c.alloc1("c", prompt(100, 4))  # 4
    c.publish("c")
    c.release("c")  # 4 cached
    expected = dict(
        logical_pages=6,
        physical_pages=4,
        shared_pages=2,
        private_pages=2,
        cached_pages=1,
        pinned_pages=1,
        free_pages=59,
        host_pages_saved=2,
        host_bytes_saved=2 * PAGE_BYTES,
        refcount_increments=8,
        refcount_decrements=1,
        lookup_tokens=24,
        hit_tokens=8,
        evicted_pages=0,
        corrupted_pages=0,
        sessions=2,
        sequences=2,
    )
    s = stats.collect(c.m)
    assert s.totals.as_dict() == expected
    [ns] = s.namespaces
    assert ns.pages.as_dict() == {**expected, "sessions": 1}  # the idle session holds nothing here
    assert (ns.namespace_id, ns.model, ns.page_bytes) == (c.ns, "tiny", PAGE_BYTES)
    budget = budget_for(64, PAGE_BYTES, PAGE_SIZE)
    assert (s.host_bytes, s.arena_bytes, s.prefix_reuse) == (budget, budget, True)
    assert list(s.as_dict())[:17] == list(stats.STAT_FIELDS)
    check(c.m)


# ---- background extent builds -------------------------------------------------------


def no_space(plan):
    """Stands in for Arena.build when /dev/shm is full."""
    raise OSError(28, "No space left on device")


def test_a_failed_background_build_returns_its_budget(make_manager):
    m = make_manager(budget_bytes=budget_for(4, PAGE_BYTES, PAGE_SIZE, extents=2), extent_bytes=2 * PAGE_BYTES)
    sid = m.open_session("test", 1).id
    build = m.arena.build
    m.arena.build = no_space
    ns = m.catalog.register_namespace(identity()).id  # provisions its first extent in the background
    futures.wait([future for _plan, future in m.supply._building.values()])
    with pytest.raises(OSError, match="No space left"):  # the build on the request path fails too
        m.allocate(sid, ns, [req("a", [1])])
    assert m.arena.reserved_bytes == 0 and m.arena.extents() == []
    m.arena.build = build  # the disk has room again
    plans = m.allocate(sid, ns, [req("a", prompt(0, 16))]).result
    assert len(plans[0].private_pages) == 4  # the whole budget is usable
    assert m.arena.reserved_bytes == m.arena.budget_bytes
    check(m)


def test_close_survives_a_failed_background_build(make_manager):
    m = make_manager(budget_bytes=8 * PAGE_BYTES, extent_bytes=2 * PAGE_BYTES)
    sid = m.open_session("test", 1).id
    ns = m.catalog.register_namespace(identity()).id
    m.allocate(sid, ns, [req("a", prompt(0, 8))])  # fills extent 0; extent 1 is built behind
    settle(m)
    m.arena.build = no_space
    m.allocate(sid, ns, [req("b", prompt(100, 8))])  # fills extent 1; extent 2's build fails behind
    futures.wait([future for _plan, future in m.supply._building.values()])
    m.close()  # still unmaps and unlinks every extent
    assert m.arena.extents() == [] and leftover_segments(m.arena.name_prefix) == []


# ---- the invariant checker ----------------------------------------------------------


def test_invariant_checker_finds_corruption(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 8))  # 0 1
    c.publish("a")
    check(c.m)
    pool, index = c.m.pool, c.m.index
    free = pool._by_namespace[c.ns].free  # corrupt the core directly, then restore it
    i = free.index(5)
    free[i] = 0  # a published page listed as free, page 5 lost
    assert invariants.violations(c.m) == [
        f"namespace {c.ns}: free list holds pages [0] it should not, misses [5] and lists 0 pages twice"
    ]
    free[i] = 5
    content = pool.content(1)
    index.remove(content.page, content.key)  # its run held what it holds
    assert invariants.violations(c.m) == ["published page 1 has no content record"]
    index.insert(content, 1)
    columns = pool._columns
    slot = columns.slot(0)
    columns.refcount[slot] += 1
    assert invariants.violations(c.m) == ["page 0 has refcount 2 but 1 references (sequences + pins)"]
    columns.refcount[slot] -= 1
    c.seq("a").pages.append(7)
    assert "sequence 'a' holds 3 pages for 8 tokens" in invariants.violations(c.m)
    c.seq("a").pages.pop()
    pinned(c, prompt(0, 4))
    columns.pins[slot] -= 1
    assert invariants.violations(c.m) == ["page 0 counts 0 pins but 1 pins hold it"]
    columns.pins[slot] += 1
    c.release("a")  # pages 0 and 1 cached, page 0 still pinned: the LRU holds page 1
    check(c.m)
    pool._by_namespace[c.ns].cached._live += 1
    assert invariants.violations(c.m) == [f"namespace {c.ns}: counts 2 cached pages, its LRU lists 1"]
    pool._by_namespace[c.ns].cached._live -= 1
    check(c.m)


# ---- prewarm (no tier: what the call says at once; tests/test_prewarm.py has the tiers) ----


def test_a_prewarm_needs_no_session_and_says_what_is_resident_missing_or_beyond_the_budget(make_manager):
    c = Core(make_manager, pages=8)
    c.alloc1("a", prompt(0, 3 * PAGE_SIZE))
    c.publish("a")
    c.release("a")  # 3 cached pages
    c.alloc1("held", prompt(1, 3 * PAGE_SIZE))  # 3 pages a sequence holds: 5 to spare, the 3 cached included
    ns = c.m.namespace_named(None, identity())
    [warm] = c.m.prewarm(ns, [req("w", prompt(0, 8 * PAGE_SIZE + 1))])  # 3 resident, 5 missing, a partial tail
    assert (warm.requested_tokens, warm.resident_tokens) == (8 * PAGE_SIZE, 3 * PAGE_SIZE)
    # no tier below: what fits the budget (2 pages: the hit's 3 cached ones are not spare) is on no tier at once
    assert (warm.pending_tokens, warm.not_found_tokens, warm.over_budget_tokens) == (0, 2 * PAGE_SIZE, 3 * PAGE_SIZE)
    assert warm.partial and not c.m.prewarms.busy
    counted = c.m.prewarms.counters
    assert (counted.prompts, counted.not_found_tokens, counted.pending_tokens) == (1, 2 * PAGE_SIZE, 0)
    assert c.seq("held").pages and c.m.pool.cached_count(c.ns) == 3  # nothing evicted
    check(c.m)


def test_a_prewarm_of_an_unknown_identity_bad_tokens_or_without_prefix_reuse_is_refused(make_manager):
    c = Core(make_manager)
    with pytest.raises(NotFound, match="no engine registered model 'other'"):
        c.m.namespace_named(None, identity(model="other"))
    ns = c.m.namespace_named(c.ns, None)
    with pytest.raises(InvalidArgument):
        c.m.prewarm(ns, [req("bad", [1, -2, 3])])
    assert c.m.prewarms.counters.prompts == 0
    off = Core(make_manager, prefix_reuse=False)
    with pytest.raises(FailedPrecondition, match="prefix reuse is off"):
        off.m.prewarm(off.m.namespace_named(off.ns, None), [req("w", prompt(0, 2 * PAGE_SIZE))])
