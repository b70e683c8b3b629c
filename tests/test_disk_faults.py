"""Faults under the disk tier's storage engine (issue 30): each is a counted, logged refusal or
a miss, never an exception into the caller, never a page served with wrong bytes.

EIO and ENOSPC are injected at the syscall boundary (``DiskStore.inject``: the next preadv,
pwritev or fdatasync fails): this host has loop devices but no device-mapper (no
/dev/mapper/control), so no dm-error target. A full file system and a read-only one are real:
a small tmpfs or a loop-mounted ext4 in a private mount namespace (``unshare -m``)."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from disk_pages import CHUNK, content, host_pages, identity, number_of, open_store, read_back, write

from kvd.diskstore.layout import FILE_NAME, SlotClass
from kvd.diskstore.results import (
    NotWritten,
    OpenRefusal,
    OpenRefused,
    PageRead,
    PageWrite,
    ReadFailure,
    ReadMiss,
    WriteRefusal,
)
from kvd.diskstore.store import DiskStore

PAGE_BYTES, PAGE_SIZE = 8192, 16


@pytest.fixture
def store(tmp_path):
    """A store holding pages 0-3 (one run), with chunk 0 formatted."""
    opened = open_store(str(tmp_path))
    write(opened.store, range(4), PAGE_BYTES, PAGE_SIZE)
    yield opened.store
    opened.store.close()


def reopened_numbers(tmp_path) -> set[int]:
    opened = open_store(str(tmp_path))
    numbers = {number_of(p) for p in opened.pages}
    assert all(read_back(opened.store, opened.pages).values())
    opened.store.close()
    return numbers


def test_a_read_error_is_a_dropped_miss(store, tmp_path, caplog):
    """The read of a run of two pages fails: both are misses, dropped from the disk."""
    pages = store.pages()
    store.inject("read", errno.EIO)
    out = host_pages(2, PAGE_BYTES)
    with caplog.at_level(logging.ERROR, logger="kvd.diskstore.store"):
        results = store.read([PageRead(pages[0].slot, out[0]), PageRead(pages[1].slot, out[1])]).result()
    assert results == [ReadMiss(pages[0].slot, ReadFailure.IO_ERROR), ReadMiss(pages[1].slot, ReadFailure.IO_ERROR)]
    assert all(r.dropped for r in results) and "not read back" in caplog.text
    c = store.counters()
    assert (c.read_errors, c.reads, c.pages) == (2, 0, 2)
    assert store.page(pages[0].slot) is None
    assert read_back(store, pages[2:]) == {2: True, 3: True}, "the other pages still serve"
    store.close()
    assert reopened_numbers(tmp_path) == {2, 3}, "a dropped page's header was zeroed"


def test_bytes_changed_on_disk_are_a_dropped_miss(store, tmp_path):
    pages = store.pages()
    slots = SlotClass(PAGE_BYTES, PAGE_SIZE).slots_in(CHUNK)
    data_of_slot_2 = 4096 + 4096 + slots * 4096 + 2 * PAGE_BYTES  # superblock, chunk header, slot headers
    with open(os.path.join(tmp_path, FILE_NAME), "r+b") as f:
        f.seek(data_of_slot_2 + 100)
        f.write(b"\x00\x01\x02")
    out = host_pages(4, PAGE_BYTES)
    results = store.read([PageRead(p.slot, row) for p, row in zip(pages, out)]).result()
    assert [getattr(r, "reason", None) for r in results] == [None, None, ReadFailure.CORRUPT, None]
    assert store.counters().dropped_pages == 1
    assert store.read([PageRead(pages[2].slot, out[2])]).result() == [ReadMiss(pages[2].slot, ReadFailure.NOT_STORED)]
    store.close()
    assert reopened_numbers(tmp_path) == {0, 1, 3}


@pytest.mark.parametrize(
    "op, skip, error, reason",
    [
        ("write", 0, errno.EIO, WriteRefusal.IO_ERROR),  # the page bytes
        ("sync", 0, errno.EIO, WriteRefusal.IO_ERROR),  # the barrier between bytes and headers
        ("write", 1, errno.EIO, WriteRefusal.IO_ERROR),  # the headers
        ("sync", 1, errno.EIO, WriteRefusal.IO_ERROR),  # the headers' sync
        ("write", 0, errno.ENOSPC, WriteRefusal.NO_SPACE),  # a file system that does not honour fallocate
    ],
)
def test_a_failed_write_is_refused_and_leaves_nothing_on_disk(store, tmp_path, caplog, op, skip, error, reason):
    store.inject(op, error, skip=skip)
    pages = host_pages(2, PAGE_BYTES)
    with caplog.at_level(logging.ERROR, logger="kvd.diskstore.store"):
        results = store.write([PageWrite(identity(10 + i, PAGE_SIZE), pages[i]) for i in range(2)]).result()
    assert results == [NotWritten(reason)] * 2 and "not written" in caplog.text
    c = store.counters()
    assert (c.write_errors, c.refused_no_space) == ((2, 0) if reason is WriteRefusal.IO_ERROR else (0, 2))
    assert (c.pages, c.backlog_pages, c.backlog_bytes, c.lost_slots) == (4, 0, 0, 0)
    # the slots are free again (after their headers were zeroed, where they may have been written)
    assert [p.slot for p in write(store, [20, 21], PAGE_BYTES, PAGE_SIZE)] == [4, 5]
    store.free([4, 5]).result()
    store.close()
    assert reopened_numbers(tmp_path) == {0, 1, 2, 3}


def test_a_slot_whose_header_cannot_be_zeroed_is_not_reused(store, tmp_path):
    """A free whose header write fails: the page is gone from the store, its slot is lost until
    the next open, and there the page (whose header and bytes are intact) comes back."""
    store.inject("write", errno.EIO)
    assert store.free([1]).result() == [True]
    assert store.page(1) is None and store.counters().lost_slots == 1
    assert [p.slot for p in write(store, [30], PAGE_BYTES, PAGE_SIZE)] == [4]
    store.close()
    assert reopened_numbers(tmp_path) == {0, 1, 2, 3, 30}


def test_a_missing_directory_is_refused(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvd.diskstore.store"):
        refused = DiskStore.open(str(tmp_path / "absent"), 16 << 20, chunk_bytes=1 << 20)
    assert isinstance(refused, OpenRefused) and refused.reason is OpenRefusal.MISSING
    assert "refused (missing)" in caplog.text
    (tmp_path / "a-file").write_text("")
    assert DiskStore.open(str(tmp_path / "a-file"), 16 << 20, chunk_bytes=1 << 20).reason is OpenRefusal.MISSING


def test_a_directory_removed_under_the_store_refuses_writes_and_still_serves(tmp_path, caplog):
    directory = tmp_path / "tier"
    directory.mkdir()
    opened = open_store(str(directory))
    written = write(opened.store, range(3), PAGE_BYTES, PAGE_SIZE)
    shutil.rmtree(directory)
    view = host_pages(1, PAGE_BYTES)[0]
    view[:] = content(9, PAGE_BYTES)
    with caplog.at_level(logging.ERROR, logger="kvd.diskstore.store"):
        result = opened.store.write([PageWrite(identity(9, PAGE_SIZE), view)]).result()
    assert result == [NotWritten(WriteRefusal.VANISHED)] and "vanished" in caplog.text
    assert opened.store.counters().refused_vanished == 1
    assert read_back(opened.store, written) == {0: True, 1: True, 2: True}, "what it holds is still right"
    opened.store.close()
    assert DiskStore.open(str(directory), 16 << 20, chunk_bytes=1 << 20).reason is OpenRefusal.MISSING


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a private mount namespace needs root and unshare (CI runs as root)",
)
MOUNTS = {
    "tmpfs": "mount -t tmpfs -o size=16m kvdtest {dir}",
    "ext4": "truncate -s 24M {img} && mkfs.ext4 -q -F {img} && mount -o loop {img} {dir}",
    "read-only": "mount -t tmpfs -o ro,size=16m kvdtest {dir}",
}


def in_namespace(tmp_path, mount: str, scenario: str) -> list[dict]:
    """What a scenario of tests/disk_pages.py reports, run in a private mount namespace on the
    file system ``mount`` at ``tmp_path/mnt``."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = MOUNTS[mount].format(dir=mnt, img=tmp_path / "fs.img") + ' && exec "$@"'
    child = str(pathlib.Path(__file__).with_name("disk_pages.py"))
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
        + [sys.executable, child, scenario, str(mnt), str(64 << 10), str(PAGE_SIZE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@needs_root
@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_a_full_file_system_refuses_the_budget_at_open_never_a_write(tmp_path, fs):
    refused, filled, wrote = in_namespace(tmp_path, fs, "fill-after-open")
    assert refused == {"refused": "no-space", "left": []}, "refused, and the partial file removed"
    assert filled["free_after_filler"] < 64 << 10, "another file took what was left"
    assert filled["direct_io"] == (fs == "ext4"), "direct I/O on ext4; tmpfs is memory"
    assert wrote["refusals"] == ["full"] and wrote["verified"]
    assert wrote["written"] == 4 * ((1 << 20) - 4096) // (4096 + (64 << 10))  # every slot of the budget
    assert (wrote["write_errors"], wrote["refused_no_space"]) == (0, 0)


@needs_root
def test_a_read_only_file_system_is_refused(tmp_path):
    assert in_namespace(tmp_path, "read-only", "read-only") == [{"refused": "read-only"}]
