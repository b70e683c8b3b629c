"""KVDConnector's scheduler half: decides what each vLLM request loads from kvd and saves to it.

It holds no tensors, writes no page, and makes no kvd call on vLLM's scheduler thread:
its calls run on the thread of its `Lookahead` (gpu_worker/vllm/lookahead.py).

1. `seen` (vLLM's `on_new_request`) hands a new request's prompt to the lookahead
   thread, which looks it up and holds its hit (a kvd sequence of this half's session:
   its pages cannot be evicted) together with every other prompt that arrived meanwhile.
2. `matched_tokens` (`get_num_new_matched_tokens`) offers the held, block-aligned hit
   beyond vLLM's own local hit, never the whole prompt (vLLM computes at least the last
   token). While the thread is still at it, or kvd fetches more of the prompt from its
   remote store, it answers None: vLLM asks again next step. After a step that ran
   nothing (vLLM only waits for kvd), the first ask waits up to `IDLE_WAIT` for the
   answer: vLLM's empty steps would keep two processes busy that the daemon and the
   lookahead thread need the CPU of (a 2-core box: 8K-token hits' calls reached the
   daemon 30-145 ms late); while anything runs, no ask waits. A hold whose session ended,
   or whose pages kvd removed, is not offered: it is asked for afresh. It offers nothing
   while the workers cannot load: their last report (each step's `KVDWorkerMetadata`)
   must name the daemon instance of the hold (before the first report they are assumed
   to), so after an outage, in which the two halves reconnect each on its own, no load
   is promised that the workers would fail.
3. `allocated` (`update_state_after_alloc`): when vLLM takes the offer, the hold becomes
   the request's load and `build_metadata` maps its pages to the vLLM blocks just
   allocated; an offer vLLM did not take is let go. Should kvd have removed a held page
   meanwhile, the load's blocks go into the plan as missing, the worker reports them,
   and vLLM recomputes them.
4. `build_metadata` hands the workers the loads and, for every scheduled request, the
   full blocks that this step completes (prompt blocks, then generated ones, unless
   `save_generated` is off); each worker saves them into its own kvd sequence and
   publishes them (gpu_worker/vllm/worker.py). So the next turn of a conversation, whose
   prompt holds this turn's answer, hits that answer too. A request that read blocks a
   synchronous load fills saves nothing until every rank's word on that load is back
   (its `LoadVerdicts`, gpu_worker/vllm/load_verdicts.py): one rank's failed load makes
   every rank's KV of that step wrong.
5. `update_from_workers` notes the workers' daemon instance and their word on the step's
   loads, and turns what they published into vLLM KV events (`BlockStored`); with KV
   events on, it remembers the kvd keys of
   those blocks, and `take_events` adds `BlockRemoved` for them once kvd evicts or drops
   them (gpu_worker/vllm/block_events.py).
6. `finished` lets the request's hold go and tells the workers to release their
   sequences. Published pages stay cached in kvd. The workers save asynchronously: a
   request a save was planned for keeps its blocks in vLLM until the workers report its
   saves done (`request_finished` returns True, the workers' `finished_sending`), and
   the requests vLLM preempted go to the workers with the step's metadata
   (`KVDConnectorMetadata.preempted`), so that no save reads a block vLLM reuses.

A request may say what kvd does with it (`kv_transfer_params["kvd"]`, read once in `seen`:
gpu_worker/vllm/request_params.py): with `"store": false` no save plan is made for it
(its lookups and loads are as any request's); with `"keep_seconds": N`, once it finished
and its saves are done (step 6), its cacheable prompt goes to the lookahead thread, which
pins it for N seconds (gpu_worker/vllm/keeps.py).

So the scheduler half's calls are a lookup and a hold per batch of arriving requests,
a release per batch of finished ones, and a pin per prompt kept, all off vLLM's scheduler
loop.

Under tensor parallelism every call above goes to each rank's namespace (the link's
peers): a hit counts only as far as every rank holds it, and the load plan is per rank.
An MLA model's ranks share one namespace (cache_shape.py): the link has no peers, and
every rank loads the one plan's pages.
With vLLM's hybrid manager on, a request has blocks in each KV-cache group: a page (all
layers of a block) loads into every group's block at its position, except a
sliding-window group's blocks outside the window (vLLM's null block), and is saved only
where every group holds the block. With more than one group, loads are asynchronous
(`async_loads`): vLLM waits for them between steps and calls `allocated` again once
they are done; one that failed (`update_from_workers`) makes vLLM compute the prompt,
and kvd is not offered for that request again.

Requests with prompt embeddings are left alone; a request whose cacheable prefix a
multimodal item cut saves nothing past that cut.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_events import KVCacheEvent

from engine_client import ExtraKey, ExtraKind, SequenceRequest
from gpu_worker.vllm.block_events import BlockEvents, KeyChain
from gpu_worker.vllm.keeps import KeepAsk
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.load_verdicts import LoadVerdicts
from gpu_worker.vllm.lookahead import Hold, Lookahead
from gpu_worker.vllm.plans import NULL_BLOCK, KVDConnectorMetadata, KVDWorkerMetadata, LoadPlan, PromptKey, SavePlan
from gpu_worker.vllm.request_params import KvdParams


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
    params: KvdParams  # what the request asked of kvd: nothing saved (store false), its prompt kept
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group: the request's vLLM blocks
    planned: int = 0  # blocks [0, planned) were in a save plan already
    computed: int = 0  # blocks [0, computed) hold KV of the steps planned so far
    announced: bool = False  # its prompt went to the workers with a plan
    awaits_load: bool = False  # an asynchronous load was planned; vLLM allocates again once it is done
    keys: KeyChain = field(default_factory=KeyChain)  # how far its kvd keys were computed (for KV events)


@dataclass(frozen=True)
class _Load:
    """A load vLLM took the offer of: blocks [first_block, end_block) of the request (past
    vLLM's local hit, up to the end of the offer) from its hold, into `block_ids`."""

    hold: Hold
    first_block: int
    end_block: int
    block_ids: list[list[int]]  # per KV-cache group


# How long the first ask after an empty step may wait for the lookahead's answer: a few
# calls' worth (~1 ms each when the daemon has the CPU); a request arriving meanwhile is
# added at most this late.
IDLE_WAIT = 0.02


class KVDSchedulerSide:
    def __init__(
        self,
        link: KVDLink,
        block_size: int,
        save_generated: bool = True,
        track_removals: bool = True,
        sliding_groups: tuple[bool, ...] = (False,),
        lookup_patience: float | None = None,
        keep_share: float = 0.5,
    ) -> None:
        """`lookup_patience`: seconds a request waits for its lookup (None: one call timeout);
        `keep_share`: the share of kvd's budget the prompts requests ask to keep may hold
        (gpu_worker/vllm/keeps.py)."""
        self.link = link
        self.block_size = block_size
        self.save_generated = save_generated
        # per KV-cache group, whether it is a sliding-window group of vLLM's hybrid manager,
        # where vLLM's null block stands for its blocks outside the window
        self.sliding_groups = sliding_groups
        # block-level load errors cannot name a block of one of several groups: vLLM waits
        # for such loads between steps, and a failed one fails its request (plans.LoadPlan)
        self.async_loads = len(sliding_groups) > 1
        self._failed_loads: set[str] = set()  # requests whose asynchronous load failed: computed
        self.events = BlockEvents(link, block_size, track_removals)
        self.lookahead = Lookahead(
            link, block_size, self.events.removal_listeners, patience=lookup_patience, keep_share=keep_share
        )
        self._params: dict[str, KvdParams] = {}  # what each request asked of kvd, read once
        self._counts: Counter[str] = Counter()  # requests_not_stored, params_ignored; since `take_counts`
        self._local_hits: dict[str, int] = {}  # req_id -> vLLM's block-aligned local hit at lookup
        self._workers_instance: str | None = None  # the workers' last report: whose pages they load (None: none yet)
        self._idle = False  # vLLM's last step ran nothing, and no ask has waited since
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[str, _Load] = {}  # the step's loads, planned when its metadata is built
        self._finished: set[str] = set()  # for the workers, with the next metadata
        self._finished_requests: dict[str, _Tracked] = {}  # finished, saves in flight: for events still to come
        self._saving: set[str] = set()  # requests a save plan went out for, until they finish
        self.verdicts = LoadVerdicts()  # whose saves wait for every rank's word on a load
        self._finished_waiting: dict[str, _Tracked] = {}  # finished while their saves waited: for the next metadata

    # ---- lookup and allocation ----------------------------------------------------

    def _wanted(self, request) -> SequenceRequest | None:
        """What kvd may supply of the request's prompt: its cacheable full blocks, never the
        block of the last prompt token (None: nothing)."""
        if request.prompt_token_ids is None:
            return None
        tokens, keys = cacheable_tokens(request, self.block_size)
        loadable = min(len(tokens), (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size)
        if not loadable:
            return None
        return SequenceRequest(self.link.seq_id(request.request_id), tokens[:loadable], keys)

    def seen(self, request) -> None:
        """vLLM added the request: what it asks of kvd is read (a warning for what is
        wrong), and its lookup starts now, on the lookahead thread."""
        self._params_of(request)
        if (wanted := self._wanted(request)) is not None:
            self.lookahead.ask(request.request_id, wanted, speculative=True)

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond vLLM's local hit that kvd holds for the request (block-aligned,
        never the last prompt token); None while the lookahead thread is at it, or kvd
        fetches more of the prompt from its remote store (vLLM asks again next step)."""
        wanted = self._wanted(request)
        if wanted is None or len(wanted.token_ids) <= num_computed_tokens or request.request_id in self._failed_loads:
            return 0
        hold = self.lookahead.answer(request.request_id, wanted, wait=IDLE_WAIT if self._idle else 0.0)
        self._idle = False
        if hold is None:
            return None
        if not hold.blocks or not self._workers_can_load(hold.instance):
            return 0
        self._local_hits[request.request_id] = num_computed_tokens
        return max(0, hold.blocks * self.block_size - num_computed_tokens)

    def allocated(self, request, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request (per KV-cache group): track it; a load it
        took the offer of is planned with the step's metadata, an offer it did not take is
        let go. After an asynchronous load vLLM calls again, with no load: nothing changes."""
        req_id = request.request_id
        if not num_external_tokens and (t := self._tracked.get(req_id)) is not None and t.awaits_load:
            t.awaits_load = False
            return
        local_hit = self._local_hits.pop(req_id, 0)
        self._loads.pop(req_id, None)  # a preempted request comes back here: start over
        if request.prompt_token_ids is None:
            return
        tokens, keys = cacheable_tokens(request, self.block_size)
        whole = len(tokens) == len(request.prompt_token_ids) // self.block_size * self.block_size
        self._tracked[req_id] = _Tracked(
            request, PromptKey(tokens, keys), self.save_generated and whole, len(tokens), self._params_of(request)
        )
        if num_external_tokens:
            first, end = local_hit // self.block_size, (local_hit + num_external_tokens) // self.block_size
            self._loads[req_id] = _Load(self.lookahead.claim(req_id), first, end, [list(g) for g in block_ids])
            self._tracked[req_id].awaits_load = self.async_loads
        else:
            self.lookahead.let_go(req_id)

    # ---- per step -------------------------------------------------------------------

    def build_metadata(self, scheduler_output) -> KVDConnectorMetadata:
        """This step's loads (from `allocated`), saves (the full blocks it completes, unless
        the request waits for a load's verdict: load_verdicts.py) and the requests finished
        since the last step."""
        self._idle = not any(scheduler_output.num_scheduled_tokens.values())
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta = KVDConnectorMetadata(loads=self._plan_loads(), finished=self._finished, preempted=preempted)
        self._finished = set()
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if (t := self._tracked.get(new.req_id)) is not None:
                t.block_ids = [list(g) for g in new.block_ids]
                computed_before[new.req_id] = new.num_computed_tokens
                self.verdicts.reads(new.req_id, t.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (t := self._tracked.get(req_id)) is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = [list(g) for g in new_blocks] if new_blocks is not None else []
                self.verdicts.reads(req_id, t.block_ids)
            elif new_blocks is not None:
                for blocks, more in zip(t.block_ids, new_blocks):
                    blocks.extend(more)
            computed_before[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed_before.items():
            t = self._tracked[req_id]
            # Fewer tokens computed than planned: vLLM recomputes blocks that failed to load
            # (or a preempted request starts over); their saves were dropped, plan them again.
            t.planned = min(t.planned, before // self.block_size)
            done = (before + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // self.block_size
            known = len(t.request.all_token_ids) if t.extends else len(t.prompt.token_ids)
            t.computed = min(done, known // self.block_size, min((len(g) for g in t.block_ids), default=0))
            if not self.verdicts.waits(req_id) and (plan := self._save_plan(t)) is not None:
                meta.saves.append(plan)
                self._saving.add(req_id)
        for req_id, t in self._finished_waiting.items():
            # Finished in the step its load's verdict came with (an abort: maybe before it):
            # vLLM tells the workers it finished with this step, so they hear of it now. No
            # verdict yet: what it computed meanwhile is not saved. A plan of no block still
            # counts: the workers report it done, and vLLM frees its blocks.
            if self.verdicts.waits(req_id):
                t.planned = max(t.planned, t.computed)
            meta.saves.append(self._save_plan(t) or SavePlan(req_id, [], tuple([] for _ in t.block_ids)))
            meta.finished.add(req_id)
            self.verdicts.forget(req_id)
        self._finished_waiting = {}
        return meta

    def _save_plan(self, t: _Tracked) -> SavePlan | None:
        """The plan of the request's blocks computed and not planned yet (None: none, or
        the request asked that nothing of it be stored)."""
        if t.computed <= t.planned or not t.params.store:
            return None
        positions = self._held_by_every_group(t.block_ids, t.planned, t.computed)
        plan = SavePlan(
            t.request.request_id,
            positions,
            tuple([blocks[p] for p in positions] for blocks in t.block_ids),
            prompt=None if t.announced else t.prompt,
            more_tokens=list(t.request.all_token_ids[t.sent : t.computed * self.block_size]),
        )
        t.planned, t.announced, t.sent = t.computed, True, max(t.sent, t.computed * self.block_size)
        return plan

    def update_from_workers(
        self,
        worker_meta: KVDWorkerMetadata | None,
        failed_loads: set[str] = frozenset(),
        saved: set[str] = frozenset(),
    ) -> None:
        """The workers' daemon instance, their word on the step's synchronous loads (what
        requests that read a failed load's blocks computed meanwhile is never saved: vLLM
        computes it again), vLLM KV events for the blocks they published, the
        asynchronous loads that failed (vLLM computes those requests' prompts, kvd is not
        offered for them again), and the finished requests whose saves every worker
        reported done (`finished_sending`: no events of theirs come later)."""
        for req_id in failed_loads:
            self._failed_loads.add(req_id)
            self.lookahead.let_go(req_id)
            if (t := self._tracked.get(req_id)) is not None:
                t.awaits_load = False
        if worker_meta is not None:
            self._workers_instance = worker_meta.daemon_instance
            for req_id in self.verdicts.decided(worker_meta.loaded):
                if (t := self._tracked.get(req_id) or self._finished_waiting.get(req_id)) is not None:
                    t.planned = max(t.planned, t.computed)
        for req_id, (start, end) in (worker_meta.published if worker_meta else {}).items():
            t = self._tracked.get(req_id) or self._finished_requests.get(req_id)
            if t is not None:
                self.events.stored(t.request, t.prompt.extra_keys, t.keys, start, end)
        for req_id in saved:
            if (t := self._finished_requests.pop(req_id, None)) is not None:
                self._keep(t)

    def finished(self, request) -> bool:
        """The request is done (or aborted): its hold is let go; the workers release their
        sequences. True when a save was planned for it: vLLM keeps its blocks until every
        worker reports its saves done (`finished_sending`; the workers count the same plans).
        So it is when its saves wait for a load's verdict (vLLM finishes a request before
        it reads the step's connector output): they go out with the next metadata.
        A prompt the request asked to keep is kept once what it saved is published: now,
        or when the workers report its saves done (`update_from_workers`)."""
        req_id = request.request_id
        t = self._tracked.pop(req_id, None)
        self._params.pop(req_id, None)
        waiting = t is not None and t.params.store and self.verdicts.waits(req_id) and t.computed > t.planned
        saving = req_id in self._saving or waiting
        self._saving.discard(req_id)
        self._local_hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._failed_loads.discard(req_id)
        self.lookahead.let_go(req_id)
        if waiting:
            self._finished_waiting[req_id] = t  # planned and released with the next metadata
        else:
            self.verdicts.forget(req_id)
        if t is not None:
            if not waiting:
                self._finished.add(req_id)
            if saving:  # what its saves publish is reported until the workers say they are done
                self._finished_requests[req_id] = t
            else:
                self._keep(t)
        return saving

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take()

    def take_counts(self) -> dict[str, int]:
        """The scheduler half's counts since the last call (the connector's stats:
        gpu_worker/vllm/connector_stats.py)."""
        counts, self._counts = self._counts, Counter()
        return {
            "lookups_unanswered": self.lookahead.take_unanswered(),
            "requests_not_stored": counts["requests_not_stored"],
            "params_ignored": counts["params_ignored"],
            **self.lookahead.keeps.take_counts(),
        }

    def close(self) -> None:
        self.lookahead.close()

    # ---- helpers --------------------------------------------------------------------

    def _params_of(self, request) -> KvdParams:
        """What the request asks of kvd, read (and counted) once: when vLLM adds it."""
        params = self._params.get(request.request_id)
        if params is None:
            params = self._params[request.request_id] = KvdParams.of(request)
            self._counts["requests_not_stored"] += int(not params.store)
            self._counts["params_ignored"] += int(bool(params.ignored))
        return params

    def _keep(self, t: _Tracked) -> None:
        """The request is done and what it saved published: keep its prompt, if it asked."""
        if t.params.keep_seconds:
            self.lookahead.keep(KeepAsk(t.request.request_id, t.prompt, t.params.keep_seconds))

    def _held_by_every_group(self, block_ids: list[list[int]], start: int, end: int) -> list[int]:
        """The positions in [start, end) whose blocks hold KV in every group (a page holds
        every layer): not those a sliding-window group left outside its window (vLLM's
        null block). Only these are saved; loads skip a group's null blocks one by one."""
        return [
            p
            for p in range(start, end)
            if not any(sliding and blocks[p] == NULL_BLOCK for sliding, blocks in zip(self.sliding_groups, block_ids))
        ]

    def _workers_can_load(self, instance: str) -> bool:
        """Whether the workers' kvd sessions are with this daemon instance (their last
        report says so, or none came yet), so that they can load what it holds."""
        return self._workers_instance is None or self._workers_instance == instance

    def _plan_loads(self) -> list[LoadPlan]:
        """The step's loads from the holds vLLM took: each rank's pages into the blocks
        vLLM allocated (in every KV-cache group; a sliding-window group's blocks outside
        the window are null and skipped). Blocks from a page kvd removed since on, or all
        of a hold whose session ended, go into the plan as missing: vLLM recomputes them
        (an asynchronous load: its request's prompt)."""
        loads, self._loads = self._loads, {}
        plans = []
        for req_id, load in loads.items():
            hit = min(self.lookahead.usable_blocks(req_id), load.end_block)
            positions = [p for p in range(load.first_block, load.end_block) if p < hit]
            missing = range(max(hit, load.first_block), load.end_block)
            if hit and not (self.async_loads and len(missing)):
                self._tracked[req_id].planned = hit  # kvd holds these blocks: nothing to save
            if not self.async_loads:  # computed in the step that loads: every rank's word first
                self.verdicts.sent(req_id, [blocks[load.first_block : load.end_block] for blocks in load.block_ids])
            plans.append(
                LoadPlan(
                    req_id,
                    load.hold.instance,
                    pages_by_rank=tuple([pages[p] for p in positions] for pages in load.hold.pages_by_rank),
                    block_ids=tuple([blocks[p] for p in positions] for blocks in load.block_ids),
                    missing_block_ids=[b for g in load.block_ids for p in missing if (b := g[p]) != NULL_BLOCK],
                    asynchronous=self.async_loads,
                    extents_by_rank=load.hold.extents_by_rank,
                )
            )
        return plans
