"""The disk tier's write path: the pages RAM gives up on their way to the disk.

Writes are **write-back on eviction**: when RAM unpublishes a page (evicted, reclaimed,
reset), the tier (kvd/disk/tier.py) hands ``WriteBack.evicted`` a view of it with its seal;
its bytes are copied at once, while they and their seal are still there (the page is reused
next), and written from the copy on the store's threads (kvd/diskstore/store.py); the store
checks the copy against the seal, so a page whose bytes changed in host memory never
reaches the disk. An eviction never waits for the disk: with ``backlog_bytes`` of copies
already waiting, the page is not written (``skipped_pages``). The trace study
(bench/trace_sim.py, bench/RESULTS.md) chose it: on Mooncake's traces, write-back serves the
same hits as write-through at a fraction of the bytes written (a page RAM still holds is hit
there, so writing it at publish is spent unless it is evicted), and costs the publish path
nothing.

One batch is written at a time (the pages queued meanwhile form the next): each batch is
admitted to the tier's policy (``DiskIndex``, kvd/disk/index.py) and the pages it gives up
for it are freed first, so a page given up is on disk already or in the batch being
admitted (then not written), and no write takes the slots freed for another's retry. A
write the disk still refuses as full frees as many more of the policy's victims among the
pages whose slots the refused pages can use (kvd/disk/reclaim.py) and is tried once more
(still full: ``refused_pages``). A page written is indexed (and announced) by the index.
At a graceful stop the pages host memory still holds are written through the same path
(``write``, kvd/disk/stop_writes.py), straight from host memory.

``WriteBack`` owns what is on its way: the queue, the copies (``copy_of``: a promotion
copies a page still on its way from its write's copy, ``from_copy``, so an eviction is never
a miss while its write waits), the extra keys of the pages queued (for their KV events) and
the backlog bytes.

While the tier opens (kvd/disk/opening.py) the queue waits: nothing is admitted or
written until the store knows which of its slots hold pages and the index has learnt them
(``opened``); the backlog bounds what waits, as it bounds a slow disk.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np

from kvd.config import DiskConfig
from kvd.core.index import ExtraKey
from kvd.core.records import page_checksum
from kvd.disk.answers import StoreAnswers
from kvd.disk.index import DiskIndex, DiskKey, disk_key
from kvd.disk.ledger import DiskTierCounters
from kvd.diskstore.layout import BLOCK, DiskPage
from kvd.diskstore.results import NotWritten, PageWrite, WriteRefusal, Written
from kvd.diskstore.store import DiskStore
from kvd.tiers.fetches import Arrival, PageHeader


class WriteBack:
    """One tenant's pages on their way to the disk: the queue, their copies, the backlog."""

    def __init__(
        self,
        store: DiskStore,
        index: DiskIndex,
        answers: StoreAnswers,
        counters: DiskTierCounters,
        settings: DiskConfig,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.store, self.index, self.answers = store, index, answers
        self.counters = counters
        self.backlog_limit = settings.backlog_bytes  # bytes of copies waiting, at most
        self.loop = loop
        self._queued: list[PageWrite] = []
        self._backlog = 0  # bytes of copies queued or being written
        self._writing = False  # a batch is on its way to the disk
        self._copies: dict[DiskKey, PageWrite] = {}  # queued or being written: hits read the copy meanwhile
        self._extra_keys: dict[DiskKey, tuple[ExtraKey, ...]] = {}  # of queued pages that have some: their events
        self._open = False  # the store knows its slots and the index its pages (kvd/disk/opening.py)

    @property
    def backlog_bytes(self) -> int:
        """Bytes of pages queued for the disk or being written."""
        return self._backlog

    def evicted(self, write: PageWrite, extra_keys: tuple[ExtraKey, ...]) -> None:
        """Copies a page RAM gives up (``write.view`` is the page, about to be reused) and
        queues the copy; skipped when the backlog is full."""
        if self._backlog + write.view.nbytes > self.backlog_limit:
            self.counters.skipped_pages += 1
            return
        copy = _aligned_copy(write.view)
        self._backlog += copy.nbytes
        if not self._queued:
            self.loop.call_soon(self._write_queued)  # once the eviction's call is done: one batch
        self._queued.append(write := PageWrite(write.identity, copy, write.seal))
        self._copies[disk_key(write.identity)] = write
        self.keep_extra_keys(write, extra_keys)

    def write(self, writes: list[PageWrite]) -> None:
        """Writes pages as write-backs are, after them (admitted to the policy: a full disk
        evicts); their views stay unchanged until ``backlog_bytes`` is 0."""
        self._backlog += sum(w.view.nbytes for w in writes)
        self._queued += writes
        self._write_queued()

    def opened(self) -> None:
        """The store's slots and the index's pages are known: the pages queued meanwhile are
        written, but those the disk held already (they count as used there)."""
        self._open = True
        queued, self._queued = self._queued, []
        for write in queued:
            key = disk_key(write.identity)
            if self.index.get(key) is None:
                self._queued.append(write)
                continue
            self.index.hit(key)
            self._backlog -= write.view.nbytes
            self._extra_keys.pop(key, None)
            self.drop_copy(write)
        self._write_queued()

    def keep_extra_keys(self, write: PageWrite, extra_keys: tuple[ExtraKey, ...]) -> None:
        """The extra keys of a page on its way to the disk, for the KV event once it is written."""
        if extra_keys:
            self._extra_keys[disk_key(write.identity)] = extra_keys

    def copy_of(self, key: DiskKey) -> PageWrite | None:
        """The copy of a page queued or being written; None when none is."""
        return self._copies.get(key)

    def drop_copy(self, write: PageWrite) -> None:
        """The write's copy is not read again (its write is done, or it failed a check)."""
        key = disk_key(write.identity)
        if self._copies.get(key) is write:
            del self._copies[key]

    def _write_queued(self) -> None:
        """Admits the queued pages to the policy and writes those it still holds once the
        pages it gave up for them are freed: one batch at a time, so every page the policy
        gives up is on disk (its slot freed before the write) or in this very batch (not
        written). Pages queued meanwhile wait for the next batch, and all wait for the
        tier's open (``opened``)."""
        if self._writing or not self._queued or not self._open:
            return
        self._writing = True
        queued, self._queued = self._queued, []
        keys = [disk_key(write.identity) for write in queued]
        admitted = self.index.admitted
        once = dict.fromkeys(keys)  # a page may be queued twice
        freed = [page for key in once if not admitted(key) for page in self.index.admit(key)]
        batch, batch_keys = [], []
        for write, key in zip(queued, keys):
            if admitted(key):
                batch.append(write)
                batch_keys.append(key)  # the policy's own tuple: the index keeps the same
            else:  # given up for a page after it in the batch
                self.counters.evicted_pages += 1
                self._backlog -= write.view.nbytes
                self._extra_keys.pop(key, None)
                self.drop_copy(write)
        self._free_then_write(freed, batch, batch_keys, retry=False)

    def _free_then_write(self, freed: list[DiskPage], batch: list[PageWrite], keys: list[DiskKey], retry: bool) -> None:
        """Frees ``freed``, then writes ``batch`` (``keys``: each page's key). A store call that
        raised (a bug, logged) leaves the batch unwritten, as an I/O error would: the next
        batch still goes."""

        def failed(_: BaseException) -> None:
            self._written(batch, keys, [NotWritten(WriteRefusal.IO_ERROR)] * len(batch), retry)

        def write(_=None) -> None:
            self.answers.when_done(
                self.store.write(batch), lambda results: self._written(batch, keys, results, retry), failed
            )

        if freed:
            self.answers.when_done(self.store.free([p.slot for p in freed]), write, failed)
        else:
            write()

    def _written(self, writes: list[PageWrite], keys: list[DiskKey], results, retry: bool) -> None:
        """Indexes the pages written; the disk full, frees as many more of the policy's
        victims among the pages whose slots the refused ones can use (kvd/disk/reclaim.py)
        and writes the refused pages once more; then the next batch."""
        full: list[PageWrite] = []
        full_keys: list[DiskKey] = []
        c, extra_keys = self.counters, self._extra_keys
        for write, key, result in zip(writes, keys, results):
            if type(result) is Written:
                c.written_pages += 1
                c.written_bytes += result.page.page_bytes
                self.index.index(result.page, extra_keys.pop(key, ()) if extra_keys else (), key)
            elif result.reason is WriteRefusal.FULL and not retry:
                full.append(write)
                full_keys.append(key)
                continue
            else:
                extra_keys.pop(key, None)
                self.index.not_written(key)
                if result.reason is WriteRefusal.CHANGED:
                    c.skipped_pages += 1
                elif result.reason is WriteRefusal.IO_ERROR:
                    c.errors += 1
                elif result.reason is not WriteRefusal.CLOSED:
                    c.refused_pages += 1
            self._backlog -= write.view.nbytes
            if self._copies:
                self.drop_copy(write)
        if full:
            for key in full_keys:
                self.index.not_written(key)
            freed = self.index.make_room(Counter(write.page_class for write in full))
            freed += [page for key in full_keys for page in self.index.admit(key)]  # none: room was made
            self._free_then_write(freed, full, full_keys, retry=True)
            return
        self._writing = False
        self._write_queued()


def from_copy(write: PageWrite, view: np.ndarray) -> PageHeader | Arrival:
    """A write's copy into a host page (a promotion of a page still on its way to disk): its
    header, or MISMATCHED when the copy does not match the seal it was taken under."""
    view[:] = write.view
    assert write.seal is not None, "the tier's writes carry their seal"
    if page_checksum(write.seal.covered, view) != write.seal.checksum:
        return Arrival.MISMATCHED
    i = write.identity
    return PageHeader(i.page_index, i.key, i.parent_key, i.local, i.tokens)


def _aligned_copy(view: np.ndarray) -> np.ndarray:
    """A copy of a page at a block-aligned address: written with direct I/O as it is, never
    through the store's bounce buffer (kvd/diskstore/slot_file.py)."""
    room = np.empty(view.nbytes + BLOCK, dtype=np.uint8)
    start = -room.ctypes.data % BLOCK
    copy = room[start : start + view.nbytes]
    copy[:] = view
    return copy
