"""New extents for namespaces: built ahead of need in the background, or on the request path.

Building an extent (create, map, pre-fault, mlock) is slow: first touch of shared memory
runs at ~0.5 GB/s. When a namespace's free pages run low, the next extent is built on a
worker thread and adopted on the event loop at the next call; a request that needs room
before then takes the build in flight, or builds one itself. Once adopted, the extent's
objects are frozen out of the garbage collector's walks (kvd/collector.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from kvd import collector
from kvd.arena import Arena, Extent, ExtentPlan, ShmFull
from kvd.namespaces import Namespace
from kvd.pool import PagePool
from kvd.types import NamespaceId

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
            self._building[ns.id] = (plan, self._builder.submit(self.arena.build, plan))

    def build_ahead(self, ns: Namespace) -> Future | None:
        """The namespace's extent being built in the background, started now if none is;
        None when the budget holds no further extent (for a caller that waits for it
        without holding the event loop, ``Room.steps``)."""
        self.adopt_built()
        if ns.id not in self._building:
            plan = self.arena.plan(ns.id, ns.page_bytes, ns.page_size, ns.root)
            if plan is None:
                return None
            self._building[ns.id] = (plan, self._builder.submit(self.arena.build, plan))
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
            extent = self.arena.build(plan)
        except ShmFull as e:
            self.arena.cancel(plan)
            self.arena.shm_refused(e)
            return False
        except BaseException:
            self.arena.cancel(plan)
            raise
        self._adopt(extent)
        return True

    def close(self) -> None:
        self.settle()
        self._builder.shutdown()

    def _take(self, plan: ExtentPlan, future: Future) -> bool:
        """Adopts a background build (True), or returns the budget of one that failed (False)."""
        try:
            extent = future.result()
        except ShmFull as e:
            self.arena.cancel(plan)
            self.arena.shm_refused(e)
            return False
        except Exception:
            # The next build runs on the request path (add_extent) and reports the error there.
            self.arena.cancel(plan)
            log.exception("building extent %s in the background failed; its budget is returned", plan.name)
            return False
        self._adopt(extent)
        return True

    def _adopt(self, extent: Extent) -> None:
        self.arena.shm_accepted()
        self.arena.adopt(extent)
        self.pool.add_pages(extent.plan.namespace, extent.name, extent.first_page, extent.num_pages)
        # The extent lives as long as the daemon: no collection needs to walk its objects.
        collector.freeze_grown()
