"""`Saver`: the worker half's kvd calls and save copies, on a thread of its own, so that
vLLM's forward pass never waits for kvd, nor for a save.

The worker half (gpu_worker/vllm/worker.py) hands each engine step's save plans to this
thread after the step's forward pass (`submit`) and returns at once. The thread takes
every step handed since its last turn and, in one call of each kind for all of them,
allocates the sequences of requests new to this worker and grows the others
(`SaveLedger.targets`), copies the steps' saved blocks into their pages (each layer, one
memcpy per run of pages on CPU; on CUDA queued on a save stream of its own after the
steps' forward passes, then waited for on this thread), records them written, publishes
every sequence's blocks now complete in order, and releases the sequences of requests
that finished. So a page is published only after its bytes are complete, and only the
session that owns a page writes it. The thread also keeps the `PageDirectory` the
forward thread loads through (page_directory.py), and adopts the link's new sessions.

vLLM keeps the blocks a save reads until the save is done:
- a finished request's: the scheduler half asks vLLM to delay freeing the blocks of every
  request it planned a save for (`request_finished` returns True) and `done_saving`
  reports such a request (vLLM's `finished_sending`) once no save of it is in flight;
- a preempted request's blocks are freed at once and may be written by the very next
  forward pass: `preempted` (vLLM's `handle_preemptions`, before that pass) drops the
  request's saves not copied yet and waits for a copy reading them (CPU: until it ends,
  a memcpy; CUDA: the compute stream waits for the save stream, the host does not).

Fail open: a hung daemon holds this thread, never a step, one call timeout (then the link
drops its session and the later calls skip kvd at once); saves that cannot be done are
dropped, and their requests are reported done all the same. A bug in a turn is logged
and its saves dropped, never the engine's crash nor a request whose blocks stay held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from gpu_worker.host_registration import register_host_extents
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.page_copies import copy_layer, merged, to_blocks
from gpu_worker.vllm.page_directory import PageDirectory
from gpu_worker.vllm.plans import SavePlan
from gpu_worker.vllm.save_ledger import SaveLedger, SaveTarget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSaves:
    """What one engine step hands the saver after its forward pass."""

    serial: int  # the worker's step count: later steps have larger serials
    plans: list[SavePlan]
    finished: frozenset[str]  # requests whose sequences are released
    ready: torch.cuda.Event | None = None  # CUDA: the step's KV is written once the compute stream passes it


def _together(plans: list[SavePlan]) -> list[SavePlan]:
    """Several steps' plans, one per request (blocks of later plans replace earlier ones)."""
    by_request: dict[str, dict[int, list[int]]] = {}
    for plan in plans:
        blocks = by_request.setdefault(plan.req_id, {})
        for i, position in enumerate(plan.positions):
            blocks[position] = [group[i] for group in plan.block_ids]
    return [
        SavePlan(req_id, list(blocks), tuple(list(group) for group in zip(*blocks.values())))
        for req_id, blocks in by_request.items()
        if blocks
    ]


class Saver:
    def __init__(
        self,
        link: KVDLink,
        layers: list[torch.Tensor],
        layer_groups: list[int],
        refresh_seconds: float = 0.5,
    ) -> None:
        """`layers`: vLLM's cache per layer as `[blocks, 2, block_size, heads, head_dim]`
        views (worker.block_view); `layer_groups[i]`: layer i's KV-cache group."""
        self.link = link
        self.ledger = SaveLedger(link)  # the thread's alone
        self.layers = layers
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups) + 1
        self.refresh_seconds = refresh_seconds
        self.directory = PageDirectory()  # replaced (never changed) by the thread
        cuda = layers[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(device=layers[0].device) if cuda else None
        self._registered: dict[str, object] = {}  # CUDA: extents registered with cudaHostRegister (kept mapped)
        self._looked_at = 0.0  # the thread's: when it last looked for released extents
        self._lock = threading.Condition()
        # under _lock
        self._backlog: list[StepSaves] = []
        self._pending: Counter[str] = Counter()  # per request: plans handed and not done or dropped yet
        self._planned: set[str] = set()  # requests with a plan handed, until reported done
        self._finishing: set[str] = set()  # of those, the ones vLLM finished
        self._published: dict[str, tuple[int, int]] = {}  # per request: blocks published since the last report
        self._refresh_asked = False
        self._closing = False
        # held while copies read vLLM's blocks; `preempted` takes it
        self._copying = threading.Lock()
        self._cut: dict[str, int] = {}  # under _copying: request -> serial below which its plans are dropped
        self._issued: torch.cuda.Event | None = None  # under _copying, CUDA: after the last copies queued
        self._thread = threading.Thread(target=self._run, name="kvd-saver", daemon=True)
        self._thread.start()

    # ---- the forward thread's side -------------------------------------------------------

    def expect(self, plans: list[SavePlan]) -> None:
        """The step's plans (handed with `submit` after its forward pass) count as in flight now."""
        with self._lock:
            for plan in plans:
                self._pending[plan.req_id] += 1
                self._planned.add(plan.req_id)

    def submit(self, step: StepSaves) -> None:
        if step.plans or step.finished:
            with self._lock:
                self._backlog.append(step)
                self._lock.notify()

    def preempted(self, req_ids: set[str], serial: int) -> None:
        """vLLM freed these requests' blocks: plans of steps before `serial` are dropped, and
        a copy reading their blocks is waited for (on CUDA by the compute stream)."""
        with self._copying:
            for req_id in req_ids:
                self._cut[req_id] = serial
            if self._issued is not None:  # CUDA
                torch.cuda.current_stream().wait_event(self._issued)

    def done_saving(self, finished: set[str]) -> set[str]:
        """Of the requests vLLM finished (now or before) that plans were handed for, those
        with no save in flight any more: vLLM may free their blocks."""
        with self._lock:
            self._finishing |= finished & self._planned
            done = {r for r in self._finishing if not self._pending[r]}
            self._finishing -= done
            self._planned -= done
            for req_id in done:
                del self._pending[req_id]
            return done

    def ask_refresh(self) -> None:
        """A load named a page the directory does not hold: map the extents again (one call)."""
        with self._lock:
            self._refresh_asked = True
            self._lock.notify()

    def take_published(self) -> dict[str, tuple[int, int]]:
        """Per request, the blocks [start, end) published since the last call."""
        with self._lock:
            published, self._published = self._published, {}
            return published

    def idle(self) -> bool:
        """Nothing handed is still to be done (for tests and benchmarks)."""
        with self._lock:
            return not self._backlog and not any(self._pending.values())

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout=self.link.connect_timeout + 2 * self.link.call_timeout)

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        self._follow_session(refresh=True)  # the first connect: loads find a directory from the first step
        while True:
            with self._lock:
                if not (self._backlog or self._refresh_asked or self._closing):
                    self._lock.wait(self.refresh_seconds)
                if self._closing:
                    return
                steps, self._backlog = self._backlog, []
                refresh, self._refresh_asked = self._refresh_asked, False
            try:
                self._follow_session(refresh or self._released())
                if steps:
                    self._save(steps)
            except Exception:  # noqa: BLE001 - a bug in a turn must not hold vLLM's blocks for ever
                log.exception("kvd saver: a turn failed; its saves are dropped")
            finally:
                with self._lock:
                    for step in steps:
                        for plan in step.plans:
                            self._pending[plan.req_id] -= 1

    def _released(self) -> bool:
        """Every `refresh_seconds`: whether the daemon released an extent the directory maps
        (a look at /dev/shm, no kvd call; new extents are mapped as saves and loads name them)."""
        now = time.monotonic()
        if now - self._looked_at < self.refresh_seconds:
            return False
        self._looked_at = now
        return self.directory.released()

    def _follow_session(self, refresh: bool) -> None:
        """Adopts a session the link's reconnect thread opened, and remakes the directory
        when the session changed, when asked to, or when the client mapped other extents."""
        instance = self.link.serving_instance()
        if not instance:
            if self.directory.instance:
                self.directory = PageDirectory()
            return
        if refresh or instance != self.directory.instance:
            extents = self.link.attempt("map extents", lambda kvd, ns: kvd.map_extents(ns), maps_memory=True)
        else:
            extents = self.link.attempt("mapped extents", lambda kvd, ns: kvd.mapped_extents(ns))
        if extents is None or (
            instance == self.directory.instance and {e.name for e in extents} == self.directory.names()
        ):
            return
        if self._stream is not None:  # CUDA: both maps; registered memory must stay mapped, so its extents are kept
            self._registered.update((e.name, e) for e in extents)
            register_host_extents(
                [memoryview(m) for e in extents for m in (e.memory, e.readonly_memory)],
                self.link.namespace.layout.page_bytes,
            )
        self.directory = PageDirectory.of(instance, self.link.namespace.layout, extents)

    def _save(self, steps: list[StepSaves]) -> None:
        for step in steps:
            self.ledger.learn(step.plans)
        with self._copying:
            cut = dict(self._cut)
        first_serial = {}
        saved = []
        for step in steps:
            for plan in step.plans:
                if step.serial >= cut.get(plan.req_id, -1):
                    saved.append(plan)
                    first_serial.setdefault(plan.req_id, step.serial)
        targets = self.ledger.targets(_together(saved))
        copies = [(t, groups) for t in targets if (groups := self._writable(t)) is not None]
        self._follow_session(refresh=False)  # CUDA: extents the client mapped for them get registered
        with self._copying:  # a preemption since the targets were made drops their copies
            copies = [(t, g) for t, g in copies if first_serial[t.req_id] >= self._cut.get(t.req_id, -1)]
            done = self._copy(copies, [s.ready for s in steps if s.ready is not None])
        if done is not None:  # CUDA: the copies end before their pages count as written
            done.synchronize()
        for target, _ in copies:
            self.ledger.written(target)
        self.ledger.publish([t.req_id for t, _ in copies])
        published = self.ledger.take_published()
        finished = set().union(*(step.finished for step in steps))
        self.ledger.finished(finished)
        with self._copying:
            for req_id in finished:
                self._cut.pop(req_id, None)
        with self._lock:
            for req_id, (start, end) in published.items():
                self._published[req_id] = (self._published.get(req_id, (start, end))[0], end)

    def _writable(self, target: SaveTarget):
        """The target's pages grouped by extent (writable: private pages of this worker's
        sequences), or None when they cannot be mapped: a dropped save."""
        return self.link.attempt(
            f"save for request {target.req_id}",
            lambda kvd, ns: kvd.pages_by_extent(ns, target.page_ids, True),
            maps_memory=True,
        )

    def _copy(self, copies: list[tuple[SaveTarget, list]], ready: list) -> torch.cuda.Event | None:
        """Copies every layer of the targets' blocks into their pages: on CPU here and now;
        on CUDA queued on the save stream after the steps' forward passes (`ready`), with
        the event after them returned."""
        if not copies:
            return None
        per_group = merged([[to_blocks(groups, b) for b in t.block_ids] for t, groups in copies], self.num_groups)
        if self._stream is None:
            for layer, view in enumerate(self.layers):
                copy_layer(view, layer, per_group[self.layer_groups[layer]], into_blocks=False)
            return None
        for event in ready:  # CUDA
            self._stream.wait_event(event)
        with torch.cuda.stream(self._stream):
            for layer, view in enumerate(self.layers):
                copy_layer(view, layer, per_group[self.layer_groups[layer]], into_blocks=False)
        self._issued = torch.cuda.Event()
        self._issued.record(self._stream)
        return self._issued
