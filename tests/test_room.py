"""Room (kvd/cache/room.py): what a namespace gives up for the pages a call needs, in order
(cached pages, a chain's tail first; another namespace's idle extent; on-hold sequences),
through a manager in process (tests/cores.py); and, against a daemon, a reclaimed extent:
the chains that ran through it leave the index with it, so what stays indexed, counted and
announced is what still hits."""

from __future__ import annotations

import queue
import threading

import agents
import numpy as np
import pytest
from conftest import budget_for, identity
from cores import PAGE_BYTES, PAGE_SIZE, Core, check, evict, prompt, req, snapshot
from test_events import read_into

from engine_client import BlockRemoved, KVDClient, PageLayout, SequenceRequest
from kvd.core.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from kvd.core.types import PageState, SequenceState

LAYOUT = agents.LAYOUT  # 16-token pages of 2 KiB: 64 pages an extent of 128 KiB
OTHER = PageLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=16, dtype="float16")  # also 2 KiB
PAGE = LAYOUT.page_size


def removed_keys(batches: queue.Queue) -> list[bytes]:
    keys = []
    while not batches.empty():
        for event in batches.get().events:
            if isinstance(event, BlockRemoved):
                keys += event.block_hashes
    return keys


def test_a_reclaimed_extent_takes_the_tail_of_every_chain_through_it(daemon_factory):
    # 4 extents of 64 pages: a 256-page conversation fills them, its first 64 pages in the
    # first extent, the one another namespace takes
    budget = budget_for(256, LAYOUT.page_bytes, PAGE, extents=4)
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", "128KiB")
    with KVDClient.connect(d.socket, client_name="a") as c, KVDClient.connect(d.socket, client_name="b") as other:
        ns = c.register_namespace(agents.MODEL, LAYOUT)
        conversation = np.arange(256 * PAGE, dtype=np.int32)
        # the head first, into the first extent (the one reclaimed first), the rest after it
        [head] = c.allocate_with_prefix(ns, [SequenceRequest("head", conversation[: 64 * PAGE])])
        assert sorted(head.pages) == list(range(64))
        c.publish(ns, ["head"])
        [alloc] = c.allocate_with_prefix(ns, [SequenceRequest("talk", conversation)])
        assert alloc.shared_pages == head.pages
        c.publish(ns, ["talk"])
        keys = c.page_keys(ns, conversation)
        c.release(ns, ["head", "talk"])  # all 256 cached, nothing referenced: every extent reclaimable
        stream = c.subscribe_events()
        batches: queue.Queue = queue.Queue()
        reading = threading.Thread(target=read_into, args=(stream, batches), daemon=True)
        reading.start()

        theirs = other.register_namespace("another-model", OTHER)
        [taken] = other.allocate_with_prefix(theirs, [SequenceRequest("x", np.arange(64 * PAGE, dtype=np.int32))])
        assert len(taken.private_pages) == 64

        [hit] = c.lookup(ns, [SequenceRequest("again", conversation)])
        stats = c.stats()
        ours = next(n for n in stats["namespaces"] if n["namespace_id"] == ns)
        assert hit.hit_pages == [], "the conversation's head went with the extent"
        assert ours["cached_pages"] == len(hit.hit_pages), "cached pages that can never hit"
        assert c.check_invariants() == []
        stream.cancel()
        reading.join(timeout=10)
        assert sorted(removed_keys(batches)) == sorted(keys), "every page that stopped being findable is announced"


# ---- what goes for room, through the manager --------------------------------------------


def test_cached_pages_are_evicted_in_lru_order_tail_first(make_manager):
    c = Core(make_manager, pages=8)
    a, b = prompt(0, 12), prompt(100, 8)
    c.alloc(req("a", a), req("b", b))  # a: 0 1 2, b: 3 4
    c.publish("a", "b")
    c.release("a")
    assert c.lru() == [2, 1, 0]  # a chain's tail goes first
    c.release("b")
    assert c.lru() == [2, 1, 0, 4, 3]
    plan = c.alloc1("c", prompt(200, 20))  # 5 pages: 3 free, then evict 2 and 1
    assert plan.private_pages == [1, 2, 5, 6, 7]
    assert c.lru() == [0, 4, 3]
    assert c.m.counters.of(c.ns).evicted_pages == 2
    assert c.lookup(a) == [0] and c.lookup(b) == [3, 4]
    check(c.m)


def test_hit_pages_move_to_the_mru_end(make_manager):
    c = Core(make_manager, pages=8)
    a, b = prompt(0, 12), prompt(100, 8)
    c.alloc(req("a", a), req("b", b))
    c.publish("a", "b")
    c.release("a", "b")
    assert c.lru() == [2, 1, 0, 4, 3]
    c.alloc1("d", a[:4] + [9])  # hits page 0
    c.release("d")
    assert c.lru() == [2, 1, 4, 3, 0]
    c.alloc1("f", a)  # hits the whole chain 0, 1, 2
    c.release("f")  # released tail first: 2 is evicted before its parents
    assert c.lru() == [4, 3, 2, 1, 0]
    c.alloc1("e", prompt(300, 20))  # 3 free pages, then evicts 4 and 3
    assert c.lru() == [2, 1, 0]
    check(c.m)


def test_on_hold_sequences_are_evicted_under_pressure_and_can_reenter(make_manager):
    c = Core(make_manager, pages=4)
    a = prompt(0, 6)
    c.alloc1("a", a)  # pages 0 (full) and 1 (partial)
    c.publish("a")
    c.m.set_aux(c.sid, c.ns, "a", b"state")
    c.m.set_state(c.sid, c.ns, "a", SequenceState.ON_HOLD)
    c.alloc1("busy", prompt(100, 4))  # page 2; a live PREFILLED sequence is never evicted
    plan = c.alloc1("b", prompt(200, 8))  # 2 pages: free 3, then a's private page 1
    assert plan.private_pages == [1, 3]
    assert c.seq("a").state is SequenceState.EVICTED and c.seq("a").pages == []
    assert c.replied == [["a"]] and c.evicted == []  # the reply names it; the stream stays for others
    assert c.m.pool.state(0) is PageState.CACHED and c.lru() == [0]
    with pytest.raises(FailedPrecondition, match="evicted under memory pressure"):
        c.publish("a")
    with pytest.raises(FailedPrecondition, match="evicted"):
        c.extend(("a", 1, None))
    check(c.m)
    c.release("b")
    c.m.set_aux(c.sid, c.ns, "a", b"state 2")  # aux is not KV: an evicted sequence keeps and updates it
    again = c.alloc1("a", a)  # re-entry: the prefix page still hits
    assert (again.shared_pages, again.shared_prefix_tokens, again.suffix_start) == ([0], 4, 4)
    assert c.seq("a").state is SequenceState.PREFILLED
    assert c.m.get_aux(c.sid, c.ns, "a") == b"state 2" and c.m.aux.used == 7
    check(c.m)


def test_cached_pages_go_before_on_hold_sequences(make_manager):
    c = Core(make_manager, pages=4)
    c.alloc(req("a", prompt(0, 6)), req("old", prompt(100, 8)))  # a: 0 1, old: 2 3
    c.publish("old")
    c.release("old")
    c.m.set_state(c.sid, c.ns, "a", SequenceState.ON_HOLD)
    assert c.alloc1("b", prompt(200, 8)).private_pages == [2, 3]
    assert c.seq("a").state is SequenceState.ON_HOLD and c.evicted == []
    check(c.m)


def test_oldest_on_hold_sequence_goes_first(make_manager):
    c = Core(make_manager, pages=4)
    c.alloc(req("x", [1]), req("y", [2]), req("z", [3]))  # 0 | 1 | 2
    for s in ("y", "x", "z"):
        c.m.set_state(c.sid, c.ns, s, SequenceState.ON_HOLD)
    c.alloc1("b", prompt(200, 8))  # free 3, then y's page
    assert c.replied == [["y"]]
    assert [c.seq(s).state for s in "xyz"] == [SequenceState.ON_HOLD, SequenceState.EVICTED, SequenceState.ON_HOLD]
    check(c.m)


def test_nothing_evictable_means_resource_exhausted(make_manager):
    c = Core(make_manager, pages=4)
    c.alloc1("a", prompt(0, 6))
    c.m.set_state(c.sid, c.ns, "a", SequenceState.IN_DECODE)
    before = snapshot(c.m)
    with pytest.raises(ResourceExhausted):
        c.alloc1("b", prompt(100, 9))
    assert snapshot(c.m) == before and c.evicted == []


def test_reentry_is_only_for_the_owner(make_manager):
    c = Core(make_manager, pages=16)
    other = c.m.open_session("other", 2).id
    c.alloc1("a", prompt(0, 5))
    c.m.set_state(c.sid, c.ns, "a", SequenceState.ON_HOLD)
    evict(c, "a")
    with pytest.raises(PermissionDenied):
        c.alloc(req("a", prompt(0, 5)), sid=other)
    assert c.alloc1("a", prompt(0, 5)).private_pages == [0, 1]
    check(c.m)


def test_a_namespace_reclaims_another_namespaces_unreferenced_extent(make_manager):
    m = make_manager(budget_bytes=budget_for(8, PAGE_BYTES, PAGE_SIZE), extent_bytes=8 * PAGE_BYTES)
    sid = m.open_session("test", 1).id
    small = m.catalog.register_namespace(identity(page_size=4)).id  # 512-byte pages
    m.allocate(sid, small, [req("a", prompt(0, 8)), req("p", prompt(50, 8))])
    m.publish(sid, small, [("a", 0)])
    big = m.catalog.register_namespace(identity(page_size=16)).id  # 2048-byte pages
    # the small namespace's extent holds the whole budget and a referenced page
    with pytest.raises(ResourceExhausted):
        m.allocate(sid, big, [req("b", prompt(0, 16))])
    m.release(sid, small, ["p", "a"])
    assert m.pool.lru_order(small) == [1, 0]
    plan = m.allocate(sid, big, [req("b", prompt(0, 16))]).result[0]
    assert m.catalog.extents(small) == [] and len(m.catalog.extents(big)) == 1
    assert plan.private_pages == [m.catalog.extents(big)[0].first_page]
    assert m.counters.of(small).evicted_pages == 2 and len(m.index) == 0
    assert m.lookup(sid, small, [req("a", prompt(0, 8))])[0].hit_pages == []
    check(m)
