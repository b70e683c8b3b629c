"""bench/bench_trace.py at small scale: the head of Mooncake's synthetic trace replayed through
a real daemon with a small RAM and a small disk (so both evict), for each disk policy, serves
what the simulation of the same tiers with the same policy class serves: the daemon behaves
like the model the study measured (bench/trace_sim.py). Each request waits until the pages
evicted so far are written, as the simulation's writes are instant (the full-speed replay's
figures are in bench/RESULTS.md)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import bench_trace  # noqa: E402
import trace_sim  # noqa: E402

TRACE = trace_sim.synthetic_trace()
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"Mooncake's synthetic trace is not at {TRACE}")
REQUESTS = 600  # 15,000 full blocks, 12,800 unique


@pytest.fixture(scope="module")
def head():
    records = trace_sim.read_requests(TRACE, REQUESTS)
    trace = trace_sim.full_blocks(records)
    return records, trace, bench_trace.sizes(trace.pages(0.05), trace.pages(0.10))


@pytest.mark.parametrize("policy", ["arc", "lru"])
def test_the_daemon_serves_what_the_simulated_tiers_serve(head, policy, tmp_path):
    records, trace, size = head
    sim = bench_trace.simulate(trace, size, policy, min_uses=1)
    run = bench_trace.run_daemon(records, size, policy, 1, str(tmp_path), settle=True)
    assert run.blocks == trace.blocks and sim.disk_hits > 100
    assert run.disk["evicted_pages"] > 0, "the disk never filled: the policy was not at work"
    assert abs((run.hits - run.disk_hits) - sim.ram_hits) <= 0.01 * sim.ram_hits + 5, (run, sim)
    assert abs(run.disk_hits - sim.disk_hits) <= 0.03 * sim.disk_hits + 2, (run, sim)
    assert abs(run.disk["written_pages"] - sim.disk_writes) <= 0.01 * sim.disk_writes, (run, sim)
