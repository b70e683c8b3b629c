"""A request trace replayed through a real daemon with a RAM and a disk budget (issue 30),
beside what a simulated cache of as many pages serves.

A trace in Mooncake's FAST'25 format (``timestamp``, ``input_length``, ``output_length``,
``hash_ids`` of 512-token blocks; bench/trace_sim.py) is replayed, requests in order, by one
client through a `kvd serve` with prefix reuse, a host budget of ``--ram`` and a ``[disk]``
budget of ``--disk`` (fractions of the trace's unique full blocks), pages of 512 tokens (one
block, one page) in a tiny layout (1 layer, 1 KV head of 2: 4 KiB pages) so the bytes stay
small. Each block id becomes 512 token ids of its own (``block_tokens``). Each request does
what an engine with kvd does:

1. ``lookup`` of its prompt, and again while ``remote_pending_tokens > 0`` (the disk is
   promoting pages; at most ``--patience`` seconds, as the vLLM connector's lookahead asks
   again each step up to its ``lookup_patience_seconds``);
2. ``allocate_with_prefix`` of the prompt: its hit is the shared prefix;
3. ``publish`` of the prompt's full pages, ``extend`` by its output tokens, ``release``.

Printed per disk policy (``--policies``): kvd's hit ratio over the trace's full blocks (from
host memory and promoted from disk), a simulation of the same tiers (bench/trace_sim.py's
``TwoTier``: RAM an LRU of as many pages, write-back to a disk of the same policy and page
count, the policy being the daemon's own class), one LRU of RAM + disk pages (the issue's
reference, target >= 0.95x), Belady's optimum of RAM + disk pages, kvd's ratio to each, and
pages written to disk per page served from it (a disk hit: a page the request's first
lookup did not find in host memory and its allocation did). The daemon's disk counters
follow (written, given up by the policy, skipped, refused) and how many requests waited for
a promotion, and the invariants are checked at the end.

``--settle``: each request also waits until the pages evicted so far are written, as the
simulation's writes are instant (tests/test_bench_trace.py replays the trace's head so).

    python bench/bench_trace.py [--trace PATH] [--ram 0.02] [--disk 0.40]
        [--policies arc lru] [--min-uses 1] [--requests N] [--patience 5] [--settle] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trace_sim
from trace_sim import BLOCK_TOKENS, DISK_POLICIES, LRU, Belady, Outcome, Placement, Trace, TwoTier, replay

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess
from kvd.core.records import HEADER_BYTES, record_size
from kvd.diskstore.layout import BLOCK, SlotClass

LAYOUT = PageLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_size=BLOCK_TOKENS, dtype="float16")
MAX_CHUNK_SLOTS = 128  # slots per disk chunk: the disk's page count is a whole number of chunks
POLL_SECONDS = 0.002  # between two lookups of a request whose pages are being promoted


def block_tokens(block: int) -> np.ndarray:
    """The 512 token ids of hash id ``block``: int32 [512], distinct for distinct ids."""
    first = block * BLOCK_TOKENS
    assert 0 <= first < 2**31 - BLOCK_TOKENS, f"hash id {block} has no int32 token ids"
    return np.arange(first, first + BLOCK_TOKENS, dtype=np.int32)


def prompt_tokens(record: dict) -> np.ndarray:
    """A request's prompt: its blocks' token ids, the last block cut to the input length."""
    ids = [block_tokens(b) for b in record["hash_ids"]]
    return np.concatenate(ids)[: record["input_length"]] if ids else np.zeros(0, np.int32)


@dataclass(frozen=True)
class Sizes:
    """The daemon's budgets for ``ram_pages`` pages in host memory and ``disk_pages`` on disk."""

    ram_pages: int
    disk_pages: int  # a whole number of chunks: at least the pages asked for
    chunk_bytes: int

    @property
    def host_bytes(self) -> int:
        """As kvd/core/arena.py counts pages in one extent: their data, records and header."""
        return self.ram_pages * (LAYOUT.page_bytes + record_size(LAYOUT.page_size)) + HEADER_BYTES

    @property
    def disk_bytes(self) -> int:
        """The slot file's superblock and its chunks."""
        return BLOCK + self.disk_pages // self.slots_per_chunk * self.chunk_bytes

    @property
    def slots_per_chunk(self) -> int:
        return SlotClass(LAYOUT.page_bytes, LAYOUT.page_size).slots_in(self.chunk_bytes)


def sizes(ram_pages: int, disk_pages: int) -> Sizes:
    """Chunks of as many slots as divide ``disk_pages`` exactly (up to ``MAX_CHUNK_SLOTS``), or
    else of ``MAX_CHUNK_SLOTS`` with the last chunk's slots added."""
    slot = SlotClass(LAYOUT.page_bytes, LAYOUT.page_size)
    per_slot = slot.header_bytes + slot.data_bytes
    exact = max(n for n in range(1, MAX_CHUNK_SLOTS + 1) if disk_pages % n == 0) if disk_pages else 1
    per_chunk = exact if exact >= MAX_CHUNK_SLOTS // 4 else MAX_CHUNK_SLOTS
    chunks = max(1, -(-disk_pages // per_chunk))
    return Sizes(ram_pages, chunks * per_chunk, BLOCK + per_chunk * per_slot)


@dataclass(frozen=True)
class Replay:
    """One replay through the daemon, counted in pages (blocks)."""

    policy: str
    min_uses: int
    blocks: int  # full blocks requested
    hits: int  # allocated prefix pages
    disk_hits: int  # of those, pages the first lookup did not find in host memory
    disk: dict  # the daemon's disk counters at the end
    waited: int  # requests that asked again while pages were promoted
    impatient: int  # of those, requests whose promotion was still pending after the patience
    seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks

    @property
    def writes_per_disk_hit(self) -> float:
        return self.disk["written_pages"] / self.disk_hits if self.disk_hits else float("nan")


def run_daemon(
    records: Sequence[dict],
    size: Sizes,
    policy: str,
    min_uses: int,
    workdir: str,
    patience: float = 5.0,
    settle: bool = False,
) -> Replay:
    """Replays ``records`` through a fresh daemon whose disk directory is under ``workdir``;
    ``settle``: each request waits until the pages evicted so far are written (the
    simulation's instant writes: the daemon's policy then sees the simulation's order)."""
    run = tempfile.mkdtemp(prefix=f"trace-{policy}-", dir=workdir)
    os.mkdir(disk := os.path.join(run, "disk"))
    flags = (
        "--enable-prefix-reuse", "--host-bytes", str(size.host_bytes), "--extent-bytes", str(size.host_bytes),
        "--disk-path", disk, "--disk-bytes", str(size.disk_bytes), "--disk-chunk-bytes", str(size.chunk_bytes),
        "--disk-policy", policy, "--disk-min-uses", str(min_uses),
    )  # fmt: skip
    daemon = DaemonProcess.start(os.path.join(run, "kvd.sock"), *flags, log_path=os.path.join(run, "kvd.log"))
    hits = disk_hits = waited = impatient = 0
    started = time.perf_counter()
    try:
        with KVDClient.connect(daemon.socket, client_name="bench-trace") as client:
            ns = client.register_namespace("trace", LAYOUT)
            for i, record in enumerate(records):
                seq, tokens = f"r{i}", prompt_tokens(record)
                request = SequenceRequest(seq, tokens)
                [first] = client.lookup(ns, [request])
                answer, deadline = first, time.monotonic() + patience
                waited += answer.remote_pending_tokens > 0
                while answer.remote_pending_tokens > 0 and time.monotonic() < deadline:
                    time.sleep(POLL_SECONDS)
                    [answer] = client.lookup(ns, [request])
                impatient += answer.remote_pending_tokens > 0
                [alloc] = client.allocate_with_prefix(ns, [request])
                hit = alloc.shared_prefix_tokens // BLOCK_TOKENS
                hits += hit
                disk_hits += max(0, hit - first.hit_tokens // BLOCK_TOKENS)
                client.publish(ns, [seq])
                if record["output_length"]:
                    client.extend(ns, seq, record["output_length"])
                client.release(ns, [seq])
                while settle and client.stats()["disk"]["backlog_bytes"]:
                    time.sleep(POLL_SECONDS)
            seconds = time.perf_counter() - started
            stats = client.stats()["disk"]
            problems = client.check_invariants()
            assert not problems, problems
    finally:
        daemon.stop()
        daemon.clean()
    assert "Traceback" not in daemon.log(), daemon.log()
    shutil.rmtree(run)
    blocks = sum(r["input_length"] // BLOCK_TOKENS for r in records)
    return Replay(policy, min_uses, blocks, hits, disk_hits, stats, waited, impatient, seconds)


def simulate(trace: Trace, size: Sizes, policy: str, min_uses: int) -> Outcome:
    """The same tiers simulated: RAM an LRU, write-back to a disk of the daemon's policy class."""
    placement = Placement(f"write-back-{min_uses}", at_publish=False, min_uses=min_uses)
    return replay(trace, TwoTier(size.ram_pages, DISK_POLICIES[policy](size.disk_pages), placement))


def print_results(trace: Trace, size: Sizes, runs: list[tuple[Replay, Outcome]], ram: float, disk: float) -> None:
    total = size.ram_pages + size.disk_pages
    lru = replay(trace, LRU(total)).hit_ratio
    best = replay(trace, Belady(total, trace)).hit_ratio
    print(
        f"{len(trace.requests):,} requests, {trace.blocks:,} full blocks, {trace.unique:,} unique; "
        f"RAM {ram:.0%} = {size.ram_pages:,} pages, disk {disk:.0%} = {size.disk_pages:,} pages "
        f"({size.disk_pages // size.slots_per_chunk} chunks of {size.slots_per_chunk}), "
        f"pages of {LAYOUT.page_bytes} bytes"
    )
    print(f"one LRU of RAM + disk pages {lru:.3f}, Belady {best:.3f}\n")
    print(
        "| disk policy | min_uses | kvd hit (RAM + disk) | simulated | kvd / sim | kvd / LRU(R+D) | kvd / Belady "
        "| written / disk hit (sim) | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r, sim in runs:
        ram_ratio = (r.hits - r.disk_hits) / r.blocks
        print(
            f"| {r.policy} | {r.min_uses} | {r.hit_ratio:.3f} ({ram_ratio:.3f} + {r.disk_hits / r.blocks:.3f}) "
            f"| {sim.hit_ratio:.3f} ({sim.ram_ratio:.3f} + {sim.disk_ratio:.3f}) | {r.hit_ratio / sim.hit_ratio:.3f} "
            f"| {r.hit_ratio / lru:.3f} | {r.hit_ratio / best:.3f} "
            f"| {r.writes_per_disk_hit:.2f} ({sim.writes_per_disk_hit:.2f}) | {r.seconds:.0f} |"
        )
    print()
    for r, sim in runs:
        d = r.disk
        print(
            f"{r.policy}: written {d['written_pages']:,} pages (simulated {sim.disk_writes:,}), promoted "
            f"{d['fetched_pages']:,}, given up {d['evicted_pages']:,}, skipped {d['skipped_pages']:,}, "
            f"refused {d['refused_pages']:,}, errors {d['errors']}; {r.waited:,} requests waited for a promotion, "
            f"{r.impatient} past the patience"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=trace_sim.synthetic_trace())
    parser.add_argument("--ram", type=float, default=0.02, help="host pages, a fraction of the unique blocks")
    parser.add_argument("--disk", type=float, default=0.40, help="disk pages, a fraction of the unique blocks")
    parser.add_argument("--policies", nargs="+", choices=sorted(DISK_POLICIES), default=["arc", "lru"])
    parser.add_argument("--min-uses", type=int, default=1, help="[disk] min_uses")
    parser.add_argument("--requests", type=int, default=None, help="only the trace's first requests")
    parser.add_argument("--patience", type=float, default=5.0, help="seconds a request waits for a promotion")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier's files go")
    parser.add_argument("--settle", action="store_true", help="each request waits until the evicted pages are written")
    args = parser.parse_args(argv)
    if not (0 < args.ram and 0 < args.disk) or args.min_uses < 1:
        parser.error("--ram and --disk are fractions > 0, --min-uses >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    records = trace_sim.read_requests(args.trace, args.requests)
    trace = trace_sim.full_blocks(records)
    size = sizes(trace.pages(args.ram), trace.pages(args.disk))
    largest = max(-(-(r["input_length"] + r["output_length"]) // BLOCK_TOKENS) for r in records)
    if size.ram_pages < largest:
        raise SystemExit(f"RAM of {size.ram_pages} pages holds no request of {largest} pages: raise --ram")
    runs = []
    for policy in args.policies:
        run = run_daemon(records, size, policy, args.min_uses, args.dir, args.patience, args.settle)
        runs.append((run, simulate(trace, size, policy, args.min_uses)))
    print_results(trace, size, runs, args.ram, args.disk)


if __name__ == "__main__":
    main()
