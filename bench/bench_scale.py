"""kvd at the size of a real 8-GPU host (issue 41): per-page costs at a million host pages.

One run fills a real daemon, through the client, with distinct 50K-token prompts
(allocate with prefix, publish, release: 3,125 new pages each) until it holds ``--pages``
host pages, and prints side by side with the box's floor (an empty gRPC round trip):

- the fill rate: pages a second and µs a page, against three empty round trips a prompt;
- the daemon's private memory per host page held: its RssAnon (heap, Python objects,
  arrays; shared memory excluded) after the fill, minus the same daemon's before it
  (namespace registered, nothing allocated), over the pages held;
- a 50K-token hit's p50 (``allocate_with_prefix`` of a held prompt, all 3,125 pages shared)
  with 12.5K pages held against with ``--pages`` held.

Then the same page count through bench/scale_tiers.py, each beside its target or floor: a
warm restart after ``kill -9`` (first answer, every page hittable), a graceful stop that
writes the host pages to the disk tier (beside the disk's sequential write bandwidth, as
bench/bench_disk.py measures it), the start after a reboot on that disk tier (first answer,
all indexed) and the daemon's private memory per disk page (``--host-only`` skips them).

    python bench/bench_scale.py                      # 1M pages of 4 KiB (~4.2 GiB of /dev/shm, ~8 GiB of disk)
    python bench/bench_scale.py --pages 10000000 --page-kib 1 --host-only   # 10M pages of 1 KiB (~11 GiB)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import scale_tiers
from footprint import cpu_seconds, host_memory

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess

TOKENS = 50_000
PAGE_SIZE = 16
PROMPT_PAGES = TOKENS // PAGE_SIZE  # 3,125
SMALL_PAGES = 4 * PROMPT_PAGES  # the "12K pages" a hit is compared at
RECORD_BYTES = 64 + 4 * PAGE_SIZE  # a page's metadata record (kvd/core/records.py), in the budget
HITS = 51  # hits timed at each size
PINGS = 200


def layout_of(page_kib: int) -> PageLayout:
    """16 tokens, 1 layer, 1 KV head, float16: head_dim 64 makes a 4 KiB page, 16 a 1 KiB one."""
    return PageLayout(num_layers=1, num_kv_heads=1, head_dim=page_kib * 16, page_size=PAGE_SIZE, dtype="float16")


def prompt(i: int) -> np.ndarray:
    """Prompt ``i``'s token ids: distinct from every other prompt's from the first page on."""
    return np.arange(TOKENS, dtype=np.int32) + i * TOKENS


@dataclass
class Figures:
    pages: int  # host pages held after the fill
    fill_seconds: float
    fill_cpu: float  # the daemon's CPU seconds during the fill (its threads together)
    fill_loop_cpu: float  # of which its event loop's thread (the one core calls wait for)
    prompt_p50: float  # seconds of one prompt's allocate + publish + release, p50
    round_trip: float  # an empty round trip's p50, seconds
    idle_anon: int  # the daemon's RssAnon before the fill, bytes
    filled_anon: int  # and after it
    hit_small: float  # a 50K-token hit's p50 at SMALL_PAGES, seconds
    hit_large: float  # and at ``pages``

    def report(self) -> str:
        rate = self.pages / self.fill_seconds
        per_page = self.fill_seconds / self.pages
        floor_per_page = 3 * self.round_trip / PROMPT_PAGES
        memory = (self.filled_anon - self.idle_anon) / self.pages
        return "\n".join(
            [
                f"empty round trip p50 (the floor): {self.round_trip * 1e6:.0f} µs",
                f"fill: {self.pages:,} pages in {self.fill_seconds:.1f} s = {rate:,.0f} pages/s, "
                f"{per_page * 1e6:.2f} µs a page (target >= 100,000 pages/s, <= 10 µs); a prompt's "
                f"3 calls p50 {self.prompt_p50 * 1e3:.1f} ms = {self.prompt_p50 / (3 * self.round_trip):.0f}x "
                f"3 round trips ({floor_per_page * 1e6:.3f} µs a page); the daemon's CPU "
                f"{self.fill_cpu / self.pages * 1e6:.2f} µs a page, its event loop's thread "
                f"{self.fill_loop_cpu / self.pages * 1e6:.2f} µs = {self.pages / self.fill_loop_cpu:,.0f} pages/s "
                "on one core",
                f"daemon private memory: {self.idle_anon / 2**20:.0f} MiB idle, {self.filled_anon / 2**20:.0f} MiB "
                f"filled: {memory:.0f} B a host page (target <= 128 B)",
                f"50K-token hit p50: {self.hit_small * 1e3:.2f} ms at {SMALL_PAGES:,} pages, "
                f"{self.hit_large * 1e3:.2f} ms at {self.pages:,} = {self.hit_large / self.hit_small:.2f}x "
                f"(target <= 1.2x); {self.hit_large / self.round_trip:.0f}x a round trip",
            ]
        )


def anon_bytes(pid: int) -> int:
    """The process's private resident memory, shared memory excluded."""
    return host_memory(pid).anon_bytes


def cpu(pid: int) -> tuple[float, float]:
    """The daemon's CPU seconds so far: all its threads, and its main thread's (the event loop's)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return cpu_seconds(pid), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_trip(c: KVDClient) -> float:
    samples = []
    for _ in range(PINGS):
        t = time.perf_counter()
        c.ping()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def hit_p50(c: KVDClient, ns: int, prompts: int) -> float:
    """p50 of a 50K-token hit on held prompts (spread over the ``prompts`` held), released after."""
    samples = []
    for i in range(HITS):
        which = i * 7919 % prompts
        t = time.perf_counter()
        (got,) = c.allocate_with_prefix(ns, [SequenceRequest("hit", prompt(which))])
        samples.append(time.perf_counter() - t)
        assert got.shared_prefix_tokens >= TOKENS - PAGE_SIZE, f"prompt {which} hit only {got.shared_prefix_tokens}"
        c.release(ns, ["hit"])
    return float(np.median(samples))


def fill(c: KVDClient, ns: int, start: int, stop: int) -> list[float]:
    """Prompts [start, stop) allocated, published and released; each prompt's seconds."""
    times = []
    for i in range(start, stop):
        t = time.perf_counter()
        c.allocate_with_prefix(ns, [SequenceRequest("p", prompt(i))])
        c.publish(ns, ["p"])
        c.release(ns, ["p"])
        times.append(time.perf_counter() - t)
    return times


def measure(tmp: str, pages: int, page_kib: int) -> Figures:
    layout = layout_of(page_kib)
    prompts = -(-pages // PROMPT_PAGES)
    extent_pages = min(1 << 16, (256 << 20) // layout.page_bytes)
    budget = (prompts * PROMPT_PAGES + extent_pages) * (layout.page_bytes + RECORD_BYTES) + (1 << 20)
    socket = os.path.join(tmp, "kvd.sock")
    args = ("--host-bytes", str(budget), "--extent-bytes", str(extent_pages * layout.page_bytes))
    daemon = DaemonProcess.start(
        socket, *args, "--enable-prefix-reuse", "--log-level", "WARNING", log_path=os.path.join(tmp, "kvd.log")
    )
    pid = daemon.process.pid
    try:
        with KVDClient.connect(socket) as c:
            ns = c.register_namespace("bench-scale", layout)
            rt = round_trip(c)
            time.sleep(0.5)
            idle = anon_bytes(pid)
            small = SMALL_PAGES // PROMPT_PAGES
            start = cpu(pid)
            times = fill(c, ns, 0, small)
            paused = cpu(pid)
            hit_small = hit_p50(c, ns, small)
            resumed = cpu(pid)
            times += fill(c, ns, small, prompts)
            time.sleep(1.0)  # the sealer's last batches recorded
            end = cpu(pid)
            used = [e - r + p - s for s, p, r, e in zip(start, paused, resumed, end)]
            filled = anon_bytes(pid)
            hit_large = hit_p50(c, ns, prompts)
        return Figures(
            prompts * PROMPT_PAGES, sum(times), *used, float(np.median(times)), rt, idle, filled, hit_small, hit_large
        )
    finally:
        daemon.stop(signal.SIGKILL)  # a graceful stop of a full daemon only keeps what clean removes
        daemon.clean()


def tier_figures(tmp: str, pages: int, disk_dir: str) -> list[str]:
    """The restart and disk figures for the same page count (bench/scale_tiers.py measures
    each in a function that returns a dict), each beside its target or floor: lines to print."""
    warm = scale_tiers.warm_restart(pages, tmp)
    work = tempfile.mkdtemp(dir=disk_dir)
    try:
        reboot = scale_tiers.reboot_start(pages, tmp, work)
    finally:
        shutil.rmtree(work)
    disk = scale_tiers.disk_write_bandwidth(disk_dir)["disk_write_mb_per_second"]
    return [
        f"warm restart after kill -9, {warm['pages']:,} pages: first answer {warm['first_answer_seconds']:.2f} s "
        f"(target <= 1 s; the daemon's own {warm['daemon_serving_after_ms']:.0f} ms), every page hittable "
        f"{warm['all_hittable_seconds']:.1f} s = {warm['all_hittable_seconds_per_million']:.1f} s per million "
        "(target <= 5 s)",
        f"start after a reboot with the disk tier, {reboot['disk_pages']:,} disk pages: first answer "
        f"{reboot['first_answer_seconds']:.2f} s (target <= 1 s), all indexed "
        f"{reboot['all_indexed_seconds_per_million']:.1f} s per million (target <= 5 s); daemon private memory "
        f"{reboot['daemon_private_bytes_per_disk_page']} B a disk page (target <= 64 B)",
        f"graceful stop writing {reboot['stop_written_pages']:,} host pages: "
        f"{reboot['stop_write_pages_per_second']:,} pages/s, {reboot['stop_write_mb_per_second']:.0f} MB/s "
        f"= {reboot['stop_write_mb_per_second'] / disk:.2f}x the disk's sequential write bandwidth ({disk:.0f} MB/s) "
        "(target >= 100,000 pages/s, or >= 0.8x the disk where that is lower)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1_000_000, help="host pages to fill (rounded up to whole prompts)")
    ap.add_argument("--page-kib", type=int, default=4, choices=(1, 2, 4), help="page size: 4 KiB, or 1 KiB for 10M")
    ap.add_argument("--disk-dir", default="/var/tmp", help="where the disk tier's file goes (a real disk, not tmpfs)")
    ap.add_argument("--host-only", action="store_true", help="the host-page figures only: no restart or disk tier")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{args.pages:,} host pages of {args.page_kib} KiB (16 tokens), filled by {TOKENS:,}-token prompts")
        print(measure(tmp, args.pages, args.page_kib).report(), flush=True)
        if not args.host_only:
            for line in tier_figures(tmp, args.pages, args.disk_dir):
                print(line, flush=True)


if __name__ == "__main__":
    main()
