"""Page checksums: sealing published pages off the event loop, auditing them, and dropping
the pages whose bytes changed. ``Integrity`` is the one home of the checksums; it hears
of a page published and of a published page freed from ``PageEvents``
(kvd/cache/page_events.py), which the pool tells; recovery hands it the checksums a
restart verified (through ``Catalog.restore``).

Hashing costs ~35 ms per GiB (xxh3_64, measured on this host), so publishing a
50K-token prefix of 2 MiB pages (~6 GB) would hold the event loop for ~0.2 s if it
hashed synchronously. Instead ``publish`` writes each page's record (state PUBLISHED,
kvd/core/records.py) and hands the page to one background sealer thread; the checksum is
recorded (state SEALED) on the event loop a moment later, and only if the page still
holds the same publish (``PagePool.publication``). A page whose daemon died before its seal is sealed by recovery
(kvd/durability/recovery.py): its bytes and record were complete before ``publish`` replied.
Published pages are immutable, so hashing them beside the event loop is safe; the
manager waits for the sealer before it unmaps an extent.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvd.core.arena import Arena
from kvd.core.counters import Counters
from kvd.core.index import PageContent
from kvd.core.listener import ChainPlace
from kvd.core.pool import PagePool
from kvd.core.records import ExtentMeta, page_checksum
from kvd.core.types import PageId

log = logging.getLogger(__name__)


class SealJob(NamedTuple):  # a named tuple: one is made per page published
    page: PageId
    publication: int  # the page's (PagePool.publication), checked when the checksum comes back
    meta: ExtentMeta
    slot: int  # the page's record in meta
    covered: bytes  # the record fields the checksum covers
    view: np.ndarray  # the page's bytes in shared memory


@dataclass(frozen=True)
class VerifyResult:
    checked_pages: int
    checked_bytes: int
    corrupted_pages: int
    seconds: float


def _hash_all(jobs: list[SealJob]) -> list[int]:
    return [page_checksum(job.covered, job.view) for job in jobs]


# Pages per batch the sealer hands back: recording a batch's checksums runs on the event
# loop (~3 µs a page), so a 3,125-page publish comes back in ~0.4 ms pieces, not one 10 ms one.
SEAL_BATCH = 128


class Sealer:
    """One background thread that computes checksums: of freshly published pages (``submit``)
    and of an audit's pages (``rehash``)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-sealer")
        self._pending: list[tuple[list[SealJob], Future]] = []
        self._rehashing: set[Future] = set()  # an audit's batches in flight: they read shared memory too
        # Set by the server: schedules apply on the event loop when a batch is done.
        self.notify: Callable[[], None] | None = None

    def submit(self, jobs: list[SealJob]) -> None:
        for start in range(0, len(jobs), SEAL_BATCH):
            batch = jobs[start : start + SEAL_BATCH]
            future = self._executor.submit(_hash_all, batch)
            self._pending.append((batch, future))
            if self.notify is not None:
                future.add_done_callback(self._done)

    def _done(self, _future: Future) -> None:
        """On the sealer thread: tells the loop a batch is done, unless the server stopped
        taking callbacks (``notify`` is None) since the batch was submitted."""
        notify = self.notify
        if notify is not None:
            notify()

    def rehash(self, jobs: list[SealJob]) -> Future:
        """The checksums of pages sealed before, computed again (a list, in order)."""
        future = self._executor.submit(_hash_all, jobs)
        self._rehashing.add(future)
        future.add_done_callback(self._rehashing.discard)
        return future

    def in_flight(self) -> list[Future]:
        """The seal batches not taken yet."""
        return [future for _, future in self._pending]

    def finished(self, wait: bool = False):
        """(job, checksum) of one finished batch (each batch notifies once, so every one is
        taken); with ``wait``, of every batch, once every read of shared memory in flight
        (an audit's too) is done."""
        if wait:
            concurrent.futures.wait(list(self._rehashing))
        still, taken = [], False
        for jobs, future in self._pending:
            if not wait and (taken or not future.done()):
                still.append((jobs, future))
                continue
            taken = True
            try:
                checksums = future.result()
            except Exception:  # noqa: BLE001 - logged; the pages stay unsealed, never wrong
                log.exception("sealing %d published pages failed; they will not survive a restart", len(jobs))
                continue
            yield from zip(jobs, checksums)
        self._pending = still

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class Integrity:
    """The checksums of sealed published or cached pages, and what to do when one fails."""

    def __init__(self, arena: Arena, pool: PagePool, counters: Counters) -> None:
        self.arena = arena
        self.pool = pool
        self.counters = counters
        self.sealer = Sealer()  # the checksums themselves are the pool's (PagePool.seal)
        self._to_seal: list[SealJob] = []

    def close(self) -> None:
        self.apply(wait=True)
        self.sealer.close()

    def describe(self, contents: Sequence[PageContent], places: Sequence[ChainPlace]) -> None:
        """Writes freshly published pages' records; their checksums follow on ``submit``."""
        jobs = self._to_seal
        first = end = 0  # the pages of the extent found last: a batch's mostly share one
        for content, place in zip(contents, places):
            page = content.page
            if not first <= page < end:
                extent = self.arena.extent_of(page)
                first, meta, pages = extent.first_page, extent.meta, extent.pages
                end = first + extent.num_pages
            slot = page - first
            covered = meta.describe(slot, content.key, content.parent, place.page_index, content.local, content.tokens)
            jobs.append(SealJob(page, self.pool.publication(page), meta, slot, covered, pages[slot]))

    def seal_job(self, page: PageId) -> SealJob:
        """What hashing a described page again reads: its record's fields and its bytes."""
        extent = self.arena.extent_of(page)
        slot = page - extent.first_page
        meta = extent.meta
        return SealJob(page, self.pool.publication(page), meta, slot, meta.covered(slot), extent.page_bytes_view(page))

    def submit(self) -> None:
        """Hands the pages described since the last call to the sealer thread."""
        self.apply()
        self.sealer.submit(self._to_seal)
        self._to_seal = []

    def apply(self, wait: bool = False) -> int:
        """Records the checksums the sealer computed; returns how many pages were sealed."""
        sealed = 0
        for job, checksum in self.sealer.finished(wait):
            if self.pool.publication(job.page) == job.publication:
                job.meta.seal(job.slot, checksum)
                self.pool.seal(job.page, checksum)
                sealed += 1
        return sealed

    def restore(self, checksums: dict[PageId, int]) -> None:
        """The checksums of the pages a warm restart verified."""
        for page, checksum in checksums.items():
            self.pool.seal(page, checksum)

    def checksum(self, page: PageId) -> int | None:
        """The page's sealed checksum; None before it is sealed, or once its seal is gone."""
        return self.pool.checksum(page)

    def verification(self) -> Verification:
        """An audit of every sealed published or cached page, done in steps (``Verification``)."""
        return Verification(self)

    def drop_corrupted(self, page: PageId) -> None:
        """A published page whose bytes changed is never served again: out of the index now,
        freed at once when cached, else when its holders release it; the pages of its chain
        after it leave the index with it (no match reaches them without it), kept as it is
        by their holders."""
        content = self.pool.content(page)
        ns_id = self.pool.namespace_of(page)
        self.counters.of(ns_id).corrupted_pages += 1
        if content is None:
            return  # freed already: cached behind another corrupted page of its chain
        log.warning(
            "page %d of namespace %d (key %s) failed its checksum; dropped from the index",
            page,
            ns_id,
            content.key.hex()[:16],
        )
        self.forget(page)
        self.pool.unindex(page)

    def forget(self, page: PageId) -> None:
        """The page leaves the published states: its record must not be recovered."""
        extent = self.arena.extent_of(page)
        extent.meta.clear(page - extent.first_page)
        self.pool.seal(page, None)


# Bytes an audit hashes per step off the loop (~2 ms at xxh3's speed here): the loop
# records a step's outcome between two, so other calls run meanwhile.
VERIFY_BATCH_BYTES = 64 << 20


class Verification:
    """One audit (``kvd verify``): every sealed page hashed again, the ones whose bytes
    changed dropped (``Integrity.drop_corrupted``).

    Hashing a large cache takes long (~35 ms per GiB), so it runs on the sealer's thread,
    ``VERIFY_BATCH_BYTES`` at a time, and ``steps`` yields each batch's Future for the
    caller to await (the servicer's ``_drive``); the loop serves other calls meanwhile,
    and only records a batch's outcome. Seals in flight are awaited first, so each page is
    audited against its own checksum. A page freed, or freed and published anew, while its
    batch was hashed is not judged (its checksum changed or went): it is neither counted
    nor dropped. A batch's pages are all judged before any is dropped (dropping a page
    frees the cached pages of its chain after it). An extent is unmapped only once the batches reading it are done
    (``Integrity.apply(wait=True)``, which ``Room`` calls before it reclaims one).
    """

    def __init__(self, integrity: Integrity) -> None:
        self._integrity = integrity
        self.result: VerifyResult | None = None  # once ``steps`` is exhausted

    def steps(self) -> Iterator[Future | None]:
        integrity = self._integrity
        start = time.perf_counter()
        in_flight = integrity.sealer.in_flight()
        for future in in_flight:
            yield future
        for _ in in_flight:  # each takes one finished batch (none that came later: never waits)
            integrity.apply()
        sealed = integrity.pool.sealed()
        checked = checked_bytes = corrupted = 0
        at = 0
        while at < len(sealed):
            batch, size = [], 0
            while at < len(sealed) and size < VERIFY_BATCH_BYTES:
                page, checksum = sealed[at]
                at += 1
                if integrity.checksum(page) != checksum:
                    continue  # freed, or published anew, since the snapshot
                batch.append((integrity.seal_job(page), checksum))
                size += batch[-1][0].view.nbytes
            if not batch:
                continue
            future = integrity.sealer.rehash([job for job, _ in batch])
            yield future
            judged = [
                (job, computed != checksum)
                for (job, checksum), computed in zip(batch, future.result())
                if integrity.checksum(job.page) == checksum and integrity.pool.publication(job.page) == job.publication
            ]  # the others were freed, or published anew, while they were hashed
            checked += len(judged)
            checked_bytes += sum(job.view.nbytes for job, _ in judged)
            for job, changed in judged:  # a drop may free pages judged after it: all are judged first
                if changed:
                    integrity.drop_corrupted(job.page)
                    corrupted += 1
        seconds = time.perf_counter() - start
        log.info(
            "verified %d published pages (%d bytes) in %.1f ms: %d corrupted",
            checked,
            checked_bytes,
            seconds * 1e3,
            corrupted,
        )
        self.result = VerifyResult(checked, checked_bytes, corrupted, seconds)
