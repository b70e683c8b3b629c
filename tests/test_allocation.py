"""An allocation's own hits are never evicted to make room for it (kvd/cache/allocation.py).

The batch is matched once, its hits are held before room is made, in the stepped path
the daemon takes (``AllocationJob.steps`` between loop turns) and in the one-piece path
in-process callers take; a batch that does not commit releases what it held.
"""

from __future__ import annotations

import agents
import numpy as np
import pytest
from conftest import allocate_in_steps, budget_for, identity

from engine_client import KVDClient, KVDError, SequenceRequest
from kvd.cache import invariants
from kvd.cache.requests import SequenceRequest as CoreRequest
from kvd.core.errors import ResourceExhausted

LAYOUT = agents.LAYOUT  # 16-token pages of 2 KiB
PAGE = LAYOUT.page_size


def budget(pages: int, extents: int = 1) -> str:
    """The host budget of ``pages`` pages of LAYOUT in ``extents`` extents."""
    return str(budget_for(pages, LAYOUT.page_bytes, PAGE, extents))


def tokens(first: int, pages: int) -> np.ndarray:
    return np.arange(first, first + pages * PAGE, dtype=np.int32)


def test_computed_blocks_not_evicted(daemon_factory):
    """vLLM's test of the same name, through a daemon: a budget of two pages; P0 (the
    oldest cached page) is request 2's hit and must stay, P1 gives its slot."""
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", budget(2), "--extent-bytes", "4KiB")
    with KVDClient.connect(d.socket, client_name="vllm-like") as kvd:
        ns = kvd.register_namespace(agents.MODEL, LAYOUT)
        [r0] = kvd.allocate_with_prefix(ns, [SequenceRequest("r0", tokens(0, 1))])
        [r1] = kvd.allocate_with_prefix(ns, [SequenceRequest("r1", tokens(PAGE, 1))])
        kvd.publish(ns, ["r0", "r1"])
        kvd.release(ns, ["r0"])
        kvd.release(ns, ["r1"])  # P0 is now the least recently used cached page
        before = kvd.stats()["evicted_pages"]
        [r2] = kvd.allocate_with_prefix(ns, [SequenceRequest("r2", tokens(0, 2))])
        assert r2.shared_prefix_tokens == PAGE and r2.shared_pages == r0.pages
        assert r2.private_pages == r1.pages, "P1's slot is the new page"
        assert kvd.stats()["evicted_pages"] - before == 1
        assert kvd.check_invariants() == []


def test_a_long_prompts_whole_prefix_hits_when_it_is_the_oldest_cached_under_a_full_budget(daemon_factory):
    """A 50K-token prefix, the least recently used cached pages of a full budget: the room
    made for its suffix comes from the newer cached pages, and all of it hits."""
    prefix_pages, other_pages, suffix_pages = 3125, 875, 800  # 4,000 pages fill the budget
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", budget(4000, extents=8), "--extent-bytes", "1000KiB")
    with KVDClient.connect(d.socket, client_name="agents") as kvd:
        ns = kvd.register_namespace(agents.MODEL, LAYOUT)
        prefix = tokens(1_000_000, prefix_pages)
        kvd.allocate_with_prefix(ns, [SequenceRequest("first", prefix)])
        kvd.allocate_with_prefix(ns, [SequenceRequest("other", tokens(0, other_pages))])
        kvd.publish(ns, ["first", "other"])
        kvd.release(ns, ["first"])
        kvd.release(ns, ["other"])
        stats = kvd.stats()
        assert stats["cached_pages"] == prefix_pages + other_pages and stats["free_pages"] == 0
        [agent] = kvd.allocate_with_prefix(ns, [SequenceRequest("agent", np.append(prefix, tokens(0, suffix_pages)))])
        assert agent.shared_prefix_tokens == prefix_pages * PAGE == 50_000
        assert kvd.stats()["evicted_pages"] == suffix_pages
        assert kvd.check_invariants() == []


@pytest.mark.parametrize("stepped", [True, False], ids=["in-steps", "in-one-piece"])
def test_the_oldest_cached_prefix_is_a_hit_in_both_paths_and_matched_once(make_manager, stepped):
    m = make_manager(budget_bytes=int(budget(4)), extent_bytes=4 * 2048)
    ns = m.catalog.register_namespace(identity(page_size=PAGE))
    session = m.open_session("engine", 1).id

    def allocate(requests):
        return allocate_in_steps(m, session, ns.id, requests) if stepped else m.allocate(session, ns.id, requests)

    def req(seq_id, *parts):
        return CoreRequest(seq_id, np.concatenate(parts).astype("<i4").tobytes())

    prefix = tokens(0, 2)
    allocate([req("a", prefix), req("b", tokens(100, 2))])
    m.publish(session, ns.id, [("a", 0), ("b", 0)])
    m.release(session, ns.id, ["a"])
    m.release(session, ns.id, ["b"])  # a's pages are the oldest cached
    matches = []
    match = m.index.match
    m.index.match = lambda *args: matches.append(args) or match(*args)
    [plan] = allocate([req("c", prefix, tokens(200, 2))]).result
    assert plan.shared_prefix_tokens == 2 * PAGE
    assert len(matches) == 1, "an allocation is matched once"
    assert m.counters.of(ns.id).evicted_pages == 2 and m.allocations == set()
    assert invariants.violations(m) == []


def test_a_batch_that_does_not_commit_releases_its_held_hits(make_manager):
    m = make_manager(budget_bytes=int(budget(4)), extent_bytes=4 * 2048)
    ns = m.catalog.register_namespace(identity(page_size=PAGE))
    session = m.open_session("engine", 1).id
    prefix = tokens(0, 2).astype("<i4").tobytes()
    [a] = m.allocate(session, ns.id, [CoreRequest("a", prefix)]).result
    m.publish(session, ns.id, [("a", 0)])
    m.release(session, ns.id, ["a"])
    a0, a1 = a.pages
    lru = m.pool.lru_order(ns.id)
    assert set(lru) == {a0, a1}
    grow = prefix + tokens(100, 2).astype("<i4").tobytes()
    with m.allocation(session, m.batch(ns.id, [CoreRequest("c", grow)])) as job:
        assert list(job.held()) == [a0, a1] and invariants.violations(m) == []
        # another call takes the room the job counted on before it commits
        m.allocate(session, ns.id, [CoreRequest("other", tokens(500, 2).astype("<i4").tobytes())])
        with pytest.raises(ResourceExhausted):
            job.commit()
    assert m.allocations == set() and m.pool.refcount(a0) == m.pool.refcount(a1) == 0
    assert m.pool.lru_order(ns.id) == lru, "released tail first, as a sequence is"
    assert invariants.violations(m) == []


def test_a_refused_batch_evicts_nothing_and_holds_nothing(daemon_factory):
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", budget(4), "--extent-bytes", "8KiB")
    with KVDClient.connect(d.socket, client_name="engine") as kvd:
        ns = kvd.register_namespace(agents.MODEL, LAYOUT)
        kvd.allocate_with_prefix(ns, [SequenceRequest("a", tokens(0, 2))])
        kvd.publish(ns, ["a"])
        kvd.release(ns, ["a"])
        before = kvd.stats()
        with pytest.raises(KVDError) as e:
            kvd.allocate_with_prefix(ns, [SequenceRequest("big", tokens(0, 7))])  # 2 hits + 5 new > 4 pages
        assert e.value.code.name == "RESOURCE_EXHAUSTED"
        after = kvd.stats()
        assert (after["cached_pages"], after["evicted_pages"]) == (before["cached_pages"], before["evicted_pages"])
        assert kvd.check_invariants() == []
