"""The eviction policy: in which order cached pages and on-hold sequences give up their room.

Edit this module to change the policy; the pool keeps the data, ``Room`` (kvd/room.py)
decides when room is needed and in which order its sources are tried.

Today's policy:

- Cached pages (published, refcount 0) go least recently released first (LRU), one
  queue per namespace (``CachedQueue``).
- A chain's tail goes before its parents: whoever drops references to a chain (a released
  sequence, an expired pin, a refused batch) releases them in ``release_order``, tail
  first, so the tail enters the queue first; pages a warm restart recovers enter it in
  ``restore_order``, deepest first. A prefix therefore never loses its head while its
  tail stays cached, and a lookup (which walks a chain from page 0) never finds a tail it
  cannot reach.
- An on-hold sequence is evicted only when no cached page or reclaimable extent is left,
  the one on hold longest first (``held_victim``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from kvd.types import PageId

T = TypeVar("T")


class CachedQueue:
    """The cached pages of one namespace, next victim first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[PageId, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[PageId]:
        return iter(self._order)

    def add(self, page: PageId) -> None:
        """The page's last reference is gone: it is now the last to be evicted."""
        self._order[page] = None

    def remove(self, page: PageId) -> None:
        """The page is referenced again, or dropped out of turn."""
        del self._order[page]

    def victim(self) -> PageId:
        """Takes the next page to evict out of the queue."""
        page, _ = self._order.popitem(last=False)
        return page


def release_order(pages: Sequence[PageId]) -> Iterable[PageId]:
    """The order to drop references to a chain's pages in (``pages`` parents first): the
    tail first, so it is evicted before its parents."""
    return reversed(pages)


def restore_order(pages: list[tuple[int, T]]) -> list[T]:
    """Recovered (chain page index, page) pairs in the order they enter the queue: deepest first."""
    return [page for _, page in sorted(pages, key=lambda p: -p[0])]


def held_victim(on_hold: Iterable[T], protect: T | None = None) -> T | None:
    """The on-hold sequence to evict next (on hold longest first), never ``protect``; None if none."""
    return next((seq for seq in on_hold if seq is not protect), None)
