"""The disk tier of one cache (one tenant): pages RAM gives up kept in a file on local disk,
promoted back into host memory when a prompt asks for them, and still there after a daemon
restart or a host reboot.

``DiskTier`` is what the cache calls as its ``Tier`` (kvd/tiers/tier.py), composed of:

- ``DiskIndex`` (kvd/disk/index.py): the pages on disk by (namespace root, chain key), the
  eviction policy that holds them, and their KV events (medium ``STORAGE``);
- ``WriteBack`` (kvd/disk/write_back.py): the write path. When RAM unpublishes a page
  (``unpublished``: evicted, reclaimed, reset), the tier hands it a view of the page with
  its seal, unless the disk holds it already or is writing it (the policy counts it as used
  then, as the trace study does) or, with ``[disk] min_uses`` above 1, it has had fewer uses
  (kvd/disk/admission.py; a use is a publish or an allocation that hit it);
- ``Fetches`` (kvd/tiers/fetches.py, shared with the remote tier), with the disk as its
  ``FetchSource`` (``DiskSource``, kvd/disk/source.py), for promotions;
- ``StoreAnswers`` (kvd/disk/answers.py): the store's answers on the event loop, dropped
  once the tier closes.
- ``DiskOpening`` (kvd/disk/opening.py): the store opened in the background, the pages it
  finds learnt by the index between calls; the write-back waits for it.

Hits: ``missed`` starts a promotion only when the disk holds the prompt's first page missing
(else it answers 0 at once, and the remote tier below hears of the miss in the same call);
``Fetches`` then finds the leading run, reads it and publishes what passes its checks, the
disk's side of it in kvd/disk/source.py. RAM's own events say the rest: the eviction that
sent a page here was its ``BlockRemoved`` for ``CPU``, a promotion is a ``BlockStored`` for
``CPU`` (the disk keeps its copy). Between an eviction and the write's end the page is on
neither medium, and announced on neither (a promotion may still copy it from the write's copy).

At a graceful stop the pages host memory still holds are written too (``unwritten``, then
the write-back's ``write``, kvd/disk/stop_writes.py).

Metrics beside the counters (kvd/disk/ledger.py): bytes written and read, and the promotion
latency (from the reads' start to their pages back on the event loop, checked) as a
histogram (``Latencies``, kvd/tiers/stats.py).

The launcher (kvd/server/daemon.py) attaches one to each tenant's cache before the remote
tier (RAM → disk → store): ``Tiers.missed`` asks the remote tier only when the disk brings
nothing.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from kvd.cache.ports import TierPorts
from kvd.config import DiskConfig
from kvd.core.index import PageContent
from kvd.core.listener import ChainPlace
from kvd.core.types import PageId
from kvd.disk.answers import StoreAnswers
from kvd.disk.index import DiskIndex, disk_key
from kvd.disk.ledger import DiskStats, DiskTierCounters
from kvd.disk.opening import DiskOpening
from kvd.disk.source import DiskSource
from kvd.disk.write_back import WriteBack
from kvd.diskstore.layout import PageIdentity, SlotClass
from kvd.diskstore.results import PageWrite, Seal
from kvd.diskstore.store import Opening
from kvd.tiers.fetches import Fetches
from kvd.tiers.holds import Holds
from kvd.tiers.places import page_seal
from kvd.tiers.tier import Miss


class DiskTier:
    """One tenant's pages on disk: their index, the writes on their way, the promotions."""

    def __init__(
        self, opening: Opening, scope: str, settings: DiskConfig, ports: TierPorts, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Built before the daemon takes any call and before a warm restart's pages are
        restored (``restored``); ``opening`` is the tenant's store as ``DiskStore.opening``
        started it (its pages are learnt in the background, kvd/disk/opening.py), ``ports``
        what the tenant's cache lends it."""
        self.store = opening.store
        self.arena, self.pool, self.integrity = ports.arena, ports.pool, ports.integrity
        self.counters = DiskTierCounters()
        of_tenant = f" of tenant {scope}" if scope else ""  # for log lines
        self.answers = StoreAnswers(loop, of_tenant)
        self.index = DiskIndex(self.store, scope, settings, ports.events, ports.namespaces, self.counters, of_tenant)
        self.write_back = WriteBack(self.store, self.index, self.answers, self.counters, settings, loop)
        self.opening = DiskOpening(opening, self.index, self.answers, loop, self.write_back.opened)
        self.source = DiskSource(self.store, scope, self.index, self.write_back, self.answers, self.counters, loop)
        self._holds = Holds(ports.pool)
        self._placed: dict[PageId, ChainPlace] = {}
        self.scope = scope
        self.fetches = Fetches(
            self.source, self._holds, self.counters, ports.arena, ports.pool, ports.index, ports.room, ports.pages
        )

    # ---- Tier -------------------------------------------------------------------------

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        if place.parent_key is not None:  # else its chain root is not known: it cannot be written
            self._placed[content.page] = place

    def published(self, content: PageContent, place: ChainPlace) -> None:
        self._placed[content.page] = place
        self.index.sized(SlotClass(place.ns.page_bytes, place.ns.page_size))
        if self.index.uses is not None and not self.fetches.brought(content.page):
            self.index.uses.used((place.ns.root, content.key))

    def submit(self) -> None:
        pass  # pages are written when RAM gives them up

    def unpublished(self, page: PageId) -> None:
        """Hands the page to the write-back (its bytes and seal are still there), unless the
        disk has it (then it counts as used there) or it has had fewer than ``min_uses`` uses."""
        place = self._placed.pop(page, None)
        self.fetches.forget(page)
        if place is None or place.parent_key is None:
            return
        key = (place.ns.root, self.pool.key(page))
        self.index.sized(SlotClass(place.ns.page_bytes, place.ns.page_size))
        if self.index.admitted(key):  # on disk, or on its way there
            self.index.hit(key)
            return
        if self.index.uses is not None and not self.index.uses.enough(key):
            return
        write = self._write_of(page, place)
        if write is not None:
            self.write_back.evicted(write, place.extra_keys)

    def served(self, hits: list[PageId], page_size: int) -> None:
        self.fetches.served(hits, page_size)
        if self.index.uses is not None:
            for page in hits:
                place = self._placed.get(page)
                if place is not None:
                    self.index.uses.used((place.ns.root, self.pool.key(page)))

    def missed(self, miss: Miss) -> int:
        """Starts a promotion only when the disk holds the first page missing: a prompt the
        disk cannot help is answered 0 at once, and is not kept from the disk for the fetch
        machinery's recheck delay (``RECHECK_SECONDS``) when its pages reach the disk meanwhile,
        nor after a promotion that landed pages (the next ask finds them in host memory)."""
        if next(self.source.leading_run(miss.ns, miss.chain, miss.tokens, miss.parent_key, miss.missing), None) is None:
            return 0
        return self.fetches.missed(miss)

    def fetching(self, miss: Miss) -> int:
        return self.fetches.fetching(miss)

    def holds(self) -> Counter[PageId]:
        return self._holds.all()

    def stats(self) -> DiskStats:
        c, s = self.counters, self.store.counters()
        return DiskStats(
            state="on" if self.opening.done else "opening",
            pages=len(self.index),
            bytes=self.index.bytes,
            capacity_bytes=s.capacity_bytes,
            written_pages=c.written_pages,
            fetched_pages=c.fetched_pages,
            hit_tokens=c.hit_tokens,
            skipped_pages=c.skipped_pages,
            refused_pages=c.refused_pages,
            evicted_pages=c.evicted_pages,
            rejected_pages=c.rejected_pages,
            errors=c.errors,
            written_bytes=c.written_bytes,
            read_bytes=c.read_bytes,
            promotion_buckets=list(c.promotions.counts),
            promotion_seconds=c.promotions.seconds,
            backlog_bytes=self.write_back.backlog_bytes,
            recovered_pages=s.recovered_pages,
            pending_pages=self.opening.pending_pages,
            direct_io=s.direct_io,
        )

    # ---- a graceful stop (kvd/disk/stop_writes.py) -------------------------------------------

    def unwritten(self) -> list[PageWrite]:
        """The sealed published pages host memory holds and the disk does not (nor is writing),
        in the order host memory would evict them (cached pages next eviction first, then the
        referenced ones); each write's view is the page itself, unchanged while no call runs.
        The write-back keeps their extra keys, for the KV events once they are written."""
        placed = self._placed
        namespaces = {place.ns.id: place.ns for place in placed.values()}
        for ns in namespaces.values():
            self.index.sized(SlotClass(ns.page_bytes, ns.page_size))
        lru = [page for ns in sorted(namespaces) for page in self.pool.lru_order(ns) if page in placed]
        cached = set(lru)
        writes = []
        for page in lru + [page for page in placed if page not in cached]:
            place = placed[page]
            write = self._write_of(page, place)
            if write is not None and not self.index.admitted(disk_key(write.identity)):
                writes.append(write)
                self.write_back.keep_extra_keys(write, place.extra_keys)
        return writes

    def close(self) -> None:
        """Waits for the transfers in flight (before host memory is unmapped); their answers
        are dropped: the cache is closing."""
        self.opening.close()
        self.answers.close()
        self.store.close()

    def _write_of(self, page: PageId, place: ChainPlace) -> PageWrite | None:
        """Writing a published page to disk: a view of it with its seal; None when it is not
        sealed or its chain's parent is not known (a page a warm restart recovered)."""
        sealed = None if place.parent_key is None else page_seal(self.integrity, self.arena, page)
        if sealed is None:
            return None
        content = self.pool.content(page)
        identity = PageIdentity(
            self.scope, place.ns.root, content.key, place.parent_key, place.page_index, content.local, content.tokens
        )
        return PageWrite(identity, self.arena.page_bytes_view(page), Seal(*sealed))
