"""KVDConnector's scheduler half: decides what each vLLM request loads from kvd and saves to it.

It holds no tensors and writes no page:

1. `matched_tokens` (vLLM's `get_num_new_matched_tokens`) looks the prompt up in kvd,
   without pinning anything, and offers the block-aligned hit beyond vLLM's own local hit,
   never the whole prompt (vLLM computes at least the last token). While kvd fetches
   more of the prompt from its remote store it answers None: vLLM asks again next step.
   It offers nothing while the workers cannot load: their last report (each step's
   `KVDWorkerMetadata`) must name the daemon instance of this half's session (before
   the first report they are assumed to), so after an outage, in which the two halves
   reconnect each on its own, no load is promised that the workers would fail.
2. `allocated` (`update_state_after_alloc`): when vLLM takes the offer, the request's
   hit is noted; `build_metadata`, at the end of the same scheduling pass, pins every
   hit of the step in one call (a kvd sequence of this session per request: its pages
   cannot be evicted before the workers load them), and the load plan maps them to the
   vLLM blocks just allocated. A block whose page vanished since the lookup goes into
   the plan as missing, the worker reports it, and vLLM recomputes it.
3. `build_metadata` hands the workers the loads and, for every scheduled request, the
   full blocks that this step completes (prompt blocks, then generated ones, unless
   `save_generated` is off); each worker saves them into its own kvd sequence and
   publishes them (gpu_worker/vllm/worker.py). So the next turn of a conversation, whose
   prompt holds this turn's answer, hits that answer too.
4. `update_from_workers` notes the workers' daemon instance and turns what they published into vLLM KV events
   (`BlockStored`); with KV events on, it remembers the kvd keys of those blocks, and
   `take_events` adds `BlockRemoved` for them once kvd evicts or drops them
   (gpu_worker/vllm/kvd_events.py).
5. `finished` lets the pinning sequence go (the next metadata releases the step's
   pins in one call) and tells the workers to release theirs. Published pages stay
   cached in kvd.

So the scheduler half calls kvd once per request (its lookup) and at most twice per
step whatever the batch (release, pin), besides `page_keys` for KV events.

Under tensor parallelism every call above goes to each rank's namespace (the link's
peers): a hit counts only as far as every rank holds it, and the pins and the load plan
are per rank. In a sliding-window group, blocks outside the window (vLLM's null block)
are neither loaded nor saved.

Requests with prompt embeddings are left alone; a request whose cacheable prefix a
multimodal item cut saves nothing past that cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from engine_client import ExtraKey, ExtraKind, SequenceRequest
from gpu_worker.vllm.kvd_events import StoredBlocks
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.plans import NULL_BLOCK, KVDConnectorMetadata, KVDWorkerMetadata, LoadPlan, PromptKey, SavePlan

MEDIUM = "kvd"  # the medium of the connector's KV events


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

    A multimodal item that straddles the end cuts the prefix before the block where it
    starts (its pages would otherwise be keyed without it), until no item straddles it."""
    tokens = request.prompt_token_ids or []
    end = len(tokens) // block_size * block_size
    keys = kvd_extra_keys(request)
    items = [k for k in keys if k.kind == ExtraKind.MULTIMODAL]
    while straddling := [k for k in items if k.offset < end < k.offset + k.length]:
        end = min(k.offset for k in straddling) // block_size * block_size
    kept = tuple(k for k in keys if k.kind != ExtraKind.MULTIMODAL or k.offset + k.length <= end)
    return list(tokens[:end]), kept


@dataclass
class _Tracked:
    """A request this scheduler half plans saves for."""

    request: object
    prompt: PromptKey
    extends: bool  # blocks past the prompt may be saved (generated tokens)
    sent: int  # tokens the workers know: the cacheable prompt, then more with each plan
    block_ids: list[int] = field(default_factory=list)  # the request's vLLM blocks (group 0)
    planned: int = 0  # blocks [0, planned) were in a save plan already
    announced: bool = False  # its prompt went to the workers with a plan
    pinned_on: str = ""  # the session whose sequence pins its loads ("" none)
    keyed_pages: int = 0  # kvd keys of blocks [0, keyed_pages) were computed (for KV events)
    last_key: bytes | None = None  # the key of block keyed_pages - 1, where the chain goes on


@dataclass(frozen=True)
class _Pin:
    """A load vLLM took the offer of: the prompt's tokens up to the end of the hit, and
    the request's vLLM blocks from `first_block` (past vLLM's local hit) on."""

    tokens: list[int]
    extra_keys: tuple[ExtraKey, ...]
    first_block: int
    block_ids: list[int]


class KVDSchedulerSide:
    def __init__(
        self,
        link: KVDLink,
        block_size: int,
        save_generated: bool = True,
        track_removals: bool = True,
        drops_outside_window: bool = False,
    ) -> None:
        self.link = link
        self.block_size = block_size
        self.save_generated = save_generated
        # a sliding-window group: vLLM's null block stands for its blocks outside the window
        self.drops_outside_window = drops_outside_window
        # kvd key -> vLLM hash of the blocks reported stored, for BlockRemoved when kvd drops them
        self._stored = StoredBlocks(link) if track_removals else None
        self._local_hits: dict[str, int] = {}  # req_id -> vLLM's block-aligned local hit at lookup
        self._workers_instance: str | None = None  # the workers' last report: whose pages they load (None: none yet)
        self._tracked: dict[str, _Tracked] = {}
        self._pins: dict[str, _Pin] = {}  # the step's loads, pinned when its metadata is built
        self._unpinned: list[tuple[str, str]] = []  # (session, kvd sequence) of pins to release with the next metadata
        self._finished: set[str] = set()  # for the workers, with the next metadata
        self._finished_requests: dict[str, _Tracked] = {}  # for events still to come
        self._events: list[KVCacheEvent] = []

    # ---- lookup and allocation ----------------------------------------------------

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond vLLM's local hit that kvd can supply now (block-aligned, never
        the last prompt token); None while kvd fetches more of the prompt from its remote
        store (vLLM then asks again next step). Pins nothing in kvd."""
        if request.prompt_token_ids is None:
            return 0
        tokens, keys = cacheable_tokens(request, self.block_size)
        loadable = min(len(tokens), (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size)
        if loadable <= num_computed_tokens:
            return 0
        wanted = SequenceRequest(self.link.seq_id(request.request_id), tokens[:loadable], keys)
        found = self.link.attempt_all(
            "lookup", lambda kvd, namespaces: [kvd.lookup(ns, [wanted])[0] for ns in namespaces]
        )
        if not found or not self._workers_can_load():
            return 0
        if any(rank.remote_pending_tokens for rank in found):
            return None
        self._local_hits[request.request_id] = num_computed_tokens
        hit = min(rank.hit_tokens for rank in found)  # every rank loads its heads of each block
        return max(0, min(hit, loadable) - num_computed_tokens)

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request: track it, and note what it will load (the
        step's metadata pins all of it in one call)."""
        req_id = request.request_id
        local_hit = self._local_hits.pop(req_id, 0)
        self._unpin(req_id)  # a preempted request comes back here: start over
        self._pins.pop(req_id, None)
        if request.prompt_token_ids is None:
            return
        tokens, keys = cacheable_tokens(request, self.block_size)
        whole = len(tokens) == len(request.prompt_token_ids) // self.block_size * self.block_size
        self._tracked[req_id] = _Tracked(request, PromptKey(tokens, keys), self.save_generated and whole, len(tokens))
        if num_external_tokens:
            self._pins[req_id] = _Pin(
                tokens[: local_hit + num_external_tokens], keys, local_hit // self.block_size, list(block_ids)
            )

    # ---- per step -------------------------------------------------------------------

    def build_metadata(self, scheduler_output) -> KVDConnectorMetadata:
        """This step's loads (from `allocated`), saves (the full blocks it completes) and
        the requests finished since the last step."""
        if self._stored is not None:
            self._stored.follow()
        self._release_unpinned()
        meta = KVDConnectorMetadata(loads=self._pin_loads(), finished=self._finished)
        self._finished = set()
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
            # Fewer tokens computed than planned: vLLM recomputes blocks that failed to load
            # (or a preempted request starts over); their saves were dropped, plan them again.
            t.planned = min(t.planned, before // self.block_size)
            done = (before + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // self.block_size
            known = len(t.request.all_token_ids) if t.extends else len(t.prompt.token_ids)
            end = min(done, known // self.block_size, len(t.block_ids))
            if end > t.planned:
                positions = self._holding_kv(t.block_ids, t.planned, end)
                more = list(t.request.all_token_ids[t.sent : end * self.block_size])
                meta.saves.append(
                    SavePlan(
                        req_id,
                        positions,
                        [t.block_ids[p] for p in positions],
                        prompt=None if t.announced else t.prompt,
                        more_tokens=more,
                    )
                )
                t.planned, t.announced, t.sent = end, True, max(t.sent, end * self.block_size)
        return meta

    def update_from_workers(self, worker_meta: KVDWorkerMetadata | None) -> None:
        """The workers' daemon instance, and vLLM KV events for the blocks they published."""
        if worker_meta is not None:
            self._workers_instance = worker_meta.daemon_instance
        for req_id, (start, end) in (worker_meta.published if worker_meta else {}).items():
            t = self._tracked.get(req_id) or self._finished_requests.get(req_id)
            if t is not None:
                event = self._stored_event(t.request, start, end)
                self._events.append(event)
                if self._stored is not None:
                    self._remember(t, end, event.block_hashes)
        self._finished_requests.clear()  # a step's output answers its saves; none come later

    def finished(self, request) -> None:
        """The request is done: release the pin of its loads; the workers release theirs."""
        req_id = request.request_id
        self._local_hits.pop(req_id, None)
        self._pins.pop(req_id, None)
        self._unpin(req_id)
        if (t := self._tracked.pop(req_id, None)) is not None:
            self._finished.add(req_id)
            self._finished_requests[req_id] = t

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        removed = self._stored.take_removed() if self._stored is not None else []
        if removed:
            events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        return events

    def close(self) -> None:
        if self._stored is not None:
            self._stored.close()

    # ---- helpers --------------------------------------------------------------------

    def _holding_kv(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """The positions in [start, end) whose blocks hold KV: in a sliding-window group,
        not those outside the window (vLLM's null block), which are neither loaded nor saved."""
        return [p for p in range(start, end) if not (self.drops_outside_window and block_ids[p] == NULL_BLOCK)]

    def _workers_can_load(self) -> bool:
        """Whether the workers' kvd sessions are with this half's daemon instance (their
        last report says so, or none came yet), so that they can load what it pins."""
        return self._workers_instance is None or self._workers_instance == self.link.instance

    def _remember(self, t: _Tracked, end: int, hashes: list) -> None:
        """The kvd keys of the request's blocks [end - len(hashes), end), mapped to their vLLM hashes.

        The chain goes on from the last key computed for the request, so a long decode that
        publishes its generated blocks a few at a time hashes each block once, not its whole
        prefix each time. Blocks before that key (published again) are hashed from the
        request's first block on."""
        if not hashes:
            return
        if t.keyed_pages > end - len(hashes):
            t.keyed_pages, t.last_key = 0, None
        first_page, parent = t.keyed_pages, t.last_key
        tokens = t.request.all_token_ids[first_page * self.block_size : end * self.block_size]
        extra_keys = t.prompt.extra_keys  # blocks past the prompt: no item was cut
        new_keys = self.link.attempt(
            "page keys",
            lambda kvd, ns: kvd.page_keys(ns, tokens, extra_keys, first_page=first_page, parent=parent),
        )
        if new_keys is not None and len(new_keys) == end - first_page:
            t.keyed_pages, t.last_key = end, new_keys[-1]
            self._stored.remember(new_keys[len(new_keys) - len(hashes) :], hashes)

    def _stored_event(self, request, first: int, end: int) -> BlockStored:
        """vLLM's KV event for blocks [first, end) of the request, keyed by vLLM's own block
        hashes so that KV-aware routers match them to vLLM's other events."""
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[first:end]]
        parent = maybe_convert_block_hash(request.block_hashes[first - 1]) if first and request.block_hashes else None
        lora = request.lora_request
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[first * self.block_size : end * self.block_size]),
            block_size=self.block_size,
            lora_id=lora.lora_int_id if lora else None,
            medium=MEDIUM,
            lora_name=lora.lora_name if lora else None,
        )

    def _pin_loads(self) -> list[LoadPlan]:
        """Pins the step's loads in one kvd sequence each, in every tensor-parallel rank's
        namespace (one call a rank; all ranks or none), and plans them. A block whose page
        vanished since the lookup on any rank (or all of them, when kvd cannot serve) goes
        into the plan as missing: the worker reports it and vLLM recomputes it on all ranks."""
        pins, self._pins = self._pins, {}
        if not pins:
            return []
        requests = [SequenceRequest(self.link.seq_id(r), pin.tokens, pin.extra_keys) for r, pin in pins.items()]
        pinned: list[int] = []  # the namespaces whose allocate succeeded

        def pin_every_rank(kvd, namespaces) -> list[list]:
            found = []
            for ns in namespaces:
                found.append(kvd.allocate_with_prefix(ns, requests))
                pinned.append(ns)
            return found

        by_rank = self.link.attempt_all("allocate", pin_every_rank)
        if by_rank is None and pinned:  # a rank refused after others pinned: let those go
            seq_ids = [r.seq_id for r in requests]
            self.link.attempt_all("release", lambda kvd, _: [kvd.release(ns, seq_ids) for ns in pinned])
        ranks = self.link.namespace.tp_size
        plans = []
        for i, (req_id, pin) in enumerate(pins.items()):
            pages_by_rank = [found[i].shared_pages for found in by_rank] if by_rank else [[]] * ranks
            hit = min(len(pages) for pages in pages_by_rank)  # blocks every rank can load
            if by_rank:
                self._tracked[req_id].pinned_on = self.link.session
                self._tracked[req_id].planned = hit  # kvd holds these blocks: nothing to save
            positions = self._holding_kv(pin.block_ids, pin.first_block, len(pin.tokens) // self.block_size)
            plans.append(
                LoadPlan(
                    req_id,
                    self.link.instance,
                    pages_by_rank=tuple([pages[p] for p in positions if p < hit] for pages in pages_by_rank),
                    block_ids=[pin.block_ids[p] for p in positions if p < hit],
                    missing_block_ids=[pin.block_ids[p] for p in positions if p >= hit],
                )
            )
        return plans

    def _unpin(self, req_id: str) -> None:
        """The request's pin goes with the next metadata's release (one call for the step's)."""
        t = self._tracked.get(req_id)
        if t is not None and t.pinned_on:
            self._unpinned.append((t.pinned_on, self.link.seq_id(req_id)))
            t.pinned_on = ""

    def _release_unpinned(self) -> None:
        """Releases the pins let go since the last metadata, in one call (those of an ended
        session ended with it)."""
        unpinned = [seq_id for session, seq_id in self._unpinned if session == self.link.session]
        self._unpinned = []
        if unpinned:
            self.link.attempt_all("release", lambda kvd, namespaces: [kvd.release(ns, unpinned) for ns in namespaces])
