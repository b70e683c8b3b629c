"""A small inference engine: kvd host pages + a GPU page pool + the reference model runner.

One `Engine` serves one model in one namespace of one `KVDClient` session:

- `prefill(batch)`: one `allocate_with_prefix` for the whole batch (hits, misses and full
  hits together); the planner maps each unique cached host page to one GPU page (loaded
  once) and gives every sequence fresh GPU pages for its suffix; the runner computes only
  the suffix tokens (a full hit recomputes just the last token's query) and, layer by
  layer, the new K/V are offloaded into the sequence's private host pages; then full pages
  are published and the daemon's rebinds (a page identical to one already published is
  replaced by it) are applied to the host row and the GPU page table alike.
- `decode_step(seq_ids)`: one greedy token per sequence. GPU room first (a runway page
  when the new token starts a page), then one `extend_batch` carrying the token ids, the
  forward pass, the offload of the token's K/V into its private host page, and `publish`
  of every page that filled.
- `hold` / `resume` / `complete`: the daemon's IN_DECODE ⇄ ON_HOLD → COMPLETED, with the
  GPU references dropped on hold (copies stay cached) and reacquired on resume.

Rules kept here:
- Only private host pages are written, and only by the sequence that owns them; shared
  (published) host pages and their GPU copies are read only.
- A batch that does not fit (GPU pool or host) raises `NoRoom` and changes no count: GPU
  room is taken before the daemon is asked, and given back if the daemon refuses.
- A GPU copy of a host page is trusted only while one of this engine's sequences holds a
  daemon reference to that page: when the last one goes (completion, eviction, rebind) the
  copy is forgotten, because the daemon may then free the page id and reuse it for other
  KV. A sequence the daemon evicted while on hold is noticed through the session's
  eviction events, or at the latest when the daemon hands out one of its pages again.

One engine per client: `take_evicted()` reports every namespace of the session.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from engine_client import ExtendItem, KVDClient, KVDError, SequenceAllocation, SequenceRequest, SequenceState
from gpu_worker.gpu_stats import GpuPoolStats
from gpu_worker.host_pages import ClientHostPages
from gpu_worker.loader import CopyBatch, PageLoader, PageStore
from gpu_worker.model import DecodeRequest, LayerCallback, ModelRunner, PrefillOutput, PrefillRequest
from gpu_worker.model_config import ModelSpec
from gpu_worker.planner import DecodeBatchPlanner, DecodePlan, HostRow, PlanExhausted, SeqId
from gpu_worker.pool import GpuPageId, GpuPagePool, HostPageId, PageLoad


T = TypeVar("T")


class NoRoom(RuntimeError):
    """A batch needs more GPU pages or host pages than can be had; nothing changed."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"no room on {where}: {message}")
        self.where = where  # "gpu" or "host"


class SequenceEvicted(RuntimeError):
    """The daemon evicted these on-hold sequences (host memory pressure); their KV is gone.
    Complete them and prefill their tokens again (the prefix may still hit)."""

    def __init__(self, seq_ids: Sequence[str]) -> None:
        super().__init__(f"sequences {list(seq_ids)} were evicted while on hold")
        self.seq_ids = tuple(seq_ids)


@dataclass(frozen=True)
class PrefillResult:
    seq_id: str
    logits: torch.Tensor  # [vocab] float32: next-token logits after the last prompt token
    next_token: int  # greedy choice from `logits`; the next decode_step feeds it
    computed_tokens: int  # prompt tokens whose K/V this prefill computed
    reused_tokens: int  # prompt tokens whose K/V came from cached host pages


@dataclass(frozen=True)
class DecodeResult:
    seq_ids: tuple[str, ...]
    tokens: tuple[int, ...]  # greedy next token of each sequence (fed by the next step)
    logits: torch.Tensor  # [batch, vocab] float32
    loaded_pages: int  # host→GPU page copies this step needed
    published_pages: int  # pages that filled this step and were published


@dataclass(frozen=True)
class SequenceInfo:
    seq_id: str
    tokens: tuple[int, ...]  # tokens whose K/V is cached: the prompt, then every token fed
    next_token: int  # chosen but not yet fed; tokens + (next_token,) is the conversation so far
    host_pages: tuple[HostPageId, ...]  # the daemon's page table, token order
    published_pages: int  # leading host pages that are published (immutable, shareable)
    state: str  # "IN_DECODE", "ON_HOLD" or "EVICTED"

    @property
    def conversation(self) -> list[int]:
        return [*self.tokens, self.next_token]


@dataclass(frozen=True)
class EngineStats:
    gpu: GpuPoolStats  # loads, skipped duplicate loads, logical/physical/shared GPU pages
    sequences: int
    prefill_tokens_computed: int
    prefill_tokens_reused: int
    decode_tokens: int
    pages_published: int
    rebinds: int  # host pages replaced by an identical published page
    bytes_offloaded: int  # device→host K/V bytes


@dataclass
class _Seq:
    tokens: list[int]
    next_token: int
    host: list[HostPageId]
    published: int
    state: SequenceState = SequenceState.IN_DECODE


@dataclass
class _Counters:
    computed: int = 0
    reused: int = 0
    decoded: int = 0
    published: int = 0
    rebinds: int = 0
    offloaded: int = 0


def attention_kind(spec: ModelSpec) -> str:
    """The daemon's attention kind for a model: full, sliding, or both kinds of layer."""
    kinds = {layer.kind for layer in spec.layers}
    return {frozenset({"full"}): "gqa", frozenset({"sliding"}): "sliding"}.get(frozenset(kinds), "gqa+sliding")


class Engine:
    """Prefill, greedy decode and the sequence life cycle for one model in one namespace."""

    def __init__(
        self,
        client: KVDClient,
        runner: ModelRunner,
        spec: ModelSpec,
        page_size: int,
        gpu_pages: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        model: str,
        revision: str = "",
    ) -> None:
        """`model` and `revision` name the weights: engines share pages only when both
        (and the page layout, dtype and attention kind) are equal."""
        device = runner.device if device is None else torch.empty(0, device=device).device
        dtype = runner.dtype if dtype is None else dtype
        if device != runner.device or dtype != runner.dtype:
            raise ValueError(f"engine is {dtype} on {device}, its runner {runner.dtype} on {runner.device}")
        if spec != runner.spec:
            raise ValueError("the engine's model spec differs from its runner's")
        self.client = client
        self.runner = runner
        self.spec = spec
        self.page_size = page_size
        self.layout = spec.page_layout(page_size, dtype)
        self.ns = client.register_namespace(
            model, self.layout, revision=revision, attention=attention_kind(spec),
            vocab_size=spec.vocab_size, extra={"model_type": spec.model_type},
        )
        self.host = ClientHostPages(client, self.ns)
        self.pool = GpuPagePool.allocate(self.layout, gpu_pages, device)
        self.planner = DecodeBatchPlanner(self.pool)
        self.loader = PageLoader(self.pool, self.host)
        self._seqs: dict[str, _Seq] = {}
        # host page -> {sequence: position}: which of this engine's sequences hold a daemon
        # reference to the page. A GPU copy is kept only while this is not empty.
        self._holders: dict[HostPageId, dict[str, int]] = {}
        self._counters = _Counters()

    # ---- prefill -------------------------------------------------------------------------

    def prefill(self, batch: Sequence[tuple[str, Sequence[int]]]) -> list[PrefillResult]:
        """Prefill new sequences `(seq_id, prompt_ids)`; computes only what is not cached."""
        self._sync_evictions()
        seq_ids = [s for s, _ in batch]
        prompts = [[int(t) for t in p] for _, p in batch]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in the prefill batch {seq_ids}")
        for s, p in zip(seq_ids, prompts):
            if s in self._seqs:
                raise ValueError(f"sequence {s!r} already exists; complete it first")
            if not p:
                raise ValueError(f"sequence {s!r} has an empty prompt")
        try:
            allocs = self.client.allocate_with_prefix(
                self.ns, [SequenceRequest(s, p) for s, p in zip(seq_ids, prompts)]
            )
        except KVDError as e:
            raise _no_room_or(e) from None
        for alloc, prompt in zip(allocs, prompts):
            self._check_hits(alloc.shared_pages, prompt)
            self._check_fresh(alloc.private_pages)

        rows = {SeqId(a.seq_id): HostRow(tuple(a.shared_pages)) for a in allocs}
        plan = self.planner.plan(rows, runway_pages={SeqId(a.seq_id): len(a.private_pages) for a in allocs})
        if isinstance(plan, PlanExhausted):
            self.client.release(self.ns, seq_ids)
            raise NoRoom("gpu", f"the batch needs {plan.needed} GPU pages, {plan.available} can be had")
        for alloc, prompt in zip(allocs, prompts):
            seq = _Seq(prompt, -1, list(alloc.pages), len(alloc.shared_pages))
            self._seqs[alloc.seq_id] = seq
            for position, page in enumerate(seq.host):
                self._ref_page(page, alloc.seq_id, position)
        try:
            return self._prefill_planned(allocs, prompts, plan)
        except BaseException:
            self._abandon(seq_ids)
            raise

    def _prefill_planned(
        self, allocs: list[SequenceAllocation], prompts: list[list[int]], plan: DecodePlan
    ) -> list[PrefillResult]:
        seq_ids = [a.seq_id for a in allocs]
        self._load(plan.loads)
        requests = []
        offloads: list[tuple[GpuPageId, HostPageId]] = []  # suffix GPU page -> private host page
        for alloc, prompt, table in zip(allocs, prompts, plan.rows):
            assert len(table) == len(alloc.pages), f"{alloc.seq_id}: {len(table)} GPU pages for {len(alloc.pages)} host pages"
            reused = alloc.shared_prefix_tokens
            if reused == len(prompt):
                requests.append(PrefillRequest(table, reused, [], full_hit_last_token=prompt[-1]))
            else:
                requests.append(PrefillRequest(table, reused, prompt[reused:]))
            offloads.extend(zip(table[len(alloc.shared_pages):], alloc.private_pages))
            self._counters.computed += len(prompt) - reused
            self._counters.reused += reused
        out: PrefillOutput = self._run(lambda hook: self.runner.prefill(requests, self.pool.kv, on_layer_written=hook), offloads)
        for alloc in allocs:
            self.planner.adopt_runway(SeqId(alloc.seq_id), alloc.private_pages)
        self._publish(seq_ids)
        for s in seq_ids:
            self.client.set_state(self.ns, s, SequenceState.IN_DECODE)

        results = []
        for i, (alloc, prompt) in enumerate(zip(allocs, prompts)):
            logits = out.last_logits[i]
            self._seqs[alloc.seq_id].next_token = int(logits.argmax())
            results.append(PrefillResult(
                alloc.seq_id, logits, int(logits.argmax()), len(prompt) - alloc.shared_prefix_tokens,
                alloc.shared_prefix_tokens,
            ))
        return results

    # ---- decode --------------------------------------------------------------------------

    def decode_step(self, seq_ids: Sequence[str]) -> DecodeResult:
        """Feed each sequence its chosen token; return the next greedy token and logits."""
        self._sync_evictions()
        seqs = self._live(seq_ids, SequenceState.IN_DECODE)
        page = self.page_size
        # The new token at position n = len(tokens) starts a page when n is a page multiple.
        starts_page = {SeqId(s): int(len(q.tokens) == len(q.host) * page) for s, q in zip(seq_ids, seqs)}
        plan = self.planner.plan({SeqId(s): self._row(q) for s, q in zip(seq_ids, seqs)}, starts_page)
        if isinstance(plan, PlanExhausted):
            raise NoRoom("gpu", f"the step needs {plan.needed} GPU pages, {plan.available} can be had")
        try:
            extended = self.client.extend_batch(
                self.ns, [ExtendItem(s, 1, [q.next_token]) for s, q in zip(seq_ids, seqs)]
            )
        except KVDError as e:
            for s, needs in starts_page.items():
                if needs:
                    self.planner.trim_runway(s, 0)
            raise _no_room_or(e) from None
        new_pages = {r.seq_id: r.new_pages for r in extended}
        for s, q in zip(seq_ids, seqs):
            assert len(new_pages[s]) == starts_page[SeqId(s)], f"{s}: daemon added {new_pages[s]} pages"
            self._check_fresh(new_pages[s])
        self._load(plan.loads)

        requests, offloads = [], []
        for s, q, table in zip(seq_ids, seqs, plan.rows):
            n = len(q.tokens)
            requests.append(DecodeRequest(table, n, q.next_token))
            index = n // page
            assert index >= q.published, f"{s}: token {n} would be written into published page {index}"
            offloads.append((table[index], (q.host + new_pages[s])[index]))
        logits = self._run(lambda hook: self.runner.decode(requests, self.pool.kv, on_layer_written=hook), offloads)

        for s, q in zip(seq_ids, seqs):
            if new_pages[s]:
                self.planner.adopt_runway(SeqId(s), new_pages[s])
                for page_id in new_pages[s]:
                    self._ref_page(page_id, s, len(q.host))
                    q.host.append(page_id)
            q.tokens.append(q.next_token)
        tokens = tuple(int(t) for t in logits.argmax(dim=-1).tolist())
        for q, t in zip(seqs, tokens):
            q.next_token = t
        self._counters.decoded += len(seqs)
        filled = [s for s, q in zip(seq_ids, seqs) if len(q.tokens) % page == 0]
        published = self._publish(filled) if filled else 0
        return DecodeResult(tuple(seq_ids), tokens, logits, len(plan.loads), published)

    # ---- life cycle ----------------------------------------------------------------------

    def hold(self, seq_ids: Sequence[str]) -> None:
        """IN_DECODE → ON_HOLD: drop the GPU references; host pages and GPU copies stay."""
        self._sync_evictions()
        for s, q in zip(seq_ids, self._live(seq_ids, SequenceState.IN_DECODE)):
            self.client.set_state(self.ns, s, SequenceState.ON_HOLD)
            self.planner.suspend(SeqId(s))
            q.state = SequenceState.ON_HOLD

    def resume(self, seq_ids: Sequence[str]) -> int:
        """ON_HOLD → IN_DECODE: reacquire GPU pages, loading only copies evicted meanwhile.
        Returns the number of pages loaded. Raises `SequenceEvicted` (changing nothing)
        if the daemon dropped any of them."""
        self._sync_evictions()
        evicted = [s for s in seq_ids if s in self._seqs and self._seqs[s].state is SequenceState.EVICTED]
        if evicted:
            raise SequenceEvicted(evicted)
        seqs = self._live(seq_ids, SequenceState.ON_HOLD)
        resumed: list[str] = []
        try:
            for s in seq_ids:  # the daemon no longer evicts them once they are IN_DECODE
                self.client.set_state(self.ns, s, SequenceState.IN_DECODE)
                resumed.append(s)
        except KVDError:
            for s in resumed:
                self.client.set_state(self.ns, s, SequenceState.ON_HOLD)
            self._sync_evictions()
            raise
        plan = self.planner.plan({SeqId(s): self._row(q) for s, q in zip(seq_ids, seqs)}, runway_pages=0)
        if isinstance(plan, PlanExhausted):
            for s in seq_ids:
                self.client.set_state(self.ns, s, SequenceState.ON_HOLD)
            raise NoRoom("gpu", f"resuming needs {plan.needed} GPU pages, {plan.available} can be had")
        self._load(plan.loads)
        for q in seqs:
            q.state = SequenceState.IN_DECODE
        return len(plan.loads)

    def complete(self, seq_ids: Sequence[str]) -> None:
        """Release every GPU and host reference of the sequences."""
        self._sync_evictions()
        for s in seq_ids:
            if s not in self._seqs:
                raise KeyError(f"sequence {s!r} is not in this engine")
        for s in seq_ids:
            q = self._seqs.pop(s)
            self.client.set_state(self.ns, s, SequenceState.COMPLETED)
            if q.state is SequenceState.IN_DECODE:
                self.planner.suspend(SeqId(s))
            self._drop_host_pages(s, q)

    # ---- inspection ----------------------------------------------------------------------

    def info(self, seq_id: str) -> SequenceInfo:
        q = self._seqs[seq_id]
        return SequenceInfo(seq_id, tuple(q.tokens), q.next_token, tuple(q.host), q.published, q.state.name)

    def page_table(self, seq_id: str) -> tuple[GpuPageId, ...]:
        """The sequence's GPU page table (only while IN_DECODE)."""
        return self.planner.table(SeqId(seq_id))

    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(
            gpu=self.pool.stats(), sequences=len(self._seqs), prefill_tokens_computed=c.computed,
            prefill_tokens_reused=c.reused, decode_tokens=c.decoded, pages_published=c.published,
            rebinds=c.rebinds, bytes_offloaded=c.offloaded,
        )

    # ---- internals: copies and the forward pass ------------------------------------------

    def _load(self, loads: Sequence[PageLoad]) -> None:
        if loads:
            self.host.map_pages(h for h, _ in loads)
            self.loader.load(loads)

    def _run(self, forward: Callable[[LayerCallback | None], T], offloads: list[tuple[GpuPageId, HostPageId]]) -> T:
        """Run `forward(on_layer_written)`, offloading each layer of the `(gpu page, private
        host page)` pairs as soon as the runner has written it; wait for the copies."""
        if not offloads:
            return forward(None)
        self.host.map_pages(h for _, h in offloads)
        copies: list[CopyBatch] = []

        def offload(layer: int) -> None:
            stores = [PageStore(g, h, slice(layer, layer + 1)) for g, h in offloads]
            copies.append(self.loader.store(stores, compute_waits=False))

        out = forward(offload)
        for batch in copies:
            batch.synchronize()  # before publish: the daemon indexes what is in host memory
            self._counters.offloaded += batch.nbytes
        return out

    # ---- internals: publishing and page bookkeeping --------------------------------------

    def _publish(self, seq_ids: Sequence[str]) -> int:
        """Publish the sequences' full pages; apply the daemon's rebinds on host and GPU."""
        loads: list[PageLoad] = []
        published = 0
        for result in self.client.publish(self.ns, list(seq_ids)):
            q = self._seqs[result.seq_id]
            q.published += result.published_pages
            published += result.published_pages
            for rebind in result.rebinds:
                position = rebind.position
                assert q.host[position] == rebind.old_page, (
                    f"{result.seq_id}: rebind of page {rebind.old_page} at {position}, engine has {q.host[position]}"
                )
                parent = q.host[position - 1] if position else None
                self._check_hit(position, rebind.new_page, parent, q.tokens)
                self._unref_page(rebind.old_page, result.seq_id)
                q.host[position] = rebind.new_page
                self._ref_page(rebind.new_page, result.seq_id, position)
                load = self.planner.rebind(SeqId(result.seq_id), position, rebind.new_page)
                if load is not None:
                    loads.append(load)
                self._counters.rebinds += 1
        self._load(loads)
        self._counters.published += published
        return published

    def _abandon(self, seq_ids: Sequence[str]) -> None:
        """Undo a prefill that failed half-way: drop the sequences here and in the daemon."""
        for s in seq_ids:
            if s in self.planner.holding():
                self.planner.suspend(SeqId(s))
            self._drop_host_pages(s, self._seqs.pop(s))
        self.client.release(self.ns, list(seq_ids))

    def _row(self, q: _Seq) -> HostRow:
        return HostRow(tuple(q.host[: q.published]), tuple(q.host[q.published:]))

    def _live(self, seq_ids: Sequence[str], state: SequenceState) -> list[_Seq]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in {list(seq_ids)}")
        seqs = []
        for s in seq_ids:
            q = self._seqs.get(s)
            if q is None:
                raise KeyError(f"sequence {s!r} is not in this engine")
            if q.state is not state:
                raise ValueError(f"sequence {s!r} is {q.state.name}, not {state.name}")
            seqs.append(q)
        return seqs

    def _ref_page(self, page: HostPageId, seq_id: str, position: int) -> None:
        self._holders.setdefault(page, {})[seq_id] = position

    def _unref_page(self, page: HostPageId, seq_id: str) -> bool:
        """Drop the sequence's hold; True when no sequence of this engine holds the page now."""
        holders = self._holders[page]
        del holders[seq_id]
        if holders:
            return False
        del self._holders[page]
        return True

    def _drop_host_pages(self, seq_id: str, q: _Seq) -> None:
        """The sequence's daemon references are gone: forget copies nobody here holds."""
        orphans = [page for page in q.host if self._unref_page(page, seq_id)]
        self.pool.forget(orphans)
        q.host = []

    def _sync_evictions(self) -> None:
        for ns, seq_id in self.client.take_evicted():
            q = self._seqs.get(seq_id)
            if ns == self.ns and q is not None and q.state is not SequenceState.EVICTED:
                self._evicted(seq_id)

    def _evicted(self, seq_id: str) -> None:
        q = self._seqs[seq_id]
        assert q.state is SequenceState.ON_HOLD, f"sequence {seq_id!r} evicted while {q.state.name}"
        self._drop_host_pages(seq_id, q)
        q.state = SequenceState.EVICTED

    def _check_fresh(self, pages: Iterable[HostPageId]) -> None:
        """Pages the daemon just allocated were free: any sequence here that still holds one
        was evicted (its notice is still on the way), and no copy of one may be used."""
        for page in pages:
            for seq_id in list(self._holders.get(page, {})):
                self._evicted(seq_id)
            if self.pool.copy_of(page) is not None:
                self.pool.forget([page])

    def _check_hits(self, hits: Sequence[HostPageId], tokens: Sequence[int]) -> None:
        for position, page in enumerate(hits):
            self._check_hit(position, page, hits[position - 1] if position else None, tokens)

    def _check_hit(self, position: int, page: HostPageId, parent: HostPageId | None,
                   tokens: Sequence[int]) -> None:
        """A published page the daemon hands out at `position` (after `parent`, holding
        these tokens) is what the sequences here that hold it think it is, unless they were
        evicted and the page id reused; then they are evicted here too and its copy dropped."""
        holders = self._holders.get(page)
        if not holders or any(self._seqs[s].state is SequenceState.IN_DECODE for s in holders):
            return  # an IN_DECODE holder keeps the page alive in the daemon: it is what it was
        size = self.page_size
        seq_id, pos = next(iter(holders.items()))
        q = self._seqs[seq_id]
        same = (
            pos == position and pos < q.published
            and (q.host[pos - 1] if pos else None) == parent
            and q.tokens[pos * size:(pos + 1) * size] == list(tokens[position * size:(position + 1) * size])
        )
        if not same:
            for s in list(holders):
                self._evicted(s)


def _no_room_or(e: KVDError) -> Exception:
    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NoRoom("host", e.message)
    return e
