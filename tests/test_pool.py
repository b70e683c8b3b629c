"""The host page pool: on its own, its columns and slots, its lazy LRU, and both of its
paths (page by page, arrays) against a small reference model of what every call does; under
a manager (tests/cores.py), the refcounts client calls take and drop."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import pytest
from conftest import identity
from cores import Core, check, prompt, req, snapshot

import kvd.core.eviction
import kvd.core.pool
from kvd.core.counters import Counters
from kvd.core.errors import InvalidArgument, NotFound
from kvd.core.index import PageContent
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import Namespace
from kvd.core.page_columns import PageColumns
from kvd.core.pool import PagePool
from kvd.core.types import NamespaceId, PageId, PageKey, PageState

OWN_CHAIN = ChainPlace(Namespace(NamespaceId(0), identity(), b"root"), 0, b"root")  # page 0 of a chain of its own


def content(page: int) -> PageContent:
    return PageContent(PageId(page), PageKey(page.to_bytes(16, "little")), b"\0" * 16, None, b"")


class Heard:
    """A pool listener that keeps what it was told: the pages indexed now, as reported (each
    page entering and leaving once), and the pages freed while published, in order."""

    def __init__(self) -> None:
        self.indexed: set[PageId] = set()
        self.freed: list[PageId] = []  # unpublished, in order

    def published(self, contents: list[PageContent], places: list[ChainPlace], indexed: bool) -> None:
        for content in contents if indexed else ():
            assert content.page not in self.indexed, f"page {content.page} indexed twice"
            self.indexed.add(content.page)

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        self.published([content], [place], True)

    def unindexed(self, page: PageId, key: PageKey, namespace: NamespaceId) -> None:
        assert page in self.indexed, f"page {page} unindexed but not indexed"
        self.indexed.remove(page)

    def unpublished(self, page: PageId) -> None:
        self.freed.append(page)


@pytest.fixture(params=["page-by-page", "arrays"])
def batch_path(request, monkeypatch):
    """Runs a test once with every batch going page by page, once with every batch on arrays."""
    monkeypatch.setattr(kvd.core.pool, "BATCH_PAGES", 10**9 if request.param == "page-by-page" else 1)
    return request.param


# ---- columns and slots ----------------------------------------------------------------


def test_slots_of_live_extents_and_reuse_of_removed_ones():
    c = PageColumns()
    a = c.add(PageId(0), 4, 7)
    b = c.add(PageId(4), 6, 7)
    assert (a, b, c.capacity) == (range(0, 4), range(4, 10), 10)
    assert [c.slot(p) for p in range(10)] == list(range(10)) and c.slots(range(10)).tolist() == list(range(10))
    c.remove(PageId(0))
    assert 0 not in c and 4 in c
    with pytest.raises(KeyError):
        c.slot(3)
    with pytest.raises(KeyError, match="2"):
        c.slots([5, 2])
    assert c.add(PageId(100), 3, 8) == range(0, 3)  # the first gap that fits
    assert c.add(PageId(200), 4, 8) == range(10, 14)  # none left that fits: past the end
    assert c.slots([101, 4, 203, 100]).tolist() == [1, 4, 13, 0]
    assert c.page[c.slots([101, 203])].tolist() == [101, 203] and c.namespace[1] == 8
    c.remove(PageId(200))
    c.remove(PageId(4))
    assert c.capacity == 3  # the free end is given back
    c.remove(PageId(100))
    assert (c.capacity, c.extents()) == (0, [])
    with pytest.raises(KeyError):
        c.slots([100])


def test_a_hit_on_cached_pages_keeps_the_lru_order_of_remove_and_add(batch_path):
    pool, ns = PagePool(Counters()), NamespaceId(0)
    pool.add_pages(ns, "e", PageId(0), 64)
    pages = pool.allocate(ns, 40)
    for page in pages:
        pool.publish(page, content(page), OWN_CHAIN)
    pool.release_all(reversed(pages))  # tail first
    assert pool.lru_order(ns) == pages[::-1] and pool.cached_count(ns) == 40
    pool.acquire_all(pages[:30])  # a hit on the first 30 leaves their entries behind
    assert pool.lru_order(ns) == pages[:29:-1] and pool.cached_count(ns) == 10
    assert [pool.state(p) for p in pages[:31]] == [PageState.PUBLISHED] * 30 + [PageState.CACHED]
    pool.release_all(reversed(pages[:30]))
    assert pool.lru_order(ns) == pages[:29:-1] + pages[29::-1]
    evicted = [pool.evict_many(ns, 1)[0] for _ in range(12)]
    assert evicted == pages[:29:-1] + pages[29:27:-1] and pool.cached_count(ns) == 28


def test_a_chain_published_as_one_batch_is_what_page_by_page_publishes_make(batch_path):
    """``publish_chain`` (a publish's batch) leaves the pages, the index's run and what the
    listener heard as publishing each page does; a page not PRIVATE names the broken invariant."""
    pool, ns = PagePool(Counters()), NamespaceId(0)
    heard = pool.listener = Heard()
    pool.add_pages(ns, "e", PageId(0), 64)
    pages = pool.allocate(ns, 40)
    contents = [
        PageContent(page, PageKey(page.to_bytes(16, "little")), b"\0" * 16, pages[i - 1] if i else None, b"")
        for i, page in enumerate(pages)
    ]
    places = [OWN_CHAIN._replace(page_index=i) for i in range(len(pages))]
    pool.publish_chain(contents[:1], places[:1])  # a batch of one: page by page
    pool.publish_chain(contents[1:], places[1:])
    assert [pool.state(p) for p in pages] == [PageState.PUBLISHED] * 40 and heard.indexed == set(pages)
    assert [pool.content(p) for p in pages] == contents and pool.index.run_problems() == []
    assert len(pool.index._numbered) == 1  # one run: the batch joined its parent's
    more = pool.allocate(ns, 2)
    pool.release_all(more[1:])  # FREE again: publishing it is a broken invariant
    late = [PageContent(p, PageKey(p.to_bytes(16, "little")), b"\1" * 16, None, b"") for p in more]
    with pytest.raises(AssertionError, match=f"page {more[1]} published while free"):
        pool.publish_chain(late, [OWN_CHAIN] * 2)


def test_left_behind_entries_are_dropped_and_the_queue_stays_bounded(monkeypatch):
    monkeypatch.setattr(kvd.core.eviction, "STALE_ENTRIES", 8)
    pool, ns = PagePool(Counters()), NamespaceId(0)
    pool.add_pages(ns, "e", PageId(0), 16)
    pages = pool.allocate(ns, 16)
    for page in pages:
        pool.publish(page, content(page), OWN_CHAIN)
    pool.release_all(pages)
    for _ in range(100):  # every round trip leaves 16 entries behind
        pool.acquire_all(pages)
        pool.release_all(pages)
        queue = pool._by_namespace[ns].cached
        assert queue._tail - queue._head <= 2 * 16 + 8 + 16  # entries, live or left behind
    assert pool.lru_order(ns) == pages and pool.cached_count(ns) == 16


@pytest.mark.parametrize("count", [1, 40])
def test_broken_invariants_name_the_page(batch_path, count):
    pool, ns = PagePool(Counters()), NamespaceId(0)
    pool.add_pages(ns, "e", PageId(0), 64)
    pool.add_pages(NamespaceId(1), "f", PageId(64), 8)
    pages = pool.allocate(ns, count)
    with pytest.raises(AssertionError, match=f"page {pages[0]} acquired while private"):
        pool.acquire_all(pages)
    pool.release_all(pages)
    with pytest.raises(AssertionError, match=f"page {pages[0]} released with refcount 0"):
        pool.release_all(pages)
    assert pool.free_count(ns) == 64  # refused before anything changed
    other = pool.allocate(NamespaceId(1), 1)
    with pytest.raises(AssertionError, match=f"page {other[0]} of namespace 1 released with pages of namespace 0"):
        pool.release_all([*pool.allocate(ns, count), *other])
    held = pool.allocate(ns, count)
    with pytest.raises(AssertionError, match=f"page {held[0]} unpinned but holds no pin"):
        pool.release_all(held, pin=True)


# ---- both paths against a reference model ---------------------------------------------


@dataclass
class Model:
    """What the pool must hold, kept the plain way: a dict per page and an ordered LRU."""

    state: dict[int, PageState] = field(default_factory=dict)
    refcount: dict[int, int] = field(default_factory=dict)
    pins: dict[int, int] = field(default_factory=dict)
    namespace: dict[int, int] = field(default_factory=dict)
    indexed: dict[int, bool] = field(default_factory=dict)
    free: dict[int, list[int]] = field(default_factory=dict)
    lru: dict[int, OrderedDict] = field(default_factory=dict)
    unpublished: list[int] = field(default_factory=list)

    def add(self, ns: int, first: int, count: int) -> None:
        for page in range(first + count - 1, first - 1, -1):
            self.state[page], self.refcount[page], self.pins[page] = PageState.FREE, 0, 0
            self.namespace[page], self.indexed[page] = ns, False
            self.free.setdefault(ns, []).append(page)
        self.lru.setdefault(ns, OrderedDict())

    def remove(self, ns: int, first: int, count: int) -> None:
        for page in range(first, first + count):
            for column in (self.state, self.refcount, self.pins, self.namespace, self.indexed):
                del column[page]
        self.free[ns] = [p for p in self.free[ns] if not first <= p < first + count]

    def allocate(self, ns: int, count: int) -> list[int]:
        taken = [self.free[ns].pop() for _ in range(count)]
        for page in taken:
            self.state[page], self.refcount[page] = PageState.PRIVATE, 1
        return taken

    def acquire(self, page: int, pin: bool) -> None:
        if self.state[page] is PageState.CACHED:
            del self.lru[self.namespace[page]][page]
            self.state[page] = PageState.PUBLISHED
        self.refcount[page] += 1
        self.pins[page] += pin

    def release(self, page: int, pin: bool) -> None:
        self.refcount[page] -= 1
        self.pins[page] -= pin
        if self.refcount[page]:
            return
        if self.state[page] is PageState.PUBLISHED and self.indexed[page]:
            self.state[page] = PageState.CACHED
            self.lru[self.namespace[page]][page] = None
        else:
            self.to_free(page)

    def to_free(self, page: int) -> None:
        if self.state[page] is not PageState.PRIVATE:
            self.unpublished.append(page)
        self.state[page], self.indexed[page] = PageState.FREE, False
        self.free[self.namespace[page]].append(page)

    def evict(self, page: int) -> None:
        del self.lru[self.namespace[page]][page]
        self.to_free(page)


def test_both_paths_agree_with_the_model(monkeypatch):
    monkeypatch.setattr(kvd.core.eviction, "STALE_ENTRIES", 4)  # drop left-behind entries often
    rng = random.Random(15)
    model = Model()
    pool = PagePool(Counters())
    pool.listener = heard = Heard()
    refs: list[tuple[int, bool]] = []  # references taken: (page, pinned)
    extents: dict[str, tuple[int, int, int]] = {}  # name -> (namespace, first, count)
    next_page = 0

    def add_extent(ns: int) -> None:
        nonlocal next_page
        count = rng.choice([8, 24, 40, 70])
        name = f"e{len(extents)}-{next_page}"
        pool.add_pages(NamespaceId(ns), name, PageId(next_page), count)
        model.add(ns, next_page, count)
        extents[name] = (ns, next_page, count)
        next_page += count

    for ns in (0, 0, 1):
        add_extent(ns)
    for step in range(3000):
        monkeypatch.setattr(kvd.core.pool, "BATCH_PAGES", rng.choice([1, 10**9]))  # each call takes either path
        ns = rng.choice([0, 1])
        live = [p for p, s in model.state.items() if model.namespace[p] == ns]
        shared = [p for p in live if model.state[p] in (PageState.PUBLISHED, PageState.CACHED)]
        held = [(p, pin) for p, pin in refs if model.namespace[p] == ns]
        op = rng.random()
        if op < 0.2 and model.free.get(ns):
            count = rng.randint(1, min(len(model.free[ns]), 60))
            got = pool.allocate(NamespaceId(ns), count)
            assert got == model.allocate(ns, count)
            refs += [(p, False) for p in got]
        elif op < 0.35 and [p for p in live if model.state[p] is PageState.PRIVATE]:
            page = rng.choice([p for p in live if model.state[p] is PageState.PRIVATE])
            indexed = rng.random() < 0.8
            pool.publish(PageId(page), content(page), OWN_CHAIN, indexed)
            model.state[page], model.indexed[page] = PageState.PUBLISHED, indexed
        elif op < 0.5 and shared:
            pages = rng.sample(shared, rng.randint(1, min(len(shared), 60)))
            pin = rng.random() < 0.3
            pool.acquire_all(pages, pin)
            for page in pages:
                model.acquire(page, pin)
            refs += [(p, pin) for p in pages]
        elif op < 0.75 and held:
            pin = rng.random() < 0.3
            candidates = list({p: None for p, pinned in held if pinned == pin})
            if candidates:
                pages = rng.sample(candidates, rng.randint(1, min(len(candidates), 60)))
                pool.release_all(pages, pin)
                for page in pages:
                    model.release(page, pin)
                    refs.remove((page, pin))
        elif op < 0.8 and model.lru[ns]:
            page = next(iter(model.lru[ns]))
            assert pool.evict_many(NamespaceId(ns), 1) == [page]
            model.evict(page)
        elif op < 0.82 and model.lru[ns]:
            count = rng.randint(1, 60)  # more than are cached at times
            victims = list(model.lru[ns])[:count]
            assert pool.evict_many(NamespaceId(ns), count) == victims
            for page in victims:
                model.evict(page)
        elif op < 0.86 and model.lru[ns]:
            page = rng.choice(list(model.lru[ns]))
            pool.evict(PageId(page))
            model.evict(page)
        elif op < 0.9 and [p for p in shared if model.indexed[p]]:
            page = rng.choice([p for p in shared if model.indexed[p]])
            pool.unindex(PageId(page))
            model.indexed[page] = False
            if model.state[page] is PageState.CACHED:
                model.evict(page)
        elif op < 0.95:  # an idle extent goes (its cached pages evicted), a new one comes
            idle = [name for name in extents if pool.extent_in_use(name) == 0]
            for name in idle[: len(extents) > 2]:
                e_ns, first, count = extents.pop(name)
                for page in [p for p in model.lru[e_ns] if first <= p < first + count]:
                    pool.evict(PageId(page))
                    model.evict(page)
                pool.remove_pages(NamespaceId(e_ns), name, PageId(first), count)
                model.remove(e_ns, first, count)
            if len(extents) < 5:
                add_extent(ns)
        assert list(pool.pages()) == [
            (p, model.state[p], model.refcount[p], model.pins[p], model.namespace[p]) for p in sorted(model.state)
        ], f"step {step}"
        for n in (0, 1):
            assert pool.free_list(NamespaceId(n)) == model.free.get(n, []), f"step {step}"
            assert pool.lru_order(NamespaceId(n)) == list(model.lru.get(n, {})), f"step {step}"
            assert pool.cached_count(NamespaceId(n)) == len(model.lru.get(n, {})), f"step {step}"
        assert heard.freed == model.unpublished
        assert all(pool.is_indexed(PageId(p)) == model.indexed[p] for p in model.state)
        assert heard.indexed == {p for p in model.state if model.indexed[p]}, f"step {step}"
        assert all(
            (pool.content(PageId(p)) is not None) == (s in (PageState.PUBLISHED, PageState.CACHED))
            for p, s in model.state.items()
        )


# ---- refcounts through the manager ----------------------------------------------------


def test_acquire_and_release_are_symmetric(make_manager):
    c = Core(make_manager)
    a = prompt(0, 8)
    c.alloc1("a", a)
    c.publish("a")
    c.alloc(req("b", a), req("c", a + [7]))
    assert c.refcounts([0, 1]) == [3, 3]
    assert c.release("b") == 2
    assert c.refcounts([0, 1]) == [2, 2]
    c.release("c", "a")
    assert c.refcounts([0, 1]) == [0, 0] and c.lru() == [1, 0]
    counters = c.m.counters.of(c.ns)
    # a: 2 allocated, b: 2 hits, c: 2 hits + 1 private
    assert (counters.refcount_increments, counters.refcount_decrements) == (7, 7)
    check(c.m)


def test_double_release_is_not_found(make_manager):
    c = Core(make_manager)
    c.alloc1("a", prompt(0, 5))
    assert c.release("a") == 2
    before = snapshot(c.m)
    with pytest.raises(NotFound, match="'a' does not exist"):
        c.release("a")
    assert snapshot(c.m) == before


def test_release_batch_is_validated_whole(make_manager):
    c = Core(make_manager)
    c.alloc1("b", [1])
    before = snapshot(c.m)
    with pytest.raises(InvalidArgument, match="appears twice"):
        c.release("b", "b")
    with pytest.raises(NotFound):
        c.release("b", "gone")  # the known id stays alive
    assert snapshot(c.m) == before


def test_pool_asserts_on_a_release_at_refcount_zero(make_manager):
    c = Core(make_manager)
    c.alloc1("a", [1, 2])
    c.release("a")
    with pytest.raises(AssertionError, match="page 0 released with refcount 0"):
        c.m.pool.release(0)
    c.alloc1("b", prompt(0, 4))
    c.publish("b")
    with pytest.raises(AssertionError, match="page 0 unpinned but holds no pin"):
        c.m.pool.release(0, pin=True)
