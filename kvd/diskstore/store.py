"""The disk tier's storage engine: pages kept in slots of one preallocated file, written,
read back, freed and found again after a crash, all off the caller's thread.

``DiskStore.open(directory, budget_bytes)`` creates or opens the slot file
(kvd/diskstore/slot_file.py, format in kvd/diskstore/layout.py), recovers what it holds
(kvd/diskstore/recovery.py) and answers ``Opened`` (the store and every valid page on disk,
for the tier to index) or ``OpenRefused`` (no such directory, not writable, the budget
does not fit, the file cannot be read). Opening reads every slot header and blocks while
it does (~0.8 s per 100,000 pages here): never on the event loop. ``DiskStore.opening``
opens the file and answers at once (``Opening``), the headers read on a thread of the
store's own; until that recovery is done the store holds no page and takes no write (its
slots are not known yet). Then (results in kvd/diskstore/results.py, free slots in kvd/diskstore/slots.py):

- ``write([PageWrite(identity, view, seal)])`` stores pages from the caller's buffers
  (numpy views of shared-memory pages): the store picks free slots (pages of one size
  together, consecutive where it can), and a page with no free slot is refused at once
  (``NotWritten(FULL)``: freeing is the tier's policy, not the store's).
- ``read([PageRead(slot, view)])`` reads pages into the caller's buffers (newly allocated
  host pages) and checks each against its header's checksum; a page that fails, or whose
  read fails, is a miss and is dropped from the disk (its slot freed).
- ``free(slots)`` frees slots the tier evicts (by its policy, kvd/tiers/eviction.py).

Pages are known by slot: the tier keeps its own index from chain key to slot (from
``Opened.pages`` and each ``Written.page``). Two slots may hold the same identity (written
twice); ``DiskPage.sequence`` orders writes, so the tier keeps the latest and frees the other.

Each returns a ``concurrent.futures.Future`` of one result per item, in order, completed
on a worker thread (the daemon wraps it for its event loop, which never waits on the disk);
expected faults (full, ENOSPC, EIO, a vanished file, a changed page) are results, counted
in ``counters()`` and logged, never exceptions. A caller keeps a view alive and unchanged
until its future is done.

Crash safety comes from the order of writes. A write puts a run of pages' bytes in
their slots, syncs (fdatasync), then writes their headers and syncs again; the future says
``Written`` only after that. A free zeroes the slots' headers and syncs before the slots
can be written again. So at every instant each slot's header on disk is either invalid or
describes the bytes in the slot: a crash (kill -9, power loss) mid-write leaves the slot
free, and the next open returns exactly the pages whose header reached the file. A slot
that is being read is written again only after the read (a free meanwhile waits for it).

Runs of consecutive slots move with one ``preadv``/``pwritev`` (up to ``MAX_RUN_PAGES``
pages or ``MAX_RUN_BYTES`` bytes), and the runs of one call spread over ``threads``
workers, so a large promotion keeps several requests in flight.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import mmap
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from kvd.core.records import page_checksum
from kvd.diskstore import crashpoints
from kvd.diskstore.layout import (
    BLOCK,
    HEAD_BYTES,
    SCOPE_BYTES,
    ChunkFormat,
    DiskPage,
    SlotClass,
    SlotId,
    SlotStamp,
    file_bytes,
    pack_chunk_header,
    slot_header,
)
from kvd.diskstore.recovery import recover
from kvd.diskstore.results import (
    NotWritten,
    OpenRefusal,
    OpenRefused,
    PageRead,
    PageWrite,
    ReadFailure,
    ReadMiss,
    ReadOk,
    ReadResult,
    RecoveryReport,
    StoreCounters,
    WriteRefusal,
    WriteResult,
    Written,
)
from kvd.diskstore.slot_file import SlotFile, Staging
from kvd.diskstore.slots import Chunk, SlotTable

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_THREADS = 4
MAX_RUN_PAGES = 256  # a page takes at most 3 buffers of a preadv: IOV_MAX is 1024
MAX_RUN_BYTES = 4 << 20  # a large call is split in runs the workers share: reads overlap checksums


T = TypeVar("T")


class _Calls(Generic[T]):
    """One call's results, filled by its runs on the workers; the future completes with the last."""

    def __init__(self, results: list[T | None], runs: int) -> None:
        self.future: Future[list[T]] = Future()
        self.results = results
        self._left = runs
        self._lock = threading.Lock()
        if runs == 0:
            self.future.set_result(results)  # type: ignore[arg-type]

    def done(self, filled: Iterable[tuple[int, T]]) -> None:
        for i, result in filled:
            self.results[i] = result
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.future.set_result(self.results)  # type: ignore[arg-type]

    def failed(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(frozen=True, slots=True)
class _Item:
    """One page of a call, placed in a slot."""

    index: int  # in the call
    slot: SlotId
    sequence: int  # writes only


@dataclass(frozen=True)
class Opened:
    store: DiskStore
    pages: list[DiskPage]  # every valid page on disk, in the order they were written, for the tier to index
    recovery: RecoveryReport


@dataclass(frozen=True)
class Opening:
    """A store whose file is open and whose recovery runs on its threads: ``opened``
    completes with ``Opened`` (its slots known: it writes from then on) or ``OpenRefused``
    (the file could not be read; the store is the caller's to close)."""

    store: DiskStore
    opened: Future[Opened | OpenRefused]


class DiskStore:
    """The slots of one file: which hold which page, and the transfers between them and buffers."""

    def __init__(self, file: SlotFile, chunk_bytes: int, chunks: int, threads: int) -> None:
        self._file = file
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvd-disk")
        self._lock = threading.Lock()  # everything below; never held across a transfer
        self._closed = False
        self._adopted = False  # the file's slots are known (its recovery done): writes may take them
        self._recovery: threading.Thread | None = None  # reads what the file holds (``opening``)
        self._file_id = b""
        self._slots = SlotTable(chunk_bytes, chunks)
        self._pages: dict[SlotId, DiskPage] = {}
        self._readers: Counter[SlotId] = Counter()
        self._free_after_read: set[SlotId] = set()
        self._sequence = itertools.count(1)
        self._headers = Staging()  # slot headers on their way to the file
        self._counters = StoreCounters(direct_io=file.direct, capacity_bytes=file.size)

    @classmethod
    def open(cls, directory: str, budget_bytes: int, **options: Any) -> Opened | OpenRefused:
        """``opening``'s store (the same options), once its recovery is done."""
        opening = cls.opening(directory, budget_bytes, **options)
        if isinstance(opening, OpenRefused):
            return opening
        opened = opening.opened.result()
        if isinstance(opened, OpenRefused):
            opening.store.close()
        return opened

    @classmethod
    def opening(
        cls,
        directory: str,
        budget_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        threads: int = DEFAULT_THREADS,
        direct: bool = True,
    ) -> Opening | OpenRefused:
        """Opens (or creates) the file in ``directory`` (which must exist), reserved at the
        chunks ``budget_bytes`` holds, and starts its recovery on a thread of the store's
        own (``Opening.opened``); refused at once when the file cannot be opened or
        reserved. ``direct=False`` never uses direct I/O."""
        if chunk_bytes % BLOCK or chunk_bytes < 2 * BLOCK:
            raise ValueError(f"chunk_bytes {chunk_bytes}: a multiple of {BLOCK} bytes, two blocks at least")
        chunks = (budget_bytes - BLOCK) // chunk_bytes
        if chunks < 1:
            raise ValueError(f"a disk budget of {budget_bytes} bytes holds no chunk of {chunk_bytes} bytes")
        try:
            file = SlotFile.open(directory, file_bytes(chunks, chunk_bytes), direct=direct)
        except OSError as e:
            return _refused(_OPEN_REFUSALS.get(e.errno, OpenRefusal.IO_ERROR), directory, e)
        store = cls(file, chunk_bytes, chunks, threads)
        opened: Future[Opened | OpenRefused] = Future()
        store._recovery = threading.Thread(
            target=_complete, args=(opened, store._recover, directory, chunks), name="kvd-disk-open", daemon=True
        )
        store._recovery.start()
        return Opening(store, opened)

    def _recover(self, directory: str, chunks: int) -> Opened | OpenRefused:
        """Reads what the file holds (kvd/diskstore/recovery.py: on its own thread, the reads
        on the workers), then adopts it: from then on the store writes."""
        try:
            recovered = recover(self._file, self._slots.chunk_bytes, chunks, self._executor)
        except OSError as e:
            return _refused(OpenRefusal.IO_ERROR, directory, e)
        pages = sorted(recovered.pages, key=lambda p: p.sequence)
        with self._lock:
            self._adopt(recovered.file_id, recovered.chunks, pages, recovered.torn, recovered.seconds)
        if crashpoints.FAULT is not None:
            self.inject(*crashpoints.FAULT)
        report = RecoveryReport(
            len(pages), recovered.torn, recovered.formatted, recovered.header_bytes_read, recovered.seconds
        )
        log.info(
            "disk tier in %s: %d bytes, %s I/O; %d pages recovered (%d invalid headers) in %.3f s",
            directory, self._file.size, "direct" if self._file.direct else "buffered", report.pages, report.torn,
            report.seconds,
        )  # fmt: skip
        return Opened(self, pages, report)

    def _adopt(
        self, file_id: bytes, formats: list[ChunkFormat | None], pages: list[DiskPage], torn: int, seconds: float
    ) -> None:
        self._file_id = file_id
        self._slots.adopt(formats, pages)
        self._pages = {page.slot: page for page in pages}
        self._sequence = itertools.count(max((p.sequence for p in pages), default=0) + 1)
        c = self._counters
        c.pages, c.bytes, c.recovered_pages = len(pages), sum(p.page_bytes for p in pages), len(pages)
        c.torn_headers, c.recovery_seconds = torn, seconds
        self._adopted = True

    # ---- what the tier calls (any thread; nothing here waits on the disk) -----------------

    @property
    def direct_io(self) -> bool:
        return self._file.direct

    def page(self, slot: SlotId) -> DiskPage | None:
        with self._lock:
            return self._pages.get(slot)

    def pages(self) -> list[DiskPage]:
        with self._lock:
            return list(self._pages.values())

    def holds_at_most(self, page_class: SlotClass) -> int:
        """How many pages of ``page_class`` the file holds, every chunk formatted for them."""
        return self._slots.most(page_class)

    def counters(self) -> StoreCounters:
        """A copy of the counters, consistent at one instant."""
        with self._lock:
            return dataclasses.replace(self._counters)

    def inject(self, op: str, error: int, count: int = 1, skip: int = 0) -> None:
        """Test hook (kvd/diskstore/slot_file.py): after ``skip`` file calls of ``op`` ("read", "write",
        "sync"), the next ``count`` fail with ``error``."""
        self._file.inject(op, error, count, skip)

    def write(self, pages: Sequence[PageWrite]) -> Future[list[WriteResult]]:
        """Stores ``pages`` in free slots; one result per page, in order."""
        results: list[WriteResult | None] = [None] * len(pages)
        placed: list[_Item] = []
        with self._lock:
            assert self._adopted or self._closed, "a write before the store's recovery knew which slots hold pages"
            by_class: dict[SlotClass, list[int]] = defaultdict(list)
            for i, w in enumerate(pages):
                _check_write(w)
                by_class[w.page_class].append(i)
            for page_class, indexes in by_class.items():
                slots = [] if self._closed else self._slots.take(page_class, len(indexes))
                for i, slot in zip(indexes, slots):
                    placed.append(_Item(i, slot, next(self._sequence)))
                for i in indexes[len(slots) :]:
                    results[i] = NotWritten(self._refusal(page_class))
            self._counters.backlog_pages += len(placed)
            self._counters.backlog_bytes += sum(pages[item.index].view.nbytes for item in placed)
            return self._fan_out(placed, results, lambda run: self._write_run(run, pages))

    def read(self, reads: Sequence[PageRead]) -> Future[list[ReadResult]]:
        """Reads pages into the views and checks them; one result per read, in order."""
        results: list[ReadResult | None] = [None] * len(reads)
        items: list[_Item] = []
        with self._lock:
            for i, r in enumerate(reads):
                page = None if self._closed else self._pages.get(r.slot)
                if page is None:
                    results[i] = ReadMiss(r.slot, ReadFailure.CLOSED if self._closed else ReadFailure.NOT_STORED)
                    continue
                assert _is_page_view(r.view, page.page_bytes), f"slot {r.slot}: a view of {r.view.nbytes} bytes"
                self._readers[r.slot] += 1
                items.append(_Item(i, r.slot, page.sequence))
            return self._fan_out(items, results, lambda run: self._read_run(run, reads))

    def free(self, slots: Iterable[SlotId]) -> Future[list[bool]]:
        """Frees the slots (their pages are gone once this returns); True for each slot that held a
        page. A slot is written again only after its header is zeroed on disk."""
        slots = list(slots)
        results: list[bool | None] = [False] * len(slots)
        items: list[_Item] = []
        with self._lock:
            for i, slot in enumerate(slots):
                if self._closed or self._forget(slot) is None:
                    continue
                results[i] = True
                if self._readers[slot]:
                    self._free_after_read.add(slot)
                else:
                    items.append(_Item(i, slot, 0))
            return self._fan_out(items, results, self._invalidate_run)

    def close(self) -> None:
        """Waits for the transfers in flight, then closes the file; later calls answer CLOSED
        (``free``: False). Not from a future's callback: that runs on a worker it would wait for."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._recovery is not None and self._recovery is not threading.current_thread():
            self._recovery.join()  # its reads run on the workers
        self._executor.shutdown(wait=True)
        self._file.close()

    def _refusal(self, page_class: SlotClass) -> WriteRefusal:
        if self._closed:
            return WriteRefusal.CLOSED
        self._counters.refused_full += 1
        return WriteRefusal.FULL if self._slots.fits(page_class) else WriteRefusal.TOO_LARGE

    def _forget(self, slot: SlotId) -> DiskPage | None:
        """Removes the page in ``slot`` from the store (not from the disk); None when there is none."""
        page = self._pages.pop(slot, None)
        if page is not None:
            self._counters.pages -= 1
            self._counters.bytes -= page.page_bytes
        return page

    # ---- work on the workers ---------------------------------------------------------------

    def _fan_out(
        self, items: list[_Item], results: list[T | None], work: Callable[[list[_Item]], list[tuple[int, T]]]
    ) -> Future[list[T]]:
        """Submits ``work`` for each run of ``items`` (under the lock: ``close`` waits for every
        run submitted before it); the future completes with ``results`` once all are done."""
        runs = self._runs(items)
        calls = _Calls(results, len(runs))
        for run in runs:
            self._executor.submit(_run, work, run, calls)
        return calls.future

    def _runs(self, items: list[_Item]) -> list[list[_Item]]:
        """``items`` in slot order, cut into runs of consecutive slots of at most MAX_RUN_PAGES
        pages and MAX_RUN_BYTES bytes."""
        runs: list[list[_Item]] = []
        longest = 0  # pages the last run may hold (a run never leaves its chunk: a chunk's last slot id is unused)
        for item in sorted(items, key=lambda item: item.slot):
            if runs and item.slot == runs[-1][-1].slot + 1 and len(runs[-1]) < longest:
                runs[-1].append(item)
            else:
                runs.append([item])
                longest = self._run_pages(item.slot)
        return runs

    def _run_pages(self, slot: SlotId) -> int:
        return min(MAX_RUN_PAGES, max(1, MAX_RUN_BYTES // self._slots.place(slot)[0].cls.data_bytes))

    def _write_run(self, run: list[_Item], pages: Sequence[PageWrite]) -> list[tuple[int, WriteResult]]:
        fmt, first = self._slots.place(run[0].slot)
        header_bytes = fmt.cls.header_bytes
        views = [pages[item.index].view for item in run]
        written: list[tuple[int, WriteResult]] = []
        headers_sent = False
        try:
            if self._file.vanished():
                raise OSError(errno.ESTALE, "the file was removed")
            self._format(self._slots.chunk(run[0].slot))
            headers = []
            for item in run:
                w = pages[item.index]
                if w.seal is not None and page_checksum(w.seal.covered, w.view) != w.seal.checksum:
                    headers.append(bytes(header_bytes))  # still an invalid header: the slot stays free
                    written.append((item.index, NotWritten(WriteRefusal.CHANGED)))
                    continue
                stamp = SlotStamp(self._file_id, fmt.generation, item.slot)
                header, page = slot_header(header_bytes, stamp, item.sequence, w.identity, w.view)
                headers.append(header)
                written.append((item.index, Written(page)))
            staging = self._headers.take(len(run) * header_bytes)
            staging[:] = np.frombuffer(b"".join(headers), np.uint8)
            bounced = self._file.write_pages(fmt.data_offset(first), views, fmt.cls.data_bytes)
            crashpoints.reached("disk-data-written")
            self._file.sync()
            headers_sent = True
            self._file.write_blocks(fmt.header_offset(first), staging, HEAD_BYTES + 4 * fmt.cls.page_size)
            crashpoints.reached("disk-header-written")
            self._file.sync()
            self._file.forget(fmt.data_offset(first), len(run) * fmt.cls.data_bytes)
            self._file.forget(fmt.header_offset(first), len(run) * header_bytes)
        except OSError as e:
            return self._write_failed(run, views, e, headers_sent)
        with self._lock:
            c = self._counters
            c.backlog_pages -= len(run)
            c.backlog_bytes -= sum(v.nbytes for v in views)
            c.bounced_pages += bounced
            for item, (_, result) in zip(run, written):
                if isinstance(result, Written):
                    self._pages[item.slot] = result.page
                    c.pages += 1
                    c.bytes += result.page.page_bytes
                    c.writes += 1
                    c.write_bytes += result.page.page_bytes
                else:
                    c.changed_pages += 1
                    self._slots.release([item.slot])
        return written

    def _write_failed(
        self, run: list[_Item], views: list[np.ndarray], error: OSError, headers_sent: bool
    ) -> list[tuple[int, WriteResult]]:
        reason = {
            errno.ENOSPC: WriteRefusal.NO_SPACE,
            errno.EDQUOT: WriteRefusal.NO_SPACE,
            errno.ESTALE: WriteRefusal.VANISHED,
        }.get(error.errno, WriteRefusal.IO_ERROR)  # fmt: skip
        log.error("disk tier: %d pages not written (%s): %s", len(run), reason.value, error)
        with self._lock:
            c = self._counters
            c.backlog_pages -= len(run)
            c.backlog_bytes -= sum(v.nbytes for v in views)
            if reason is WriteRefusal.IO_ERROR:
                c.write_errors += len(run)
            elif reason is WriteRefusal.NO_SPACE:
                c.refused_no_space += len(run)
            else:
                c.refused_vanished += len(run)
            if not headers_sent:  # the headers on disk are still the invalid ones they were
                self._slots.release(item.slot for item in run)
        if headers_sent:  # a header may have reached the disk: zero them before the slots are reused
            self._invalidate_run(run)
        return [(item.index, NotWritten(reason)) for item in run]

    def _format(self, chunk: Chunk) -> None:
        """Writes a newly formatted chunk's header (once), before any slot of it is written."""
        if chunk.on_disk:
            return
        with chunk.lock:
            if chunk.on_disk:
                return
            block = np.frombuffer(mmap.mmap(-1, BLOCK), np.uint8)
            pack_chunk_header(block, self._file_id, chunk.format)
            self._file.write_blocks(chunk.format.offset, block)
            self._file.sync()
            crashpoints.reached("disk-chunk-formatted")
            chunk.on_disk = True

    def _read_run(self, run: list[_Item], reads: Sequence[PageRead]) -> list[tuple[int, ReadResult]]:
        fmt, first = self._slots.place(run[0].slot)
        views = [reads[item.index].view for item in run]
        with self._lock:
            pages = [self._pages.get(item.slot) for item in run]
        try:
            bounced = self._file.read_pages(fmt.data_offset(first), views, fmt.cls.data_bytes)
            self._file.forget(fmt.data_offset(first), len(run) * fmt.cls.data_bytes)
            failure = None
        except OSError as e:
            log.error("disk tier: %d pages not read back (%s): dropped", len(run), e)
            bounced, failure = 0, ReadFailure.IO_ERROR
        read: list[tuple[int, ReadResult]] = []
        for item, page, view in zip(run, pages, views):
            if page is None or page.sequence != item.sequence:  # dropped by another read meanwhile
                read.append((item.index, ReadMiss(item.slot, ReadFailure.NOT_STORED)))
            elif failure is None and page.matches(view):
                read.append((item.index, ReadOk(page)))
            else:
                read.append((item.index, ReadMiss(item.slot, failure or ReadFailure.CORRUPT)))
        corrupt = sum(isinstance(r, ReadMiss) and r.reason is ReadFailure.CORRUPT for _, r in read)
        if corrupt:
            log.error("disk tier: %d pages read back failed their checksum: dropped", corrupt)
        invalidate: list[_Item] = []
        with self._lock:
            c = self._counters
            c.bounced_pages += bounced
            for item, (_, result) in zip(run, read):
                if isinstance(result, ReadOk):
                    c.reads += 1
                    c.read_bytes += result.page.page_bytes
                elif result.dropped:
                    c.read_errors += result.reason is ReadFailure.IO_ERROR
                    c.dropped_pages += result.reason is ReadFailure.CORRUPT
                    if self._pages.get(item.slot) is not None and self._pages[item.slot].sequence == item.sequence:
                        self._forget(item.slot)
                        self._free_after_read.add(item.slot)
                self._readers[item.slot] -= 1
                if self._readers[item.slot] == 0:
                    del self._readers[item.slot]
                    if item.slot in self._free_after_read:
                        self._free_after_read.discard(item.slot)
                        invalidate.append(item)
        if invalidate:
            for part in self._runs(invalidate):
                self._invalidate_run(part)
        return read

    def _invalidate_run(self, run: list[_Item]) -> list[tuple[int, bool]]:
        """Zeroes the headers of a run of slots, syncs, and frees the slots."""
        fmt, first = self._slots.place(run[0].slot)
        try:
            self._file.write_zeros(fmt.header_offset(first), len(run) * fmt.cls.header_bytes)
            crashpoints.reached("disk-slot-invalidated")
            self._file.sync()
            self._file.forget(fmt.header_offset(first), len(run) * fmt.cls.header_bytes)
        except OSError as e:
            log.error("disk tier: %d slots could not be freed (%s): unused until the tier reopens", len(run), e)
            with self._lock:
                self._counters.lost_slots += len(run)
        else:
            with self._lock:
                self._slots.release(item.slot for item in run)
        return [(item.index, True) for item in run]


def _complete(future: Future[T], work: Callable[..., T], *args) -> None:
    try:
        future.set_result(work(*args))
    except BaseException as e:  # a bug, not a disk fault (those are results): the caller sees it
        log.exception("disk tier: opening the store failed unexpectedly")
        future.set_exception(e)


def _run(work: Callable[[list[_Item]], list[tuple[int, T]]], run: list[_Item], calls: _Calls[T]) -> None:
    try:
        calls.done(work(run))
    except BaseException as e:  # a bug, not a disk fault (those are results): the caller sees it
        log.exception("disk tier: a transfer failed unexpectedly")
        calls.failed(e)
        raise


def _is_page_view(view: np.ndarray, page_bytes: int) -> bool:
    return view.dtype == np.uint8 and view.ndim == 1 and view.nbytes == page_bytes and view.flags.c_contiguous


def _check_write(w: PageWrite) -> None:
    i = w.identity
    assert _is_page_view(w.view, w.view.nbytes) and w.view.nbytes > 0, f"page {i.key.hex()}: not a uint8 page view"
    assert len(i.scope.encode()) <= SCOPE_BYTES, f"scope {i.scope!r} is longer than {SCOPE_BYTES} bytes"
    assert len(i.namespace_root) == len(i.key) == len(i.parent_key) == 16, f"page {i.key.hex()}: keys of 16 bytes"
    assert len(i.local) in (0, 16) and len(i.tokens) % 4 == 0 and i.tokens, f"page {i.key.hex()}: local or tokens"


_OPEN_REFUSALS = {
    errno.ENOENT: OpenRefusal.MISSING,
    errno.ENOTDIR: OpenRefusal.MISSING,
    errno.EROFS: OpenRefusal.READ_ONLY,
    errno.EACCES: OpenRefusal.READ_ONLY,
    errno.EPERM: OpenRefusal.READ_ONLY,
    errno.ENOSPC: OpenRefusal.NO_SPACE,
    errno.EDQUOT: OpenRefusal.NO_SPACE,
    errno.EFBIG: OpenRefusal.NO_SPACE,
}


def _refused(reason: OpenRefusal, directory: str, error: OSError) -> OpenRefused:
    log.warning("disk tier in %s refused (%s): %s", directory, reason.value, error)
    return OpenRefused(reason, f"{directory}: {error}")
