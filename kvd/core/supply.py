"""New extents for namespaces: built ahead of need in the background, or on the request path.

Building an extent (create, map, pre-fault, mlock) is slow: first touch of shared memory
runs at ~0.5 GB/s. When a namespace's free pages run low, the next extent is built on a
worker thread and adopted on the event loop at the next call; a request that needs room
before then takes the build in flight, or builds one itself. Once adopted, the extent's
objects are frozen out of the garbage collector's walks (kvd/collector.py).

A build /dev/shm refuses (``ShmFull``) is an outcome, not an error: its budget is given
back, the arena stops planning extents for a while (``Arena.shm_refused``), and whoever
waited for the build makes room from the cached pages instead (kvd/cache/room.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from kvd import collector
from kvd.core.arena import Arena, Extent, ExtentPlan
from kvd.core.namespaces import Namespace
from kvd.core.pool import PagePool
from kvd.core.shm import ShmFull
from kvd.core.types import NamespaceId

log = logging.getLogger(__name__)


class ExtentSupply:
    def __init__(self, arena: Arena, pool: PagePool) -> None:
        self.arena = arena
        self.pool = pool
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-extent")
        self._building: dict[NamespaceId, tuple[ExtentPlan, Future]] = {}

    def building_pages(self, namespace: NamespaceId) -> int:
        """Pages of the namespace's extent being built in the background (0 when none)."""
        building = self._building.get(namespace)
        return building[0].num_pages if building else 0

    def provision(self, ns: Namespace) -> None:
        """Starts building the namespace's next extent when its free pages run low."""
        self.adopt_built()
        if ns.id in self._building:
            return
        watermark = max(1, self.arena.extent_bytes // ns.page_bytes // 2)
        if self.pool.free_count(ns.id) >= watermark:
            return
        plan = self.arena.plan(ns.id, ns.page_bytes, ns.page_size, ns.root)
        if plan is not None:
            self._building[ns.id] = (plan, self._builder.submit(self._build, plan))

    def build_ahead(self, ns: Namespace) -> Future | None:
        """The namespace's extent being built in the background, started now if none is;
        None when the budget holds no further extent (for a caller that waits for it
        without holding the event loop, ``Room.steps``). The future's result is the extent,
        or the ``ShmFull`` that refused it: awaiting it never raises for a full /dev/shm."""
        self.adopt_built()
        if ns.id not in self._building:
            plan = self.arena.plan(ns.id, ns.page_bytes, ns.page_size, ns.root)
            if plan is None:
                return None
            self._building[ns.id] = (plan, self._builder.submit(self._build, plan))
        return self._building[ns.id][1]

    def adopt_built(self) -> None:
        """Adopts every background build that has finished."""
        for ns_id, (plan, future) in list(self._building.items()):
            if future.done():
                del self._building[ns_id]
                self._take(plan, future)

    def settle(self) -> None:
        """Waits for every background build and adopts it."""
        for ns_id, (plan, future) in list(self._building.items()):
            del self._building[ns_id]
            self._take(plan, future)

    def add_extent(self, ns: Namespace) -> bool:
        """Adds one extent's pages to the namespace now: the build in flight, else a new one.
        False when the budget holds no further extent, or /dev/shm refused it (``Arena.shm_refused``)."""
        building = self._building.pop(ns.id, None)
        if building is not None and self._take(*building):
            return True
        plan = self.arena.plan(ns.id, ns.page_bytes, ns.page_size, ns.root)
        if plan is None:
            return False
        try:
            built = self._build(plan)
        except BaseException:
            self.arena.cancel(plan)
            raise
        return self._settle(plan, built)

    def close(self) -> None:
        self.settle()
        self._builder.shutdown()

    def _build(self, plan: ExtentPlan) -> Extent | ShmFull:
        """``Arena.build``, with a refusal by /dev/shm returned (on any thread)."""
        try:
            return self.arena.build(plan)
        except ShmFull as e:
            return e

    def _take(self, plan: ExtentPlan, future: Future) -> bool:
        """Settles a background build: adopted (True), or its budget returned (False)."""
        try:
            built = future.result()
        except Exception:
            # The next build runs on the request path (add_extent) and reports the error there.
            self.arena.cancel(plan)
            log.exception("building extent %s in the background failed; its budget is returned", plan.name)
            return False
        return self._settle(plan, built)

    def _settle(self, plan: ExtentPlan, built: Extent | ShmFull) -> bool:
        """Adopts a built extent (True), or returns the budget of one /dev/shm refused (False)."""
        if isinstance(built, ShmFull):
            self.arena.cancel(plan)
            self.arena.shm_refused(built)
            return False
        self._adopt(built)
        return True

    def _adopt(self, extent: Extent) -> None:
        self.arena.shm_accepted()
        self.arena.adopt(extent)
        self.pool.add_pages(extent.plan.namespace, extent.name, extent.first_page, extent.num_pages)
        # The extent lives as long as the daemon: no collection needs to walk its objects.
        collector.freeze_grown()
