"""Prometheus metrics (``--metrics-port``): page stats, budget, sessions, call latency,
the remote tier (``kvd_remote_*``), the disk tier (``kvd_disk_*``), the daemon's build and the standard ``process_*``
metrics; per tenant on a daemon with [tenants].

Every scrape shows live values: the HTTP endpoint runs on prometheus-client's own
thread, so it asks the event loop, which owns the core, to compute the stats (one O(pages)
walk, as ``kvd stats``) and waits for the answer; a scrape never touches the core's data
structures from another thread. A loop that does not answer within ``SCRAPE_TIMEOUT``
fails the scrape rather than serve stale values.
"""

from __future__ import annotations

import asyncio
import itertools
import platform
import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvd import __version__
from kvd.cache import stats as stats_mod
from kvd.cache.stats import Stats
from kvd.cache.tenants import Tenants
from kvd.server import messages
from kvd.tiers.stats import PROMOTION_BUCKETS

SCRAPE_TIMEOUT = 5.0

_GAUGES = {
    "logical_pages": "Page-table entries of all sequences",
    "physical_pages": "Distinct pages referenced by sequences",
    "shared_pages": "Published pages with at least one reference",
    "private_pages": "Pages owned by one sequence, writable",
    "cached_pages": "Published pages with no reference, evictable in LRU order",
    "pinned_pages": "Pages held by pins",
    "free_pages": "Free pages in the extents created so far (kvd_host_bytes_free counts the whole budget)",
    "host_pages_saved": "Logical minus physical pages",
    "host_bytes_saved": "Bytes sharing saves against keeping each sequence's KV separately",
    "sequences": "Live sequences",
}
_COUNTERS = {
    "refcount_increments": "Page reference increments",
    "refcount_decrements": "Page reference decrements",
    "lookup_tokens": "Prompt tokens looked up for prefix hits",
    "hit_tokens": "Prompt tokens served from cached pages",
    "evicted_pages": "Cached pages evicted",
    "corrupted_pages": "Published pages dropped because their bytes failed the checksum",
}


_REMOTE_COUNTERS = {
    "stored_pages": "Pages the remote store accepted",
    "fetched_pages": "Pages fetched from the remote store, verified and published locally",
    "hit_tokens": "Allocated prefix tokens served by pages fetched from the remote store",
    "refused_pages": "Pages the remote store refused (full): kept local only",
    "skipped_pages": "Published pages not stored: the remote store unreachable or the backlog full",
    "rejected_pages": "Fetched pages whose header or checksum did not match: served as a miss",
    "errors": "Remote store calls that failed (the master unreachable, a page that did not arrive)",
    "outages": "Times the remote store became unreachable or lost this host's objects",
    "resets": "Times the remote store had lost this host's objects (its master restarted)",
    "reoffered_pages": "Pages offered again after the remote store came back, and accepted",
}
_REMOTE_STATES = ("off", "connecting", "up", "down")


def _remote_families(remote):
    """The remote tier: its state (1 for the current one) and its counters."""
    state = GaugeMetricFamily("kvd_remote_state", "State of the remote store's link (1: current)", labels=["state"])
    for name in _REMOTE_STATES:
        state.add_metric([name], float(remote.state == name))
    yield state
    for name, doc in _REMOTE_COUNTERS.items():
        yield CounterMetricFamily(f"kvd_remote_{name}", doc, value=getattr(remote, name))


_DISK_COUNTERS = {
    "written_pages": "Pages written to the disk tier (copies of pages host memory evicted)",
    "fetched_pages": "Pages read back from the disk tier, verified and published (promoted)",
    "hit_tokens": "Allocated prefix tokens served by pages promoted from the disk tier",
    "skipped_pages": "Evicted pages not written to disk: the write backlog full, or their bytes changed",
    "refused_pages": "Pages the disk tier refused: full after evicting, out of space, or its directory gone",
    "evicted_pages": "Pages freed from the disk tier to make room",
    "rejected_pages": "Pages read back from disk that failed a check: served as a miss and dropped",
    "errors": "Disk tier reads and writes that failed",
    "written_bytes": "Page bytes written to the disk tier",
    "read_bytes": "Page bytes read back from the disk tier (promotions)",
}
_DISK_GAUGES = {
    "pages": "Pages on the disk tier",
    "bytes": "Page bytes on the disk tier",
    "capacity_bytes": "Bytes of the disk tier's file",
    "backlog_bytes": "Copies of evicted pages waiting to be written to disk",
    "pending_pages": "Pages found on disk at start-up, not indexed yet (the disk tier opens while the daemon serves)",
    "direct_io": "1 when the disk tier bypasses the page cache (O_DIRECT)",
}


def _disk_families(disk):
    """The disk tier: on or off, what it holds, and its counters."""
    yield GaugeMetricFamily("kvd_disk_on", "1 when the disk tier is configured", value=float(disk.state != "off"))
    for name, doc in _DISK_GAUGES.items():
        yield GaugeMetricFamily(f"kvd_disk_{name}", doc, value=float(getattr(disk, name)))
    for name, doc in _DISK_COUNTERS.items():
        yield CounterMetricFamily(f"kvd_disk_{name}", doc, value=getattr(disk, name))
    cumulative = list(itertools.accumulate(disk.promotion_buckets))
    yield HistogramMetricFamily(
        "kvd_disk_promotion_seconds",
        "Seconds a batch of promotion reads took, from the reads' start to their pages checked on the daemon's loop",
        buckets=[(str(bound), n) for bound, n in zip(PROMOTION_BUCKETS, cumulative)] + [("+Inf", cumulative[-1])],
        sum_value=disk.promotion_seconds,
    )


_PREWARM_COUNTERS = {
    "prompts": "Prompts prewarmed (pins' included)",
    "requested_tokens": "Full-page tokens of the prompts prewarmed",
    "resident_tokens": "Tokens of prewarmed prompts already in host memory",
    "promoted_tokens": "Tokens a prewarm promoted from a tier below into host memory",
    "not_found_tokens": "Tokens a prewarm found on no tier (or that failed their checks)",
    "over_budget_tokens": "Tokens a prewarm did not promote: beyond the tenant's budget",
}


def _prewarm_families(prewarm):
    """Prewarms (kvd/cache/prewarm.py): their counters, and the tokens on their way now."""
    for name, doc in _PREWARM_COUNTERS.items():
        yield CounterMetricFamily(f"kvd_prewarm_{name}", doc, value=getattr(prewarm, name))
    yield GaugeMetricFamily(
        "kvd_prewarm_pending_tokens", "Tokens of prewarms queued or being promoted", value=prewarm.pending_tokens
    )


class _StatsCollector:
    """Families from live stats: one per page statistic, labelled by namespace id and
    model name (``all`` and ``all`` for the daemon's totals) and, on a daemon with
    [tenants], by tenant too (``all`` again for the sum)."""

    def __init__(self, isolated: bool) -> None:
        self.isolated = isolated
        self.fetch = None  # () -> {tenant: Stats}, set by MetricsExporter.start

    def _rows(self, by_tenant: dict[str, Stats], every: Stats):
        """(label values, page stats) of every row a page statistic has."""
        if not self.isolated:
            yield ["all", "all"], every.totals
            yield from (([str(n.namespace_id), n.model], n.pages) for n in every.namespaces)
            return
        yield ["all", "all", "all"], every.totals
        for tenant, s in by_tenant.items():
            yield [tenant, "all", "all"], s.totals
            yield from (([tenant, str(n.namespace_id), n.model], n.pages) for n in s.namespaces)

    def collect(self):
        if self.fetch is None:
            return
        by_tenant = self.fetch()
        every = stats_mod.combined(list(by_tenant.values()))
        labels = ["tenant", "namespace", "model"] if self.isolated else ["namespace", "model"]
        for family, docs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, doc in docs.items():
                metric = family(f"kvd_{name}", doc, labels=labels)
                for values, pages in self._rows(by_tenant, every):
                    metric.add_metric(values, getattr(pages, name))
                yield metric
        yield GaugeMetricFamily("kvd_sessions", "Open client sessions", value=every.totals.sessions)
        yield GaugeMetricFamily("kvd_host_budget_bytes", "Host byte budget for pages", value=every.host_bytes)
        yield GaugeMetricFamily(
            "kvd_host_bytes_used",
            "Budget bytes in pages holding KV (private, shared, cached)",
            value=every.host_bytes_used,
        )
        yield GaugeMetricFamily(
            "kvd_host_bytes_free",
            "Budget bytes free: free pages of extents and budget not yet made into extents",
            value=every.host_bytes_free,
        )
        yield GaugeMetricFamily("kvd_arena_bytes", "Bytes of shared-memory extents created", value=every.arena_bytes)
        yield GaugeMetricFamily(
            "kvd_aux_budget_bytes", "Budget for the non-KV state of all sequences", value=every.aux_bytes
        )
        yield GaugeMetricFamily("kvd_aux_bytes_used", "Non-KV state the sequences hold", value=every.aux_bytes_used)
        yield CounterMetricFamily(
            "kvd_shm_refusals", "Extents /dev/shm could not hold (calls refused)", value=every.shm_refusals
        )
        recovery = every.recovery
        yield GaugeMetricFamily(
            "kvd_recovery_recovered_pages",
            "Published pages the daemon's start recovered",
            value=recovery.recovered_pages,
        )
        dropped = GaugeMetricFamily(
            "kvd_recovery_dropped_pages", "Published pages the daemon's start dropped", labels=["reason"]
        )
        for reason, pages in recovery.dropped_pages.items():
            dropped.add_metric([reason], pages)
        yield dropped
        yield GaugeMetricFamily(
            "kvd_recovery_pending_pages",
            "Published pages the daemon's start found and has not verified yet (it recovers while serving)",
            value=recovery.pending_pages,
        )
        yield GaugeMetricFamily(
            "kvd_recovery_incomplete_extents",
            "Extents a crash left incomplete, dropped at start",
            value=recovery.incomplete_extents,
        )
        yield from _remote_families(messages.remote_stats_message(every))
        yield from _disk_families(messages.disk_stats_message(every))
        yield from _prewarm_families(every.prewarm)


class MetricsExporter:
    def __init__(self, isolated: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._collector = _StatsCollector(isolated)
        self.registry.register(self._collector)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=self.registry)  # python_info
        Info("kvd_build", "The running kvd's version", registry=self.registry).info(  # kvd_build_info
            {"version": __version__, "python": platform.python_version()}
        )
        self._latency = Histogram(
            "kvd_request_seconds",
            "Latency of gRPC calls inside the daemon",
            ["method"],
            registry=self.registry,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5, 1.0),
        )
        self._stalls = Counter(
            "kvd_event_loop_stalls",
            "Times the event loop was held over a second (calls waited; the log says where)",
            registry=self.registry,
        )
        self._server = None

    def count_stall(self) -> None:  # on the loop watchdog's thread (kvd/server/loop_watch.py)
        self._stalls.inc()

    def observe_latency(self, method: str, seconds: float) -> None:
        self._latency.labels(method).observe(seconds)

    def start(self, tenants: Tenants, host: str, port: int) -> None:
        """Starts the HTTP endpoint (call on the event loop, which then answers every scrape)."""
        loop = asyncio.get_running_loop()

        async def collect() -> dict[str, Stats]:
            return {name: stats_mod.collect(manager) for name, manager in tenants.items()}

        def fetch() -> dict[str, Stats]:  # on the HTTP thread
            return asyncio.run_coroutine_threadsafe(collect(), loop).result(SCRAPE_TIMEOUT)

        self._collector.fetch = fetch
        self._server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._thread: threading.Thread = thread

    def stop(self) -> None:
        self._collector.fetch = None  # the loop is about to stop answering
        if self._server is not None:
            self._server.shutdown()
