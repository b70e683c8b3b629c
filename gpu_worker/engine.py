"""A small inference engine: kvd host pages + a GPU page pool + the reference model runner.

One `Engine` serves one model in one namespace of one `KVDClient` session. A batch walks
one straight line, prefill and decode alike:

1. the daemon, in one call, gives each sequence its host row (`allocate_with_prefix`:
   cached prefix pages plus fresh private pages; `extend_batch`: a page when the new token
   starts one);
2. `GpuPageTables.map` turns the rows into GPU page tables (each unique host page one GPU
   page, loaded once; fresh runway pages for what the batch writes) and the loads;
3. the loads run, then the forward pass computes only the tokens that are not cached (a
   full hit recomputes just the last token's query; the runner reports what it computed,
   and that is what `computed_tokens` counts) and, layer by layer, the new K/V are
   offloaded into the sequences' private host pages;
4. the daemon, in one call, publishes the pages that filled; its rebinds (a page identical
   to one already published replaces it) are applied to the host row and the page table
   alike; a prefill then moves its sequences to IN_DECODE in one `set_states` call.

`hold` / `resume` / `complete` are the daemon's IN_DECODE ⇄ ON_HOLD → COMPLETED, one
`set_states` call each, with the GPU references dropped on hold (copies stay cached) and
reacquired on resume.

Rules kept here:
- Only private host pages are written, and only by the sequence that owns them; shared
  (published) host pages and their GPU copies are read only.
- A batch that does not fit (GPU pool or host) raises `NoRoom` and changes no count. A
  prefill asks the daemon first (its hits decide the GPU room needed) and releases the new
  sequences if the GPU pool refuses; a decode step takes GPU room first and gives it back
  if the daemon refuses.
- Which host pages the sequences hold, and when a GPU copy may no longer be trusted, is
  `HeldSequences`' business (gpu_worker/sequences.py).

One engine per client: `take_evicted()` reports every namespace of the session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from engine_client import ErrorCode, ExtendItem, KVDClient, KVDError, SequenceAllocation, SequenceRequest, SequenceState
from gpu_worker.gpu_stats import GpuPoolStats
from gpu_worker.host_pages import ClientHostPages
from gpu_worker.loader import CopyBatch, PageLoader, PageStore
from gpu_worker.model import DecodeRequest, LayerCallback, ModelRunner, PrefillOutput, PrefillRequest
from gpu_worker.model_config import ModelSpec
from gpu_worker.page_tables import BatchTables, GpuPageTables, HostRow, SeqId
from gpu_worker.pool import GpuPageId, GpuPagePool, HostPageId, PageLoad, PoolExhausted
from gpu_worker.sequences import EngineSequence, HeldSequences

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
    # Prompt tokens the runner ran through the model (its own count, PrefillOutput): the
    # suffix; for a full hit the last token, whose query is recomputed for the logits.
    computed_tokens: int
    reused_tokens: int  # prompt tokens whose K/V came from cached host pages (not recomputed)


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
    prefill_tokens_computed: int  # the sum of PrefillResult.computed_tokens: what the runner ran
    prefill_tokens_reused: int
    decode_tokens: int
    pages_published: int
    rebinds: int  # host pages replaced by an identical published page
    bytes_offloaded: int  # device→host K/V bytes


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
            model,
            self.layout,
            revision=revision,
            attention=attention_kind(spec),
            vocab_size=spec.vocab_size,
            extra={"model_type": spec.model_type},
        )
        self.host = ClientHostPages(client, self.ns)
        self.pool = GpuPagePool.allocate(self.layout, gpu_pages, device)
        self.tables = GpuPageTables(self.pool)
        self.loader = PageLoader(self.pool, self.host)
        self.seqs = HeldSequences(self.pool, page_size)
        self._counters = _Counters()

    # ---- prefill -------------------------------------------------------------------------

    def prefill(self, batch: Sequence[tuple[str, Sequence[int]]]) -> list[PrefillResult]:
        """Prefill new sequences `(seq_id, prompt_ids)`; computes only what is not cached."""
        self._sync_evictions()
        seq_ids = [s for s, _ in batch]
        prompts = [[int(t) for t in p] for _, p in batch]
        self._check_new(seq_ids, prompts)
        try:
            allocs = self.client.allocate_with_prefix(
                self.ns, [SequenceRequest(s, p) for s, p in zip(seq_ids, prompts)]
            )
        except KVDError as e:
            raise _no_room_or(e) from None
        for alloc, prompt in zip(allocs, prompts):
            self.seqs.check_hits(alloc.shared_pages, prompt)
            self.seqs.check_fresh(alloc.private_pages)

        rows = {SeqId(a.seq_id): HostRow(tuple(a.shared_pages)) for a in allocs}
        tables = self.tables.map(rows, runway_pages={SeqId(a.seq_id): len(a.private_pages) for a in allocs})
        if isinstance(tables, PoolExhausted):
            self.client.release(self.ns, seq_ids)
            raise NoRoom("gpu", f"the batch needs {tables.needed} GPU pages, {tables.available} can be had")
        for alloc, prompt in zip(allocs, prompts):
            self.seqs.add(alloc.seq_id, prompt, alloc.pages, len(alloc.shared_pages))
        try:
            return self._prefill_mapped(allocs, prompts, tables)
        except BaseException:
            self._abandon(seq_ids)
            raise

    def _check_new(self, seq_ids: list[str], prompts: list[list[int]]) -> None:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in the prefill batch {seq_ids}")
        for s, p in zip(seq_ids, prompts):
            if s in self.seqs:
                raise ValueError(f"sequence {s!r} already exists; complete it first")
            if not p:
                raise ValueError(f"sequence {s!r} has an empty prompt")

    def _prefill_mapped(
        self, allocs: list[SequenceAllocation], prompts: list[list[int]], tables: BatchTables
    ) -> list[PrefillResult]:
        seq_ids = [a.seq_id for a in allocs]
        self._load(tables.loads)
        requests = []
        offloads: list[tuple[GpuPageId, HostPageId]] = []  # suffix GPU page -> private host page
        for alloc, prompt, row, table in zip(allocs, prompts, tables.rows, tables.tables):
            assert len(row) == len(alloc.pages), (
                f"{alloc.seq_id}: {len(row)} GPU pages for {len(alloc.pages)} host pages"
            )
            reused = alloc.shared_prefix_tokens
            if reused == len(prompt):
                requests.append(PrefillRequest(table, reused, [], full_hit_last_token=prompt[-1]))
            else:
                requests.append(PrefillRequest(table, reused, prompt[reused:]))
            offloads.extend(zip(row[len(alloc.shared_pages) :], alloc.private_pages))
            self._counters.reused += reused
        out: PrefillOutput = self._run(
            lambda hook: self.runner.prefill(requests, self.pool.kv, on_layer_written=hook), offloads
        )
        self._counters.computed += sum(out.computed_tokens)
        for alloc in allocs:
            self.tables.adopt_runway(SeqId(alloc.seq_id), alloc.private_pages)
        self._publish(seq_ids)
        self.client.set_states(self.ns, seq_ids, SequenceState.IN_DECODE)

        results = []
        for alloc, logits, computed in zip(allocs, out.last_logits, out.computed_tokens):
            self.seqs[alloc.seq_id].next_token = int(logits.argmax())
            results.append(
                PrefillResult(alloc.seq_id, logits, int(logits.argmax()), computed, alloc.shared_prefix_tokens)
            )
        return results

    # ---- decode --------------------------------------------------------------------------

    def decode_step(self, seq_ids: Sequence[str]) -> DecodeResult:
        """Feed each sequence its chosen token; return the next greedy token and logits."""
        self._sync_evictions()
        seqs = self.seqs.live(seq_ids, SequenceState.IN_DECODE)
        page = self.page_size
        # The new token at position n = len(tokens) starts a page when n is a page multiple.
        starts_page = {SeqId(s): int(len(seq.tokens) == len(seq.host) * page) for s, seq in zip(seq_ids, seqs)}
        tables = self.tables.map({SeqId(s): seq.row for s, seq in zip(seq_ids, seqs)}, starts_page)
        if isinstance(tables, PoolExhausted):
            raise NoRoom("gpu", f"the step needs {tables.needed} GPU pages, {tables.available} can be had")
        new_pages = self._extend(seq_ids, seqs, starts_page)
        self._load(tables.loads)

        requests, offloads = [], []
        for s, seq, row, table in zip(seq_ids, seqs, tables.rows, tables.tables):
            n = len(seq.tokens)
            requests.append(DecodeRequest(table, n, seq.next_token))
            index = n // page
            assert index >= seq.published, f"{s}: token {n} would be written into published page {index}"
            offloads.append((row[index], (seq.host + new_pages[s])[index]))
        logits = self._run(lambda hook: self.runner.decode(requests, self.pool.kv, on_layer_written=hook), offloads)

        for s, seq in zip(seq_ids, seqs):
            if new_pages[s]:
                self.tables.adopt_runway(SeqId(s), new_pages[s])
                for page_id in new_pages[s]:
                    self.seqs.append_page(s, page_id)
            seq.tokens.append(seq.next_token)
        tokens = tuple(int(t) for t in logits.argmax(dim=-1).tolist())
        for seq, t in zip(seqs, tokens):
            seq.next_token = t
        self._counters.decoded += len(seqs)
        filled = [s for s, seq in zip(seq_ids, seqs) if len(seq.tokens) % page == 0]
        published = self._publish(filled) if filled else 0
        return DecodeResult(tuple(seq_ids), tokens, logits, len(tables.loads), published)

    def _extend(
        self, seq_ids: Sequence[str], seqs: list[EngineSequence], starts_page: dict[SeqId, int]
    ) -> dict[str, list[HostPageId]]:
        """One `extend_batch` for the step's tokens; the new host page of each sequence that
        starts one. A refusal gives back the runway `map` took for it."""
        try:
            extended = self.client.extend_batch(
                self.ns, [ExtendItem(s, 1, [seq.next_token]) for s, seq in zip(seq_ids, seqs)]
            )
        except KVDError as e:
            for s, needs in starts_page.items():
                if needs:
                    self.tables.trim_runway(s, 0)
            raise _no_room_or(e) from None
        new_pages = {r.seq_id: list(r.new_pages) for r in extended}
        for s in seq_ids:
            assert len(new_pages[s]) == starts_page[SeqId(s)], f"{s}: daemon added {new_pages[s]} pages"
            self.seqs.check_fresh(new_pages[s])
        return new_pages

    # ---- life cycle ----------------------------------------------------------------------

    def hold(self, seq_ids: Sequence[str]) -> None:
        """IN_DECODE → ON_HOLD: drop the GPU references; host pages and GPU copies stay."""
        self._sync_evictions()
        seqs = self.seqs.live(seq_ids, SequenceState.IN_DECODE)
        self.client.set_states(self.ns, list(seq_ids), SequenceState.ON_HOLD)
        for s, seq in zip(seq_ids, seqs):
            self.tables.suspend(SeqId(s))
            seq.state = SequenceState.ON_HOLD

    def resume(self, seq_ids: Sequence[str]) -> int:
        """ON_HOLD → IN_DECODE: reacquire GPU pages, loading only copies evicted meanwhile.
        Returns the number of pages loaded. Raises `SequenceEvicted` (changing nothing)
        if the daemon dropped any of them."""
        self._sync_evictions()
        evicted = [s for s in seq_ids if s in self.seqs and self.seqs[s].state is SequenceState.EVICTED]
        if evicted:
            raise SequenceEvicted(evicted)
        seqs = self.seqs.live(seq_ids, SequenceState.ON_HOLD)
        try:  # the daemon no longer evicts them once they are IN_DECODE
            self.client.set_states(self.ns, list(seq_ids), SequenceState.IN_DECODE)
        except KVDError:
            self._sync_evictions()
            raise
        tables = self.tables.map({SeqId(s): seq.row for s, seq in zip(seq_ids, seqs)}, runway_pages=0)
        if isinstance(tables, PoolExhausted):
            self.client.set_states(self.ns, list(seq_ids), SequenceState.ON_HOLD)
            raise NoRoom("gpu", f"resuming needs {tables.needed} GPU pages, {tables.available} can be had")
        self._load(tables.loads)
        for seq in seqs:
            seq.state = SequenceState.IN_DECODE
        return len(tables.loads)

    def complete(self, seq_ids: Sequence[str]) -> None:
        """Release every GPU and host reference of the sequences."""
        self._sync_evictions()
        for s in seq_ids:
            if s not in self.seqs:
                raise KeyError(f"sequence {s!r} is not in this engine")
        self.client.set_states(self.ns, list(seq_ids), SequenceState.COMPLETED)
        for s in seq_ids:
            if self.seqs[s].state is SequenceState.IN_DECODE:
                self.tables.suspend(SeqId(s))
            self.seqs.remove(s)

    # ---- inspection ----------------------------------------------------------------------

    def info(self, seq_id: str) -> SequenceInfo:
        seq = self.seqs[seq_id]
        return SequenceInfo(seq_id, tuple(seq.tokens), seq.next_token, tuple(seq.host), seq.published, seq.state.name)

    def page_table(self, seq_id: str) -> tuple[GpuPageId, ...]:
        """The sequence's GPU page table (only while IN_DECODE)."""
        return self.tables.table(SeqId(seq_id))

    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(
            gpu=self.pool.stats(),
            sequences=len(self.seqs),
            prefill_tokens_computed=c.computed,
            prefill_tokens_reused=c.reused,
            decode_tokens=c.decoded,
            pages_published=c.published,
            rebinds=c.rebinds,
            bytes_offloaded=c.offloaded,
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

    # ---- internals: publishing and undoing -----------------------------------------------

    def _publish(self, seq_ids: Sequence[str]) -> int:
        """Publish the sequences' full pages; apply the daemon's rebinds on host and GPU."""
        loads: list[PageLoad] = []
        published = 0
        for result in self.client.publish(self.ns, list(seq_ids)):
            self.seqs[result.seq_id].published += result.published_pages
            published += result.published_pages
            for rebind in result.rebinds:
                self.seqs.rebind(result.seq_id, rebind.position, rebind.old_page, rebind.new_page)
                load = self.tables.rebind(SeqId(result.seq_id), rebind.position, rebind.new_page)
                if load is not None:
                    loads.append(load)
                self._counters.rebinds += 1
        self._load(loads)
        self._counters.published += published
        return published

    def _abandon(self, seq_ids: Sequence[str]) -> None:
        """Undo a prefill that failed half-way: drop the sequences here and in the daemon."""
        for s in seq_ids:
            if s in self.tables.holding():
                self.tables.suspend(SeqId(s))
            self.seqs.remove(s)
        self.client.release(self.ns, list(seq_ids))

    def _sync_evictions(self) -> None:
        for ns, seq_id in self.client.take_evicted():
            if ns == self.ns and seq_id in self.seqs and self.seqs[seq_id].state is not SequenceState.EVICTED:
                self.seqs.evicted(seq_id)


def _no_room_or(e: KVDError) -> Exception:
    if e.code is ErrorCode.RESOURCE_EXHAUSTED:
        return NoRoom("host", e.message)
    return e
