"""Event counters per namespace: the one home of every count that only ever grows.

Counts that follow from the state (pages per state, sessions, sequences) are not kept
here: kvd/cache/stats.py computes them from the core on demand. What happened over time is
counted here, by whichever class sees it happen: the pool counts refcount changes and
evictions, the manager lookups and hits, integrity the pages it dropped as corrupted.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.core.types import NamespaceId


@dataclass
class NamespaceCounters:
    refcount_increments: int = 0
    refcount_decrements: int = 0
    lookup_tokens: int = 0  # prompt tokens allocated with prefix matching
    hit_tokens: int = 0  # of those, tokens served from published pages
    evicted_pages: int = 0  # cached pages given up for room
    corrupted_pages: int = 0  # published pages dropped because their bytes failed the checksum


class Counters:
    """The counters of every namespace of one manager, created on first use."""

    def __init__(self) -> None:
        self._by_namespace: dict[NamespaceId, NamespaceCounters] = {}

    def of(self, namespace: NamespaceId) -> NamespaceCounters:
        counters = self._by_namespace.get(namespace)
        if counters is None:
            counters = self._by_namespace[namespace] = NamespaceCounters()
        return counters
