"""What KVDConnector's scheduler half tells its worker halves each step, and what they answer.

vLLM sends the step's `KVDConnectorMetadata` from the scheduler process to every worker
before the forward pass, and returns each worker's `KVDWorkerMetadata` to the scheduler
after it. Page ids are those of the daemon instance named in each plan: a worker whose
own session is with another instance (the daemon restarted in between) must not use them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadPlan:
    """Copy kvd pages into the request's vLLM blocks before the forward pass.

    `missing_block_ids` are blocks vLLM was promised but kvd no longer holds (evicted or
    dropped between lookup and allocation): the worker reports them as load errors, so
    vLLM recomputes them."""

    req_id: str
    daemon_instance: str
    page_ids: list[int]
    block_ids: list[int]
    missing_block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SavePlan:
    """Copy the request's newly computed full vLLM blocks into its private kvd pages.

    `positions` are the blocks' indices in the request (block i holds tokens
    [i * block_size, (i + 1) * block_size)); the scheduler publishes a page only after a
    worker reported its position written."""

    req_id: str
    daemon_instance: str
    positions: list[int]
    page_ids: list[int]
    block_ids: list[int]


@dataclass
class KVDConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class KVDWorkerMetadata(KVConnectorWorkerMetadata):
    """Block positions each request's save plans wrote into kvd pages this step."""

    written: dict[str, set[int]] = field(default_factory=dict)

    def aggregate(self, other: "KVDWorkerMetadata") -> "KVDWorkerMetadata":
        """A position counts as written only when every worker wrote it."""
        return KVDWorkerMetadata({
            req_id: positions & other.written[req_id]
            for req_id, positions in self.written.items() if req_id in other.written
        })
