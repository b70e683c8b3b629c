"""What the disk tier counts, and what it reports. Its index (kvd/disk/index.py), its
write-back (kvd/disk/write_back.py) and its promotions (kvd/disk/source.py, through
kvd/tiers/fetches.py) share one ``DiskTierCounters``; the tier reports them, with what the
index and the store hold, as its ``DiskStats`` (a ``TierStats``, kvd/tiers/stats.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from kvd.tiers.stats import Latencies


@dataclass
class DiskTierCounters:
    written_pages: int = 0  # pages written to disk
    fetched_pages: int = 0  # pages read back, verified and published (promoted)
    hit_tokens: int = 0  # allocated prefix tokens served by promoted pages
    skipped_pages: int = 0  # evicted while the write backlog was full, or changed: not written
    refused_pages: int = 0  # not written: the disk full (after evicting), out of space, vanished
    evicted_pages: int = 0  # freed from the disk to make room
    rejected_pages: int = 0  # read back and failed a check: a miss, dropped from the disk
    errors: int = 0  # reads and writes that failed
    written_bytes: int = 0  # page bytes written
    read_bytes: int = 0  # page bytes read back (promotions, rejected pages included)
    promotions: Latencies = field(default_factory=Latencies)  # seconds each batch of reads took


@dataclass
class DiskStats:
    """The disk tier (kvd/disk/tier.py): what it holds and its counters."""

    kind: ClassVar[str] = "disk"
    state: str = "on"  # "opening" while the pages on disk are still being read and indexed (kvd/disk/opening.py)
    pages: int = 0  # pages on disk now
    bytes: int = 0  # their page bytes
    capacity_bytes: int = 0  # the file reserved
    written_pages: int = 0
    fetched_pages: int = 0  # read back, verified and published (promoted)
    hit_tokens: int = 0  # allocated prefix tokens served by promoted pages
    skipped_pages: int = 0  # evicted while the write backlog was full (or changed): not written
    refused_pages: int = 0  # not written: disk full after evicting, out of space, vanished
    evicted_pages: int = 0  # freed from the disk to make room
    rejected_pages: int = 0  # read back and failed a check: dropped from the disk
    errors: int = 0  # reads and writes that failed
    written_bytes: int = 0  # page bytes written
    read_bytes: int = 0  # page bytes read back
    promotion_buckets: list[int] = field(default_factory=lambda: Latencies().counts)  # batches of reads, by seconds
    promotion_seconds: float = 0.0  # their seconds, summed
    backlog_bytes: int = 0  # copies of evicted pages waiting to be written
    recovered_pages: int = 0  # found on disk at start-up
    pending_pages: int = 0  # of those, not indexed yet (not hittable yet): the tier opens while the daemon serves
    direct_io: bool = False

    def combined(self, other: DiskStats) -> DiskStats:
        """Two tenants' disk tiers together: counts summed, direct I/O when both are, opening
        while either is."""
        total = DiskStats(direct_io=self.direct_io and other.direct_io)
        total.state = "opening" if "opening" in (self.state, other.state) else self.state
        for f in fields(self):
            if f.name not in ("state", "direct_io", "promotion_buckets"):
                setattr(total, f.name, getattr(self, f.name) + getattr(other, f.name))
        total.promotion_buckets = [a + b for a, b in zip(self.promotion_buckets, other.promotion_buckets)]
        return total

    def as_dict(self) -> dict:
        return asdict(self)
