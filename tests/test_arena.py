"""The page arena: lazy extents, pre-faulted pages, mlock or one warning."""

from __future__ import annotations

import logging
import time

from conftest import identity, unique_prefix

from engine_client import KVDClient
from kvd.core.arena import Arena, _MemoryLocker


def shm_rss_kib(name: str) -> int:
    """Resident KiB of this process's mapping of the shared-memory segment ``name``."""
    rss, in_segment = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                in_segment = line.rstrip().endswith("/dev/shm" + name)
            elif in_segment and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


def test_a_new_extent_is_resident_before_any_request_touches_it():
    arena = Arena(64 << 20, 16 << 20, unique_prefix(), lock_memory=False)
    try:
        plan = arena.plan(1, 4096, 16, b"r" * 16)
        extent = arena.build(plan)
        arena.adopt(extent)
        assert shm_rss_kib(plan.name) * 1024 >= plan.size, "build() must fault every OS page in"
    finally:
        arena.close()


def test_mlock_failures_warn_once(caplog):
    locker = _MemoryLocker()
    with caplog.at_level(logging.WARNING, logger="kvd.core.arena"):
        # Address 4096 is never mapped: mlock fails with ENOMEM, like a low RLIMIT_MEMLOCK would.
        assert locker.lock(4096, 4096) is False
        assert locker.lock(4096, 4096) is False
    warnings = [r for r in caplog.records if "cannot mlock host pages" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_start_up_does_not_depend_on_the_budget(daemon_factory):
    started = time.monotonic()
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64GiB")  # more than this machine has
    took = time.monotonic() - started
    with KVDClient.connect(d.socket) as client:
        assert client.stats()["arena_bytes"] == 0, "no extent before a namespace needs one"
    print(f"\nstart-up with a 64 GiB budget: {took * 1e3:.0f} ms")
    assert took < 3.0


def test_registering_a_namespace_builds_its_first_extent_in_the_background(make_manager):
    m = make_manager(budget_bytes=16 << 20, extent_bytes=1 << 20)
    ns = m.catalog.register_namespace(identity())
    deadline = time.monotonic() + 10
    while not m.catalog.extents(ns.id) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.catalog.extents(ns.id), "no extent was built without a request asking for pages"
    assert m.pool.free_count(ns.id) > 0
