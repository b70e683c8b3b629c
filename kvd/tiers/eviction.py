"""Which pages a tier keeps when it is full: the disk tier's eviction policy (``[disk]
policy``, whose names kvd/config.py reads from ``POLICIES`` here), apart from its index
(kvd/disk/index.py). bench/trace_sim.py replays traces through these same classes, so what
the study measured is what the daemon runs.

A policy holds the keys of the pages on disk (or on their way there), ``capacity`` of them
at most; keys are the tier's (namespace root, chain key), any hashable in the simulator.

- ``admit(key)``: a page not held is about to be written; answers the keys to free first so
  that it fits (already forgotten here; the key itself when the capacity is 0).
- ``hit(key)``: a page held was used again (read back for a prompt, or evicted from host
  memory again while the disk still has it).
- ``forget(key)``: a page left the disk by no choice of the policy (rejected when read back,
  its write refused).
- ``victims(count, usable)``: the disk refused a write for lack of room although the policy
  holds fewer than ``capacity`` pages (pages of several sizes share the file): ``count``
  more to free among the pages ``usable`` accepts (kvd/disk/reclaim.py: those whose slots
  the refused pages can use), in the policy's order, forgotten now.

``LruPolicy``: least recently used first. ``ArcPolicy``: Adaptive Replacement Cache (Megiddo
and Modha, FAST'03), the default: the disk choice of the trace study (bench/RESULTS.md,
+0.026 of the trace's blocks over an LRU disk at RAM 2 % / disk 40 %).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

Usable = Callable[[Hashable], bool]  # which held pages ``victims`` may name


def _any(key: Hashable) -> bool:
    return True


class EvictionPolicy(Protocol):
    capacity: int

    def __contains__(self, key: Hashable) -> bool: ...

    def __len__(self) -> int: ...

    def admit(self, key: Hashable) -> list[Hashable]: ...

    def hit(self, key: Hashable) -> None: ...

    def forget(self, key: Hashable) -> None: ...

    def victims(self, count: int, usable: Usable = _any) -> list[Hashable]: ...


class LruPolicy:
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def admit(self, key: Hashable) -> list[Hashable]:
        order = self._order
        order[key] = None
        return [order.popitem(last=False)[0]] if len(order) > self.capacity else []

    def hit(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, count: int, usable: Usable = _any) -> list[Hashable]:
        chosen = _oldest(self._order, usable, count)
        for key in chosen:
            del self._order[key]
        return chosen


class ArcPolicy:
    """Adaptive Replacement Cache: pages used once (T1) and pages used again (T2), each in
    recency order, with ghosts of what each gave up (B1, B2: keys only, no page). A page
    admitted whose ghost is in B1 was given up too soon by recency, so T1's target size
    grows; in B2, shrinks. A page that comes back as a ghost enters T2. The cache never holds
    more than ``capacity`` pages, nor remembers more than ``capacity`` ghosts besides."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._target = 0.0  # T1's target size, 0 to capacity

    def __contains__(self, key: Hashable) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def admit(self, key: Hashable) -> list[Hashable]:
        c, t1, t2, b1, b2 = self.capacity, self._t1, self._t2, self._b1, self._b2
        if key in b1:
            self._target = min(c, self._target + max(len(b2) / len(b1), 1))
            freed = self._replace(after_b2=False)
            del b1[key]
            t2[key] = None
            return freed
        if key in b2:
            self._target = max(0.0, self._target - max(len(b1) / len(b2), 1))
            freed = self._replace(after_b2=True)
            del b2[key]
            t2[key] = None
            return freed
        if c == 0:
            return [key]
        freed = []
        if len(t1) + len(b1) == c:
            if len(t1) < c:
                b1.popitem(last=False)
                freed = self._replace(after_b2=False)
            else:
                freed = [t1.popitem(last=False)[0]]  # T1 is the whole cache: its oldest leaves no ghost
        elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
            if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                b2.popitem(last=False)
            freed = self._replace(after_b2=False)
        t1[key] = None
        return freed

    def hit(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def victims(self, count: int, usable: Usable = _any) -> list[Hashable]:
        """Each as REPLACE would give it up (to its ghost list), among the pages ``usable``
        accepts: T1's oldest of them above its target, else T2's, else T1's below it."""
        freed: list[Hashable] = []
        while len(freed) < count and (given_up := self._give_up(after_b2=False, usable=usable)):
            freed += given_up
        return freed

    def _replace(self, after_b2: bool) -> list[Hashable]:
        """ARC's REPLACE: when the cache is full, the page to free for the one coming in."""
        return self._give_up(after_b2) if len(self) >= self.capacity else []

    def _give_up(self, after_b2: bool, usable: Usable = _any) -> list[Hashable]:
        """Moves the oldest page ``usable`` accepts of T1 (above its target) or else of T2 to
        its ghost list: its key, or none when neither list has such a page."""
        t1, t2 = self._t1, self._t2
        oldest = _oldest(t1, usable, 1)
        if not oldest or not (len(t1) > self._target or (after_b2 and len(t1) == self._target)):
            oldest_t2 = _oldest(t2, usable, 1)
            if oldest_t2:
                del t2[oldest_t2[0]]
                self._b2[oldest_t2[0]] = None
                return oldest_t2
        if oldest:
            del t1[oldest[0]]
            self._b1[oldest[0]] = None
        return oldest


def _oldest(pages: OrderedDict[Hashable, None], usable: Usable, count: int) -> list[Hashable]:
    """The ``count`` oldest of ``pages`` that ``usable`` accepts (fewer when fewer do)."""
    return list(itertools.islice((key for key in pages if usable(key)), count))


POLICIES: dict[str, type[LruPolicy] | type[ArcPolicy]] = {"arc": ArcPolicy, "lru": LruPolicy}
