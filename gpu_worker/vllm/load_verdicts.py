"""`LoadVerdicts`: which requests' saves wait for every rank's word on a synchronous load.

A load plan goes to every tensor-parallel rank, and each rank loads its own pages: one
rank can fail alone (its kvd session dropped, a page it has not mapped). Its blocks then
hold stale bytes, and the forward pass of that step attends to them on every rank
(tensor parallelism all-reduces each layer's output), so every rank's KV of that request
computed in that step is wrong. vLLM recomputes (the failing rank reports the blocks as
load errors, vLLM gathers every rank's), but the other ranks' workers never learn of it.
So the scheduler half (gpu_worker/vllm/scheduler.py) plans no save of a request that read
a loaded block (the loading request, and one that took a local hit on those blocks in
vLLM's own prefix cache) until the step's output brings every rank's word on the load
(`KVDWorkerMetadata.loaded`, gathered by vLLM): all loaded, and the saves go out with the
next metadata; one failed, and what those requests computed meanwhile is never saved
(vLLM computes it again and the scheduler half plans it again).

Asynchronous loads need none of this: vLLM computes nothing of their request until every
rank reported the load, and a failure on any rank makes it compute the prompt.
A request that reads no loaded block is never held back.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_worker.vllm.plans import NULL_BLOCK


class LoadVerdicts:
    def __init__(self) -> None:
        self._loads: dict[str, frozenset[int]] = {}  # load (its request) -> its vLLM blocks, until every rank's word
        self._waiting: dict[str, set[str]] = {}  # request -> the loads whose blocks it read

    def sent(self, req_id: str, block_ids: Iterable[list[int]]) -> None:
        """A synchronous load into these blocks (per KV-cache group) goes to the workers
        with this step's metadata: its request waits for the verdict."""
        blocks = frozenset(b for group in block_ids for b in group if b != NULL_BLOCK)
        if blocks:
            self._loads[req_id] = blocks
            self._waiting.setdefault(req_id, set()).add(req_id)

    def reads(self, req_id: str, block_ids: Iterable[list[int]]) -> None:
        """The request was scheduled with these blocks (new, or resumed after a preemption):
        it waits for the loads into any of them (a local hit on blocks being loaded)."""
        if not self._loads:
            return
        blocks = {b for group in block_ids for b in group}
        if loads := {load for load, loaded in self._loads.items() if not loaded.isdisjoint(blocks)}:
            self._waiting.setdefault(req_id, set()).update(loads)

    def waits(self, req_id: str) -> bool:
        """Whether the request's saves wait for a load's verdict."""
        return req_id in self._waiting

    def decided(self, loaded: dict[str, bool]) -> set[str]:
        """Every rank's word on these loads (request -> all its blocks loaded on every rank);
        returns the requests that read blocks of a load that failed."""
        vetoed = {load for load, ok in loaded.items() if not ok}
        touched = set()
        for load in loaded:
            self._loads.pop(load, None)
        for req_id, loads in list(self._waiting.items()):
            if not loads.isdisjoint(vetoed):
                touched.add(req_id)
            loads.difference_update(loaded)
            if not loads:
                del self._waiting[req_id]
        return touched

    def forget(self, req_id: str) -> None:
        """The request finished: nothing of it waits any more (its own load's verdict still
        releases the requests that read its blocks)."""
        self._waiting.pop(req_id, None)
