"""The one shape every tier reports its state through, and the latency histogram tiers keep.

A tier's ``stats()`` (kvd/tiers/tier.py) answers a ``TierStats``: its ``kind`` names it in
the cache's stats (kvd/cache/stats.py, ``Stats.tiers``), ``as_dict`` gives its fields (the
wire's ``DiskStats`` and ``RemoteStats``, kvd/server/messages.py), and ``combined`` adds
another tenant's stats of the same kind, as that tier defines. The disk tier's is
``DiskStats`` (kvd/disk/ledger.py), the remote tier's ``RemoteStats`` (kvd/remote/ledger.py);
the cache carries them without knowing a field.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import ClassVar, Protocol


class TierStats(Protocol):
    kind: ClassVar[str]  # where the stats name the tier: "disk", "remote"

    def combined(self, other: TierStats) -> TierStats:
        """This tenant's stats and another's (of the same kind) as one daemon's."""

    def as_dict(self) -> dict:
        """Its fields by name, as the wire names them."""


# Upper bounds (seconds) of the promotion latency's buckets, then one above them all: a
# promotion of 64 pages of 2 MiB read in 0.13-0.2 s on a SATA-class disk (bench/RESULTS.md).
PROMOTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Latencies:
    """Seconds observed, counted per bucket of ``PROMOTION_BUCKETS`` (the last: above them
    all), and their sum: a Prometheus histogram's data."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(PROMOTION_BUCKETS) + 1))
    seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(PROMOTION_BUCKETS, seconds)] += 1  # bucket i: at most PROMOTION_BUCKETS[i]
        self.seconds += seconds


def bucket_quantile(counts: list[int], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of what ``counts`` counted
    (inf: above the last bound); None when nothing was."""
    total, seen = sum(counts), 0
    for bound, n in zip((*PROMOTION_BUCKETS, float("inf")), counts):
        seen += n
        if total and seen >= q * total:
            return bound
    return None
