"""Publishing (kvd/cache/publishing.py) through a manager in process (tests/cores.py): full
private pages become shared, identical ones dedup, a bad count changes nothing, and a
publish run in steps leaves a consistent state between them."""

from __future__ import annotations

import pytest
from cores import PAGE_SIZE, Core, check, prompt, req, snapshot

from kvd.cache import stats
from kvd.cache.manager import PublishResult
from kvd.cache.requests import Rebind
from kvd.core.errors import InvalidArgument, NotFound
from kvd.core.types import PageState


def test_publish_dedups_identical_prompts_allocated_before_either_published(make_manager):
    c = Core(make_manager)
    a = prompt(0, 10)
    plans = c.alloc(req("x", a), req("y", a))
    assert [p.pages for p in plans] == [[0, 1, 2], [3, 4, 5]]
    x, y = c.publish("x", "y")
    assert (x.published_pages, x.rebinds) == (2, [])
    assert (y.published_pages, y.rebinds) == (2, [Rebind(0, 3, 0), Rebind(1, 4, 1)])
    assert c.seq("y").pages == [0, 1, 5]
    assert [c.m.pool.state(p) for p in (3, 4)] == [PageState.FREE, PageState.FREE]
    assert c.m.pool.free_list(c.ns)[-2:] == [3, 4]
    assert c.refcounts([0, 1, 2, 5]) == [2, 2, 1, 1]
    s = stats.collect(c.m).totals
    assert (s.logical_pages, s.physical_pages, s.host_pages_saved) == (6, 4, 2)
    check(c.m)


def test_publish_dedups_against_a_cached_page(make_manager):
    c = Core(make_manager)
    a = prompt(0, 4)
    c.alloc(req("x", a), req("y", a))  # 0 | 1
    c.publish("x")
    c.release("x")
    assert c.lru() == [0]
    [y] = c.publish("y")
    assert y.rebinds == [Rebind(0, 1, 0)] and c.lru() == [] and c.refcounts([0]) == [1]
    check(c.m)


def test_publish_rejects_bad_counts_and_changes_nothing(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 8))
    before = snapshot(c.m)
    for n in (6, 12, -4):
        with pytest.raises(InvalidArgument):
            c.publish("a", num_tokens=n)
    with pytest.raises(NotFound):
        c.m.publish(c.sid, c.ns, [("a", 4), ("zz", 4)])
    assert snapshot(c.m) == before
    assert c.publish("a", num_tokens=4)[0].published_pages == 1
    assert c.publish("a", num_tokens=4)[0].published_pages == 0
    check(c.m)


def test_publish_in_steps_leaves_a_consistent_state_between_steps(make_manager):
    """A publish job (what the servicer runs, yielding the loop between steps) publishes in
    position order; between steps the state is that of a shorter publish, and other calls
    may run: a second publish of the same sequence shares the work, a release ends it."""
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 40))  # 10 pages
    c.alloc1("b", prompt(100, 40))
    first = c.m.publish_job(c.sid, c.ns, [("a", 0)])
    assert not first.step(0)  # a step publishes one page at least, here exactly one
    assert c.seq("a").num_published == 1
    check(c.m)
    second = c.m.publish_job(c.sid, c.ns, [("a", 0), ("b", 0)])
    assert not second.step(0) and not second.step(0)  # takes a's pages 2 and 3
    assert c.seq("a").num_published == 3
    check(c.m)
    c.release("b")  # between steps: b goes before the job reaches it
    while not first.step(0):
        check(c.m)
    assert first.results()[0].published_pages == 8
    assert second.run() == [PublishResult("a", 2, []), PublishResult("b", 0, [])]
    assert c.seq("a").num_published == 10
    assert c.lookup(prompt(0, 40)) == c.seq("a").pages
    check(c.m)


def test_publish_job_skips_a_sequence_released_between_steps(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 40))
    job = c.m.publish_job(c.sid, c.ns, [("a", 0)])
    job.step(0)
    c.release("a")
    c.alloc1("a", prompt(0, 40))  # the same id again: a new sequence, not the job's
    assert job.run() == [PublishResult("a", 1, [])]
    assert c.seq("a").num_published == 1  # the new sequence's hit on the one page published
    assert c.seq("a").shared_prefix_tokens == PAGE_SIZE
    check(c.m)
