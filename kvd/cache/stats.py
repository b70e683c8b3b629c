"""Page statistics, globally and per namespace, computed from the core's state on demand.

Field names are part of the public contract (``kvd stats --json``, the gRPC StatsReply,
Prometheus metrics): logical pages count every sequence's page-table entries, physical
pages count the distinct pages those entries point at, so ``host_pages_saved`` is what
sharing saves against keeping each sequence's KV separately.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import asdict, dataclass, field, fields

from kvd.core.types import PageState
from kvd.durability.report import RecoveryReport


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
class RemoteStats:
    """The remote tier (kvd/remote/tier.py): the link's state and the tier's counters."""

    state: str = "off"
    stored_pages: int = 0
    fetched_pages: int = 0
    hit_tokens: int = 0
    refused_pages: int = 0
    skipped_pages: int = 0
    rejected_pages: int = 0
    errors: int = 0
    outages: int = 0
    resets: int = 0
    reoffered_pages: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


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


@dataclass
class DiskStats:
    """The disk tier (kvd/disk/tier.py): what it holds and its counters ("off" without it)."""

    state: str = "off"
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
    direct_io: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def combined_disk(parts: list[DiskStats]) -> DiskStats:
    """Every tenant's disk tier together: counts summed, on when any is, direct I/O when all are."""
    on = [part for part in parts if part.state != "off"]
    total = DiskStats(state="on" if on else "off", direct_io=bool(on) and all(part.direct_io for part in on))
    for part in on:
        for f in fields(part):
            if f.name not in ("state", "direct_io", "promotion_buckets"):
                setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
        total.promotion_buckets = [a + b for a, b in zip(total.promotion_buckets, part.promotion_buckets)]
    return total


def combined_remote(parts: list[RemoteStats]) -> RemoteStats:
    """Tenants share one link: its state, outages and resets once, the tiers' counters summed."""
    link = ("state", "outages", "resets")
    total = RemoteStats(**{name: getattr(parts[0], name) for name in link}) if parts else RemoteStats()
    for part in parts:
        for f in fields(part):
            if f.name not in link:
                setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
    return total


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
    remote: RemoteStats = field(default_factory=RemoteStats)
    disk: DiskStats = field(default_factory=DiskStats)

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
            "remote": self.remote.as_dict(),
            "disk": self.disk.as_dict(),
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
        manager.tiers.stats(RemoteStats),
        manager.tiers.stats(DiskStats),
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
        remote=combined_remote([part.remote for part in parts]),
        disk=combined_disk([part.disk for part in parts]),
        host_bytes_used=sum(part.host_bytes_used for part in parts),
        host_bytes_free=sum(part.host_bytes_free for part in parts),
        aux_bytes=sum(part.aux_bytes for part in parts),
        aux_bytes_used=sum(part.aux_bytes_used for part in parts),
        aux_bytes_per_sequence=max((part.aux_bytes_per_sequence for part in parts), default=0),
    )
