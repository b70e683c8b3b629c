"""The disk tier's storage engine killed at its dangerous instants (issue 30): a real child
process (tests/disk_pages.py) is killed with SIGKILL at a crash point
(kvd/diskstore/crashpoints.py), then a fresh open must return exactly the pages whose writes
completed (and whose frees did not), each reading back with its own bytes, and nothing else.

Each test fails on a build without the protection it tests: the data-then-header order
(a header written first describes bytes that never arrived), the header checksum (a torn
header would be returned with the tokens it lost), zeroing a freed slot's header before the
slot is written again (the old header would describe the new bytes)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from disk_pages import number_of, open_store, read_back, write

CHILD = str(pathlib.Path(__file__).with_name("disk_pages.py"))
PAGE_BYTES = 10_000  # not a multiple of 4 KiB: most host pages are unaligned (bounced with direct I/O)
PAGE_SIZE = 512  # tokens: a header spans several 512-byte sectors, so a torn one loses tokens
MODES = ["direct", "buffered"]  # on the test's file system (ext4 here); buffered: page cache + fadvise


def run_child(directory, scenario: str, mode: str, crash_at: str | None) -> list[dict]:
    """Runs a scenario in a child process; asserts it died at ``crash_at`` (or finished without one)."""
    env = {k: v for k, v in os.environ.items() if k != "KVD_DISK_CRASH_AT"}
    if crash_at:
        env["KVD_DISK_CRASH_AT"] = crash_at
    args = [sys.executable, CHILD, scenario, str(directory), str(PAGE_BYTES), str(PAGE_SIZE)]
    child = subprocess.run(
        args + (["buffered"] if mode == "buffered" else []), capture_output=True, text=True, timeout=60, env=env
    )
    expected = -signal.SIGKILL if crash_at else 0
    assert child.returncode == expected, f"exit {child.returncode}, expected {expected}:\n{child.stdout}{child.stderr}"
    return [json.loads(line) for line in child.stdout.splitlines()]


def reopened(directory, mode: str, expected: set[int]):
    """Opens the store afresh: it returns exactly ``expected`` pages, each with its own bytes."""
    opened = open_store(str(directory), buffered=mode == "buffered")
    found = {number_of(p): p for p in opened.pages}
    assert set(found) == expected, f"recovered {sorted(found)}, expected {sorted(expected)}"
    assert read_back(opened.store, list(found.values())) == {n: True for n in expected}
    return opened


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "crash_at, survivors",
    [
        ("disk-data-torn:2", {0, 1, 2}),  # half of the second batch's bytes written
        ("disk-data-written:2", {0, 1, 2}),  # all its bytes, no header yet
        ("disk-header-torn:2", {0, 1, 2}),  # half of its first header's bytes
        ("disk-header-written:2", {0, 1, 2, 3, 4, 5}),  # its headers complete (unsynced, unreported)
    ],
)
def test_a_crash_while_pages_are_written_returns_exactly_the_completed_writes(tmp_path, mode, crash_at, survivors):
    steps = run_child(tmp_path, "two-batches", mode, crash_at)
    assert steps == [{"stored": [0, 1, 2]}], steps  # the first batch returned, the second never did
    opened = reopened(tmp_path, mode, survivors)
    assert opened.recovery.torn == (crash_at == "disk-header-torn:2")
    # the slots of lost writes are free again: the next pages land in the lowest free slots
    stored = write(opened.store, range(10, 16), PAGE_BYTES, PAGE_SIZE)
    assert [p.slot for p in stored] == list(range(len(survivors), len(survivors) + 6))
    opened.store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_crash_while_a_freed_slot_is_written_again_returns_neither_page(tmp_path, mode):
    """Page 0 is written, freed (its free returned) and its slot written with page 1; the child
    dies after page 1's bytes reached the slot, before its header. Page 0 must not come back:
    its header would describe page 1's bytes."""
    steps = run_child(tmp_path, "reuse", mode, "disk-data-written:2")
    assert steps == [{"stored": [0]}, {"freed": [0]}], steps
    reopened(tmp_path, mode, set()).store.close()


def test_the_freed_slot_is_the_one_written_again(tmp_path):
    """What the test above relies on: without a crash, page 1 lands in page 0's slot."""
    steps = run_child(tmp_path, "reuse", "direct", None)
    assert steps == [{"stored": [0]}, {"freed": [0]}, {"stored": [0]}, {"done": True}], steps
    reopened(tmp_path, "direct", {1}).store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_crash_while_a_slot_is_invalidated_keeps_the_other_pages(tmp_path, mode):
    """The child dies right after page 0's header was zeroed, before the free returned: page 0
    is gone (its free had reached the disk), page 1 is whole."""
    steps = run_child(tmp_path, "free", mode, "disk-slot-invalidated:1")
    assert steps == [{"stored": [0, 1]}], steps
    reopened(tmp_path, mode, {1}).store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_crash_after_a_chunk_is_formatted_for_another_size(tmp_path, mode):
    """The file's one chunk held page 0 (freed); it is formatted again for pages of another size
    and the child dies before any of them is written: nothing comes back, and the chunk serves
    either size afterwards."""
    steps = run_child(tmp_path, "reformat", mode, "disk-chunk-formatted:2")
    assert steps == [{"stored": [0]}, {"freed": [0]}], steps
    opened = open_store(str(tmp_path), buffered=mode == "buffered", budget=(1 << 20) + 4096)
    assert opened.pages == [] and opened.recovery.torn == 0
    [page] = write(opened.store, [7], PAGE_BYTES + 4096, PAGE_SIZE)
    assert read_back(opened.store, [page]) == {7: True}
    opened.store.close()
