"""Page columns: every page's state, refcount, pins, namespace, ... in arrays, at its slot.

The pool (kvd/core/pool.py) keeps its per-page data here, one array ("column") per field, so a
batch of pages is read and changed with a few numpy operations; each column also has a
memoryview of the same memory, through which the pool reads and writes one page's field
as a Python int at about a third of a numpy item's cost.

Columns are indexed by slot, not by page id: page ids are never reused (kvd/core/arena.py: a
stale id must not alias a new extent's page), so arrays indexed by page id would grow with
every extent ever built. An extent's pages take consecutive slots, ``slot = page +
offset`` of their extent, and the slots of a removed extent go to the next one that fits.
"""

from __future__ import annotations

import array
import bisect
from bisect import bisect_right
from collections.abc import Iterable

import numpy as np

from kvd.core.types import PageId, PageState

STATES = tuple(PageState)  # ``state`` holds a page's position here (its code)
FREE, PRIVATE, PUBLISHED, CACHED = (
    STATES.index(s) for s in (PageState.FREE, PageState.PRIVATE, PageState.PUBLISHED, PageState.CACHED)
)
KEY_BYTES = 16  # of a page key (kvd/wire/keys.py)


class PageColumns:
    """The columns, and the slots of the pages of every live extent."""

    def __init__(self) -> None:
        # Per live extent, ascending by first page id: first id, one past its last id, slot - id.
        self._firsts: list[int] = []
        self._ends: list[int] = []
        self._offsets: list[int] = []
        self._first_ids = self._end_ids = self._offset_ids = np.zeros(0, np.int64)  # the same, for batches
        # The extent ``slot`` found last (first id, end, offset): the pages of one call mostly share one.
        self._last_first = self._last_end = self._last_offset = 0
        self._gaps: list[range] = []  # slots no extent holds below ``capacity``, ascending, never adjacent
        self.capacity = 0  # every extent's slots lie below
        self.page = np.zeros(0, np.int64)  # the page id at each slot
        self.state = np.zeros(0, np.int8)  # FREE, PRIVATE, PUBLISHED or CACHED
        self.refcount = np.zeros(0, np.int32)
        self.pins = np.zeros(0, np.int32)
        self.namespace = np.zeros(0, np.int32)
        self.indexed = np.zeros(0, np.bool_)  # the index maps the page's content key to it
        self.stamp = np.zeros(0, np.int64)  # a CACHED page's entry in its queue (kvd/core/eviction.py)
        # A published page's seal (kvd/durability/integrity.py decides it): 9 B a page, where a
        # dict by page id took ~88 B
        self.sealed = np.zeros(0, np.bool_)
        self.checksum = np.zeros(0, np.uint64)
        self.run = np.zeros(0, np.int64)  # an indexed page's place in its run: kvd/core/index.py's
        # An indexed page's key (kvd/core/index.py writes it, kvd/core/key_table.py finds it);
        # ``key_at`` is its bytes, KEY_BYTES a slot
        self.key = np.zeros(0, f"V{KEY_BYTES}")
        # Which publish of its slot a published page is (counted up at each, modulo 2**32): what
        # work begun on a page checks it still holds, rather than the identity of its content
        self.publication = np.zeros(0, np.uint32)
        # What a PUBLISHED or CACHED page holds (kvd/core/index.py PageContent), None for any
        # other: a list, one reference a slot, where a dict by page id took ~50 B a page.
        self.content: list = []
        self.next_stamp = 0  # stamps are never reused, across namespaces too
        self._views()

    def _views(self) -> None:
        self.page_at = memoryview(self.page)
        self.state_at = memoryview(self.state)
        self.refcount_at = memoryview(self.refcount)
        self.pins_at = memoryview(self.pins)
        self.namespace_at = memoryview(self.namespace)
        self.indexed_at = memoryview(self.indexed)
        self.stamp_at = memoryview(self.stamp)
        self.sealed_at = memoryview(self.sealed)
        self.checksum_at = memoryview(self.checksum)
        self.run_at = memoryview(self.run)
        self.key_at = memoryview(self.key.view(np.uint8))
        self.publication_at = memoryview(self.publication)

    def _resize(self, size: int) -> None:
        """Makes every column ``size`` slots long, keeping what they hold."""
        self.page = _longer(self.page, size)
        self.state = _longer(self.state, size)
        self.refcount = _longer(self.refcount, size)
        self.pins = _longer(self.pins, size)
        self.namespace = _longer(self.namespace, size)
        self.indexed = _longer(self.indexed, size)
        self.stamp = _longer(self.stamp, size)
        self.sealed = _longer(self.sealed, size)
        self.checksum = _longer(self.checksum, size)
        self.run = _longer(self.run, size)
        self.key = _longer(self.key, size)
        self.publication = _longer(self.publication, size)
        self.content += [None] * (size - len(self.content))
        self._views()

    # ---- extents ------------------------------------------------------------------

    def add(self, first: PageId, count: int, namespace: int) -> range:
        """Slots for a new extent's pages ``[first, first + count)``, FREE: the first gap
        they fit in, else new slots past ``capacity``."""
        at = bisect.bisect_right(self._firsts, first)
        below_ok = not at or self._ends[at - 1] <= first
        above_ok = at == len(self._firsts) or first + count <= self._firsts[at]
        assert below_ok and above_ok, f"pages {first}..{first + count - 1} overlap a live extent's"
        fits = next((i for i, gap in enumerate(self._gaps) if len(gap) >= count), None)
        if fits is None:
            slots = range(self.capacity, self.capacity + count)
            self.capacity += count
            if self.capacity > len(self.state):
                self._resize(max(self.capacity, 2 * len(self.state)))
        else:
            gap = self._gaps[fits]
            slots = range(gap.start, gap.start + count)
            if len(gap) > count:
                self._gaps[fits] = range(slots.stop, gap.stop)
            else:
                del self._gaps[fits]
        self._firsts.insert(at, first)
        self._ends.insert(at, first + count)
        self._offsets.insert(at, slots.start - first)
        self._mirror()
        held = slice(slots.start, slots.stop)
        self.page[held] = np.arange(first, first + count)
        self.state[held] = FREE
        self.refcount[held] = 0
        self.pins[held] = 0
        self.namespace[held] = namespace
        self.indexed[held] = False
        self.sealed[held] = False
        self.run[held] = -1
        self.publication[held] = 0
        self.content[held] = [None] * count
        return slots

    def remove(self, first: PageId) -> None:
        """Forgets the extent whose first page is ``first``: its slots become a gap."""
        at = bisect.bisect_left(self._firsts, first)
        assert at < len(self._firsts) and self._firsts[at] == first, f"no extent starts at page {first}"
        slots = range(first + self._offsets[at], self._ends[at] + self._offsets[at])
        del self._firsts[at], self._ends[at], self._offsets[at]
        self._mirror()
        gaps = sorted([*self._gaps, slots], key=lambda gap: gap.start)
        merged = [gaps[0]]
        for gap in gaps[1:]:
            if merged[-1].stop == gap.start:
                merged[-1] = range(merged[-1].start, gap.stop)
            else:
                merged.append(gap)
        if merged[-1].stop == self.capacity:  # the end is free: new extents start there
            self.capacity = merged.pop().start
        self._gaps = merged

    def extents(self) -> list[tuple[PageId, range]]:
        """(first page, slots) of every live extent, ascending by page id."""
        return [
            (PageId(first), range(first + offset, end + offset))
            for first, end, offset in zip(self._firsts, self._ends, self._offsets)
        ]

    # ---- slots --------------------------------------------------------------------

    def __contains__(self, page: int) -> bool:
        try:
            self.slot(page)
        except KeyError:
            return False
        return True

    def slot(self, page: int) -> int:
        """The slot of one page; KeyError for a page of no live extent."""
        if self._last_first <= page < self._last_end:
            return page + self._last_offset
        at = bisect_right(self._firsts, page) - 1
        if at < 0 or page >= self._ends[at]:
            raise KeyError(page)
        self._last_first, self._last_end, self._last_offset = self._firsts[at], self._ends[at], self._offsets[at]
        return page + self._last_offset

    def slots(self, pages: Iterable[int]) -> np.ndarray:
        """The slots of a batch of pages, in order (int64); KeyError for a page of no live extent."""
        ids = np.frombuffer(array.array("I", pages), np.uintc).astype(np.int64)  # page ids are uint32 on the wire
        if not self._firsts and len(ids):
            raise KeyError(int(ids[0]))
        at = np.searchsorted(self._first_ids, ids, "right") - 1
        known = (at >= 0) & (ids < self._end_ids[at])
        if not known.all():
            raise KeyError(int(ids[np.flatnonzero(~known)[0]]))
        return ids + self._offset_ids[at]

    def _mirror(self) -> None:
        """The extents changed: the arrays for batches follow the lists, ``slot`` forgets its last extent."""
        self._last_first = self._last_end = self._last_offset = 0
        self._first_ids = np.array(self._firsts, np.int64)
        self._end_ids = np.array(self._ends, np.int64)
        self._offset_ids = np.array(self._offsets, np.int64)


def _longer(column: np.ndarray, size: int) -> np.ndarray:
    new = np.zeros(size, column.dtype)
    new[: len(column)] = column
    return new
