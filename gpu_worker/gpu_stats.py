"""Counters of one GPU page pool: how much host→device traffic sharing saved.

A snapshot, taken by `GpuPagePool.stats()`. "Logical" pages are what the page tables
address (the sum of row lengths over every sequence that holds GPU pages); "physical"
pages are the distinct GPU pages behind them. With no sharing the two are equal
(docs/architecture.md invariant 4, applied to the GPU pool).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPoolStats:
    """Gauges of the pool's current state plus cumulative load counters."""

    capacity: int
    # Cumulative, since the pool was created:
    unique_host_pages_loaded: int  # host→device page copies planned (each unique missing page once)
    duplicate_loads_skipped: int  # host page references served without a copy (batch dedup or resident)
    # Gauges, now:
    logical_pages: int  # sum of references over all pages = sum of row lengths
    physical_pages: int  # pages with at least one reference
    shared_pages: int  # pages with two or more references
    shared_refs: int  # references held on shared pages
    cached_pages: int  # resident copies of host pages with no reference (evictable, LRU)
    free_pages: int

    @property
    def sharing_ratio(self) -> float:
        """logical / physical: how many page-table entries each physical page serves."""
        return self.logical_pages / self.physical_pages if self.physical_pages else 1.0
