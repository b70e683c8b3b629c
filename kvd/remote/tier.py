"""The remote tier of one cache (one tenant): what the cache calls as its ``Tier``.

Its parts, one job each, share the tier's holds (kvd/tiers/holds.py) and counters (kvd/remote/ledger.py):

- ``WriteBehind`` (kvd/remote/storing.py): which published pages go to the store, and when
  (as they are published, or as they are evicted), and offering them all again each time
  the link comes up (a restarted master has lost them);
- ``Fetches`` (kvd/tiers/fetches.py, the store its source through kvd/remote/fetching.py):
  a prompt's pages past its local hit, found in the store, read into new local pages,
  checked and published;
- ``TierJobs`` (kvd/remote/jobs.py): the jobs both hand the link's worker thread, and the
  door to it.

Every hold is a pool reference (kvd/core/pool.py), so a page the store is reading or writing
is never evicted or reused; ``holds`` lists them for kvd/cache/invariants.py. The launcher
(kvd/server/daemon.py) attaches one to each tenant's cache (``Tiers.attach``,
kvd/tiers/tier.py); they share one ``RemoteLink``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict

from kvd.cache.ports import TierPorts
from kvd.config import RemoteConfig
from kvd.core.index import PageContent
from kvd.core.listener import ChainPlace
from kvd.core.types import PageId
from kvd.remote.fetching import RemoteSource
from kvd.remote.jobs import TierJobs
from kvd.remote.ledger import RemoteCounters, RemoteStats
from kvd.remote.link import RemoteLink
from kvd.remote.storing import WriteBehind
from kvd.tiers.fetches import Fetches
from kvd.tiers.holds import Holds
from kvd.tiers.tier import Miss


class RemoteTier:
    def __init__(self, link: RemoteLink, scope: str, settings: RemoteConfig, ports: TierPorts) -> None:
        """The tier of one tenant's cache (``ports``: what the cache lends it); ``scope`` keeps
        this tenant's pages apart from other tenants' in the store. Built before the daemon
        takes any call, and before a warm restart's pages are restored (``restored`` places them)."""
        p = ports
        self.link = link
        self.counters = RemoteCounters()
        self._holds = Holds(p.pool)
        jobs = TierJobs(link, scope, p.arena)
        self.write_behind = WriteBehind(
            jobs, self._holds, self.counters, settings, p.arena, p.pool, p.integrity, p.events, p.namespaces
        )
        self.fetches = Fetches(
            RemoteSource(jobs), self._holds, self.counters, p.arena, p.pool, p.index, p.room, p.pages
        )
        link.on_up.append(self.write_behind.store_came_back)

    def published(self, content: PageContent, place: ChainPlace) -> None:
        self.write_behind.published(content, place, fetched=self.fetches.brought(content.page))

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        self.write_behind.restored(content, place)

    def submit(self) -> None:
        self.write_behind.submit()

    def unpublished(self, page: PageId) -> None:
        self.write_behind.unpublished(page, fetched=self.fetches.forget(page))

    def served(self, hits: list[PageId], page_size: int) -> None:
        self.fetches.served(hits, page_size)

    def missed(self, miss: Miss) -> int:
        return self.fetches.missed(miss)

    def holds(self) -> Counter[PageId]:
        """Pool references the tier holds, by page (kvd/cache/invariants.py)."""
        return self._holds.all()

    def stats(self) -> RemoteStats:
        """The link's state, outages and resets, and this tier's counters (kvd/remote/ledger.py)."""
        link = self.link
        return RemoteStats(state=link.state.value, outages=link.outages, resets=link.resets, **asdict(self.counters))
