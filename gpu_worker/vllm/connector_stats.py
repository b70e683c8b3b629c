"""What the connector counts, in vLLM's connector-stats channel: vLLM logs it with its
"KV Transfer metrics" line and exports it as Prometheus counters beside its own.

The scheduler half counts each request kvd gave no answer for (`lookups_unanswered`: its
lookup or hold call failed, or no answer came within the lookahead's patience, because kvd
hung, is down, refused, or this process was starved of CPU; the request was computed
without kvd), and what requests asked of kvd in their `kv_transfer_params`
(gpu_worker/vllm/request_params.py, gpu_worker/vllm/keeps.py): requests that said
`"store": false`, requests whose "kvd" entry was wrong in part (a warning each), prompts
kept resident for their requests, the pages those keeps pinned, and keeps cut short or
refused for the budget. vLLM collects the counts every step
(`KVDConnector.get_kv_connector_stats`), adds up the intervals (`aggregate`), logs them and
hands them to `KVDPromMetrics`, which exports each as `vllm:kvd_<name>_total` per engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTS = {
    "lookups_unanswered": "Requests computed without kvd because kvd gave no answer (failed call or patience out)",
    "requests_not_stored": 'Requests that asked kvd to store nothing of them ("kvd": {"store": false})',
    "params_ignored": 'Requests whose kv_transfer_params "kvd" entry was wrong in part (logged, ignored)',
    "keeps": 'Prompts kvd keeps resident because their requests asked ("kvd": {"keep_seconds": N})',
    "kept_pages": "kvd pages pinned for the prompts requests asked to keep",
    "keeps_over_budget": "Keeps cut short or refused: the engine's keeps would exceed keep_share of kvd's budget",
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
        """What vLLM logs: the counts that are not 0."""
        return {name: n for name, n in self.data.items() if n}

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
