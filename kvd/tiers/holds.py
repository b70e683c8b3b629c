"""The pool references a tier holds: every page a tier's transfer reads or writes is held
with a pool reference (kvd/core/pool.py), so it is never evicted or reused meanwhile (pages
being stored, a fetch's local hit and the pages it lands in). ``Holds`` keeps them, and the
backlog bytes they take; ``all`` lists them for kvd/cache/invariants.py. Each tier has one.
"""

from __future__ import annotations

from collections import Counter

from kvd.core.pool import PagePool
from kvd.core.types import PageId


class Holds:
    """The pool references one tier holds, by page, and the backlog bytes it holds."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.bytes = 0  # of pages held for the store, and of copies of evicted pages
        self._held: Counter[PageId] = Counter()

    def hold(self, pages: list[PageId], page_bytes: int) -> None:
        """One more reference to each page (published or cached), ``page_bytes`` each of the backlog."""
        self.pool.acquire_all(pages)
        for page in pages:
            self._held[page] += 1
        self.bytes += page_bytes * len(pages)

    def take(self, pages: list[PageId]) -> None:
        """New PRIVATE pages the tier was granted (``Room.grant_spare``; a fetch lands in them):
        their one reference is the tier's."""
        for page in pages:
            self._held[page] += 1

    def release(self, pages: list[PageId], page_bytes: int) -> None:
        """Drops the references ``hold`` or ``take`` counted, in the given order."""
        self.pool.release_all(pages)
        for page in pages:
            self._held[page] -= 1
            if not self._held[page]:
                del self._held[page]
        self.bytes -= page_bytes * len(pages)

    def all(self) -> Counter[PageId]:
        return Counter(+self._held)
