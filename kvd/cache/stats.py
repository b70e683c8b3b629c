"""Page statistics, globally and per namespace, computed from the core's state on demand.

Field names are part of the public contract (``kvd stats --json``, the gRPC StatsReply,
Prometheus metrics): logical pages count every sequence's page-table entries, physical
pages count the distinct pages those entries point at, so ``host_pages_saved`` is what
sharing saves against keeping each sequence's KV separately.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from kvd.core.types import PageState
from kvd.durability.report import RecoveryReport
from kvd.tiers.stats import TierStats


@dataclass
class PageStats:
    logical_pages: int = 0
    physical_pages: int = 0
    shared_pages: int = 0  # published pages with at least one reference
    private_pages: int = 0
    cached_pages: int = 0
    pinned_pages: int = 0
    free_pages: int = 0  # free pages in extents created so far
    host_pages_saved: int = 0
    host_bytes_saved: int = 0
    refcount_increments: int = 0
    refcount_decrements: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    corrupted_pages: int = 0  # published pages dropped because their bytes failed the checksum
    sessions: int = 0
    sequences: int = 0

    def add(self, other: PageStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


STAT_FIELDS = tuple(f.name for f in fields(PageStats))


@dataclass
class NamespaceStats:
    namespace_id: int
    model: str
    page_bytes: int
    pages: PageStats


@dataclass
class Stats:
    totals: PageStats
    namespaces: list[NamespaceStats]
    host_bytes: int
    arena_bytes: int
    prefix_reuse: bool
    host_bytes_used: int  # in pages that hold KV: private, shared or cached
    host_bytes_free: int  # free pages of created extents + budget not yet made into extents
    aux_bytes: int  # budget of non-KV state, all sequences together (beside host_bytes)
    aux_bytes_used: int  # non-KV state the sequences hold now
    aux_bytes_per_sequence: int  # the most one sequence may hold
    shm_refusals: int = 0  # extents /dev/shm could not hold
    recovery: RecoveryReport = field(default_factory=RecoveryReport)  # what this start found
    tiers: dict[str, TierStats] = field(default_factory=dict)  # by kind; a tier not configured is absent

    def as_dict(self) -> dict:
        return {
            **self.totals.as_dict(),
            "host_bytes": self.host_bytes,
            "host_bytes_used": self.host_bytes_used,
            "host_bytes_free": self.host_bytes_free,
            "aux_bytes": self.aux_bytes,
            "aux_bytes_used": self.aux_bytes_used,
            "aux_bytes_per_sequence": self.aux_bytes_per_sequence,
            "arena_bytes": self.arena_bytes,
            "prefix_reuse": self.prefix_reuse,
            "shm_refusals": self.shm_refusals,
            "recovery": self.recovery.as_dict(),
            **{kind: stats.as_dict() for kind, stats in self.tiers.items()},
            "namespaces": [
                {"namespace_id": n.namespace_id, "model": n.model, "page_bytes": n.page_bytes, **n.pages.as_dict()}
                for n in self.namespaces
            ],
        }


def collect(manager) -> Stats:
    """Walks sequences and pages once; costs O(pages), fine for an admin call."""
    per_ns: dict[int, PageStats] = {}
    referenced: dict[int, set] = {}
    holders: dict[int, set] = {}
    for ns in manager.namespaces.all():
        per_ns[ns.id] = PageStats(**asdict(manager.counters.of(ns.id)), free_pages=manager.pool.free_count(ns.id))
        referenced[ns.id], holders[ns.id] = set(), set()
    for seq in manager.sequences:
        s = per_ns[seq.namespace]
        s.logical_pages += len(seq.pages)
        s.sequences += 1
        referenced[seq.namespace].update(seq.pages)
        holders[seq.namespace].add(seq.session)
    for pin in manager.pins:
        holders[pin.namespace].add(pin.session)
    for _page, state, _refcount, pins, ns_id in manager.pool.pages():
        s = per_ns[ns_id]
        if state is PageState.PRIVATE:
            s.private_pages += 1
        elif state is PageState.PUBLISHED:
            s.shared_pages += 1
        elif state is PageState.CACHED:
            s.cached_pages += 1
        if pins:
            s.pinned_pages += 1
    totals = PageStats()
    namespaces = []
    arena = manager.arena
    used, free = 0, arena.budget_bytes - arena.reserved_bytes
    for ns in manager.namespaces.all():
        s = per_ns[ns.id]
        used += (s.private_pages + s.shared_pages + s.cached_pages) * ns.page_bytes
        free += s.free_pages * ns.page_bytes
        s.physical_pages = len(referenced[ns.id])
        s.host_pages_saved = s.logical_pages - s.physical_pages
        s.host_bytes_saved = s.host_pages_saved * ns.page_bytes
        s.sessions = len(holders[ns.id])
        totals.add(s)
        namespaces.append(NamespaceStats(ns.id, ns.identity.model, ns.page_bytes, s))
    totals.sessions = len(manager.sessions)
    return Stats(
        totals,
        namespaces,
        arena.budget_bytes,
        arena.reserved_bytes,
        manager.prefix_reuse,
        used,
        free,
        manager.aux.budget,
        manager.aux.used,
        manager.aux.per_sequence,
        arena.shm_refusals,
        manager.catalog.last_recovery or RecoveryReport(),
        manager.tiers.stats(),
    )


def combined(parts: list[Stats]) -> Stats:
    """Several tenants' stats as one daemon's: totals and budgets summed, namespaces listed together."""
    totals = PageStats()
    for part in parts:
        totals.add(part.totals)
    return Stats(
        totals=totals,
        namespaces=[n for part in parts for n in part.namespaces],
        host_bytes=sum(part.host_bytes for part in parts),
        arena_bytes=sum(part.arena_bytes for part in parts),
        prefix_reuse=any(part.prefix_reuse for part in parts),
        shm_refusals=sum(part.shm_refusals for part in parts),
        recovery=RecoveryReport.combined([part.recovery for part in parts]),
        tiers=combined_tiers([part.tiers for part in parts]),
        host_bytes_used=sum(part.host_bytes_used for part in parts),
        host_bytes_free=sum(part.host_bytes_free for part in parts),
        aux_bytes=sum(part.aux_bytes for part in parts),
        aux_bytes_used=sum(part.aux_bytes_used for part in parts),
        aux_bytes_per_sequence=max((part.aux_bytes_per_sequence for part in parts), default=0),
    )


def combined_tiers(parts: list[dict[str, TierStats]]) -> dict[str, TierStats]:
    """Every tenant's tiers together, kind by kind, each kind combined as its tier says."""
    total: dict[str, TierStats] = {}
    for part in parts:
        for kind, stats in part.items():
            total[kind] = total[kind].combined(stats) if kind in total else stats
    return total
