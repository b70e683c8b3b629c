"""Prometheus metrics (``--metrics-port``): page stats, sessions and call latency, per tenant
on a daemon with [tenants].

The HTTP endpoint runs on prometheus-client's own thread while the core lives on the
event loop, so the loop publishes a stats snapshot every ``SNAPSHOT_SECONDS`` and
scrapes read only that snapshot: a scrape never touches the core's data structures.
"""
from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvd import stats as stats_mod
from kvd.stats import Stats
from kvd.tenants import Tenants

SNAPSHOT_SECONDS = 1.0

_GAUGES = {
    "logical_pages": "Page-table entries of all sequences",
    "physical_pages": "Distinct pages referenced by sequences",
    "shared_pages": "Published pages with at least one reference",
    "private_pages": "Pages owned by one sequence, writable",
    "cached_pages": "Published pages with no reference, evictable in LRU order",
    "pinned_pages": "Pages held by pins",
    "free_pages": "Free pages in the extents created so far",
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


class _StatsCollector:
    """Families from the latest snapshot: one per page statistic, labelled by namespace
    (``all`` for the daemon's totals) and, on a daemon with [tenants], by tenant too
    (``all`` again for the sum)."""

    def __init__(self, isolated: bool) -> None:
        self.isolated = isolated
        self.snapshot: dict[str, Stats] | None = None  # by tenant

    def _rows(self, by_tenant: dict[str, Stats], every: Stats):
        """(label values, page stats) of every row a page statistic has."""
        if not self.isolated:
            yield ["all"], every.totals
            yield from (([str(n.namespace_id)], n.pages) for n in every.namespaces)
            return
        yield ["all", "all"], every.totals
        for tenant, s in by_tenant.items():
            yield [tenant, "all"], s.totals
            yield from (([tenant, str(n.namespace_id)], n.pages) for n in s.namespaces)

    def collect(self):
        by_tenant = self.snapshot
        if by_tenant is None:
            return
        every = stats_mod.combined(list(by_tenant.values()))
        labels = ["tenant", "namespace"] if self.isolated else ["namespace"]
        for family, docs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, doc in docs.items():
                metric = family(f"kvd_{name}", doc, labels=labels)
                for values, pages in self._rows(by_tenant, every):
                    metric.add_metric(values, getattr(pages, name))
                yield metric
        yield GaugeMetricFamily("kvd_sessions", "Open client sessions", value=every.totals.sessions)
        yield GaugeMetricFamily("kvd_host_budget_bytes", "Host byte budget for pages", value=every.host_bytes)
        yield GaugeMetricFamily("kvd_arena_bytes", "Bytes of shared-memory extents created", value=every.arena_bytes)
        yield CounterMetricFamily("kvd_shm_refusals", "Extents /dev/shm could not hold (calls refused)",
                                  value=every.shm_refusals)
        recovery = every.recovery
        yield GaugeMetricFamily("kvd_recovery_recovered_pages", "Published pages the daemon's start recovered",
                                value=recovery.recovered_pages)
        dropped = GaugeMetricFamily("kvd_recovery_dropped_pages", "Published pages the daemon's start dropped",
                                    labels=["reason"])
        for reason, pages in recovery.dropped_pages.items():
            dropped.add_metric([reason], pages)
        yield dropped
        yield GaugeMetricFamily("kvd_recovery_incomplete_extents", "Extents a crash left incomplete, dropped at start",
                                value=recovery.incomplete_extents)


class MetricsExporter:
    def __init__(self, isolated: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._collector = _StatsCollector(isolated)
        self.registry.register(self._collector)
        self._latency = Histogram(
            "kvd_request_seconds", "Latency of gRPC calls inside the daemon", ["method"], registry=self.registry,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5, 1.0),
        )
        self._server = None
        self._task: asyncio.Task | None = None

    def observe_latency(self, method: str, seconds: float) -> None:
        self._latency.labels(method).observe(seconds)

    def start(self, tenants: Tenants, host: str, port: int) -> None:
        """Starts the HTTP endpoint and the snapshot task (call on the event loop)."""

        def snapshot() -> dict[str, Stats]:
            return {name: stats_mod.collect(manager) for name, manager in tenants.items()}

        self._collector.snapshot = snapshot()
        self._server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._thread: threading.Thread = thread

        async def refresh() -> None:
            while True:
                await asyncio.sleep(SNAPSHOT_SECONDS)
                self._collector.snapshot = snapshot()

        self._task = asyncio.get_running_loop().create_task(refresh())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            self._server.shutdown()
