"""The daemon's garbage-collector policy (kvd/collector.py): long-lived objects frozen.

A full collection that walks a heap of 512K pages stalls every call for 0.5 s or more;
the daemon freezes what it keeps so collections walk only what is new, and hands the
frozen objects back once in a while so that cycles frozen while alive are still collected.
"""

from __future__ import annotations

import gc
import re

import numpy as np
import pytest

from engine_client import KVDClient, PageLayout, SequenceRequest
from kvd import collector
from tests.conftest import identity, stop_cleanly

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float16")  # 2 KiB pages


class _Node:
    def __init__(self) -> None:
        self.other = self


@pytest.fixture
def installed():
    clock = [0.0]
    policy = collector.Collector(complete_seconds=10.0, clock=lambda: clock[0]).install()
    try:
        yield policy, clock
    finally:
        policy.uninstall()


def test_a_full_collection_freezes_what_it_kept_and_walks_only_what_is_new(installed):
    policy, _ = installed
    assert gc.get_threshold()[2] == collector.OLDEST_THRESHOLD
    kept = [_Node() for _ in range(1000)]
    gc.collect()
    frozen = gc.get_freeze_count()
    assert frozen >= 1000 and policy.full_collections >= 2  # install's two, then this one
    assert not any(o is kept[0] for o in gc.get_objects())  # no collection walks it now
    # A cycle made after the freeze is collected as before.
    _Node()
    assert gc.collect() >= 1


def test_cycles_frozen_while_alive_are_collected_after_the_complete_interval(installed):
    policy, clock = installed
    alive = [_Node() for _ in range(100)]
    gc.collect()  # frozen while alive
    del alive
    assert gc.collect() < 100  # the garbage is frozen: kept
    clock[0] = 11.0
    gc.collect()  # due: hands the frozen generation back
    assert policy.complete_collections == 1
    assert gc.collect() >= 100  # the next full collection finds the cycles
    assert gc.get_freeze_count() > 0  # and freezes what is left


def test_a_manager_without_a_collector_leaves_the_collector_alone(make_manager):
    before = gc.get_freeze_count()
    m = make_manager(budget_bytes=4 << 20, extent_bytes=1 << 20)
    m.supply.add_extent(m.catalog.register_namespace(identity(page_size=16)))
    assert gc.get_freeze_count() == before


def test_the_daemon_freezes_at_start_up_and_after_each_adopted_extent(daemon_factory):
    """A real daemon: its log says how many objects it froze at start-up and after each
    extent (1 MiB: 512 pages of 2 KiB) it adopted while a client allocated 1,500 pages."""
    d = daemon_factory("--host-bytes", "8MiB", "--extent-bytes", "1MiB", "--log-level", "DEBUG")
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace("gc", LAYOUT)
        for i in range(3):
            c.allocate_with_prefix(ns, [SequenceRequest(f"s{i}", np.arange(8000, dtype=np.int32) + 8000 * i)])
    stop_cleanly(d)
    log = d.log()
    started = [int(n) for n in re.findall(r"collector: (\d+) long-lived objects frozen at start-up", log)]
    grown = [int(n) for n in re.findall(r"collector: (\d+) long-lived objects frozen after adopting an extent", log)]
    assert len(started) == 1 and started[0] > 1000, log
    assert len(grown) >= 3, log  # 1,500 pages need three extents
    # A page is a row of the pool's columns (kvd/core/page_columns.py), not an object to track.
    assert grown[-1] - grown[0] < 512, f"adopting extents of 512 pages added as many tracked objects: {grown}"
