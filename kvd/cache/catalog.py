"""The cache as a whole, apart from any session: its namespaces and the manifest that records
them, what a warm restart hands over, and the prefix-cache reset.

``KVCacheManager`` (kvd/cache/manager.py) answers the calls that act on sequences, pins and
sessions; what acts on every published page of a namespace at once lives here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvd.cache.requests import ResetResult
from kvd.core.arena import Arena, ExtentPlan
from kvd.core.counters import Counters
from kvd.core.errors import ResourceExhausted
from kvd.core.namespaces import Namespace, NamespaceIdentity, NamespaceRegistry, identity_doc
from kvd.core.pool import PagePool
from kvd.core.records import MetaError
from kvd.core.supply import ExtentSupply
from kvd.core.types import NamespaceId, PageState
from kvd.durability.integrity import Integrity
from kvd.durability.reindexing import Reindexing

if TYPE_CHECKING:
    from kvd.durability.recovery import Recovered
    from kvd.durability.report import RecoveryReport

log = logging.getLogger(__name__)


class Catalog:
    """Namespaces and their published pages, for registration, warm restart and reset."""

    def __init__(
        self,
        arena: Arena,
        namespaces: NamespaceRegistry,
        pool: PagePool,
        integrity: Integrity,
        supply: ExtentSupply,
        counters: Counters,
    ) -> None:
        self.arena = arena
        self.namespaces = namespaces
        self.pool = pool
        self.integrity = integrity
        self.supply = supply
        self.counters = counters
        self._report: RecoveryReport | None = None  # of this start, set by restore()
        self.reindexing: Reindexing | None = None  # a warm restart's pages, verified and indexed in steps

    def register_namespace(self, identity: NamespaceIdentity) -> Namespace:
        """The namespace of ``identity``; a new one is registered all or nothing: it is
        written to the manifest first, and a manifest that cannot be written registers nothing."""
        ns = self.namespaces.find(identity)
        if ns is None:
            ns = self.namespaces.new(identity)
            try:
                self.write_manifest([*self.namespaces.all(), ns])
            except (MetaError, OSError) as e:
                raise ResourceExhausted(f"cannot record namespace {ns.id} in shared memory: {e}") from None
            self.namespaces.add(ns)
        self.supply.provision(ns)
        return ns

    def write_manifest(self, namespaces: list[Namespace] | None = None) -> None:
        """What a restarted daemon checks before it re-attaches the extents (kvd/core/records.py):
        the settings and ``namespaces`` (default: the registered ones)."""
        self.arena.write_manifest(
            {
                "host_bytes": self.arena.budget_bytes,
                "extent_bytes": self.arena.extent_bytes,
                "namespaces": [identity_doc(ns.identity) for ns in namespaces or self.namespaces.all()],
            }
        )

    def extents(self, namespace_id: int) -> list[ExtentPlan]:
        """The extents holding the namespace's pages, those built in the background included."""
        ns = self.namespaces.get(namespace_id)
        self.supply.adopt_built()
        return [e.plan for e in self.arena.extents() if e.plan.namespace == ns.id]

    def restore(self, report: RecoveryReport, found: Recovered | None = None) -> None:
        """Takes what a warm restart (kvd/durability/recovery.py) attached, before any call: its
        namespaces with their old ids, its extents' pages as FREE but the published ones, held
        until ``reindexing`` verifies and indexes them (kvd/durability/reindexing.py)."""
        self._report = report
        if found is None:
            return
        for identity, ns_id in found.namespaces:
            got = self.namespaces.register(identity)
            assert got.id == ns_id, f"recovered namespace {identity.model} got id {got.id}, not {ns_id}"
        for extent, held in zip(found.extents, found.held):
            self.arena.adopt_recovered(extent)
            self.pool.add_pages(extent.plan.namespace, extent.name, extent.first_page, extent.num_pages, held)
        self.reindexing = Reindexing(
            found.pending, self.arena, found.extents, self.pool, self.integrity, self.counters, self.namespaces, report
        )
        self.write_manifest()

    def give_up_recovery(self, namespace: NamespaceId, count: int) -> int:
        """Frees ``count`` pages of the namespace a warm restart's recovery holds and has not
        verified yet, or none, for an allocation short of room (kvd/cache/room.py); how many."""
        return 0 if self.reindexing is None else self.reindexing.give_up(namespace, count)

    @property
    def last_recovery(self) -> RecoveryReport | None:
        """What this start recovered, so far while ``reindexing`` runs; None before ``restore``."""
        return self._report if self.reindexing is None else self.reindexing.report()

    def reset_prefix_cache(self, namespace_id: int | None = None) -> ResetResult:
        """Drops every cached (published, unreferenced) page of a namespace, or of all: what
        vLLM's ``reset_prefix_cache`` does after a weight update. Pages a sequence or pin
        references stay as they are, indexed; nothing is refused."""
        namespaces = self.namespaces.all() if namespace_id is None else [self.namespaces.get(namespace_id)]
        if self.reindexing is not None:
            self.reindexing.finish()  # the pages it holds are cached ones too
        ids = {ns.id for ns in namespaces}
        dropped = 0
        for ns_id in ids:
            dropped += len(self.pool.evict_many(ns_id, self.pool.cached_count(ns_id)))
        kept = sum(1 for _, state, _, _, ns_id in self.pool.pages() if state is PageState.PUBLISHED and ns_id in ids)
        log.info("prefix cache reset: %d cached pages dropped, %d published pages in use kept", dropped, kept)
        return ResetResult(dropped, kept)
