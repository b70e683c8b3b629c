"""KVDConnector with a fault the test can arm: the page damage of an unlucky instant.

For tests/test_vllm_connector.py only. vLLM looks a prompt up (`get_num_new_matched_tokens`)
and allocates its blocks (`update_state_after_alloc`) in one scheduler step, microseconds
apart, so no outside process can hit the window between them. This subclass does, when
the test has written a fault file (`kv_connector_extra_config["fault_file"]`): just before
the real `update_state_after_alloc`, it either damages one page of the request's prefix in
kvd's shared memory and has the daemon audit it (``corrupt N [RANK]``: page N of
tensor-parallel rank RANK's namespace, default 0, and the pages chained after it leave the
index), or empties kvd's prefix cache (``evict``). Everything after that is the real
connector against the real daemon. Block ids it reported as load errors are appended to
`errors_file`, so the test can see the worker reported them; with `loads_file` in the
extra config, each worker appends how many blocks each load plan copies into vLLM.
"""

from __future__ import annotations

import os

from conftest import raw_page

from engine_client import SequenceRequest
from gpu_worker.vllm.scheduler import cacheable_tokens
from gpu_worker.vllm_connector import KVDConnector


class FaultyKVDConnector(KVDConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._fault_file = extra["fault_file"]
        self._errors_file = extra["errors_file"]
        self._loads_file = extra.get("loads_file")
        self._block_size = vllm_config.cache_config.block_size

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens and os.path.exists(self._fault_file):
            with open(self._fault_file) as f:
                fault = f.read().split()
            os.unlink(self._fault_file)
            self._link.attempt_all("fault", lambda kvd, namespaces: self._inject(kvd, namespaces, request, fault))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _inject(self, kvd, namespaces: tuple[int, ...], request, fault: list[str]) -> None:
        if fault[0] == "evict":
            kvd.reset_prefix_cache(namespaces[0])
            return
        ns = namespaces[int(fault[2]) if len(fault) > 2 else 0]
        tokens, keys = cacheable_tokens(request, self._block_size)
        [hit] = kvd.lookup(ns, [SequenceRequest("fault", tokens, keys)])
        raw_page(kvd, ns, hit.hit_pages[int(fault[1])])[...] = 0
        kvd.verify_pages()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self._loads_file and self.has_connector_metadata():
            with open(self._loads_file, "a") as f:
                f.writelines(f"{len(plan.block_ids)}\n" for plan in self._get_connector_metadata().loads)
        super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            with open(self._errors_file, "a") as f:
                f.write(" ".join(map(str, sorted(errors))) + "\n")
        return errors
