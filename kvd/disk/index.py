"""The disk tier's index: which pages of one tenant are on disk, the eviction policy that
holds them, and the KV events that announce them.

``DiskIndex`` maps (namespace root, chain key) to the ``DiskPage`` that holds it: built at
start-up from the pages the store recovered (``DiskStore.opening`` reads every header on
its threads while the daemon serves, and ``DiskOpening``, kvd/disk/opening.py, hands them
to ``learn`` in steps; they enter the policy in the order they were written, as pages used
once), then from each page the write-back writes (kvd/disk/write_back.py).
The policy (``[disk] policy``: ARC or LRU, kvd/tiers/eviction.py, the same classes the
trace study replays) holds as many pages as the file has slots of the first page size the
tier sees; each page is admitted before it is written, and the pages it gives up for it
are forgotten here, to be freed before the write. A write the disk still refuses as full
(pages of several sizes share the file) makes room among the pages whose slots the refused
pages can use (kvd/disk/reclaim.py). With ``[disk] min_uses`` above 1 the index sizes the
``UseCounts`` (kvd/disk/admission.py) the tier consults beside the policy.

KV events (kvd/cache/events.py) keep a router's view of this host exact: a page becomes
findable on disk once its write is done (or at start-up, for the pages recovered) and is
announced ``BlockStored`` with medium ``STORAGE``; a page that stops being findable (freed
to make room, rejected, dropped by a failed read) is announced ``BlockRemoved`` with medium
``STORAGE``. A recovered page whose namespace no engine registered yet is announced with
namespace id 0 (the ZMQ stream carries no namespace).
"""

from __future__ import annotations

import logging
from collections import Counter

from kvd.cache.events import MEDIUM_STORAGE, EventLog
from kvd.config import DiskConfig
from kvd.core.index import ExtraKey
from kvd.core.namespaces import NamespaceRegistry
from kvd.core.types import NamespaceId, PageKey
from kvd.disk import reclaim
from kvd.disk.admission import UseCounts
from kvd.disk.ledger import DiskTierCounters
from kvd.diskstore.layout import DiskPage, PageIdentity, SlotClass
from kvd.diskstore.store import DiskStore
from kvd.tiers.eviction import POLICIES, EvictionPolicy
from kvd.wire.codec import TOKEN_BYTES

log = logging.getLogger(__name__)

DiskKey = tuple[bytes, PageKey]  # (namespace root, chain key)


def disk_key(identity: PageIdentity) -> DiskKey:
    return identity.namespace_root, identity.key


class DiskIndex:
    """One tenant's pages on disk by key, the policy that holds them (and the pages on their
    way there), and their KV events."""

    def __init__(
        self,
        store: DiskStore,
        scope: str,
        settings: DiskConfig,
        events: EventLog,
        namespaces: NamespaceRegistry,
        counters: DiskTierCounters,
        of_tenant: str,
    ) -> None:
        """Empty: the pages tenant ``scope`` has on disk are learnt as the store's recovery
        finds them (``learn``)."""
        self.store = store
        self.scope = scope
        self.settings = settings
        self.events, self.namespaces = events, namespaces
        self.counters = counters
        self.of_tenant = of_tenant  # for log lines: " of tenant NAME", or nothing for the implicit tenant
        self.policy: EvictionPolicy | None = None  # sized by the first page size seen (sized)
        self.uses: UseCounts | None = None  # with min_uses > 1
        self._on_disk: dict[DiskKey, DiskPage] = {}

    def learn(self, pages: list[DiskPage]) -> None:
        """Pages the store found on disk at its opening (in the order they were written: the
        policy holds them as pages used once) become findable; other tenants' are skipped,
        and those the policy gives up for them are freed."""
        freed: list[DiskPage] = []
        for page in pages:
            if page.identity.scope == self.scope:
                key = disk_key(page.identity)
                if key not in self.sized(page.page_class):
                    freed += self.admit(key)
                self.index(page, (), key)
        if freed:
            self.store.free([p.slot for p in freed])

    def __len__(self) -> int:
        return len(self._on_disk)

    @property
    def bytes(self) -> int:
        """Page bytes on disk."""
        return sum(p.page_bytes for p in self._on_disk.values())

    def get(self, key: DiskKey) -> DiskPage | None:
        """The page on disk under ``key``; None when the disk does not hold it (yet)."""
        return self._on_disk.get(key)

    def sized(self, page_class: SlotClass) -> EvictionPolicy:
        """The policy, made for as many pages of ``page_class`` as the file holds when it is
        first called (pages of other sizes count one page each)."""
        if self.policy is None:
            capacity = self.store.holds_at_most(page_class)
            self.policy = POLICIES[self.settings.policy](capacity)
            if self.settings.min_uses > 1:
                self.uses = UseCounts(self.settings.min_uses, remembered=2 * capacity)
            log.info(
                "disk tier%s: %s of %d pages of %d bytes; pages written from their use %d on",
                self.of_tenant, self.settings.policy.upper(), capacity,
                page_class.page_bytes, self.settings.min_uses,
            )  # fmt: skip
        return self.policy

    def admitted(self, key: DiskKey) -> bool:
        """Whether the policy holds the page: on disk, or on its way there."""
        return key in self._policy

    def hit(self, key: DiskKey) -> None:
        """The page was used (found on disk, or evicted again while the disk holds it)."""
        self._policy.hit(key)

    def admit(self, key: DiskKey) -> list[DiskPage]:
        """The page under ``key`` is held by the policy from now on; the pages on disk it gave
        up for it, forgotten here (to be freed)."""
        return self._on_disk_of(self._policy.admit(key))

    def not_written(self, key: DiskKey) -> None:
        """A page admitted and not written after all: the policy no longer holds it."""
        self._policy.forget(key)

    def make_room(self, refused: Counter[SlotClass]) -> list[DiskPage]:
        """For writes refused as full, ``refused[page_class]`` pages of each class: as many
        of the policy's victims among the pages whose slots they can use, forgotten here (to
        be freed)."""
        victims = []  # for each size in turn: a page named for one is gone for the next
        for page_class, count in refused.items():
            victims += reclaim.victims(self._policy, self._on_disk, page_class, count, self.settings.chunk_bytes)
        return self._on_disk_of(victims)

    def index(self, page: DiskPage, extra_keys: tuple[ExtraKey, ...] = (), key: DiskKey | None = None) -> None:
        """A page on disk (the policy holds it) becomes findable (and is announced); an older
        copy of the same page is freed. ``key``: the tuple the policy was given for it, kept
        by the index too (one tuple a page, not two); made from the page when not given."""
        key = disk_key(page.identity) if key is None else key
        assert key in self._policy, f"page {key[1].hex()} is on disk, and the disk's policy does not hold it"
        older = self._on_disk.get(key)
        self._on_disk[key] = page
        if older is not None:
            self.store.free([older.slot])
            return
        i = page.identity
        page_size = len(i.tokens) // TOKEN_BYTES
        parent = PageKey(i.parent_key) if i.page_index else None
        ns = self._namespace_id(i.namespace_root)
        self.events.stored(ns, page_size, i.page_index, i.key, parent, i.tokens, extra_keys, medium=MEDIUM_STORAGE)

    def forget(self, on_disk: DiskPage) -> bool:
        """The page stops being findable and held (its slot is the caller's to free); False
        when the index holds another copy of it, or none."""
        key = disk_key(on_disk.identity)
        if self._on_disk.get(key) != on_disk:
            return False
        self._unindex(key)
        self._policy.forget(key)
        return True

    @property
    def _policy(self) -> EvictionPolicy:
        assert self.policy is not None, "a page on disk, or on its way, before any page size was seen"
        return self.policy

    def _on_disk_of(self, victims: list) -> list[DiskPage]:
        freed = [self._unindex(key) for key in victims if key in self._on_disk]
        self.counters.evicted_pages += len(freed)
        return freed

    def _unindex(self, key: DiskKey) -> DiskPage:
        """A page on disk stops being findable (and is announced so)."""
        page = self._on_disk.pop(key)
        self.events.removed(self._namespace_id(key[0]), key[1], medium=MEDIUM_STORAGE)
        return page

    def _namespace_id(self, root: bytes) -> NamespaceId:
        """The id of the namespace ``root`` roots in this daemon; 0 while no engine registered it."""
        ns = self.namespaces.by_root(root)
        return NamespaceId(0) if ns is None else ns.id
