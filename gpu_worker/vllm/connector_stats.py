"""What the connector counts, in vLLM's connector-stats channel: vLLM logs it with its
"KV Transfer metrics" line and exports it as Prometheus counters beside its own.

The scheduler half counts each request kvd gave no answer for (`lookups_unanswered`: its
lookup or hold call failed, or no answer came within the lookahead's patience, because kvd
hung, is down, refused, or this process was starved of CPU; the request was computed
without kvd). vLLM collects the counts every step (`KVDConnector.get_kv_connector_stats`),
adds up the intervals (`aggregate`), logs them and hands them to `KVDPromMetrics`, which
exports `vllm:kvd_lookups_unanswered_total` per engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTS = {
    "lookups_unanswered": "Requests computed without kvd because kvd gave no answer (failed call or patience out)",
}


@dataclass
class KVDConnectorStats(KVConnectorStats):
    """Counts of one interval (`data`: one entry of `COUNTS` each)."""

    def __post_init__(self) -> None:
        for name in COUNTS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVDConnectorStats:
        for name in COUNTS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVDPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of `COUNTS`, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvd_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counters in self._counters.items():
            if transfer_stats_data.get(name):
                counters[engine_idx].inc(transfer_stats_data[name])
