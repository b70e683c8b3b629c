"""Page states and reference counts: the one class that changes a refcount.

``acquire`` and ``release`` are symmetric. A page's refcount is the number of sequence
references plus pins. Its state follows from the count and from whether it was published:

    FREE --allocate--> PRIVATE(1) --publish--> PUBLISHED(>=1) --release to 0--> CACHED
      ^                    |                                                      |
      +---release to 0-----+<-----------------------evict (LRU)-------------------+

CACHED pages sit in a per-namespace ``CachedQueue``; which one goes first is the
eviction policy's (kvd/eviction.py), not this module's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvd.counters import Counters
from kvd.eviction import CachedQueue
from kvd.index import PageContent
from kvd.types import NamespaceId, PageId, PageState


@dataclass(slots=True)
class _Page:
    namespace: NamespaceId
    extent: str
    state: PageState = PageState.FREE
    refcount: int = 0
    pins: int = 0
    content: PageContent | None = None  # set while PUBLISHED or CACHED
    indexed: bool = False  # the index maps content.key to this page


@dataclass
class _NamespacePages:
    free: list[PageId] = field(default_factory=list)
    cached: CachedQueue = field(default_factory=CachedQueue)


class PagePool:
    """States, refcounts, free lists and LRU of every host page of the daemon."""

    def __init__(self, counters: Counters, on_unpublish: Callable[[PageId], None] | None = None) -> None:
        # Called when a published page stops being published (freed), before it can be reused.
        self._on_unpublish = on_unpublish
        self._pages: dict[PageId, _Page] = {}
        self._by_namespace: dict[NamespaceId, _NamespacePages] = {}
        self._extent_in_use: dict[str, int] = {}  # PRIVATE or PUBLISHED pages per extent
        self._counters = counters  # refcount changes and evictions are counted here

    # ---- extents ------------------------------------------------------------------

    def add_pages(self, namespace: NamespaceId, extent: str, first: PageId, count: int) -> None:
        """Adds a new extent's pages as FREE."""
        pages = self._ns(namespace)
        for page in range(first + count - 1, first - 1, -1):  # pop() hands out low ids first
            self._pages[PageId(page)] = _Page(namespace, extent)
            pages.free.append(PageId(page))
        self._extent_in_use[extent] = 0

    def remove_pages(self, namespace: NamespaceId, extent: str, first: PageId, count: int) -> None:
        """Forgets an extent whose pages are all FREE."""
        assert self._extent_in_use.pop(extent) == 0, f"extent {extent} removed while pages are in use"
        gone = set(range(first, first + count))
        for page in gone:
            p = self._pages.pop(PageId(page))
            assert p.state is PageState.FREE, f"page {page} of extent {extent} removed while {p.state.value}"
        pages = self._ns(namespace)
        pages.free = [p for p in pages.free if p not in gone]

    def restore(self, namespace: NamespaceId, contents: list[PageContent]) -> None:
        """FREE → CACHED (indexed, refcount 0) for pages a warm restart recovered.

        ``contents`` come in eviction order: first in the list, first evicted."""
        pages = self._ns(namespace)
        restored = set()
        for content in contents:
            p = self._pages[content.page]
            assert p.state is PageState.FREE and p.namespace == namespace, (
                f"page {content.page} restored while {p.state.value}"
            )
            p.state, p.content, p.indexed = PageState.CACHED, content, True
            pages.cached.add(content.page)
            restored.add(content.page)
        pages.free = [page for page in pages.free if page not in restored]

    def extent_in_use(self, extent: str) -> int:
        return self._extent_in_use[extent]

    # ---- queries ------------------------------------------------------------------

    def __contains__(self, page: PageId) -> bool:
        return page in self._pages

    def namespace_of(self, page: PageId) -> NamespaceId:
        return self._pages[page].namespace

    def state(self, page: PageId) -> PageState:
        return self._pages[page].state

    def refcount(self, page: PageId) -> int:
        return self._pages[page].refcount

    def pins(self, page: PageId) -> int:
        return self._pages[page].pins

    def content(self, page: PageId) -> PageContent | None:
        return self._pages[page].content

    def is_indexed(self, page: PageId) -> bool:
        return self._pages[page].indexed

    def free_count(self, namespace: NamespaceId) -> int:
        return len(self._ns(namespace).free)

    def cached_count(self, namespace: NamespaceId) -> int:
        return len(self._ns(namespace).cached)

    def lru_order(self, namespace: NamespaceId) -> list[PageId]:
        """CACHED pages of a namespace, next eviction first."""
        return list(self._ns(namespace).cached)

    def free_list(self, namespace: NamespaceId) -> list[PageId]:
        return list(self._ns(namespace).free)

    def pages(self):
        """(page id, state, refcount, pins, namespace) of every page."""
        for page, p in self._pages.items():
            yield page, p.state, p.refcount, p.pins, p.namespace

    # ---- transitions --------------------------------------------------------------

    def allocate(self, namespace: NamespaceId, count: int) -> list[PageId]:
        """``count`` pages FREE → PRIVATE with refcount 1. The caller made sure they exist."""
        if not count:  # most decode steps fit in the tail page
            return []
        free, pages_of, free_state, private = self._ns(namespace).free, self._pages, PageState.FREE, PageState.PRIVATE
        taken = free[len(free) - count :][::-1]
        del free[len(free) - count :]
        extents = []
        for page in taken:
            p = pages_of[page]
            assert p.state is free_state and p.refcount == 0, f"free list held page {page} in state {p.state.value}"
            p.state = private
            p.refcount = 1
            extents.append(p.extent)
        for extent, n in Counter(extents).items():
            self._extent_in_use[extent] += n
        self._counters.of(namespace).refcount_increments += count
        return taken

    def acquire(self, page: PageId, pin: bool = False) -> None:
        """One more reference to a published or cached page (a prefix hit, a fork, a pin)."""
        self.acquire_all((page,), pin)

    def acquire_all(self, pages: Sequence[PageId], pin: bool = False) -> None:
        """acquire() for each page of one namespace, in one pass (a 50K-token hit pins ~3K pages).

        The loop only counts; a page that is not PUBLISHED in that namespace takes
        ``_revive``, which moves a CACHED page out of the LRU or names a broken invariant."""
        if not pages:
            return
        pages_of, published = self._pages, PageState.PUBLISHED
        namespace = pages_of[pages[0]].namespace
        for page in pages:
            p = pages_of[page]
            if p.state is not published or p.namespace != namespace:
                self._revive(page, p, namespace)
            p.refcount += 1
        if pin:
            for page in pages:
                pages_of[page].pins += 1
        self._counters.of(namespace).refcount_increments += len(pages)

    def _revive(self, page: PageId, p: _Page, namespace: NamespaceId) -> None:
        assert p.namespace == namespace, (
            f"page {page} of namespace {p.namespace} acquired with pages of namespace {namespace}"
        )
        if p.state is PageState.CACHED:
            self._by_namespace[p.namespace].cached.remove(page)
            p.state = PageState.PUBLISHED
            self._extent_in_use[p.extent] += 1
        assert p.state is PageState.PUBLISHED, (
            f"page {page} acquired while {p.state.value}; only published pages are shared"
        )

    def release(self, page: PageId, pin: bool = False) -> None:
        """Drops one reference; at zero a private or unindexed page is freed, an indexed one cached."""
        self.release_all((page,), pin)

    def release_all(self, pages: Iterable[PageId], pin: bool = False) -> None:
        """release() for each page of one namespace, in the given order (kvd/eviction.py's release_order)."""
        pages = list(pages)
        if not pages:
            return
        pages_of, in_use, published = self._pages, self._extent_in_use, PageState.PUBLISHED
        namespace = pages_of[pages[0]].namespace
        cache = self._by_namespace[namespace].cached.add
        for page in pages:
            p = pages_of[page]
            if p.refcount < 1 or p.namespace != namespace or (pin and p.pins < 1):
                self._refuse_release(page, p, namespace, pin)
            p.refcount -= 1
            if pin:
                p.pins -= 1
            if p.refcount:
                continue
            in_use[p.extent] -= 1
            if p.state is published and p.indexed:
                p.state = PageState.CACHED
                cache(page)
            else:
                self._to_free(page, p)
        self._counters.of(namespace).refcount_decrements += len(pages)

    @staticmethod
    def _refuse_release(page: PageId, p: _Page, namespace: NamespaceId, pin: bool) -> None:
        """Names the broken invariant of a release that must not happen."""
        assert p.namespace == namespace, (
            f"page {page} of namespace {p.namespace} released with pages of namespace {namespace}"
        )
        assert p.refcount > 0, f"page {page} released with refcount 0 (double release)"
        assert not pin or p.pins > 0, f"page {page} unpinned but holds no pin"

    def publish(self, page: PageId, content: PageContent, indexed: bool) -> None:
        """PRIVATE → PUBLISHED: the page is immutable from now on."""
        p = self._pages[page]
        assert p.state is PageState.PRIVATE and p.refcount == 1, (
            f"page {page} published while {p.state.value} with refcount {p.refcount}"
        )
        p.state = PageState.PUBLISHED
        p.content = content
        p.indexed = indexed

    def evict_next(self, namespace: NamespaceId) -> PageContent:
        """CACHED → FREE for the eviction policy's next victim; returns what it held."""
        return self._evict(self._ns(namespace).cached.victim())

    def evict(self, page: PageId) -> PageContent:
        """CACHED → FREE for one page (integrity failures, extent reclaim)."""
        p = self._pages[page]
        assert p.state is PageState.CACHED, f"page {page} evicted while {p.state.value}"
        self._by_namespace[p.namespace].cached.remove(page)
        return self._evict(page)

    def unindex(self, page: PageId) -> None:
        """Takes a published page out of sharing (it failed its checksum, or its chain was
        re-published after its parent did): a CACHED one is
        freed now, a referenced one stays with its holders and is freed, never cached, on
        its last release. The caller removes its index entry."""
        p = self._pages[page]
        assert p.content is not None, f"page {page} unindexed while {p.state.value}"
        p.indexed = False
        if p.state is PageState.CACHED:
            self._by_namespace[p.namespace].cached.remove(page)
            self._to_free(page, p)

    def _evict(self, page: PageId) -> PageContent:
        p = self._pages[page]
        content = p.content
        assert content is not None, f"cached page {page} has no content"
        self._counters.of(p.namespace).evicted_pages += 1
        self._to_free(page, p)
        return content

    def _to_free(self, page: PageId, p: _Page) -> None:
        if p.content is not None and self._on_unpublish is not None:
            self._on_unpublish(page)
        p.state = PageState.FREE
        p.content = None
        p.indexed = False
        self._by_namespace[p.namespace].free.append(page)

    def _ns(self, namespace: NamespaceId) -> _NamespacePages:
        pages = self._by_namespace.get(namespace)
        if pages is None:
            pages = self._by_namespace[namespace] = _NamespacePages()
        return pages
