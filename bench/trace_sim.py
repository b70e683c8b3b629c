"""Which pages a disk tier should hold, measured on a request trace before it is built (issue 30).

A simulation, no daemon: a trace in Mooncake's FAST'25 format (one JSON object a line:
``timestamp``, ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks, equal
ids for equal blocks with equal prefixes) is replayed, requests in order, through one cache
tier of N pages (LRU, Belady, ARC, LRU admitting on a second use) or through two tiers, RAM
of R pages above a disk of D pages, under four placements (which pages reach the disk, and
when). One block is one kvd page. bench/RESULTS.md has the study; tests/test_trace_sim.py
checks the figures of ../shared/traces/README.md and the accounting.

    python bench/trace_sim.py [--trace PATH] [--ram 0.02] [--disk 0.40] [--policies ...]
        [--disk-policies lru arc] [--requests N]

Sizes are fractions of the trace's unique full blocks, ``int(fraction * unique)`` pages.

**How hits are counted** (prefix runs, as kvd serves them): only a request's full blocks
count (the first ``input_length // 512`` ids; the last id may be a partial block). A
request's hit is the leading run of its full blocks found in the cache (RAM or disk): a
prefix cache cannot use block k once block k-1 missed. Blocks found past the first miss are
counted apart (``scattered``: present, not servable). After the lookup, every full block of
the request is published (inserted, or touched where present), **tail first**, as kvd
releases a chain (kvd/core/eviction.py): the head ends most recent, so an LRU evicts a
chain's tail before its head. A block found on disk is read back into RAM (promotion).

The README's figures and this model: its unbounded 0.659 and its LRU figures (0.077 at 2 %,
0.555 at 40 %) are this model's. (Published head first instead, an LRU evicts heads before
tails and serves 0.076 and 0.555: measured once with that variant, not kept here.) Its
Belady 0.247 at 2 % is this model's Belady breaking ties (blocks next used by the same
request) **head first** (``tail_first=False``); ties broken tail first, as by default here,
Belady serves **0.259** at 2 %.

**Belady** (offline: evict the block whose next use is furthest, a new block bypassing when
its own is) is the optimum of a plain cache: the blocks it has present at lookups (its hits
and ``scattered``) are the most any policy can have, so they bound every policy's prefix
hits from above. For a prefix cache it is otherwise only a heuristic, since a block is worth
nothing without its parents. On traces such as these, where every request that uses a block
uses its parent too (a parent's next use is never later than its child's), Belady with ties
broken tail first never holds a child without its parent: nothing is scattered, its prefix
hits reach the bound, and it is the optimum. Head first it strands tails and serves less.

Two tiers: RAM is an LRU that every published block enters (kvd publishes into host pages);
the disk is an LRU (``--disk-policies``: or an ARC) whose entries are refreshed when read
back and whenever the placement would write a block already there. A ``Placement`` says
when a block is written to disk: at publish (every use; write-through) or when RAM evicts
it (write-back), and after how many uses (1, or 2 as Dynamo KVBM's frequency filter admits
to disk). A block already on disk is not written again (pages are immutable), and a disk
copy stays when the block is promoted. Writes are counted in blocks: blocks written per
block served from disk is the SSD's cost of each disk hit.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

import numpy as np

from kvd.tiers.eviction import ArcPolicy, LruPolicy

BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
SYNTHETIC_TRACE = Path("shared", "traces", "synthetic_trace.jsonl")


def synthetic_trace() -> Path:
    """Mooncake's synthetic trace in ../shared/traces beside the checkout (or beside a folder
    above it, as for a worktree); the nearest one found, else the checkout's."""
    above = Path(__file__).resolve().parents[2:]
    return next((p / SYNTHETIC_TRACE for p in above if (p / SYNTHETIC_TRACE).exists()), above[0] / SYNTHETIC_TRACE)


@dataclass(frozen=True)
class Trace:
    """Each request's full blocks (hash ids, head first), requests in arrival order."""

    requests: list[list[int]]

    @property
    def blocks(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def unique(self) -> int:
        return len({b for r in self.requests for b in r})

    def pages(self, fraction: float) -> int:
        """A cache size given as a fraction of the unique blocks."""
        return int(fraction * self.unique)

    def next_uses(self) -> list[np.ndarray]:
        """For each request, the index of the next request using each of its blocks
        (``len(requests)`` when none does)."""
        lengths = np.array([len(r) for r in self.requests], np.int64)
        blocks = np.fromiter((b for r in self.requests for b in r), np.int64, int(lengths.sum()))
        request = np.repeat(np.arange(len(self.requests)), lengths)
        order = np.lexsort((request, blocks))  # by block, then by request
        following = np.full(len(blocks), len(self.requests), np.int64)
        same = blocks[order[1:]] == blocks[order[:-1]]
        following[order[:-1][same]] = request[order[1:][same]]
        return np.split(following, np.cumsum(lengths)[:-1])


def read_requests(path: Path, requests: int | None = None) -> list[dict]:
    """The first ``requests`` requests (all when None) of a FAST'25 trace, as its JSON objects."""
    with open(path) as lines:
        return [json.loads(line) for line in itertools.islice(lines, requests)]


def full_blocks(records: Sequence[dict]) -> Trace:
    """The requests' full blocks (the last hash id may be a partial block)."""
    return Trace([r["hash_ids"][: r["input_length"] // BLOCK_TOKENS] for r in records])


def load_trace(path: Path, requests: int | None = None) -> Trace:
    """The first ``requests`` requests (all when None) of a FAST'25 trace, full blocks only."""
    return full_blocks(read_requests(path, requests))


class Tier(Enum):
    RAM = "RAM"
    DISK = "disk"


@dataclass(frozen=True)
class Outcome:
    """A replay's counts, in blocks."""

    blocks: int  # full blocks requested
    ram_hits: int
    disk_hits: int
    scattered: int  # found in the cache past a request's first miss: not servable
    disk_writes: int

    @property
    def hit_ratio(self) -> float:
        return (self.ram_hits + self.disk_hits) / self.blocks

    @property
    def ram_ratio(self) -> float:
        return self.ram_hits / self.blocks

    @property
    def disk_ratio(self) -> float:
        return self.disk_hits / self.blocks

    @property
    def writes_per_disk_hit(self) -> float:
        return self.disk_writes / self.disk_hits if self.disk_hits else float("nan")


class Cache(Protocol):
    def locate(self, block: int) -> Tier | None:
        """Where the block is found (None: a miss)."""

    def publish(self, blocks: Sequence[int], request: int) -> None:
        """After request number ``request``: its full blocks (head first) published."""

    @property
    def disk_writes(self) -> int: ...


def replay(trace: Trace, cache: Cache) -> Outcome:
    """Every request in order: its prefix run looked up in ``cache``, then its blocks published."""
    hits = {Tier.RAM: 0, Tier.DISK: 0}
    scattered = 0
    for request, blocks in enumerate(trace.requests):
        for k, block in enumerate(blocks):
            tier = cache.locate(block)
            if tier is None:
                scattered += sum(cache.locate(b) is not None for b in blocks[k + 1 :])
                break
            hits[tier] += 1
        cache.publish(blocks, request)
    return Outcome(trace.blocks, hits[Tier.RAM], hits[Tier.DISK], scattered, cache.disk_writes)


class OneTier:
    """A cache of one tier, given ``__contains__`` and ``touch`` (insert or refresh a block):
    a request's blocks are touched tail first."""

    disk_writes = 0

    def __contains__(self, block: int) -> bool:
        raise NotImplementedError

    def touch(self, block: int) -> int | None:
        raise NotImplementedError

    def locate(self, block: int) -> Tier | None:
        return Tier.RAM if block in self else None

    def publish(self, blocks: Sequence[int], request: int) -> None:
        for block in reversed(blocks):
            self.touch(block)


class PolicyCache(OneTier):
    """A tier that evicts by one of the disk tier's policies (kvd/tiers/eviction.py), mixed in
    before it: the daemon's own classes, so the study measures what kvd runs."""

    def touch(self, block: int) -> int | None:
        """Inserts or refreshes ``block``; the block evicted to make room, if any (the block
        itself when the capacity is 0 and the policy keeps nothing)."""
        if block in self:
            self.hit(block)
            return None
        freed = self.admit(block)
        return freed[0] if freed else None


class LRU(LruPolicy, PolicyCache):
    """Least recently used first out."""


class AdmitOnSecondUse(LRU):
    """An LRU that a block enters only from its second use on (Dynamo KVBM's frequency filter)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._uses: Counter[int] = Counter()

    def publish(self, blocks: Sequence[int], request: int) -> None:
        for block in reversed(blocks):
            self._uses[block] += 1
            if self._uses[block] >= 2:
                self.touch(block)


class ARC(ArcPolicy, PolicyCache):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03), as the disk tier runs it."""


class Belady(OneTier):
    """The offline optimum of a plain cache: the block next used furthest ahead goes first (a
    new block too: bypassing is allowed). Ties, blocks next used by the same request, go tail
    first (the deepest block of its request first) or, ``tail_first=False``, head first."""

    def __init__(self, capacity: int, trace: Trace, tail_first: bool = True) -> None:
        self.capacity = capacity
        self._next_uses = trace.next_uses()
        self._tie = -1 if tail_first else 1
        self._next: dict[int, int] = {}  # block held → its next use
        self._heap: list[tuple[int, int, int]] = []  # (-next use, tie, block); stale entries skipped

    def __contains__(self, block: int) -> bool:
        return block in self._next

    def publish(self, blocks: Sequence[int], request: int) -> None:
        held, heap = self._next, self._heap
        for depth in reversed(range(len(blocks))):
            block, following = blocks[depth], int(self._next_uses[request][depth])
            held[block] = following
            heapq.heappush(heap, (-following, self._tie * depth, block))
            while len(held) > self.capacity:
                negative, _, victim = heapq.heappop(heap)
                if held.get(victim) == -negative:
                    del held[victim]
        if len(heap) > 4 * len(held) + 1024:
            self._heap = [entry for entry in heap if held.get(entry[2]) == -entry[0]]
            heapq.heapify(self._heap)


@dataclass(frozen=True)
class Placement:
    """When a block is written to disk: at each publish (write-through) or when RAM evicts it
    (write-back), once it has had ``min_uses`` uses (requests that used it)."""

    name: str
    at_publish: bool
    min_uses: int


PLACEMENTS = {
    p.name: p
    for p in (
        Placement("write-through", at_publish=True, min_uses=1),
        Placement("write-back", at_publish=False, min_uses=1),
        Placement("write-back-2nd-use", at_publish=False, min_uses=2),
        Placement("admit-2nd-use", at_publish=True, min_uses=2),
    )
}


class TwoTier:
    """RAM (an LRU of ``ram`` pages that every published block enters) above ``disk`` (an LRU
    or an ARC) that blocks reach as ``placement`` says."""

    def __init__(self, ram: int, disk: LRU | ARC, placement: Placement) -> None:
        self.ram, self.disk, self.placement = LRU(ram), disk, placement
        self.disk_writes = 0
        self._uses: Counter[int] = Counter()

    def locate(self, block: int) -> Tier | None:
        return Tier.RAM if block in self.ram else Tier.DISK if block in self.disk else None

    def publish(self, blocks: Sequence[int], request: int) -> None:
        placement = self.placement
        for block in reversed(blocks):
            if block in self.disk and block not in self.ram:
                self.disk.touch(block)  # read back at lookup: a disk hit, or a block found past a miss
        for block in reversed(blocks):
            self._uses[block] += 1
            evicted = self.ram.touch(block)
            if placement.at_publish:
                self._to_disk(block)
            elif evicted is not None:
                self._to_disk(evicted)

    def _to_disk(self, block: int) -> None:
        if self._uses[block] < self.placement.min_uses or not self.disk.capacity:
            return
        if block not in self.disk:
            self.disk_writes += 1
        self.disk.touch(block)


ONE_TIER: dict[str, Callable[[int, Trace], Cache]] = {
    "lru": lambda pages, trace: LRU(pages),
    "arc": lambda pages, trace: ARC(pages),
    "lru-2nd-use": lambda pages, trace: AdmitOnSecondUse(pages),
    "belady": Belady,
}
DISK_POLICIES: dict[str, Callable[[int], LRU | ARC]] = {"lru": LRU, "arc": ARC}


@dataclass(frozen=True)
class Study:
    """Every requested policy on one trace at one RAM and disk size."""

    ram: int
    disk: int
    one_tier: dict[str, tuple[Outcome, Outcome]]  # policy → (at RAM pages, at RAM + disk pages)
    two_tier: dict[tuple[str, str], Outcome]  # (placement, disk policy) → outcome
    lru_total: Outcome  # one LRU of RAM + disk pages: the reference
    belady_total: Outcome  # Belady of RAM + disk pages: the limit
    seconds: float


def study(trace: Trace, ram: int, disk: int, policies: Iterable[str], disk_policies: Iterable[str]) -> Study:
    start = time.perf_counter()
    policies = list(policies)
    singles = {
        name: (replay(trace, ONE_TIER[name](ram, trace)), replay(trace, ONE_TIER[name](ram + disk, trace)))
        for name in policies
        if name in ONE_TIER
    }
    doubles = {
        (name, on_disk): replay(trace, TwoTier(ram, DISK_POLICIES[on_disk](disk), PLACEMENTS[name]))
        for on_disk in disk_policies
        for name in policies
        if name in PLACEMENTS
    }
    lru_total = singles["lru"][1] if "lru" in singles else replay(trace, LRU(ram + disk))
    belady_total = singles["belady"][1] if "belady" in singles else replay(trace, Belady(ram + disk, trace))
    return Study(ram, disk, singles, doubles, lru_total, belady_total, time.perf_counter() - start)


def print_study(trace: Trace, s: Study, ram_fraction: float, disk_fraction: float) -> None:
    unbounded = replay(trace, LRU(trace.unique))
    print(
        f"{len(trace.requests):,} requests, {trace.blocks:,} full blocks, {trace.unique:,} unique; "
        f"an unbounded cache serves {unbounded.hit_ratio:.3f}. RAM {ram_fraction:.0%} = {s.ram:,} pages, "
        f"disk {disk_fraction:.0%} = {s.disk:,} pages ({s.seconds:.1f} s)\n"
    )
    if s.one_tier:
        print(
            f"| one tier | RAM ({s.ram:,} pages) | RAM + disk ({s.ram + s.disk:,} pages) | / LRU(R+D) | / Belady(R+D) |"
        )
        print("|---|---|---|---|---|")
        for name, (small, large) in s.one_tier.items():
            print(
                f"| {name} | {small.hit_ratio:.3f} | {large.hit_ratio:.3f} "
                f"| {large.hit_ratio / s.lru_total.hit_ratio:.3f} | {large.hit_ratio / s.belady_total.hit_ratio:.3f} |"
            )
        print()
    if s.two_tier:
        print(
            "| two tiers: placement | disk | hit | from RAM | from disk | blocks written | written / disk hit "
            "| / LRU(R+D) | / Belady(R+D) |",
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for (name, on_disk), o in s.two_tier.items():
            print(
                f"| {name} | {on_disk} | {o.hit_ratio:.3f} | {o.ram_ratio:.3f} | {o.disk_ratio:.3f} "
                f"| {o.disk_writes:,} | {o.writes_per_disk_hit:.2f} | {o.hit_ratio / s.lru_total.hit_ratio:.3f} "
                f"| {o.hit_ratio / s.belady_total.hit_ratio:.3f} |",
            )
        print(
            f"\nLRU of RAM + disk pages {s.lru_total.hit_ratio:.3f}, Belady {s.belady_total.hit_ratio:.3f}",
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    names = [*ONE_TIER, *PLACEMENTS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=synthetic_trace())
    parser.add_argument("--ram", type=float, default=0.02, help="RAM pages, a fraction of the unique blocks")
    parser.add_argument("--disk", type=float, default=0.40, help="disk pages, a fraction of the unique blocks")
    parser.add_argument("--policies", nargs="+", choices=names, default=names, metavar="POLICY", help=" ".join(names))
    parser.add_argument("--disk-policies", nargs="+", choices=list(DISK_POLICIES), default=list(DISK_POLICIES))
    parser.add_argument("--requests", type=int, default=None, help="only the trace's first requests")
    args = parser.parse_args(argv)
    if not (0 <= args.ram and 0 <= args.disk):
        parser.error("--ram and --disk are fractions ≥ 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    trace = load_trace(args.trace, args.requests)
    s = study(trace, trace.pages(args.ram), trace.pages(args.disk), args.policies, args.disk_policies)
    print_study(trace, s, args.ram, args.disk)


if __name__ == "__main__":
    main()
