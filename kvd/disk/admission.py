"""Which pages host memory gives up the disk tier writes: those used ``min_uses`` times at
least (``[disk] min_uses``; Dynamo KVBM's frequency filter admits on the second use).

A use is a page's publish or an allocation that hit it (a page promoted from the disk is
not used by coming back, only by the allocation that takes it). The study (bench/RESULTS.md)
found the second-use gate cuts the pages written 2-3x, at a loss of hits where the disk is
large against host memory: a page's second use often comes after host memory dropped it,
and only then does it reach the disk. With ``min_uses = 1`` (the default) every page goes,
and the tier counts nothing.

``UseCounts`` remembers the uses of a bounded number of pages, least recently used
forgotten first: a page forgotten counts from zero again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class UseCounts:
    """Uses by page key (the tier's (namespace root, chain key)), of ``remembered`` pages at most."""

    def __init__(self, min_uses: int, remembered: int) -> None:
        assert min_uses >= 1 and remembered >= 1, (min_uses, remembered)
        self.min_uses = min_uses
        self.remembered = remembered
        self._uses: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._uses)

    def used(self, key: Hashable) -> None:
        uses = self._uses
        uses[key] = uses.pop(key, 0) + 1
        if len(uses) > self.remembered:
            uses.popitem(last=False)

    def enough(self, key: Hashable) -> bool:
        """Whether the page has had ``min_uses`` uses."""
        return self._uses.get(key, 0) >= self.min_uses
