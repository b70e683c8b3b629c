"""The eviction policy: in which order cached pages and on-hold sequences give up their room.

Edit this module to change the policy; the pool keeps the data, ``Room`` (kvd/room.py)
decides when room is needed and in which order its sources are tried.

Today's policy:

- Cached pages (published, refcount 0) go least recently released first (LRU), one
  queue per namespace (``CachedQueue``; the pool skips the entries of pages that left it).
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

from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from kvd.types import PageId

T = TypeVar("T")


class CachedQueue:
    """The cached pages of one namespace, next victim first: a log of (slot, stamp) entries.

    A page enters at the tail when its last reference goes, under a stamp no other entry
    ever had. Entries never leave out of turn: a page that stops being cached (a hit
    references it again, or it is freed out of turn) leaves its entry behind, and the pool
    (kvd/pool.py), which knows each cached page's current stamp, skips the entry when it is
    reached or ``keep``s only live ones. So a 50K-token hit on cached pages removes nothing
    from here, where an ordered map removed 3,125 entries one by one; and a page that is
    cached again goes to the tail, as with a removal and a new entry.
    """

    __slots__ = ("_slots", "_stamps", "_slot_at", "_stamp_at", "_head", "_tail")

    def __init__(self) -> None:
        self._arrays(np.zeros(1024, np.int64), np.zeros(1024, np.int64))
        self._head = 0  # the next entry to pop
        self._tail = 0  # one past the last entry

    def __len__(self) -> int:
        """Entries, live or left behind."""
        return self._tail - self._head

    def push(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """Pages whose last references went, in the order they went: the last to be evicted."""
        self._room(len(slots))
        self._slots[self._tail : self._tail + len(slots)] = slots
        self._stamps[self._tail : self._tail + len(slots)] = stamps
        self._tail += len(slots)

    def push_one(self, slot: int, stamp: int) -> None:
        self._room(1)
        self._slot_at[self._tail] = slot
        self._stamp_at[self._tail] = stamp
        self._tail += 1

    def pop(self) -> tuple[int, int]:
        """The oldest entry, taken out: (slot, stamp), live or not."""
        assert self._head < self._tail, "popped an empty cached-page queue"
        self._head += 1
        return self._slot_at[self._head - 1], self._stamp_at[self._head - 1]

    def drop(self, count: int) -> None:
        """Takes the oldest ``count`` entries out."""
        assert count <= len(self), f"dropped {count} entries of a cached-page queue of {len(self)}"
        self._head += count

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, stamps) of every entry, oldest first (views: read before the next change)."""
        return self._slots[self._head : self._tail], self._stamps[self._head : self._tail]

    def keep(self, live: np.ndarray) -> None:
        """Keeps the entries where ``live`` (one bool per entry of ``entries``) is true, in order."""
        slots, stamps = self.entries()
        kept = int(np.count_nonzero(live))
        self._slots[:kept] = slots[live]
        self._stamps[:kept] = stamps[live]
        self._head, self._tail = 0, kept

    def _room(self, count: int) -> None:
        """Makes room for ``count`` more entries past the tail: moves the entries to new
        arrays, twice as long when they would be over half full."""
        if self._tail + count <= len(self._slots):
            return
        entries = self._tail - self._head
        size = len(self._slots)
        if entries + count > size // 2:
            size = max(2 * size, 2 * (entries + count))
        slots, stamps = np.zeros(size, np.int64), np.zeros(size, np.int64)
        slots[:entries], stamps[:entries] = self.entries()
        self._arrays(slots, stamps)
        self._head, self._tail = 0, entries

    def _arrays(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """The entries' arrays, and memoryviews of them for one entry at a time (cheaper than numpy items)."""
        self._slots, self._stamps = slots, stamps
        self._slot_at, self._stamp_at = memoryview(slots), memoryview(stamps)


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
