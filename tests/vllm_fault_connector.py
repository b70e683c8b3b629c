"""KVDConnector with a fault the test can arm: the page damage of an unlucky instant.

For tests/test_vllm_connector.py only. vLLM takes the scheduler half's offer (its hold,
taken ahead by the lookahead thread) and allocates the request's blocks
(`update_state_after_alloc`) in one scheduler step, microseconds before the load plan
is built, so no outside process can hit the window between them. This subclass does,
when the test has written a fault file (`kv_connector_extra_config["fault_file"]`):
just before the real `update_state_after_alloc`, through a kvd session of its own, it
either damages one page of the request's prefix in kvd's shared memory and has the
daemon audit it (``corrupt N [RANK]``: page N of tensor-parallel rank RANK's namespace,
default 0, and the pages chained after it leave the index), then waits until the
scheduler half has heard of it on kvd's event stream (the hook that makes the race
deterministic), or empties kvd's prefix cache (``evict``). With `load_fault_file` holding
a tensor-parallel rank, that rank's worker fails the next step's loads alone, as if its
kvd session were with another daemon instance than the plans name (the real worker
reports them as load errors), and fills their blocks with random bytes: the stale bytes
a failed load leaves, which that step's forward pass attends to on every rank.
Everything after that is the real connector against the real daemon. Block ids it reported as load errors, and
``request:ID`` for each asynchronous load it reported failed, are appended to
`errors_file`, so the test can see the worker reported them; with
`loads_file` in the extra config, each worker appends how many blocks each load plan
copies into vLLM, per KV-cache group (a line per plan); with `loaded_bytes_file`, each
worker appends its tensor-parallel rank and a sha256 of the bytes each load put into
its cache, block after block, each block's layers in page order (a line per plan), so
a test can check them against kvd's pages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time

import torch
from conftest import raw_page
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from engine_client import KVDClient, SequenceRequest
from gpu_worker.vllm.plans import NULL_BLOCK
from gpu_worker.vllm.scheduler import cacheable_tokens
from gpu_worker.vllm_connector import KVDConnector


class FaultyKVDConnector(KVDConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._fault_file = extra["fault_file"]
        self._errors_file = extra["errors_file"]
        self._loads_file = extra.get("loads_file")
        self._loaded_bytes_file = extra.get("loaded_bytes_file")
        self._load_fault_file = extra.get("load_fault_file")
        self._kv_caches: dict = {}
        self._block_size = vllm_config.cache_config.block_size

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens and os.path.exists(self._fault_file):
            with open(self._fault_file) as f:
                fault = f.read().split()
            os.unlink(self._fault_file)
            with KVDClient.connect(self._link.socket) as kvd:
                self._inject(kvd, request, fault)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _inject(self, kvd: KVDClient, request, fault: list[str]) -> None:
        rank = int(fault[2]) if len(fault) > 2 else 0
        ns = ([self._link.namespace, *self._link.peers])[rank].register(kvd)
        if fault[0] == "evict":
            kvd.reset_prefix_cache(ns)
            return
        tokens, keys = cacheable_tokens(request, self._block_size)
        [hit] = kvd.lookup(ns, [SequenceRequest("fault", tokens, keys)])
        page = int(fault[1])
        raw_page(kvd, ns, hit.hit_pages[page])[...] = 0
        kvd.verify_pages()
        lookahead = self._scheduler.lookahead
        deadline = time.monotonic() + 10
        while lookahead.usable_blocks(request.request_id) > page and time.monotonic() < deadline:
            time.sleep(0.001)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self._loads_file and self.has_connector_metadata():
            with open(self._loads_file, "a") as f:
                for plan in self._get_connector_metadata().loads:  # blocks copied, per KV-cache group
                    f.write(" ".join(str(sum(b != NULL_BLOCK for b in blocks)) for blocks in plan.block_ids) + "\n")
        if self._fails_loads_alone():
            meta = self._get_connector_metadata()
            elsewhere = [dataclasses.replace(plan, daemon_instance="elsewhere") for plan in meta.loads]
            self._worker.start_step(dataclasses.replace(meta, loads=elsewhere))
            stale = torch.Generator().manual_seed(0)
            for layer in self._kv_caches.values():
                for plan in meta.loads:
                    blocks = plan.block_ids[0]
                    layer[blocks] = torch.randn(layer[blocks].shape, generator=stale, dtype=layer.dtype)
        else:
            super().start_load_kv(forward_context, **kwargs)
        if self._loaded_bytes_file and self.has_connector_metadata():  # on CPU the loads are done by now
            layers = [
                self._kv_caches[name] for name in sorted(self._worker.layer_index, key=self._worker.layer_index.get)
            ]
            with open(self._loaded_bytes_file, "a") as f:
                for plan in self._get_connector_metadata().loads:
                    digest = hashlib.sha256()
                    for block in plan.block_ids[0]:
                        for layer in layers:
                            digest.update(layer[block].contiguous().view(torch.uint8).numpy().tobytes())
                    f.write(f"{get_tensor_model_parallel_rank()} {digest.hexdigest()}\n")

    def _fails_loads_alone(self) -> bool:
        """Whether the test armed this rank to fail this step's loads alone (once)."""
        if not (self._load_fault_file and self.has_connector_metadata() and self._get_connector_metadata().loads):
            return False
        try:
            with open(self._load_fault_file) as f:
                if int(f.read()) != get_tensor_model_parallel_rank():
                    return False
            os.unlink(self._load_fault_file)
        except FileNotFoundError:  # not armed, or another rank's fault it took
            return False
        return True

    def register_kv_caches(self, kv_caches) -> None:
        self._kv_caches = kv_caches
        super().register_kv_caches(kv_caches)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        if results.failed_recving:
            with open(self._errors_file, "a") as f:
                f.write(" ".join(f"request:{r}" for r in sorted(results.failed_recving)) + "\n")
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            with open(self._errors_file, "a") as f:
                f.write(" ".join(map(str, sorted(errors))) + "\n")
        return errors
