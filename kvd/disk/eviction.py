"""Which pages the disk tier keeps when it is full: its eviction policy, apart from the tier's
index (kvd/disk/tier.py). bench/trace_sim.py replays traces through these same classes, so
what the study measured is what the daemon runs.

A policy holds the keys of the pages on disk (or on their way there), ``capacity`` of them
at most; keys are the tier's (namespace root, chain key), any hashable in the simulator.

- ``admit(key)``: a page not held is about to be written; answers the keys to free first so
  that it fits (already forgotten here; the key itself when the capacity is 0).
- ``hit(key)``: a page held was used again (read back for a prompt, or evicted from host
  memory again while the disk still has it).
- ``forget(key)``: a page left the disk by no choice of the policy (rejected when read back,
  its write refused).
- ``victims(count)``: the disk refused a write for lack of room although the policy holds
  fewer than ``capacity`` pages (pages of several sizes share the file): ``count`` more to
  free, in the policy's order, forgotten now.

``LruPolicy``: least recently used first. ``ArcPolicy``: Adaptive Replacement Cache (Megiddo
and Modha, FAST'03), the default: the disk choice of the trace study (bench/RESULTS.md,
+0.026 of the trace's blocks over an LRU disk at RAM 2 % / disk 40 %).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol


class EvictionPolicy(Protocol):
    capacity: int

    def __contains__(self, key: Hashable) -> bool: ...

    def __len__(self) -> int: ...

    def admit(self, key: Hashable) -> list[Hashable]: ...

    def hit(self, key: Hashable) -> None: ...

    def forget(self, key: Hashable) -> None: ...

    def victims(self, count: int) -> list[Hashable]: ...


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

    def victims(self, count: int) -> list[Hashable]:
        return [self._order.popitem(last=False)[0] for _ in range(min(count, len(self._order)))]


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

    def victims(self, count: int) -> list[Hashable]:
        freed: list[Hashable] = []
        while len(freed) < count and len(self):
            freed.append(self._give_up(after_b2=False))
        return freed

    def _replace(self, after_b2: bool) -> list[Hashable]:
        """ARC's REPLACE: when the cache is full, the page to free for the one coming in."""
        return [self._give_up(after_b2)] if len(self) >= self.capacity else []

    def _give_up(self, after_b2: bool) -> Hashable:
        """Moves the oldest page of T1 (above its target) or else of T2 to its ghost list."""
        t1 = self._t1
        if t1 and (len(t1) > self._target or (after_b2 and len(t1) == self._target) or not self._t2):
            key = t1.popitem(last=False)[0]
            self._b1[key] = None
        else:
            key = self._t2.popitem(last=False)[0]
            self._b2[key] = None
        return key


POLICIES: dict[str, type[LruPolicy] | type[ArcPolicy]] = {"arc": ArcPolicy, "lru": LruPolicy}
