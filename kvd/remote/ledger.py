"""What the remote tier holds and counts: its pool references, their bytes, its counters.

Every page a store call reads or writes is held by the tier with a pool reference
(kvd/core/pool.py), so it is never evicted or reused meanwhile: pages being stored, a
fetch's local hit and the pages it lands in. ``Holds`` keeps them, and the bytes pages
being stored (and copies of evicted pages, kvd/remote/storing.py) take of the tier's
backlog; ``all`` lists them for kvd/cache/invariants.py. Storing (kvd/remote/storing.py)
and fetching (kvd/remote/fetching.py) share one ``Holds`` and one ``RemoteCounters``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvd.core.pool import PagePool
from kvd.core.types import PageId


@dataclass
class RemoteCounters:
    stored_pages: int = 0  # pages the store accepted
    fetched_pages: int = 0  # pages fetched, verified and published locally
    hit_tokens: int = 0  # allocated prefix tokens served by fetched pages
    refused_pages: int = 0  # puts the store refused (full or otherwise): the page stays local only
    skipped_pages: int = 0  # published while the link was down or the backlog full: not stored
    rejected_pages: int = 0  # fetched pages whose header or checksum did not match: a miss
    errors: int = 0  # store calls that failed (the master unreachable, a page that did not arrive)
    reoffered_pages: int = 0  # offered again after the store came back, and accepted (in stored_pages too)


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
