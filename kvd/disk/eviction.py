"""Which pages the disk tier gives up when the disk is full: its eviction policy, apart from
the tier's index (kvd/disk/tier.py) so that another (ARC, bench/RESULTS.md) replaces it.

``LruPolicy`` keeps the pages on disk in recency order: a page written or hit is the most
recent; ``victims`` names the least recent ones. Keys are the tier's (namespace root, chain key).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable


class LruPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def admitted(self, key: Hashable) -> None:
        """A page was written (or found when the disk was opened)."""
        self._order[key] = None
        self._order.move_to_end(key)

    def hit(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, count: int, usable: Callable[[Hashable], bool] = lambda key: True) -> list[Hashable]:
        """The ``count`` least recent pages ``usable`` accepts (fewer when fewer are on disk),
        forgotten now."""
        chosen = list(itertools.islice((key for key in self._order if usable(key)), count))
        for key in chosen:
            del self._order[key]
        return chosen
