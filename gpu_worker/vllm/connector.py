"""`KVDConnector`: kvd as vLLM's shared host KV cache (a vLLM v1 KV connector).

Enable it with vLLM's own configuration, nothing else:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVDConnector",
        "kv_connector_module_path": "gpu_worker.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/run/kvd/kvd.sock"}}'

Every vLLM process on the host that points at the same kvd shares one host copy of each
prompt prefix: a prefix one process computed is loaded by the others instead of being
computed again. vLLM's scheduler process runs the scheduler half
(gpu_worker/vllm/scheduler.py: lookups and holds, made ahead on a thread of their own,
load and save plans, KV events); each worker runs the worker half
(gpu_worker/vllm/worker.py: page copies, saves, publishing). Each half opens its own kvd
session, so a killed vLLM process's references are dropped by the daemon like any
client's. The shape of this instance's pages, read from vLLM's configuration, is
gpu_worker/vllm/cache_shape.py's. (``gpu_worker.vllm_connector``, the path configurations
name, re-exports this class.)

kvd is a cache: when it cannot serve (not running, restarting, out of room) vLLM
computes. A page that cannot be loaded is reported to vLLM as a load error and
recomputed; for that the connector sets vLLM's `kv_load_failure_policy` to "recompute"
unless `kv_connector_extra_config` says `"load_failure_policy": "fail"`.

Under tensor parallelism each worker rank holds only its own KV heads: its pages live in
a namespace of that rank (`NamespaceSpec.tp_rank`), so engines of the same model and TP
degree share them rank by rank. The scheduler half registers every rank's namespace and
offers a prefix only as far as every rank holds it; a rank that then cannot load a page
reports it, and vLLM recomputes it on all ranks; what any rank computed in that step is
never saved (gpu_worker/vllm/load_verdicts.py). MLA models are the exception
(`CacheShape.replicated`): every rank holds the same latent cache, so there is one
namespace for all ranks (and all TP degrees), the scheduler half registers only it,
every rank loads the same pages and rank 0 alone saves them.

Sliding-window models run with vLLM's hybrid KV cache manager on (the connector is
`SupportsHMA`: a KV-cache group per attention type, a sliding-window group's blocks
outside the window are vLLM's null block, neither loaded nor saved) or off (one
full-attention group with `sliding_window` set: every token's KV is kept). A page holds
every layer of a block in model order either way (cache_shape.py), so both kinds of
engine share pages. vLLM cannot map a block-level load error back to one of several
groups, so with more than one group loads are asynchronous: vLLM waits for them between
steps, and a load that fails is reported as its request's (`get_transfer_results`).

`kv_connector_extra_config` keys: `socket` (default: found as kvd/wire/paths.py says: `KVD_SOCKET`,
the config file, `/run/kvd/kvd.sock` when it exists, the per-user default), `client_name`,
`load_failure_policy` ("recompute" or "fail"), `save_generated` (default true: generated
full blocks are saved like prompt blocks; false: prompt blocks only),
`call_timeout_seconds` (default 5: how long one kvd call may take before that half drops
its session and computes without kvd), `lookup_patience_seconds` (default: one call
timeout: how long a new request waits
for kvd's answer before it is computed without kvd; each request kvd gave no answer for
is a warning and counts in `vllm:kvd_lookups_unanswered`, gpu_worker/vllm/connector_stats.py),
`keep_share` (default 0.5: the share of kvd's budget the prompts that requests ask to keep
may hold, gpu_worker/vllm/keeps.py).

Each request may say what kvd does with it, in its `kv_transfer_params` (`"kvd": {"store":
false}`, `"kvd": {"keep_seconds": N}`): gpu_worker/vllm/request_params.py.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from gpu_worker.vllm.cache_shape import namespace_spec
from gpu_worker.vllm.connector_stats import KVDConnectorStats, KVDPromMetrics
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.plans import KVDConnectorMetadata
from gpu_worker.vllm.scheduler import KVDSchedulerSide
from gpu_worker.vllm.worker import KVDWorkerSide


class KVDConnector(KVConnectorBase_V1, SupportsHMA):
    """A facade over the scheduler half or the worker half, whichever this process runs."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if extra.get("load_failure_policy", "recompute") == "recompute":
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        shape = namespace_spec(vllm_config, kv_cache_config)
        spec = shape.namespace
        name = extra.get("client_name", "vllm")
        call_timeout = float(extra.get("call_timeout_seconds", 5.0))
        if role == KVConnectorRole.SCHEDULER:  # offers only what every rank can load
            ranks = tuple(spec.of_rank(r) for r in range(1, spec.tp_size))
            link = KVDLink(extra.get("socket"), f"{name}-scheduler", spec, call_timeout=call_timeout, peers=ranks)
        else:  # each rank loads its own KV heads (or, of a replicated cache, the one copy)
            rank = get_tensor_model_parallel_rank()
            namespace = shape.rank_namespace(rank)
            link = KVDLink(extra.get("socket"), f"{name}-worker{rank}", namespace, call_timeout=call_timeout)
        # BlockRemoved needs kvd's event stream: followed only when vLLM publishes KV events
        events = vllm_config.kv_events_config is not None and vllm_config.kv_events_config.enable_kv_cache_events
        self._scheduler = (
            KVDSchedulerSide(
                link,
                spec.layout.page_size,
                save_generated=extra.get("save_generated", True),
                track_removals=events,
                sliding_groups=shape.sliding_groups,
                lookup_patience=extra.get("lookup_patience_seconds"),
                keep_share=float(extra.get("keep_share", 0.5)),
            )
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self._worker = (
            KVDWorkerSide(link, shape.layer_names, shape.layer_groups, saves=shape.saves(rank))
            if role == KVConnectorRole.WORKER
            else None
        )
        self._link = link

    # ---- scheduler side -------------------------------------------------------------

    def on_new_request(self, request) -> None:
        self._scheduler.seen(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self._scheduler.matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and self._scheduler.async_loads

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVDConnectorMetadata:
        return self._scheduler.build_metadata(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_from_workers(
            connector_output.kv_connector_worker_meta,
            connector_output.failed_recving,
            connector_output.finished_sending or set(),
        )

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request), None  # True: freed once the workers' saves are done

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        return self._scheduler.finished(request), None

    def take_events(self):
        return self._scheduler.take_events()

    def get_kv_connector_stats(self) -> KVDConnectorStats | None:
        if self._scheduler is None:
            return None
        return KVDConnectorStats(self._scheduler.take_counts())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVDConnectorStats:
        return KVDConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVDPromMetrics:
        return KVDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVDConnectorMetadata) -> None:
        self._worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Nothing: a step's saves are handed over whole after the forward pass (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.wait_for_save()

    def build_connector_worker_meta(self):
        return self._worker.worker_metadata()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.transfer_results()
        sent = self._worker.finished_sending(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done, failed_recving=failed)

    def saves_done(self) -> bool:
        """Worker role: every save handed to this worker is published or dropped (for tests
        and benchmarks that read what an engine saved)."""
        return self._worker.saver is None or self._worker.saver.idle()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
        self._link.close()
