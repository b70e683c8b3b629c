"""KVDConnector's worker half: copies pages between kvd's shared memory and vLLM's KV blocks.

It holds no policy: the scheduler half's plans (gpu_worker/vllm/plans.py) say which kvd
page goes to which vLLM block, and which of a request's blocks this step completes. It
makes no kvd call on vLLM's forward thread: its `Saver` (gpu_worker/vllm/saver.py) makes
them all, on a thread of its own, and copies the saves there.

Loads run on the forward thread, from pages the scheduler half's kvd sequences hold,
found in the saver's `PageDirectory` (gpu_worker/vllm/page_directory.py: the extents
this process mapped, read without a call), or in the extents the load plan names, which
this thread maps itself (created since the saver last mapped them; on CUDA copied from
unregistered memory until the saver registers them). On CUDA they are queued on a load stream for
every layer at once, with an event per layer that `wait_layer` makes the compute stream
wait on, so a layer's load overlaps the layers computed before it. On CPU there is no copy
engine to overlap with: every layer is copied before the forward pass, in
`start_load_kv` (one memcpy per run of pages, gpu_worker/vllm/page_copies.py).

Saves go into a kvd sequence of this worker's own session: after the forward pass
(`wait_for_save`) the step's plans go to the saver, and the step returns. The saver
copies the blocks into the sequence's private pages and publishes them once complete,
and vLLM keeps the blocks until then (`finished_sending`, `preempted`; saver.py says
how). So no process writes a page another session owns, a page is published only after
its bytes are complete, and no step waits for a save.

Anything that cannot be copied (kvd gone, the daemon restarted since the plan was made, a
page not mapped) is reported, never guessed: a failed load's blocks go to vLLM as load
errors (it recomputes them), a failed save is dropped, never published.

vLLM hands each layer's KV cache as a standardised per-layer view `[num_blocks,
num_kv_heads, block_size, 2 * head_dim]`; a kvd page is `[num_layers, 2, page_size,
num_kv_heads, head_dim]`. `block_view` makes the first look like one layer of the
second, without copying (and an MLA layer, `[num_blocks, 1, block_size, 576]`, one
layer of a latent page, `[num_layers, page_size, 576]`). Each layer's copies go to the
block ids of its KV-cache group
(vLLM's hybrid manager: one group per attention type), skipping vLLM's null block (a
sliding-window group's blocks outside the window). An asynchronous load (several
groups) that cannot be done is not copied at all; `transfer_results` reports it failed.
CUDA paths are marked and run by scripts/gpu_check.sh."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine_client import PageLayout
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.page_copies import copy_layer, merged, to_blocks
from gpu_worker.vllm.page_directory import PageDirectory
from gpu_worker.vllm.plans import NULL_BLOCK, KVDConnectorMetadata, KVDWorkerMetadata, LoadPlan, SavePlan
from gpu_worker.vllm.saver import Saver, StepSaves
from kvd.wire.layout import LATENT_PAGES

log = logging.getLogger(__name__)


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


class KVDWorkerSide:
    def __init__(
        self, link: KVDLink, layer_names: list[str], layer_groups: list[int] | None = None, saves: bool = True
    ) -> None:
        """`layer_names` in page order; `layer_groups[i]`: the KV-cache group of layer i
        (whose block ids its copies use; all 0 by default); `saves`: whether this worker
        saves (of a cache every rank holds whole, MLA's, rank 0 alone does: cache_shape.py).
        The link is the saver's thread's (made at `register`): this half calls kvd through
        nothing else."""
        self.link = link
        self.saves = saves
        self._saved_elsewhere: set[str] = set()  # planned requests whose saves another rank makes
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.layer_groups = layer_groups or [0] * len(layer_names)
        self.num_groups = max(self.layer_groups) + 1
        self.layout = link.namespace.layout
        self.saver: Saver | None = None  # made at `register`, with vLLM's cache
        self._mapped_here = PageDirectory()  # extents load plans named that the saver's directory lacked
        self._layers: list[torch.Tensor] = []  # per layer: [blocks, 2, block_size, heads, head_dim] views
        self._load_stream: torch.cuda.Stream | None = None  # CUDA
        self._load_events: dict[int, torch.cuda.Event] = {}
        self._load_errors: set[int] = set()
        self._recving: set[str] = set()  # asynchronous loads done since vLLM last asked
        self._failed_recving: set[str] = set()  # of those, the ones that failed
        self._serial = 0  # engine steps so far (`StepSaves.serial`)
        self._plans: list[SavePlan] = []  # the step's save plans, handed to the saver after its forward pass
        self._loaded: dict[str, bool] = {}  # the step's synchronous loads: whether each loaded whole
        self._finished: frozenset[str] = frozenset()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = set(self.layer_index) - set(kv_caches)
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layers {sorted(missing)}")
        layers = [kv_caches[name] for name in sorted(self.layer_index, key=self.layer_index.get)]
        cpu_backend = layers[0].device.type == "cpu"  # vLLM's CPU attention backend
        self._layers = [block_view(kv, self.layout, cpu_backend) for kv in layers]
        if layers[0].device.type == "cuda":
            self._load_stream = torch.cuda.Stream(device=layers[0].device)
        self.saver = Saver(self.link, self._layers, self.layer_groups)

    def start_step(self, meta: KVDConnectorMetadata) -> None:
        """Before the forward pass (or right after it, when vLLM has no synchronous load):
        copy every planned load into its vLLM blocks (on CUDA queued per layer), and note
        the step's saves, which the saver takes after the forward pass (`wait_for_save`)."""
        failed = self._start_loads(meta.loads)
        self._loaded.update((plan.req_id, plan.req_id not in failed) for plan in meta.loads if not plan.asynchronous)
        if not self.saves:
            self._saved_elsewhere.update(plan.req_id for plan in meta.saves)
        self._plans, self._finished = (meta.saves if self.saves else []), frozenset(meta.finished)
        self.saver.expect(self._plans)

    def preempted(self, meta: KVDConnectorMetadata) -> None:
        """vLLM preempted these requests and freed their blocks, which the coming forward
        pass may write: no save may read them any more (vLLM's `handle_preemptions`)."""
        if meta.preempted:
            self.saver.preempted(meta.preempted, self._serial)

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
                groups = self._loadable(plan, page_ids)
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
        copies = merged(
            [[to_blocks(groups, blocks) for blocks in plan.block_ids] for plan, groups in resolved], self.num_groups
        )
        with self._on_load_stream():
            for layer, view in enumerate(self._layers):
                copy_layer(view, layer, copies[self.layer_groups[layer]], into_blocks=True)
                if self._load_stream is not None:
                    self._load_events[layer] = torch.cuda.Event()
                    self._load_events[layer].record(self._load_stream)
        return failed

    def _loadable(self, plan: LoadPlan, page_ids: list[int]):
        """The pages grouped by extent, read from the saver's directory, else from the
        extents the plan names, mapped here (no kvd call either way; the saver is asked to
        map them for the next loads); or None: pages of
        another daemon instance than the directory's (it restarted since the plan was
        made) are not trusted, and a page neither holds fails its load (the saver maps
        the extents again)."""
        directory = self.saver.directory
        if directory.instance != plan.daemon_instance:
            log.warning(
                "a load names pages of daemon instance %r, not of %r: recomputed",
                plan.daemon_instance,
                directory.instance,
            )
            return None
        groups = directory.pages_by_extent(page_ids)
        if groups is None and plan.extents_by_rank:
            if self._mapped_here.instance != directory.instance:
                self._mapped_here = PageDirectory.of(directory.instance, self.layout, [])
            self._mapped_here = self._mapped_here.extended(plan.extents_by_rank[self.link.namespace.tp_rank])
            groups = self._mapped_here.pages_by_extent(page_ids)
            self.saver.ask_refresh()  # the saver's directory lacks these extents: its next turn maps them
        if groups is None:
            log.warning("a load names a page of an extent this worker has not mapped: recomputed")
            self.saver.ask_refresh()
        return groups

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

    def wait_for_save(self) -> None:
        """After the forward pass: hand the step's saves to the saver and return (on CUDA
        with an event its copies wait for). No plan comes for a request in the step it
        loads (nor for one that read its blocks): the scheduler half plans it once every
        rank's load is known to have succeeded (`worker_metadata`, load_verdicts.py)."""
        ready = None
        if self._load_stream is not None and self._plans:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        self.saver.submit(StepSaves(self._serial, self._plans, self._finished, ready))
        self._serial += 1
        self._plans, self._finished = [], frozenset()

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose saves are all done or dropped: vLLM frees their blocks
        (once every worker says so; a worker that saves nothing says so at once)."""
        elsewhere = finished_req_ids & self._saved_elsewhere
        self._saved_elsewhere -= elsewhere
        return self.saver.done_saving(finished_req_ids) | elsewhere

    def worker_metadata(self) -> KVDWorkerMetadata:
        """What this worker published since the last step (for the scheduler's KV events),
        the daemon instance it can load from now (the scheduler's offers wait for it), and
        whether the step's synchronous loads succeeded here (the scheduler's verdicts)."""
        loaded, self._loaded = self._loaded, {}
        return KVDWorkerMetadata(
            self.saver.take_published(), self.saver.directory.instance, saves=self.saves, loaded=loaded
        )

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()

    @contextmanager
    def _on_load_stream(self) -> Iterator[None]:
        if self._load_stream is None:
            yield
            return
        self._load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._load_stream):
            yield
