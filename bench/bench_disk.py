"""The disk tier's storage engine (kvd/disk/) against the disk it runs on (issue 30).

A store in ``--dir`` is filled with ``--gib`` GiB of pages of ``--page-kib`` KiB, then the
same bytes are read back in rounds, each round one pass by each method, alternating every
``--batch`` pages (so both see the same moments of a shared, noisy disk):

- **raw**: the disk's sequential read bandwidth: one O_DIRECT descriptor of the same file,
  a plain ``os.preadv`` loop over the slots' data, one page-sized block at a time, in slot
  order, into one aligned buffer (the issue's "direct I/O, same block size");
- **engine**: ``DiskStore.read`` of ``--batch`` pages a call (as a promotion reads a run of a
  prompt's pages), into host pages laid end to end in anonymous shared memory (mmap'd and
  pre-faulted, as the arena's extents are), every page checked against its checksum; one
  call at a time.

Prints each round's bandwidth and the ratio engine / raw of each round and their median
(the issue's target: >= 0.8x), the
write bandwidth of the fill (each run synced twice: bytes, then headers), the file system
(``df -T``) and whether the engine got direct I/O. Then the time to open (recover) a store
of ``--recovery-pages`` small pages, reading their headers.

    python bench/bench_disk.py --dir /var/tmp --gib 2 --page-kib 2048
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

from kvd.diskstore.layout import BLOCK, FILE_NAME, ChunkFormat, DiskPage, PageIdentity, SlotClass, chunk_of
from kvd.diskstore.results import PageRead, PageWrite, ReadOk, Written
from kvd.diskstore.store import DiskStore, Opened

PAGE_SIZE = 16
WRITE_BATCH = 64


def identity(n: int) -> PageIdentity:
    key = n.to_bytes(16, "little")
    return PageIdentity("", b"R" * 16, key, (n - 1).to_bytes(16, "little", signed=True), n, b"", bytes(4 * PAGE_SIZE))


def host_pages(count: int, page_bytes: int) -> np.ndarray:
    """uint8 [count, page_bytes] in anonymous shared memory, pre-faulted."""
    pages = np.frombuffer(mmap.mmap(-1, count * page_bytes), np.uint8).reshape(count, page_bytes)
    pages[:] = 1
    return pages


def open_store(directory: str, budget: int, chunk_bytes: int) -> Opened:
    opened = DiskStore.open(directory, budget, chunk_bytes=chunk_bytes)
    assert isinstance(opened, Opened), opened
    return opened


def fill(store: DiskStore, count: int, page_bytes: int) -> tuple[list[DiskPage], float]:
    """Writes ``count`` random pages; returns them and the seconds it took."""
    source = host_pages(WRITE_BATCH, page_bytes)
    source[:] = np.random.default_rng(0).integers(0, 256, source.shape, dtype=np.uint8)
    pages: list[DiskPage] = []
    start = time.perf_counter()
    for first in range(0, count, WRITE_BATCH):
        n = min(WRITE_BATCH, count - first)
        results = store.write([PageWrite(identity(first + i), source[i]) for i in range(n)]).result()
        assert all(isinstance(r, Written) for r in results), results[:3]
        pages += [r.page for r in results]
    return pages, time.perf_counter() - start


def data_offsets(pages: list[DiskPage], chunk_bytes: int) -> list[int]:
    """Where each page's bytes lie in the file (kvd/diskstore/layout.py)."""
    offsets = []
    for page in pages:
        chunk, index = chunk_of(page.slot)
        cls = page.page_class
        offsets.append(ChunkFormat(chunk, 0, cls, cls.slots_in(chunk_bytes), chunk_bytes).data_offset(index))
    return offsets


def raw_read(fd: int, offsets: list[int], buffer: mmap.mmap) -> float:
    """Seconds to read one block at each offset through the O_DIRECT descriptor into ``buffer``."""
    start = time.perf_counter()
    for offset in offsets:
        assert os.preadv(fd, [buffer], offset) == len(buffer)
    return time.perf_counter() - start


def engine_read(store: DiskStore, pages: list[DiskPage], destination: np.ndarray) -> float:
    """Seconds to read ``pages`` back in one call into ``destination``'s first rows, verified."""
    start = time.perf_counter()
    results = store.read([PageRead(p.slot, destination[i]) for i, p in enumerate(pages)]).result()
    seconds = time.perf_counter() - start
    assert all(isinstance(r, ReadOk) for r in results), [r for r in results if not isinstance(r, ReadOk)][:3]
    return seconds


def interleaved_round(path: str, store: DiskStore, pages: list[DiskPage], chunk_bytes: int, batch: int):
    """One pass over every page by each method, alternating batch by batch (ABBA), so both see
    the same moments of a noisy disk: (raw seconds, engine seconds)."""
    ordered = sorted(pages, key=lambda p: p.slot)
    offsets = data_offsets(ordered, chunk_bytes)
    page_bytes = ordered[0].page_bytes
    destination = host_pages(batch, page_bytes)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = mmap.mmap(-1, page_bytes)
    raw = engine = 0.0
    try:
        for k, first in enumerate(range(0, len(ordered), batch)):
            part = slice(first, first + batch)
            if k % 2 == 0:
                raw += raw_read(fd, offsets[part], buffer)
                engine += engine_read(store, ordered[part], destination)
            else:
                engine += engine_read(store, ordered[part], destination)
                raw += raw_read(fd, offsets[part], buffer)
    finally:
        os.close(fd)
        buffer.close()
    return raw, engine


def recovery_seconds(directory: str, count: int) -> tuple[float, int]:
    """Seconds to open a store of ``count`` pages of 16 KiB, and the header bytes it read."""
    page_bytes, chunk_bytes = 16 << 10, 64 << 20
    slots = SlotClass(page_bytes, PAGE_SIZE).slots_in(chunk_bytes)
    budget = BLOCK + -(-count // slots) * chunk_bytes
    opened = open_store(directory, budget, chunk_bytes)
    fill(opened.store, count, page_bytes)
    opened.store.close()
    again = open_store(directory, budget, chunk_bytes)
    assert len(again.pages) == count
    again.store.close()
    return again.recovery.seconds, again.recovery.header_bytes_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp", help="where the store's directory is made")
    parser.add_argument("--gib", type=float, default=2.0, help="page bytes stored and read back")
    parser.add_argument("--page-kib", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32, help="pages per read call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--recovery-pages", type=int, default=10_000)
    args = parser.parse_args()
    page_bytes, chunk_bytes = args.page_kib << 10, args.chunk_mib << 20
    count = int(args.gib * (1 << 30)) // page_bytes
    slots = SlotClass(page_bytes, PAGE_SIZE).slots_in(chunk_bytes)
    directory = tempfile.mkdtemp(prefix="kvd-bench-disk-", dir=args.dir)
    try:
        df = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()[-1].split()
        print(f"file system: {df[1]} ({df[0]}), {args.dir}; pages of {args.page_kib} KiB, {count} pages")
        opened = open_store(directory, BLOCK + -(-count // slots) * chunk_bytes, chunk_bytes)
        store = opened.store
        print(f"engine I/O: {'direct' if store.direct_io else 'buffered'}")
        pages, seconds = fill(store, count, page_bytes)
        total = count * page_bytes
        print(f"fill: {total / seconds / 1e9:.2f} GB/s written ({WRITE_BATCH} pages a call)")

        raw, engine = [], []
        for r in range(args.rounds):
            raw_seconds, engine_seconds = interleaved_round(
                os.path.join(directory, FILE_NAME), store, pages, chunk_bytes, args.batch
            )
            raw.append(total / raw_seconds)
            engine.append(total / engine_seconds)
            print(f"round {r + 1}: raw {raw[-1] / 1e9:.2f} GB/s, engine {engine[-1] / 1e9:.2f} GB/s")
        c = store.counters()
        store.close()
        print(f"bounced pages: {c.bounced_pages}, read errors: {c.read_errors}, dropped: {c.dropped_pages}")
        ratios = [e / r for e, r in zip(engine, raw)]
        print(
            f"median: raw {np.median(raw) / 1e9:.2f} GB/s, engine {np.median(engine) / 1e9:.2f} GB/s "
            f"({args.batch} pages a call, verified); engine / raw per round: "
            f"{', '.join(f'{x:.2f}' for x in ratios)}, median {np.median(ratios):.2f}x (target >= 0.8x)"
        )
        shutil.rmtree(directory)
        os.mkdir(directory)
        seconds, header_bytes = recovery_seconds(directory, args.recovery_pages)
        print(
            f"open with {args.recovery_pages} pages of 16 KiB: {seconds * 1e3:.0f} ms "
            f"({header_bytes / 1e6:.1f} MB of headers read)"
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
