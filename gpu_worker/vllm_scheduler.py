"""KVDConnector's scheduler half: decides what each vLLM request loads from and saves to kvd.

It holds no tensors. Per request it keeps one kvd sequence in its own session:

1. `matched_tokens` (vLLM's `get_num_new_matched_tokens`) looks the prompt up in kvd,
   without pinning anything, and offers the block-aligned hit beyond vLLM's own local hit,
   never the whole prompt (vLLM computes at least the last token).
2. `allocated` (`update_state_after_alloc`) allocates the kvd sequence for the prompt's
   full blocks: the hit pages are pinned there (they cannot be evicted before the workers
   load them) and private pages are allocated for the rest. The load plan maps hit pages
   to the vLLM blocks just allocated; a block whose page vanished since the lookup goes
   into the plan as missing, and the worker reports it, so vLLM recomputes it.
3. `build_metadata` hands the workers the loads and, for every scheduled request, the
   full prompt blocks that this step completes and that kvd does not hold yet.
4. `update_from_workers` publishes the pages whose positions the workers reported written,
   in order, so other processes hit them; publish dedups against pages another process
   published meanwhile.
5. `finished` releases the kvd sequence (after the last reported saves, when the request
   finished in the step that saved them). Pages stay cached in kvd.

Prompt blocks only: generated tokens are not saved. Requests with prompt embeddings are
left alone.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from engine_client import ExtraKey, ExtraKind, SequenceAllocation, SequenceRequest
from gpu_worker.kvd_link import KVDLink
from gpu_worker.vllm_plans import KVDConnectorMetadata, KVDWorkerMetadata, LoadPlan, SavePlan

log = logging.getLogger(__name__)


def kvd_extra_keys(request) -> tuple[ExtraKey, ...]:
    """What besides token ids makes this request's KV different: LoRA adapter, cache salt,
    multimodal items (their content hash and placeholder range)."""
    keys = []
    if request.lora_request is not None:
        keys.append(ExtraKey.lora(request.lora_request.lora_name))
    if request.cache_salt:
        keys.append(ExtraKey.cache_salt(request.cache_salt))
    for feature in request.mm_features or ():
        position = feature.mm_position
        keys.append(ExtraKey.multimodal(feature.identifier.encode(), position.offset, position.length))
    return tuple(keys)


def cacheable_tokens(request, block_size: int) -> tuple[list[int], tuple[ExtraKey, ...]]:
    """The prompt's full blocks that kvd may hold, and their extra keys.

    A multimodal item that runs past the last full block cuts the prefix before the block
    where it starts: its pages would otherwise be keyed without it."""
    tokens = request.prompt_token_ids or []
    end = len(tokens) // block_size * block_size
    keys = kvd_extra_keys(request)
    for k in keys:
        if k.kind == ExtraKind.MULTIMODAL and k.offset + k.length > end:
            end = min(end, k.offset // block_size * block_size)
    kept = tuple(k for k in keys if k.kind != ExtraKind.MULTIMODAL or k.offset + k.length <= end)
    return list(tokens[:end]), kept


@dataclass
class _Tracked:
    """One request's kvd sequence, as this scheduler half sees it."""

    request: object
    daemon_instance: str
    page_ids: list[int]           # one kvd page per full prompt block
    shared_blocks: int            # blocks [0, shared_blocks) were hits: kvd had them
    block_ids: list[int] = field(default_factory=list)  # the request's vLLM blocks (group 0)
    planned: int = 0              # blocks [0, planned) are hits or in a save plan already sent
    written: set[int] = field(default_factory=set)      # positions the workers reported written
    published: int = 0            # blocks [0, published) are published in kvd
    unanswered: int = 0           # save plans sent whose step's worker output has not come back
    finished: bool = False


class KVDSchedulerSide:
    def __init__(self, link: KVDLink, block_size: int) -> None:
        self.link = link
        self.block_size = block_size
        self._local_hits: dict[str, int] = {}   # req_id -> vLLM's block-aligned local hit at lookup
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadPlan] = []
        self._events: list[BlockStored] = []

    # ---- lookup and allocation ----------------------------------------------------

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond vLLM's local hit that kvd can supply now (block-aligned, never
        the last prompt token). No side effect in kvd."""
        if request.prompt_token_ids is None:
            return 0
        tokens, keys = cacheable_tokens(request, self.block_size)
        loadable = min(len(tokens), (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size)
        if loadable <= num_computed_tokens:
            return 0
        found = self.link.attempt("lookup", lambda kvd, ns: kvd.lookup(
            ns, [SequenceRequest(request.request_id, tokens[:loadable], keys)]))
        if not found:
            return 0
        self._local_hits[request.request_id] = num_computed_tokens
        return max(0, min(found[0].hit_tokens, loadable) - num_computed_tokens)

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request: allocate its kvd sequence, plan its loads."""
        req_id = request.request_id
        local_hit = self._local_hits.pop(req_id, 0)
        self._release(req_id)  # a preempted request comes back here: start over
        if request.prompt_token_ids is None:
            return
        tokens, keys = cacheable_tokens(request, self.block_size)
        allocation: SequenceAllocation | None = None
        if tokens:
            found = self.link.attempt("allocate", lambda kvd, ns: kvd.allocate_with_prefix(
                ns, [SequenceRequest(req_id, tokens, keys)]))
            allocation = found[0] if found else None
        if allocation is not None:
            shared = len(allocation.shared_pages)
            self._tracked[req_id] = _Tracked(request, self.link.instance, allocation.pages, shared, planned=shared,
                                             published=shared)
        if num_external_tokens:
            first = local_hit // self.block_size
            positions = range(first, first + num_external_tokens // self.block_size)
            hits = [p for p in positions if allocation is not None and p < len(allocation.shared_pages)]
            self._loads.append(LoadPlan(
                req_id, self.link.instance,
                page_ids=[allocation.pages[p] for p in hits],
                block_ids=[block_ids[p] for p in hits],
                missing_block_ids=[block_ids[p] for p in positions if p not in set(hits)],
            ))

    # ---- per step -------------------------------------------------------------------

    def build_metadata(self, scheduler_output) -> KVDConnectorMetadata:
        """This step's loads (from `allocated`) and saves (full prompt blocks it completes)."""
        meta = KVDConnectorMetadata(loads=self._loads)
        self._loads = []
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if (t := self._tracked.get(new.req_id)) is not None:
                t.block_ids = list(new.block_ids[0])
                computed_before[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (t := self._tracked.get(req_id)) is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                t.block_ids.extend(new_blocks[0])
            computed_before[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed_before.items():
            t = self._tracked[req_id]
            done = (before + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // self.block_size
            end = min(done, len(t.page_ids), len(t.block_ids))
            if end > t.planned:
                positions = list(range(t.planned, end))
                meta.saves.append(SavePlan(req_id, t.daemon_instance, positions,
                                           page_ids=[t.page_ids[p] for p in positions],
                                           block_ids=[t.block_ids[p] for p in positions]))
                t.planned = end
                t.unanswered += 1
        return meta

    def update_from_workers(self, worker_meta: KVDWorkerMetadata | None) -> None:
        """Publish what the workers wrote, in order; release finished requests whose saves
        have all been answered. Workers save synchronously, so a step's output answers
        every save plan of that step (each of its requests appears, written or not)."""
        for req_id, positions in (worker_meta.written if worker_meta else {}).items():
            if (t := self._tracked.get(req_id)) is not None:
                t.written |= positions
                t.unanswered -= 1
                self._publish(t)
        for req_id in [r for r, t in self._tracked.items() if t.finished and not t.unanswered]:
            self._release(req_id)

    def finished(self, request) -> None:
        """The request is done; its sequence is released once its last saves are answered."""
        t = self._tracked.get(request.request_id)
        self._local_hits.pop(request.request_id, None)
        if t is None:
            return
        t.finished = True
        if not t.unanswered:
            self._release(request.request_id)

    def take_events(self) -> list[BlockStored]:
        events, self._events = self._events, []
        return events

    # ---- helpers --------------------------------------------------------------------

    def _publish(self, t: _Tracked) -> None:
        upto = t.published
        while upto in t.written:
            upto += 1
        if upto == t.published or t.daemon_instance != self.link.instance:
            return
        req_id = t.request.request_id
        done = self.link.attempt("publish", lambda kvd, ns: kvd.publish(ns, [req_id], {req_id: upto * self.block_size}))
        if not done:
            return
        self._events.append(self._stored_event(t.request, t.published, upto))
        t.published = upto

    def _stored_event(self, request, first: int, end: int) -> BlockStored:
        """vLLM's KV event for blocks [first, end) of the request, keyed by vLLM's own block
        hashes so that KV-aware routers match them to vLLM's other events."""
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[first:end]]
        parent = maybe_convert_block_hash(request.block_hashes[first - 1]) if first and request.block_hashes else None
        lora = request.lora_request
        return BlockStored(
            block_hashes=hashes, parent_block_hash=parent,
            token_ids=list(request.prompt_token_ids[first * self.block_size:end * self.block_size]),
            block_size=self.block_size, lora_id=lora.lora_int_id if lora else None, medium="kvd",
            lora_name=lora.lora_name if lora else None,
        )

    def _release(self, req_id: str) -> None:
        t = self._tracked.pop(req_id, None)
        if t is not None and t.daemon_instance == self.link.instance:
            self.link.attempt("release", lambda kvd, ns: kvd.release(ns, [req_id]))
