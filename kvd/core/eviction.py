"""The eviction policy: in which order cached pages and on-hold sequences give up their room.

Edit this module to change the policy; the pool keeps the data, ``Room`` (kvd/cache/room.py)
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

from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from kvd.core.page_columns import CACHED, PageColumns

SLOT = np.int32  # an entry's slot: a page column's index (kvd/core/page_columns.py), 4 B an entry less than int64
STALE_ENTRIES = 1024  # entries left behind in a queue, beyond its live ones, before they are dropped

T = TypeVar("T")


class CachedQueue:
    """The cached pages of one namespace, next victim first: a log of (slot, stamp) entries.

    A page enters at the tail when its last reference goes, under a stamp no entry had
    before (kvd/core/page_columns.py keeps each page's state and latest stamp). Entries never
    leave out of turn: a page that stops being cached (a hit references it again, or it is
    freed out of turn) leaves its entry behind, no longer live (the page is not CACHED, or
    is under a newer stamp), to be skipped when reached; once such entries outnumber the
    live ones they are dropped, so each entry is looked at O(1) times. A 50K-token hit on
    cached pages thus costs the queue nothing, where an ordered map removed 3,125 entries
    one by one; and a page cached again goes to the tail, as after a removal and a new entry.
    """

    __slots__ = ("_columns", "_slots", "_stamps", "_slot_at", "_stamp_at", "_head", "_tail", "_live")

    def __init__(self, columns: PageColumns) -> None:
        self._columns = columns
        self._arrays(np.zeros(1024, SLOT), np.zeros(1024, np.int64))
        self._head = 0  # the next entry to pop
        self._tail = 0  # one past the last entry
        self._live = 0  # live entries: the namespace's cached pages

    def __len__(self) -> int:
        """The cached pages."""
        return self._live

    def slots(self) -> np.ndarray:
        """The slots of the cached pages, next victim first."""
        slots, stamps = self._entries()
        return slots[self._is_live(slots, stamps)]

    def push(self, slots: np.ndarray) -> None:
        """Pages (already CACHED) whose last references went, in the order they went: the
        last to be evicted."""
        columns, count = self._columns, len(slots)
        stamps = np.arange(columns.next_stamp, columns.next_stamp + count)
        columns.next_stamp += count
        columns.stamp[slots] = stamps
        self._room(count)
        self._slots[self._tail : self._tail + count] = slots
        self._stamps[self._tail : self._tail + count] = stamps
        self._tail += count
        self._live += count
        self._drop_stale()

    def push_one(self, slot: int) -> None:
        """``push`` for one page."""
        columns = self._columns
        columns.stamp_at[slot] = columns.next_stamp
        self._room(1)
        self._slot_at[self._tail] = slot
        self._stamp_at[self._tail] = columns.next_stamp
        columns.next_stamp += 1
        self._tail += 1
        self._live += 1
        self._drop_stale()

    def left(self, count: int) -> None:
        """``count`` of its pages stopped being cached out of turn (a hit, a page evicted or
        unindexed on its own): their entries stay behind."""
        self._live -= count

    def victim(self) -> int:
        """Takes the next page to evict out of the queue; its slot."""
        assert self._live, "no cached page to evict"
        columns = self._columns
        while True:
            slot, stamp = self._slot_at[self._head], self._stamp_at[self._head]
            self._head += 1
            if columns.state_at[slot] == CACHED and columns.stamp_at[slot] == stamp:
                self._live -= 1
                return slot

    def victims(self, count: int) -> np.ndarray:
        """Takes the next ``count`` pages to evict out of the queue (all when fewer); their slots."""
        count = min(count, self._live)
        if not count:
            return np.zeros(0, SLOT)
        slots, stamps = self._entries()
        window = count  # entries looked at: doubled until ``count`` live ones are in it
        while True:
            live = np.flatnonzero(self._is_live(slots[:window], stamps[:window]))
            if len(live) >= count:
                break
            window *= 2
        taken = slots[live[:count]]
        self._head += int(live[count - 1]) + 1  # and the entries left behind among them
        self._live -= count
        return taken

    def _is_live(self, slots: np.ndarray, stamps: np.ndarray) -> np.ndarray:
        """Which entries name a page still cached under that entry."""
        return (self._columns.state[slots] == CACHED) & (self._columns.stamp[slots] == stamps)

    def _entries(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, stamps) of every entry, oldest first (views: read before the next change)."""
        return self._slots[self._head : self._tail], self._stamps[self._head : self._tail]

    def _drop_stale(self) -> None:
        """Keeps only the live entries once the others outnumber them (and a margin)."""
        if self._tail - self._head <= 2 * self._live + STALE_ENTRIES:
            return
        slots, stamps = self._entries()
        live = self._is_live(slots, stamps)
        self._slots[: self._live] = slots[live]
        self._stamps[: self._live] = stamps[live]
        self._head, self._tail = 0, self._live

    def _room(self, count: int) -> None:
        """Makes room for ``count`` more entries past the tail: moves the entries to new
        arrays, twice as long when they would be over half full."""
        if self._tail + count <= len(self._slots):
            return
        entries = self._tail - self._head
        size = len(self._slots)
        if entries + count > size // 2:
            size = max(2 * size, 2 * (entries + count))
        slots, stamps = np.zeros(size, SLOT), np.zeros(size, np.int64)
        slots[:entries], stamps[:entries] = self._entries()
        self._arrays(slots, stamps)
        self._head, self._tail = 0, entries

    def _arrays(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """The entries' arrays, and memoryviews of them for one entry at a time (cheaper than numpy items)."""
        self._slots, self._stamps = slots, stamps
        self._slot_at, self._stamp_at = memoryview(slots), memoryview(stamps)


def release_order(pages: Sequence[T]) -> Iterable[T]:
    """The order to drop references to a chain's pages (or what holds them) in (``pages``
    parents first): the tail first, so it is evicted before its parents."""
    return reversed(pages)


def restore_order(pages: list[tuple[int, T]]) -> list[T]:
    """Recovered (chain page index, page) pairs in the order they enter the queue: deepest first."""
    return [page for _, page in sorted(pages, key=lambda p: -p[0])]


def held_victim(on_hold: Iterable[T], protect: T | None = None) -> T | None:
    """The on-hold sequence to evict next (on hold longest first), never ``protect``; None if none."""
    return next((seq for seq in on_hold if seq is not protect), None)
