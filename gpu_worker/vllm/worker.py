"""KVDConnector's worker half: copies pages between kvd's shared memory and vLLM's KV blocks.

It holds no policy: the scheduler half's plans (gpu_worker/vllm/plans.py) say which kvd
page goes to which vLLM block, and which of a request's blocks this step completes.
Loads run before the forward pass, from pages the scheduler half's kvd sequences hold. Saves go
into a kvd sequence of this worker's own session (allocated at a request's first plan,
released when the scheduler says the request finished): after each layer's attention
wrote its KV, the layer is copied into the sequence's private pages, and once the step's
copies are done the worker publishes every block it wrote, in order. So no process writes
a page another session owns, and a page is published only after its bytes are complete.
Those sequences, and how far each is written and published, are the `SaveLedger`'s
(gpu_worker/vllm/save_ledger.py); this module copies.
Each kvd call covers the whole step: one allocation for the requests new to this worker,
one `extend_batch`, one `publish` of many sequences, one `release` of the finished ones.

Anything that cannot be copied (kvd gone, the daemon restarted since the plan was made, a
page that no longer maps) is reported, never guessed: a failed load's blocks go to vLLM as
load errors (it recomputes them), a failed save is simply not published.

vLLM hands each layer's KV cache as a standardised per-layer view `[num_blocks,
num_kv_heads, block_size, 2 * head_dim]`; a kvd page is `[num_layers, 2, page_size,
num_kv_heads, head_dim]`. `block_view` makes the first look like one layer of the
second, without copying (and an MLA layer, `[num_blocks, 1, block_size, 576]`, one
layer of a latent page, `[num_layers, page_size, 576]`). Each layer's copies go to the
block ids of its KV-cache group
(vLLM's hybrid manager: one group per attention type), skipping vLLM's null block (a
sliding-window group's blocks outside the window). An asynchronous load (several
groups) that cannot be done is not copied at all; `transfer_results` reports it failed.

The copies themselves are gpu_worker/vllm/page_copies.py's: per layer and extent, one
memcpy per run of consecutive pages on CPU. On CUDA (marked, checked by
scripts/gpu_check.sh) the extents are registered with cudaHostRegister once, and copies
run on a side stream: loads are queued for every layer at once with an event per layer
that `wait_layer` makes the compute stream wait on; saves of a layer are queued after
that layer's attention and waited for in `wait_for_save`, before they are published.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine_client import ErrorCode, KVDError, PageLayout
from gpu_worker.loader import register_host_extents
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.page_copies import ExtentCopies, by_extent, copy_layer
from gpu_worker.vllm.plans import NULL_BLOCK, KVDConnectorMetadata, KVDWorkerMetadata, LoadPlan, SavePlan
from gpu_worker.vllm.save_ledger import SaveLedger, SaveTarget
from kvd.wire.layout import LATENT_PAGES


def block_view(kv_layer: torch.Tensor, layout: PageLayout, k_then_v_rows: bool) -> torch.Tensor:
    """vLLM's `[blocks, heads, block_size, 2 * head_dim]` layer as `[blocks, 2, block_size,
    heads, head_dim]`, kvd's page order for one layer (a view: writes land in vLLM's cache);
    of latent pages (MLA), vLLM's `[blocks, 1, block_size, latent]` as `[blocks, block_size,
    latent]`, one latent vector per token on every backend.

    Backends read K/V memory differently. CUDA's FlashAttention splits the last dimension
    (K and V of a token side by side), which is kvd's order. vLLM's CPU backend
    (`k_then_v_rows`) stores each block in an arrangement of its own kernel's (each
    head's K rows, then its V rows): its pages are kept apart in a namespace of their own
    (cache_shape.cpu_kv_layout), so the view maps the block's bytes one to one, in vLLM's
    order, and a block's copy is one memcpy (gpu_worker/vllm/page_copies.py)."""
    blocks, heads, block_size, width = kv_layer.shape
    if layout.kind == LATENT_PAGES:
        if heads != 1 or width != layout.head_dim:
            raise ValueError(
                f"vLLM's MLA cache layer is {tuple(kv_layer.shape)}; KVDConnector expects "
                f"[num_blocks, 1, block_size, {layout.head_dim}]"
            )
        return kv_layer[:, 0]  # [B, 1, N, L] -> [B, N, L]
    if heads != layout.num_kv_heads or width != 2 * layout.head_dim:
        raise ValueError(
            f"vLLM's KV cache layer is {tuple(kv_layer.shape)}; KVDConnector expects "
            f"[num_blocks, {layout.num_kv_heads} kv heads, block_size, 2 x {layout.head_dim}]"
        )
    if k_then_v_rows:  # each contiguous block [H, N, 2 * D] read as [2, N, H, D]
        return kv_layer.view(blocks, 2, block_size, heads, layout.head_dim)
    return kv_layer.unflatten(-1, (2, layout.head_dim)).permute(0, 3, 2, 1, 4)  # [B, H, N, 2, D] -> [B, 2, N, H, D]


Copies = list[tuple[torch.Tensor, list[int], list[int]]]  # (extent, page indices, block ids)


@dataclass(frozen=True)
class _StepSave:
    """This step's copies for one request: vLLM blocks into its sequence's pages."""

    target: SaveTarget
    copies: list[Copies]  # per KV-cache group


def _to_blocks(groups, block_ids: list[int]) -> Copies:
    """`KVDClient.pages_by_extent` groups with the vLLM block of each page instead of its
    position, without the pages whose block is vLLM's null block (nothing kept there)."""
    copies = []
    for extent, indices, positions in groups:
        kept = [(i, block_ids[p]) for i, p in zip(indices, positions) if block_ids[p] != NULL_BLOCK]
        if kept:
            copies.append((extent, [i for i, _ in kept], [b for _, b in kept]))
    return copies


class KVDWorkerSide:
    def __init__(
        self, link: KVDLink, layer_names: list[str], layer_groups: list[int] | None = None, saves: bool = True
    ) -> None:
        """`layer_names` in page order; `layer_groups[i]`: the KV-cache group of layer i
        (whose block ids its copies use; all 0 by default); `saves`: whether this worker
        saves (of a cache every rank holds whole, MLA's, rank 0 alone does: cache_shape.py)."""
        self.link = link
        self.saves = saves
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.layer_groups = layer_groups or [0] * len(layer_names)
        self.num_groups = max(self.layer_groups) + 1
        self.layout = link.namespace.layout
        self._layers: list[torch.Tensor] = []  # per layer: [blocks, 2, block_size, heads, head_dim] views
        self._cuda = False
        self._stream: torch.cuda.Stream | None = None
        self._load_events: dict[int, torch.cuda.Event] = {}
        self._load_errors: set[int] = set()
        self._recving: set[str] = set()  # asynchronous loads done since vLLM last asked
        self._failed_recving: set[str] = set()  # of those, the ones that failed
        self.ledger = SaveLedger(link)
        self._saves: list[_StepSave] = []
        self._save_copies: list[list[ExtentCopies]] = []  # per KV-cache group: the step's saves, merged per extent
        self._saved_layers: set[int] = set()
        self._registered: dict[str, object] = {}  # CUDA: extents registered with cudaHostRegister

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = set(self.layer_index) - set(kv_caches)
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layers {sorted(missing)}")
        layers = [kv_caches[name] for name in sorted(self.layer_index, key=self.layer_index.get)]
        cpu_backend = layers[0].device.type == "cpu"  # vLLM's CPU attention backend
        self._layers = [block_view(kv, self.layout, cpu_backend) for kv in layers]
        self._cuda = layers[0].device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=layers[0].device)

    def start_step(self, meta: KVDConnectorMetadata) -> None:
        """Before the forward pass: release finished requests' sequences, prepare the step's
        saves, and copy every planned load into its vLLM block (all layers; on CUDA queued).
        Whatever the batch, a step costs at most one kvd call of each kind: release,
        allocate, extend (here) and publish (`wait_for_save`)."""
        self.ledger.finished(meta.finished)  # vLLM runs a step for them even when nothing else is scheduled
        failed = self._start_loads(meta.loads)
        self._saves = self._prepare_saves(meta.saves, failed) if self.saves else []
        self._save_copies = self._merged([save.copies for save in self._saves])
        self._saved_layers = set()

    # ---- loads ------------------------------------------------------------------------

    def _start_loads(self, loads: list[LoadPlan]) -> set[str]:
        """Queues the step's loads; returns the requests with a block that cannot be loaded.

        A synchronous load's failed blocks become load errors; an asynchronous load that
        fails is not copied at all and its request is reported failed (`transfer_results`)."""
        self._load_errors = set()
        self._load_events = {}
        resolved, failed = [], set()
        for plan in loads:
            page_ids = plan.pages_by_rank[self.link.namespace.tp_rank]  # this rank's heads
            groups = None
            if not (plan.asynchronous and plan.missing_block_ids):
                groups = self._resolve(plan.daemon_instance, page_ids, f"load for request {plan.req_id}")
            if plan.missing_block_ids or (groups is None and page_ids):
                failed.add(plan.req_id)
            if plan.asynchronous:
                self._recving.add(plan.req_id)
                if plan.req_id in failed:
                    self._failed_recving.add(plan.req_id)
                    continue
            else:
                self._load_errors.update(plan.missing_block_ids)
                if groups is None:
                    self._load_errors.update(b for blocks in plan.block_ids for b in blocks if b != NULL_BLOCK)
            if groups and page_ids:
                resolved.append((plan, groups))
        if not resolved:
            return failed
        copies = self._merged([[_to_blocks(groups, blocks) for blocks in plan.block_ids] for plan, groups in resolved])
        with self._side_stream():
            for layer, view in enumerate(self._layers):
                copy_layer(view, layer, copies[self.layer_groups[layer]], into_blocks=True)
                if self._cuda:
                    self._load_events[layer] = self._record()
        return failed

    def _merged(self, copies: list[list[Copies]]) -> list[list[ExtentCopies]]:
        """Each request's copies per KV-cache group, merged per group and extent."""
        return [by_extent(g for per_group in copies for g in per_group[group]) for group in range(self.num_groups)]

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """The asynchronous loads done since the last call, and which of them failed."""
        done, failed = self._recving, self._failed_recving
        self._recving, self._failed_recving = set(), set()
        return done, failed

    def wait_layer(self, layer_name: str) -> None:
        event = self._load_events.get(self.layer_index.get(layer_name, -1))
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves ------------------------------------------------------------------------

    def _prepare_saves(self, plans: list[SavePlan], failed: set[str]) -> list[_StepSave]:
        """The plans' blocks that this worker's sequences do not already hold, with their pages.

        Nothing is saved for a request with a load error in this step: the blocks it failed
        to load hold stale bytes, and what this step computes attended to them. vLLM
        recomputes from the first failed block, and the scheduler plans those saves again."""
        self.ledger.learn(plans)
        saves = []
        for target in self.ledger.targets([plan for plan in plans if plan.req_id not in failed]):
            groups = self._resolve(None, target.page_ids, f"save for request {target.req_id}", writable=True)
            if groups is not None:
                saves.append(_StepSave(target, [_to_blocks(groups, b) for b in target.block_ids]))
        return saves

    def save_layer(self, layer_name: str) -> None:
        """Copy this layer of the step's saved blocks into their kvd pages (its attention
        has written the step's KV)."""
        layer = self.layer_index.get(layer_name)
        if layer is not None and self._saves and layer not in self._saved_layers:
            self._save(layer)

    def _save(self, layer: int) -> None:
        self._saved_layers.add(layer)
        with self._side_stream():
            copy_layer(self._layers[layer], layer, self._save_copies[self.layer_groups[layer]], into_blocks=False)

    def wait_for_save(self) -> None:
        """After the forward pass: save the layers no attention call saved, wait for the
        copies, and publish each sequence's blocks that are now complete, in order."""
        if not self._saves:
            return
        for layer in range(len(self._layers)):
            if layer not in self._saved_layers:
                self._save(layer)
        if self._cuda:
            self._record().synchronize()
        for save in self._saves:
            self.ledger.written(save.target)
        self.ledger.publish([save.target.req_id for save in self._saves])
        self._saves, self._save_copies = [], []

    def worker_metadata(self) -> KVDWorkerMetadata:
        """What this worker published since the last step (for the scheduler's KV events)
        and the daemon instance it can load from now (the scheduler's offers wait for it)."""
        return KVDWorkerMetadata(self.ledger.take_published(), self.link.serving_instance(), saves=self.saves)

    # ---- helpers ----------------------------------------------------------------------

    def _resolve(self, daemon_instance: str | None, page_ids: list[int], what: str, writable: bool = False):
        """The pages grouped by extent, or None when they cannot be trusted or mapped.

        Pages another session named (loads) are trusted only from the daemon instance
        that named them; writable ones must be private pages of this worker's sequences."""

        def locate(kvd, ns):
            if daemon_instance is not None and kvd.daemon_instance != daemon_instance:
                raise KVDError(ErrorCode.FAILED_PRECONDITION, "the daemon restarted since the plan was made")
            groups = kvd.pages_by_extent(ns, page_ids, writable)
            if self._cuda:  # both maps; registered memory must stay mapped, so its extents are kept
                extents = kvd.mapped_extents(ns)
                self._registered.update((e.name, e) for e in extents)
                register_host_extents(
                    [memoryview(m) for e in extents for m in (e.memory, e.readonly_memory)], self.layout.page_bytes
                )
            return groups

        return self.link.attempt(what, locate, maps_memory=True)  # a page it cannot map: a failed copy

    @contextmanager
    def _side_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event
