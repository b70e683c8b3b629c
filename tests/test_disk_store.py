"""The disk tier's storage engine (kvd/disk/) on real files: pages written from host-page
views and read back verified, found again when the file is opened anew, slots freed and
reused, chunks formatted for each page size, and the page cache left empty."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import tempfile
import threading

import numpy as np
import posix_ipc
import pytest
from disk_pages import CHUNK, content, host_pages, identity, number_of, open_store, read_back, write

from kvd.core.records import page_checksum
from kvd.diskstore.layout import BLOCK, FILE_NAME, SlotClass
from kvd.diskstore.results import (
    NotWritten,
    PageRead,
    PageWrite,
    ReadFailure,
    ReadMiss,
    ReadOk,
    Seal,
    WriteRefusal,
    Written,
)
from kvd.diskstore.slot_file import direct_io_alignment
from kvd.diskstore.store import DiskStore

PAGE_SIZE = 16


@pytest.fixture(params=["direct", "buffered", "tmpfs"])
def where(request, tmp_path):
    """(directory, buffered): the test's file system (ext4 here) with direct I/O where it
    allows it, the same forced to buffered I/O, and a tmpfs (/dev/shm: never direct)."""
    if request.param != "tmpfs":
        yield str(tmp_path), request.param == "buffered"
        return
    directory = tempfile.mkdtemp(prefix="kvd-disk-test-", dir="/dev/shm")
    yield directory, False
    shutil.rmtree(directory)


@pytest.mark.parametrize("page_bytes", [8192, 10_000])
def test_pages_read_back_verified_and_survive_a_reopen(where, page_bytes):
    directory, buffered = where
    opened = open_store(directory, buffered)
    assert opened.pages == [] and opened.recovery.formatted
    store = opened.store
    expect_direct = not buffered and direct_io_alignment(os.path.join(directory, FILE_NAME)) is not None
    assert store.direct_io == expect_direct and store.counters().direct_io == expect_direct

    written = write(store, range(20), page_bytes, PAGE_SIZE)
    assert [p.slot for p in written] == list(range(20)), "one size, consecutive slots from the lowest"
    assert [p.sequence for p in written] == sorted(p.sequence for p in written)
    assert all(p.identity == identity(n, PAGE_SIZE) for n, p in enumerate(written))
    assert read_back(store, written) == {n: True for n in range(20)}
    c = store.counters()
    assert (c.pages, c.bytes, c.writes, c.write_bytes) == (20, 20 * page_bytes, 20, 20 * page_bytes)
    assert (c.reads, c.read_bytes, c.backlog_pages, c.backlog_bytes) == (20, 20 * page_bytes, 0, 0)
    # host pages end to end: with direct I/O an unaligned page goes through a bounce buffer, counted
    unaligned = sum(i * page_bytes % BLOCK != 0 for i in range(20))
    assert c.bounced_pages == (2 * unaligned if expect_direct else 0)
    store.close()

    again = open_store(directory, buffered)
    assert sorted(again.pages, key=lambda p: p.slot) == written
    assert (again.recovery.pages, again.recovery.torn, again.recovery.formatted) == (20, 0, False)
    assert read_back(again.store, again.pages) == {n: True for n in range(20)}
    assert again.store.counters().pages == 20
    again.store.close()


def test_pages_move_straight_between_the_file_and_a_posix_shared_memory_extent(tmp_path):
    """Host pages as the arena makes them (a POSIX shared-memory segment, mapped): written to
    disk and read back into another extent's pages, with direct I/O where the file system allows."""
    page_bytes, count = 64 << 10, 16
    name = f"/kvd-disk-test-{os.getpid()}"
    segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=2 * count * page_bytes)
    try:
        memory = mmap.mmap(segment.fd, segment.size)
        segment.close_fd()
        extent = np.frombuffer(memory, np.uint8).reshape(2 * count, page_bytes)  # [pages, page_bytes]
        store = open_store(str(tmp_path)).store
        for n in range(count):
            extent[n] = content(n, page_bytes)
        results = store.write([PageWrite(identity(n, PAGE_SIZE), extent[n]) for n in range(count)]).result()
        slots = [r.page.slot for r in results]
        back = store.read([PageRead(slot, extent[count + i]) for i, slot in enumerate(slots)]).result()
        assert all(isinstance(r, ReadOk) for r in back)
        assert (extent[count:] == extent[:count]).all()
        assert store.counters().bounced_pages == 0, "4 KiB-aligned pages move in place"
        store.close()
        del extent
        memory.close()
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_a_full_store_refuses_and_freed_slots_are_reused_lowest_first(tmp_path):
    page_bytes = 64 << 10
    slots = SlotClass(page_bytes, PAGE_SIZE).slots_in(CHUNK)
    budget = 2 * CHUNK + BLOCK  # two chunks
    store = open_store(str(tmp_path), budget=budget).store
    written = write(store, range(2 * slots), page_bytes, PAGE_SIZE)
    pages = host_pages(3, page_bytes)
    results = store.write([PageWrite(identity(100 + i, PAGE_SIZE), pages[i]) for i in range(3)]).result()
    assert results == [NotWritten(WriteRefusal.FULL)] * 3
    assert store.counters().refused_full == 3

    assert store.free([written[5].slot, written[slots + 1].slot, written[5].slot]).result() == [True, True, False]
    assert store.page(written[5].slot) is None and store.counters().pages == 2 * slots - 2
    again = write(store, [200, 201], page_bytes, PAGE_SIZE)
    assert [p.slot for p in again] == [written[5].slot, written[slots + 1].slot]
    assert read_back(store, again + written[:2]) == {200: True, 201: True, 0: True, 1: True}
    store.close()


def test_chunks_serve_each_page_size_and_are_formatted_again_once_free(tmp_path):
    """Two chunks: pages of size A take both; size B is refused until a chunk's pages are all freed."""
    a, b = 64 << 10, 100_000
    slots_a = SlotClass(a, PAGE_SIZE).slots_in(CHUNK)
    store = open_store(str(tmp_path), budget=2 * CHUNK + BLOCK).store
    written = write(store, range(2 * slots_a), a, PAGE_SIZE)
    view = host_pages(1, b)[0]
    assert store.write([PageWrite(identity(500, PAGE_SIZE), view)]).result() == [NotWritten(WriteRefusal.FULL)]
    store.free(p.slot for p in written[:slots_a] if p.slot != written[3].slot).result()
    assert store.write([PageWrite(identity(500, PAGE_SIZE), view)]).result() == [NotWritten(WriteRefusal.FULL)]
    store.free([written[3].slot]).result()  # chunk 0 is now empty: formatted for size B
    [page_b] = write(store, [500], b, PAGE_SIZE)
    assert page_b.page_class == SlotClass(b, PAGE_SIZE) and page_b.slot == 0
    assert read_back(store, [page_b, written[-1]]) == {500: True, number_of(written[-1]): True}
    store.close()

    reopened = open_store(str(tmp_path), budget=2 * CHUNK + BLOCK)
    assert {number_of(p) for p in reopened.pages} == {500} | {number_of(p) for p in written[slots_a:]}
    reopened.store.close()


def test_a_page_larger_than_a_chunk_is_refused(tmp_path):
    store = open_store(str(tmp_path)).store
    view = host_pages(1, CHUNK)[0]
    assert store.write([PageWrite(identity(1, PAGE_SIZE), view)]).result() == [NotWritten(WriteRefusal.TOO_LARGE)]
    store.close()


def test_a_page_whose_bytes_no_longer_match_its_seal_is_not_written(tmp_path):
    store = open_store(str(tmp_path)).store
    pages = host_pages(2, 8192)
    pages[0], pages[1] = content(0, 8192), content(1, 8192)
    seals = [Seal(b"record", page_checksum(b"record", pages[i])) for i in range(2)]
    pages[1, 17] ^= 1  # changed in host memory after it was sealed
    writes = [PageWrite(identity(i, PAGE_SIZE), pages[i], seals[i]) for i in range(2)]
    first, second = store.write(writes).result()
    assert isinstance(first, Written) and second == NotWritten(WriteRefusal.CHANGED)
    assert store.counters().changed_pages == 1 and store.counters().pages == 1
    assert [p.slot for p in write(store, [7], 8192, PAGE_SIZE)] == [1], "the changed page's slot stays free"
    store.close()
    assert {number_of(p) for p in open_store(str(tmp_path)).pages} == {0, 7}


def _resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (mincore over a map of it, which faults nothing in)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        address = np.frombuffer(m, np.uint8).ctypes.data
        vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0
        return sum(v & 1 for v in vector) * mmap.PAGESIZE


@pytest.mark.parametrize("buffered", [False, True])
def test_the_page_cache_does_not_hold_the_tiers_bytes_again(tmp_path, buffered):
    """Direct I/O bypasses the page cache; buffered I/O drops what it wrote and read once clean."""
    opened = open_store(str(tmp_path), buffered)
    if not buffered and not opened.store.direct_io:
        pytest.skip("no direct I/O on this file system")
    written = write(opened.store, range(64), 64 << 10, PAGE_SIZE)  # 4 MiB
    assert read_back(opened.store, written) == {n: True for n in range(64)}
    opened.store.close()
    assert _resident_bytes(os.path.join(tmp_path, FILE_NAME)) <= 64 << 10


def test_reads_frees_and_writes_at_once_never_serve_wrong_bytes(tmp_path):
    """Threads read, free and write the same slots concurrently: a read is either verified
    with the bytes of the page it names or a miss; a freed slot being read is rewritten
    only after the read."""
    page_bytes = 16 << 10
    store = open_store(str(tmp_path)).store
    live = {p.slot: p for p in write(store, range(32), page_bytes, PAGE_SIZE)}
    lock = threading.Lock()
    errors: list[str] = []

    def reader():
        out = host_pages(8, page_bytes)
        for _ in range(40):
            with lock:
                chosen = list(live.values())[:8]
            results = store.read([PageRead(p.slot, row) for p, row in zip(chosen, out)]).result()
            for r, row in zip(results, out):
                if isinstance(r, ReadOk) and not (row == content(number_of(r.page), page_bytes)).all():
                    errors.append(f"slot {r.page.slot}: wrong bytes")
                if isinstance(r, ReadMiss) and r.reason is not ReadFailure.NOT_STORED:
                    errors.append(f"slot {r.slot}: {r.reason}")

    def churn():
        for n in range(100, 160):
            with lock:
                victim = min(live)
                del live[victim]
            store.free([victim])
            [page] = write(store, [n], page_bytes, PAGE_SIZE)
            with lock:
                live[page.slot] = page

    threads = [threading.Thread(target=reader) for _ in range(2)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert read_back(store, list(live.values())) == {number_of(p): True for p in live.values()}
    store.close()


def test_a_new_chunk_size_formats_the_file_afresh(tmp_path):
    write(open_store(str(tmp_path)).store, range(4), 8192, PAGE_SIZE)
    opened = open_store(str(tmp_path), chunk=2 * CHUNK)
    assert opened.pages == [] and opened.recovery.formatted
    opened.store.close()


def test_an_invalid_header_on_disk_frees_its_slot(tmp_path):
    """A header scribbled on disk (a token id changed) fails its checksum at the next open: not
    returned, counted, and its slot is written again."""
    store = open_store(str(tmp_path)).store
    written = write(store, range(3), 8192, PAGE_SIZE)
    store.close()
    header_of_slot_1 = BLOCK + BLOCK + 1 * BLOCK  # superblock, chunk 0's header, slot headers
    with open(os.path.join(tmp_path, FILE_NAME), "r+b") as f:
        f.seek(header_of_slot_1 + 184)  # the first token id
        f.write(b"\xff")
    opened = open_store(str(tmp_path))
    assert {number_of(p) for p in opened.pages} == {0, 2} and opened.recovery.torn == 1
    assert opened.store.counters().torn_headers == 1
    assert [p.slot for p in write(opened.store, [9], 8192, PAGE_SIZE)] == [written[1].slot]
    opened.store.close()


def test_recovery_reads_headers_only(tmp_path):
    """Opening a file of 2,000 pages reads the superblock, every chunk's header and the slot
    headers of the chunks in use (one read each), never a page's bytes."""
    page_bytes, budget = 16 << 10, 64 << 20
    store = open_store(str(tmp_path), budget=budget).store
    for first in range(0, 2000, 500):
        write(store, range(first, first + 500), page_bytes, PAGE_SIZE)
    store.close()
    opened = open_store(str(tmp_path), budget=budget)
    assert len(opened.pages) == 2000 and opened.recovery.torn == 0
    chunks, slots = (budget - BLOCK) // CHUNK, SlotClass(page_bytes, PAGE_SIZE).slots_in(CHUNK)
    assert opened.recovery.header_bytes_read == (1 + chunks) * BLOCK + -(-2000 // slots) * slots * BLOCK
    print(f"recovered 2,000 pages in {opened.recovery.seconds * 1e3:.1f} ms")
    opened.store.close()


def test_a_closed_store_answers_closed(tmp_path):
    opened = open_store(str(tmp_path))
    [page] = write(opened.store, [0], 8192, PAGE_SIZE)
    opened.store.close()
    view = host_pages(1, 8192)[0]
    assert opened.store.write([PageWrite(identity(1, PAGE_SIZE), view)]).result() == [NotWritten(WriteRefusal.CLOSED)]
    assert opened.store.read([PageRead(page.slot, view)]).result() == [ReadMiss(page.slot, ReadFailure.CLOSED)]
    assert opened.store.free([page.slot]).result() == [False]
    opened.store.close()  # a second close does nothing


def test_bad_settings_are_errors(tmp_path):
    with pytest.raises(ValueError, match="multiple of 4096"):
        DiskStore.open(str(tmp_path), 64 << 20, chunk_bytes=5000)
    with pytest.raises(ValueError, match="holds no chunk"):
        DiskStore.open(str(tmp_path), CHUNK, chunk_bytes=CHUNK)
