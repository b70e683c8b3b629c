"""Pages for the disk tier's tests: identities and bytes that follow from a page number, in
host buffers like the daemon's (anonymous shared memory, pages laid end to end), and the
storage engine opened over a real directory.

Used in process by tests/test_disk_store.py and tests/test_disk_faults.py, and as a child
process by tests/test_disk_crash.py: ``python disk_pages.py SCENARIO DIR PAGE_BYTES PAGE_SIZE
[buffered]`` runs a scenario and prints one JSON line after each step that completed (what
was stored), so a test that kills it at a crash point knows what had returned; the fault
tests run some scenarios in a private mount namespace on a small file system.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import sys
from collections.abc import Iterable

import numpy as np

from kvd.diskstore.layout import DiskPage, PageIdentity, SlotId
from kvd.diskstore.results import PageRead, PageWrite, ReadOk, Written
from kvd.diskstore.store import DiskStore, Opened

BUDGET = 16 << 20
CHUNK = 1 << 20


def identity(n: int, page_size: int, scope: str = "alpha") -> PageIdentity:
    """Page ``n``'s identity: keys and token ids that follow from ``n``."""
    digest = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=32).digest()
    tokens = (np.arange(page_size, dtype="<i4") + 1000 * n).tobytes()
    return PageIdentity(scope, b"R" * 16, digest[:16], digest[16:], n % 7, b"L" * 16 if n % 2 else b"", tokens)


def content(n: int, page_bytes: int) -> np.ndarray:
    """Page ``n``'s bytes: uint8 [page_bytes]."""
    return np.random.default_rng(n).integers(0, 256, page_bytes, dtype=np.uint8)


def host_pages(count: int, page_bytes: int) -> np.ndarray:
    """``count`` pages end to end in anonymous shared memory, as an extent lays them: uint8
    [count, page_bytes] (page i starts 4 KiB-aligned only when page_bytes is a multiple of 4 KiB)."""
    return np.frombuffer(mmap.mmap(-1, max(count * page_bytes, 1)), np.uint8, count * page_bytes).reshape(
        count, page_bytes
    )


def open_store(directory: str, buffered: bool = False, budget: int = BUDGET, chunk: int = CHUNK) -> Opened:
    opened = DiskStore.open(directory, budget, chunk_bytes=chunk, threads=2, direct=not buffered)
    assert isinstance(opened, Opened), opened
    return opened


def write(store: DiskStore, numbers: Iterable[int], page_bytes: int, page_size: int) -> list[DiskPage]:
    """Writes pages ``numbers`` from host pages; every one must be written."""
    numbers = list(numbers)
    pages = host_pages(len(numbers), page_bytes)
    for row, n in zip(pages, numbers):
        row[:] = content(n, page_bytes)
    results = store.write([PageWrite(identity(n, page_size), row) for n, row in zip(numbers, pages)]).result()
    assert all(isinstance(r, Written) for r in results), results
    return [r.page for r in results]


def number_of(page: DiskPage) -> int:
    """The page number whose tokens ``page`` holds."""
    return int(np.frombuffer(page.identity.tokens[:4], "<i4")[0]) // 1000


def read_back(store: DiskStore, pages: list[DiskPage]) -> dict[int, bool]:
    """Page number → whether it reads back verified with its own bytes."""
    sizes = {p.page_bytes for p in pages}
    if len(sizes) == 1:  # end to end, as in an extent
        out = list(host_pages(len(pages), sizes.pop()))
    else:
        out = [host_pages(1, p.page_bytes)[0] for p in pages]
    results = store.read([PageRead(p.slot, row) for p, row in zip(pages, out)]).result()
    return {
        number_of(p): isinstance(r, ReadOk) and r.page == p and bool((row == content(number_of(p), p.page_bytes)).all())
        for p, r, row in zip(pages, results, out)
    }


def _report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _slots(pages: list[DiskPage]) -> list[SlotId]:
    return [p.slot for p in pages]


def fill_after_open(directory: str, page_bytes: int, page_size: int, buffered: bool) -> None:
    """On a small file system (``directory`` its mount point): a budget larger than it is
    refused, and leaves no file; one that fits is reserved whole, so once another file takes
    every byte left, the store still writes until its own slots are full."""
    os.mkdir(too_big := os.path.join(directory, "too-big"))
    refused = DiskStore.open(too_big, 64 << 20, chunk_bytes=CHUNK)
    _report(refused=getattr(refused, "reason", refused).value, left=os.listdir(too_big))
    os.mkdir(fits := os.path.join(directory, "fits"))
    store = open_store(fits, buffered, budget=4 * CHUNK + 4096).store
    with open(os.path.join(directory, "filler"), "wb") as filler:
        size = 0
        for step in (1 << 20, 4096):
            while True:
                try:
                    os.posix_fallocate(filler.fileno(), size, step)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
                size += step
    stat = os.statvfs(directory)
    _report(direct_io=store.direct_io, free_after_filler=stat.f_bavail * stat.f_frsize)
    results, n = [], 0
    while not results or isinstance(results[-1], Written):
        pages = host_pages(8, page_bytes)
        for i, row in enumerate(pages):
            row[:] = content(n + i, page_bytes)
        batch = store.write([PageWrite(identity(n + i, page_size), row) for i, row in enumerate(pages)]).result()
        results += batch
        n += 8
    written = [r.page for r in results if isinstance(r, Written)]
    refusals = sorted({r.reason.value for r in results if not isinstance(r, Written)})
    c = store.counters()
    _report(
        written=len(written),
        refusals=refusals,
        verified=all(read_back(store, written).values()),
        write_errors=c.write_errors,
        refused_no_space=c.refused_no_space,
        refused_full=c.refused_full,
    )
    store.close()


def main(scenario: str, directory: str, page_bytes: int, page_size: int, buffered: bool) -> None:
    if scenario == "fill-after-open":
        return fill_after_open(directory, page_bytes, page_size, buffered)
    if scenario == "read-only":
        refused = DiskStore.open(directory, 4 * CHUNK + 4096, chunk_bytes=CHUNK)
        return _report(refused=getattr(refused, "reason", refused).value)
    other_class = page_bytes + 4096  # pages of another size
    budget = {"reformat": CHUNK + 4096}.get(scenario, BUDGET)
    store = open_store(directory, buffered, budget).store
    if scenario == "two-batches":  # pages 0-2, then 3-5 (one run each)
        _report(stored=_slots(write(store, range(3), page_bytes, page_size)))
        _report(stored=_slots(write(store, range(3, 6), page_bytes, page_size)))
    elif scenario == "reuse":  # page 0 written, freed, and its slot written again with page 1
        first = write(store, [0], page_bytes, page_size)
        _report(stored=_slots(first))
        store.free(_slots(first)).result()
        _report(freed=_slots(first))
        _report(stored=_slots(write(store, [1], page_bytes, page_size)))
    elif scenario == "free":  # pages 0 and 1 written, page 0 freed
        pages = write(store, [0, 1], page_bytes, page_size)
        _report(stored=_slots(pages))
        store.free(_slots(pages[:1])).result()
        _report(freed=_slots(pages[:1]))
    elif scenario == "reformat":  # the file's one chunk holds page 0, then (freed) page 1 of another size
        first = write(store, [0], page_bytes, page_size)
        _report(stored=_slots(first))
        store.free(_slots(first)).result()
        _report(freed=_slots(first))
        _report(stored=_slots(write(store, [1], other_class, page_size)))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    store.close()
    _report(done=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["buffered"])
