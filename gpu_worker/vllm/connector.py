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
client's. (``gpu_worker.vllm_connector``, the path configurations name, re-exports this class.)

kvd is a cache: when it cannot serve (not running, restarting, out of room) vLLM
computes. A page that cannot be loaded is reported to vLLM as a load error and
recomputed; for that the connector sets vLLM's `kv_load_failure_policy` to "recompute"
unless `kv_connector_extra_config` says `"load_failure_policy": "fail"`.

Under tensor parallelism each worker rank holds only its own KV heads: its pages live in
a namespace of that rank (`NamespaceSpec.tp_rank`), so engines of the same model and TP
degree share them rank by rank. The scheduler half registers every rank's namespace and
offers a prefix only as far as every rank holds it; a rank that then cannot load a page
reports it, and vLLM recomputes it on all ranks.

Sliding-window models run with vLLM's hybrid KV cache manager on (the connector is
`SupportsHMA`: a KV-cache group per attention type, a sliding-window group's blocks
outside the window are vLLM's null block, neither loaded nor saved) or off (one
full-attention group with `sliding_window` set: every token's KV is kept). A page holds
every layer of a block in model order either way (`namespace_spec`), so both kinds of
engine share pages. vLLM cannot map a block-level load error back to one of several
groups, so with more than one group loads are asynchronous: vLLM waits for them between
steps, and a load that fails is reported as its request's (`get_transfer_results`).

`kv_connector_extra_config` keys: `socket` (default: found as kvd/wire/paths.py says: `KVD_SOCKET`,
the config file, `/run/kvd/kvd.sock` when it exists, the per-user default), `client_name`,
`load_failure_policy` ("recompute" or "fail"), `save_generated` (default true: generated
full blocks are saved like prompt blocks; false: prompt blocks only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from engine_client import PageLayout
from gpu_worker.vllm.kvd_link import KVDLink, NamespaceSpec
from gpu_worker.vllm.plans import KVDConnectorMetadata
from gpu_worker.vllm.scheduler import KVDSchedulerSide
from gpu_worker.vllm.worker import KVDWorkerSide

SUPPORTED = (
    "dense full and sliding-window attention (Llama, Qwen, Mistral, Gemma 2/3, GPT-OSS and other GQA/MHA "
    "models), with vLLM's hybrid KV cache manager on or off, at any tensor_parallel_size"
)


@dataclass(frozen=True)
class CacheShape:
    """What kvd pages of this vLLM instance hold: the namespace (tensor-parallel rank 0's;
    each rank's pages hold its own KV heads, in a namespace of its own), the attention
    layers in page order, the KV-cache group of each, and which groups are sliding-window
    groups of vLLM's hybrid manager (their blocks outside the window are vLLM's null block)."""

    namespace: NamespaceSpec
    layer_names: list[str]
    layer_groups: list[int]
    sliding_groups: tuple[bool, ...]


def _layer_order(name: str) -> tuple:
    """Layers in model order (`model.layers.10...` after `model.layers.9...`), whatever group holds them."""
    return tuple(int(part) for part in name.split(".") if part.isdigit()), name


def namespace_spec(vllm_config, kv_cache_config) -> CacheShape:
    """The kvd namespace of this vLLM instance's KV bytes and how its layers map to pages.

    A page holds every attention layer of one block, in model order, whichever KV-cache
    group vLLM put the layer in: with vLLM's hybrid manager on (a group per attention
    type) or off (one group, every token's KV kept), a model's pages are the same bytes,
    so both kinds of engine share them. Refuses (ValueError, at vLLM's start) what kvd's
    page layout cannot hold yet, naming it."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            f"KVDConnector supports pipeline_parallel_size=1 only (got {parallel.pipeline_parallel_size}); "
            f"supported: {SUPPORTED}"
        )
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    for spec in specs:
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec) or getattr(spec, "attention_chunk_size", None):
            raise ValueError(f"KVDConnector does not support {refused_feature(spec)} yet; supported: {SUPPORTED}")
        if spec.head_size_v != spec.head_size or spec.num_head_slots is not None or spec.page_size_padded is not None:
            raise ValueError(
                f"KVDConnector needs dense K/V of equal head sizes (no packed or padded pages); supported: {SUPPORTED}"
            )
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs}
    if len(shapes) != 1:
        raise ValueError(
            "KVDConnector needs one block size, KV head count, head size and dtype for every attention layer; "
            f"this model's KV cache groups have {sorted(map(str, shapes))}; supported: {SUPPORTED}"
        )
    windows = {s.sliding_window for s in specs if s.sliding_window}
    if len(windows) > 1:
        raise ValueError(
            f"KVDConnector supports one sliding window per model; this one has {sorted(windows)}; "
            f"supported: {SUPPORTED}"
        )
    spec = specs[0]
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    layer_names = sorted(group_of, key=_layer_order)
    layout = PageLayout(
        num_layers=len(layer_names),
        num_kv_heads=spec.num_kv_heads,  # this rank's heads
        head_dim=spec.head_size,
        page_size=spec.block_size,
        dtype=str(spec.dtype).removeprefix("torch."),
    )
    model = vllm_config.model_config
    extra = (("kv_layout", cpu_kv_layout(vllm_config, spec)),) if current_platform.is_cpu() else ()
    if windows:  # kept in every page's identity: a window changes the KV of every later layer
        extra += (("sliding_window", str(windows.pop())),)
    namespace = NamespaceSpec(
        model.model, layout, revision=model.revision or "", tp_size=parallel.tensor_parallel_size, extra=extra
    )
    return CacheShape(
        namespace,
        layer_names,
        [group_of[name] for name in layer_names],
        tuple(isinstance(s, SlidingWindowSpec) for s in specs),
    )


def refused_feature(spec) -> str:
    """What a KV cache spec kvd cannot hold is, in the words of the models that use it."""
    if isinstance(spec, MLAAttentionSpec):
        return f"MLA latent caches ({type(spec).__name__}: DeepSeek V2/V3, Kimi K2 and other MLA models)"
    if isinstance(spec, MambaSpec):
        return f"Mamba or linear-attention state ({type(spec).__name__}: Qwen3-Next, Jamba and other hybrid models)"
    if isinstance(spec, ChunkedLocalAttentionSpec) or getattr(spec, "attention_chunk_size", None):
        return f"chunked local attention ({type(spec).__name__}: Llama 4)"
    return f"KV caches of kind {type(spec).__name__}"


def cpu_kv_layout(vllm_config, spec) -> str:
    """vLLM's CPU attention backend arranges K and V inside a block in an order of its own
    that depends on the kernel it picked for this CPU and dtype (its "ISA"), not in kvd's
    page order; a page holds each layer's block bytes as vLLM's cache holds them
    ("block-bytes", worker.block_view). Its pages are shared only with engines that use
    the same arrangement."""
    from vllm.v1.attention.backends import cpu_attn

    isa = cpu_attn._get_attn_isa(
        vllm_config.model_config.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
    )
    return f"vllm-cpu-{isa}-block-bytes"


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
        if role == KVConnectorRole.SCHEDULER:  # offers only what every rank can load
            ranks = tuple(spec.of_rank(r) for r in range(1, spec.tp_size))
            link = KVDLink(extra.get("socket"), f"{name}-scheduler", spec, peers=ranks)
        else:  # each rank saves and loads its own KV heads
            rank = get_tensor_model_parallel_rank()
            link = KVDLink(extra.get("socket"), f"{name}-worker{rank}", spec.of_rank(rank))
        # BlockRemoved needs kvd's event stream: followed only when vLLM publishes KV events
        events = vllm_config.kv_events_config is not None and vllm_config.kv_events_config.enable_kv_cache_events
        self._scheduler = (
            KVDSchedulerSide(
                link,
                spec.layout.page_size,
                save_generated=extra.get("save_generated", True),
                track_removals=events,
                sliding_groups=shape.sliding_groups,
            )
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self._worker = (
            KVDWorkerSide(link, shape.layer_names, shape.layer_groups) if role == KVConnectorRole.WORKER else None
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
        self._scheduler.update_from_workers(connector_output.kv_connector_worker_meta, connector_output.failed_recving)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request)
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        self._scheduler.finished(request)
        return False, None

    def take_events(self):
        return self._scheduler.take_events()

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def build_connector_worker_meta(self):
        return self._worker.worker_metadata()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        self._link.close()
