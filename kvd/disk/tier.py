"""The disk tier of one cache (one tenant): pages RAM gives up kept in a file on local disk,
promoted back into host memory when a prompt asks for them, and still there after a daemon
restart or a host reboot.

``DiskTier`` is what the cache calls as its ``Tier`` (kvd/cache/tier.py), composed of:

- ``DiskIndex`` (kvd/disk/index.py): the pages on disk by (namespace root, chain key), the
  eviction policy that holds them, and their KV events (medium ``STORAGE``);
- ``WriteBack`` (kvd/disk/write_back.py): the write path. When RAM unpublishes a page
  (``unpublished``: evicted, reclaimed, reset), the tier hands it a view of the page with
  its seal, unless the disk holds it already or is writing it (the policy counts it as used
  then, as the trace study does) or, with ``[disk] min_uses`` above 1, it has had fewer uses
  (kvd/disk/admission.py; a use is a publish or an allocation that hit it);
- ``Fetches`` (kvd/cache/fetches.py, shared with the remote tier), whose ``FetchSource`` the
  tier is, for promotions;
- ``StoreAnswers`` (kvd/disk/answers.py): the store's answers on the event loop, dropped
  once the tier closes.

Hits: asked only when the disk holds the prompt's first page missing (else ``missed``
answers 0 at once, and the remote tier below hears of the miss in the same call): ``find``
walks the missing pages' chain keys through the index (and through the write-back's copies,
the pages still on their way to disk, whose copy ``get`` copies into the host page once it
matches its seal: an eviction is never a miss while its write waits) and counts each page
found as used in the policy; ``get`` reads the leading run into newly granted host pages
(``DiskStore.read``, which checks each page's checksum; a page that fails it is dropped from
the disk) and answers each page's header, which ``Fetches`` compares with what the request
expects before publishing the pages in chain order as CACHED. A page read back for another
tenant or namespace root never matches. A page rejected there is freed from the disk
(``reject``). RAM's own events say the rest: the eviction that sent a page here was its
``BlockRemoved`` for ``CPU``, a promotion is a ``BlockStored`` for ``CPU`` (the disk keeps
its copy). Between an eviction and the write's end the page is on neither medium, and
announced on neither (a promotion may still copy it from the write's copy).

At a graceful stop the pages host memory still holds are written too (``unwritten``, then
the write-back's ``write``, kvd/disk/stop_writes.py).

Metrics beside the counters (kvd/disk/ledger.py): bytes written and read, and the promotion
latency (from the reads' start to their pages back on the event loop, checked) as a
histogram (``Latencies``, kvd/cache/stats.py).

The launcher (kvd/server/daemon.py) attaches one to each tenant's cache before the remote
tier (RAM → disk → store): ``Tiers.missed`` asks the remote tier only when the disk brings
nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from kvd.cache.fetches import Arrival, Done, Fetches, Found, PageHeader
from kvd.cache.holds import Holds
from kvd.cache.places import page_seal
from kvd.cache.stats import DiskStats
from kvd.config import DiskConfig
from kvd.core.index import ChainSpec, ExtraKey, PageContent, page_key
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import Namespace
from kvd.core.types import PageId, PageKey
from kvd.disk.answers import StoreAnswers
from kvd.disk.index import DiskIndex, disk_key
from kvd.disk.layout import DiskPage, PageIdentity, SlotClass
from kvd.disk.ledger import DiskTierCounters
from kvd.disk.results import PageRead, PageWrite, ReadFailure, ReadOk, Seal
from kvd.disk.store import Opened
from kvd.disk.write_back import WriteBack, from_copy
from kvd.wire.codec import TOKEN_BYTES

if TYPE_CHECKING:
    from kvd.cache.manager import KVCacheManager


class DiskTier:
    """One tenant's pages on disk: their index, the writes on their way, the promotions."""

    name = "the disk"
    recheck_after_landing = False  # the index answers at once: a prompt asked again is promoted again

    def __init__(
        self, opened: Opened, scope: str, settings: DiskConfig, manager: KVCacheManager, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Built before the daemon takes any call and before a warm restart's pages are
        restored (``restored``);
        ``opened`` is the tenant's store as ``DiskStore.open`` found it."""
        m = manager
        self.store = opened.store
        self.scope = scope
        self.loop = loop
        self.arena, self.pool, self.integrity = m.arena, m.pool, m.integrity
        self.counters = DiskTierCounters()
        of_tenant = f" of tenant {scope}" if scope else ""  # for log lines
        self.answers = StoreAnswers(loop, of_tenant)
        self.index = DiskIndex(opened, scope, settings, m.events, m.namespaces, self.counters, of_tenant)
        self.write_back = WriteBack(self.store, self.index, self.answers, self.counters, settings, loop)
        self._holds = Holds(m.pool)
        self._placed: dict[PageId, ChainPlace] = {}
        self.fetches = Fetches(self, self._holds, self.counters, m.arena, m.pool, m.index, m.room, m.page_events)

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
        key = (place.ns.root, self.pool.content(page).key)
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
                    self.index.uses.used((place.ns.root, self.pool.content(page).key))

    def missed(
        self,
        ns: Namespace,
        chain: ChainSpec,
        extra_keys: tuple[ExtraKey, ...],
        tokens: bytes,
        hits: list[PageId],
        hit_keys: list[PageKey],
    ) -> int:
        """Starts a promotion only when the disk holds the first page missing: a prompt the
        disk cannot help is answered 0 at once, and is not kept from the disk for the fetch
        machinery's recheck delay (``RECHECK_SECONDS``) when its pages reach the disk meanwhile,
        nor after a promotion that landed pages (the next ask finds them in host memory)."""
        full = len(tokens) // (ns.page_size * TOKEN_BYTES)
        parent_key = hit_keys[-1] if hit_keys else chain.root
        if next(self._run(ns, chain, tokens, parent_key, range(len(hits), full)), None) is None:
            return 0
        return self.fetches.missed(ns, chain, extra_keys, tokens, hits, hit_keys)

    def holds(self) -> Counter[PageId]:
        return self._holds.all()

    def stats(self) -> DiskStats:
        c, s = self.counters, self.store.counters()
        return DiskStats(
            state="on",
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
            direct_io=s.direct_io,
        )

    # ---- a graceful stop (kvd/disk/stop_writes.py) -------------------------------------------

    def unwritten(self) -> list[PageWrite]:
        """The sealed published pages host memory holds and the disk does not (nor is writing),
        in the order host memory would evict them (cached pages next eviction first, then the
        referenced ones); each write's view is the page itself, unchanged while no call runs.
        The write-back keeps their extra keys, for the KV events once they are written."""
        namespaces = {place.ns.id for place in self._placed.values()}
        lru = [page for ns in sorted(namespaces) for page in self.pool.lru_order(ns)]
        order = {page: n for n, page in enumerate(lru)}
        writes = []
        for page in sorted(self._placed, key=lambda page: order.get(page, len(order))):
            place = self._placed[page]
            write = self._write_of(page, place)
            if write is not None and disk_key(write.identity) not in self.index.sized(write.page_class):
                writes.append(write)
                self.write_back.keep_extra_keys(write, place.extra_keys)
        return writes

    def close(self) -> None:
        """Waits for the transfers in flight (before host memory is unmapped); their answers
        are dropped: the cache is closing."""
        self.answers.close()
        self.store.close()

    # ---- FetchSource (kvd/cache/fetches.py) ---------------------------------------------

    @property
    def up(self) -> bool:
        return True

    def find(self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range, done: Done) -> None:
        found: Found = list(self._run(ns, chain, tokens, parent_key, pages))
        for _, header in found:
            self.index.hit((ns.root, header.key))
        self.loop.call_soon(done, found, None)  # as the store's answer would: after the caller's call

    def _run(
        self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range
    ) -> Iterator[tuple[DiskPage | PageWrite, PageHeader]]:
        """The leading run of ``pages`` on disk or on their way there, each with the header
        the request expects."""
        step = ns.page_size * TOKEN_BYTES
        for i in pages:
            page_tokens = tokens[i * step : (i + 1) * step]
            key = page_key(parent_key, i, page_tokens, chain.local_bytes(i))
            on_disk = self.index.get((ns.root, key)) or self.write_back.copy_of((ns.root, key))
            if on_disk is None:
                return
            yield on_disk, PageHeader(i, key, parent_key, chain.local_digest(i), page_tokens)
            parent_key = key

    def get(self, ns: Namespace, found: Found, views: list[np.ndarray], done: Done) -> None:
        """Reads the pages on disk; a page still on its way there is copied from its write's
        copy at once (on the loop, as the eviction copied it) once that matches its seal."""
        on_disk: list[tuple[int, PageRead]] = []
        copied: dict[int, PageHeader | Arrival] = {}
        for n, ((entry, _), view) in enumerate(zip(found, views)):
            if isinstance(entry, DiskPage):
                on_disk.append((n, PageRead(entry.slot, view)))
            else:
                copied[n] = from_copy(entry, view)
        started = time.monotonic()

        def arrived(results) -> None:
            reads = [found[n] for n, _ in on_disk]
            headers = self._arrivals(ns, reads, results, started) if reads else []
            read = dict(zip((n for n, _ in on_disk), headers))
            done([read[n] if n in read else copied[n] for n in range(len(found))], None)

        self.answers.when_done(self.store.read([r for _, r in on_disk]), arrived, lambda error: done(None, error))

    def reject(self, entry: DiskPage | PageWrite) -> None:
        """The page read back is not the one the request expects: freed from the disk (a
        write's copy: not read again)."""
        if isinstance(entry, PageWrite):
            self.write_back.drop_copy(entry)
        elif self.index.forget(entry):
            self.store.free([entry.slot])

    def _arrivals(self, ns: Namespace, found: Found, results, started: float) -> list[PageHeader | Arrival]:
        """Each page's header as the disk has it, once its checksum held; a page the store
        dropped is forgotten."""
        self.counters.promotions.observe(time.monotonic() - started)
        got: list[PageHeader | Arrival] = []
        for (on_disk, _), result in zip(found, results):
            if isinstance(result, ReadOk):
                self.counters.read_bytes += result.page.page_bytes
                i = result.page.identity
                ours = i.scope == self.scope and i.namespace_root == ns.root
                got.append(
                    PageHeader(i.page_index, i.key, i.parent_key, i.local, i.tokens) if ours else Arrival.MISMATCHED
                )
                continue
            if result.dropped:
                self.index.forget(on_disk)
            if result.reason is ReadFailure.CORRUPT:
                got.append(Arrival.MISMATCHED)
            else:
                got.append(Arrival.FAILED)
        return got

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
