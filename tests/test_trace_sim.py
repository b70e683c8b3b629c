"""bench/trace_sim.py: the figures of ../shared/traces/README.md reproduced on Mooncake's synthetic
trace, the order of the policies (Belady above every other, larger caches serving more), and
the disk-write accounting on a trace small enough to follow by hand."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import trace_sim  # noqa: E402
from trace_sim import ARC, LRU, PLACEMENTS, AdmitOnSecondUse, Belady, Outcome, Trace, TwoTier, replay  # noqa: E402

TRACE = trace_sim.synthetic_trace()
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"Mooncake's synthetic trace is not at {TRACE}")
SIZES = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 1.0)  # fractions of the unique blocks


@pytest.fixture(scope="module")
def trace() -> Trace:
    return trace_sim.load_trace(TRACE)


@pytest.fixture(scope="module")
def head() -> Trace:
    """The first 1,000 requests."""
    return trace_sim.load_trace(TRACE, requests=1000)


def test_readme_figures(trace):
    assert (len(trace.requests), trace.blocks, trace.unique) == (3993, 117_888, 40_148)
    assert replay(trace, LRU(trace.unique)).hit_ratio == pytest.approx(0.659, abs=5e-4)
    assert replay(trace, LRU(trace.pages(0.02))).hit_ratio == pytest.approx(0.077, abs=5e-4)
    assert replay(trace, LRU(trace.pages(0.40))).hit_ratio == pytest.approx(0.555, abs=5e-4)
    # the README's Belady broke ties head first; tail first it serves more, and is prefix-closed
    head_first = replay(trace, Belady(trace.pages(0.02), trace, tail_first=False))
    assert head_first.hit_ratio == pytest.approx(0.247, abs=5e-4)
    assert head_first.scattered > 0, "head first strands tails the prefix run cannot reach"
    tail_first = replay(trace, Belady(trace.pages(0.02), trace))
    assert tail_first.hit_ratio == pytest.approx(0.259, abs=5e-4)
    assert tail_first.scattered == 0


def test_belady_bounds_every_policy(head):
    """Belady (ties tail first) is the optimum of a prefix cache on this trace: at every size
    above LRU, and above every other policy, two tiers of as many pages in all included."""
    for fraction in SIZES:
        pages = head.pages(fraction)
        best = replay(head, Belady(pages, head))
        assert best.scattered == 0, fraction
        assert replay(head, LRU(pages)).hit_ratio <= best.hit_ratio, fraction
        if fraction not in (0.01, 0.1):
            continue
        for cache in (ARC(pages), AdmitOnSecondUse(pages), Belady(pages, head, tail_first=False)):
            assert replay(head, cache).hit_ratio <= best.hit_ratio, (fraction, type(cache).__name__)
        ram, disk = pages // 4, pages - pages // 4
        for placement in PLACEMENTS.values():
            two = replay(head, TwoTier(ram, LRU(disk), placement))
            assert two.hit_ratio <= best.hit_ratio, (fraction, placement.name)
        assert replay(head, TwoTier(ram, ARC(disk), PLACEMENTS["write-back"])).hit_ratio <= best.hit_ratio


def test_larger_caches_serve_more(head):
    """LRU and Belady are monotone in size; so is a write-through two-tier cache in each tier
    (the blocks RAM and disk see do not depend on either's size)."""
    for make in (LRU, lambda pages: Belady(pages, head)):
        ratios = [replay(head, make(head.pages(f))).hit_ratio for f in SIZES]
        assert ratios == sorted(ratios)
        assert ratios[0] == 0 and ratios[-1] == replay(head, LRU(head.unique)).hit_ratio > 0.1
    through = PLACEMENTS["write-through"]
    for ram in (0, 0.02):
        ratios = [replay(head, TwoTier(head.pages(ram), LRU(head.pages(d)), through)).hit_ratio for d in SIZES[::2]]
        assert ratios == sorted(ratios), ram
    ratios = [replay(head, TwoTier(head.pages(r), LRU(head.pages(0.1)), through)).hit_ratio for r in SIZES[::2]]
    assert ratios == sorted(ratios)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("fraction", [0.01, 0.05])
def test_no_disk_is_ram_alone(head, placement, fraction):
    pages = head.pages(fraction)
    alone = replay(head, LRU(pages))
    assert alone.ram_hits > 0
    assert replay(head, TwoTier(pages, LRU(0), PLACEMENTS[placement])) == alone


# RAM of one page (the last block published: a request's head), a disk that never evicts.
# Blocks are published tail first; each line says what RAM evicts and when a block reaches 2 uses.
BY_HAND = Trace(
    [
        [1, 2],  # evicts 2
        [3],  # evicts 1
        [1, 2],  # 1, 2 on disk if written by now; evicts 3, then 2 (at its 2nd use); 1, 2 at 2 uses
        [4],  # evicts 1 (2 uses)
        [1, 2, 3],  # evicts 4, then 3 (at its 2nd use), then 2
        [1],  # a RAM hit
        [5],  # evicts 1
        [6],  # evicts 5
        [6],  # a RAM hit; 6 at 2 uses, never evicted
    ]
)


@pytest.mark.parametrize(
    "placement, disk_hits, written",
    [
        ("write-through", 5, [1, 2, 3, 4, 5, 6]),  # each block at its first publish
        ("write-back", 5, [2, 1, 3, 4, 5]),  # each block at its first eviction; 6 is never evicted
        ("write-back-2nd-use", 2, [2, 1, 3]),  # at an eviction after 2 uses: 3 is too late for request 5's hit
        ("admit-2nd-use", 2, [2, 1, 3, 6]),  # at the 2nd use, evicted or not
    ],
)
def test_disk_writes_by_hand(placement, disk_hits, written):
    outcome = replay(BY_HAND, TwoTier(1, LRU(10), PLACEMENTS[placement]))
    assert outcome == Outcome(blocks=13, ram_hits=2, disk_hits=disk_hits, scattered=0, disk_writes=len(written))
    assert outcome.writes_per_disk_hit == len(written) / disk_hits


def test_disk_eviction_forces_a_write_again():
    """A block the disk evicted is written again when RAM evicts it next; one it holds is not."""
    trace = Trace([[1], [2], [3], [1], [4]])  # RAM 1, disk 1: 1 → disk, 2 replaces it, 3 …, 1 again
    outcome = replay(trace, TwoTier(1, LRU(1), PLACEMENTS["write-back"]))
    assert outcome == Outcome(blocks=5, ram_hits=0, disk_hits=0, scattered=0, disk_writes=4)
    trace = Trace([[1], [2], [1], [2]])  # RAM 1, disk 2: each block is on disk when RAM evicts it again
    outcome = replay(trace, TwoTier(1, LRU(2), PLACEMENTS["write-back"]))
    assert (outcome.disk_hits, outcome.disk_writes) == (2, 2)


def test_read_back_refreshes_the_disk_copy():
    """RAM 1, disk 2: block 1 read back from disk is refreshed there, so block 3's write evicts
    block 2 instead, and 1 is still on disk when RAM evicts it again (not written twice)."""
    trace = Trace([[1], [2], [3], [1], [4]])
    outcome = replay(trace, TwoTier(1, LRU(2), PLACEMENTS["write-back"]))
    assert outcome == Outcome(blocks=5, ram_hits=0, disk_hits=1, scattered=0, disk_writes=3)


def test_command_line(capsys):
    trace_sim.main(["--requests", "300", "--ram", "0.05", "--disk", "0.2"])
    out = capsys.readouterr().out
    assert "300 requests" in out
    for name in [*trace_sim.ONE_TIER, *PLACEMENTS]:
        assert f"| {name} |" in out
    with pytest.raises(SystemExit):
        trace_sim.parse_args(["--ram", "-0.1"])
