"""How long the daemon's event loop is held at a stretch while one client sends the largest
calls the limits allow (issue 17), measured in process.

The daemon (``kvd.server.daemon``'s ``_Daemon``, built as ``kvd serve`` builds it, with its garbage
collector policy and GIL switch interval) runs on this process's event loop beside a probe
task that sleeps 1 ms at a time and records how late it wakes. A client process sends the
heavy client's calls of bench/bench_fairness.py one at a time: a Lookup of two 4M-id
sequences (through the token buffer) and one of 4,096 sequences with 4 LoRA keys each; with
``--allocate``, allocations of the same (each released again). Printed per kind of call:
its duration, and the probe's longest lateness while it ran (p50 and max over the calls),
i.e. the longest the loop was held. With ``--floor`` the client loads a second daemon (a
child process) instead: the same CPU load on the box, nothing asked of this loop, so what
scheduling alone does to the probe. uvloop's timers have 1 ms resolution: lateness under
~1 ms is noise.

    python bench/bench_loop_stall.py [--calls 10] [--allocate] [--floor]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import time

import numpy as np
import uvloop
from bench_fairness import LAYOUT, largest_calls

from engine_client import KVDClient
from engine_client.launch import DaemonProcess
from kvd import collector
from kvd.config import ServeConfig
from kvd.server import daemon as server

SPAWN = multiprocessing.get_context("spawn")


def client(socket: str, calls: int, allocate: bool, report) -> None:
    """Sends ``calls`` rounds of the largest calls; reports (kind, start, end) of each, on
    the monotonic clock this process shares with the daemon's."""
    big, wide = largest_calls()
    done = []
    with KVDClient.connect(socket, client_name="heavy") as c:
        ns = c.register_namespace("stall", LAYOUT)
        for i in range(calls + 1):  # the first round opens the token buffer and builds extents: not counted
            for kind, requests in (("8M ids", big), ("4,096 x 4 LoRA keys", wide)):
                started = time.monotonic()
                if allocate:
                    c.allocate_with_prefix(ns, requests)
                else:
                    c.lookup(ns, requests)
                if i:
                    done.append((kind, started, time.monotonic()))
                if allocate:
                    c.release(ns, [r.seq_id for r in requests])
    report.put(done)


async def measure(args: argparse.Namespace) -> None:
    sys.setswitchinterval(server.GIL_SWITCH_SECONDS)
    with tempfile.TemporaryDirectory() as tmp:
        config = ServeConfig(socket=f"{tmp}/kvd.sock", host_bytes=4 << 30, enable_prefix_reuse=True, lock_memory=False)
        daemon = server._Daemon(config, None)
        await daemon.start()
        gc_policy = collector.Collector().install()
        other = None
        if args.floor:
            other = DaemonProcess.start(
                f"{tmp}/other.sock", "--enable-prefix-reuse", "--host-bytes", "4GiB", log_path=f"{tmp}/other.log"
            )
        late: list[tuple[float, float]] = []  # (woke at, seconds late)

        async def probe() -> None:
            while True:
                started = time.monotonic()
                await asyncio.sleep(0.001)
                woke = time.monotonic()
                late.append((woke, woke - started - 0.001))

        task = asyncio.create_task(probe())
        report = SPAWN.Queue()
        target = other.socket if other is not None else config.socket
        p = SPAWN.Process(target=client, args=(target, args.calls, args.allocate, report))
        p.start()
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(None, report.get)
        await loop.run_in_executor(None, p.join)
        task.cancel()
        if other is not None:
            other.stop()
            other.clean()
        gc_policy.uninstall()
        await daemon.stop(keep_cache=False)  # a benchmark's cache is not worth keeping
    for kind in dict.fromkeys(k for k, _, _ in done):
        calls = [(start, end) for k, start, end in done if k == kind]
        # a wake up to 2 ms after the call's end was due during it
        held = [max((x for woke, x in late if start <= woke <= end + 0.002), default=0.0) for start, end in calls]
        print(
            f"{kind} ({'allocate' if args.allocate else 'lookup'}{', floor' if args.floor else ''}): "
            f"call p50 {np.median([end - start for start, end in calls]) * 1e3:.1f} ms; longest loop stall per call "
            f"p50 {np.median(held) * 1e3:.2f} ms, max {max(held) * 1e3:.2f} ms ({len(calls)} calls)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--allocate", action="store_true", help="allocate (and release) instead of looking up")
    parser.add_argument("--floor", action="store_true", help="the client loads a second daemon: the box's floor")
    uvloop.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
