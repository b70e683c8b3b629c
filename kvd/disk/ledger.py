"""What the disk tier counts. Its index (kvd/disk/index.py), its write-back
(kvd/disk/write_back.py) and its promotions (kvd/disk/tier.py, through kvd/cache/fetches.py)
share one ``DiskTierCounters``, which the tier reports as its stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.cache.stats import Latencies


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
