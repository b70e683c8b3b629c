"""What the cache lends a tier: the parts a tier may use, named one by one, so a tier never
sees the manager.

``TierPorts`` is built by the cache (``KVCacheManager.tier_ports``) and handed to a tier's
constructor by the launcher (kvd/server/daemon.py); the disk tier (kvd/disk/tier.py) and the
remote tier (kvd/remote/tier.py) take what they need from it, and pass on only that.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.cache.events import EventLog
from kvd.cache.page_events import PageEvents
from kvd.cache.room import Room
from kvd.core.arena import Arena
from kvd.core.index import PrefixIndex
from kvd.core.namespaces import NamespaceRegistry
from kvd.core.pool import PagePool
from kvd.durability.integrity import Integrity


@dataclass(frozen=True)
class TierPorts:
    arena: Arena  # page id → bytes: what transfers read and write
    pool: PagePool  # holds (pool references), publishing what a tier brings, page contents
    index: PrefixIndex  # a page published meanwhile wins over a fetched copy
    room: Room  # new pages for a fetch (``grant_spare``)
    pages: PageEvents  # a fetch's publish done: its seals and events follow
    integrity: Integrity  # the seal a page copied out must match
    events: EventLog  # the tier's own KV events (medium STORAGE, REMOTE)
    namespaces: NamespaceRegistry  # a recovered page's namespace, a namespace id by root
