"""What a durable publish costs (issue 11): a 50K-token publish, side by side in one run.

A publish that returned survives a kill -9 of the daemon: each page's record (key, parent,
token ids) is written to shared memory before the reply, and a page the sealer had not
checksummed yet is sealed by recovery (kvd/durability/recovery.py). Printed as ratios:

1. over gRPC: p50 of publishing a fresh 50K-token prompt against an empty round trip;
2. in process: the publish call alone (records before the reply: the contract) against
   the same call followed by every checksum (the other way to make it durable: seal
   before the reply);
3. in process: the longest time one publish holds the event loop (the servicer runs it in
   steps and serves other calls between them), and recording a sealed batch's checksums;
4. a daemon killed as soon as the publish returned: the restart seals what the sealer had
   not, and the cost per GiB of that.

    python bench/bench_publish.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import tempfile
import time

import numpy as np

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess

TOKENS = 50_000
LAYOUTS = {  # 3,125 pages either way
    "2 KiB pages": PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float16"),
    "128 KiB pages": PageLayout(num_layers=8, num_kv_heads=4, head_dim=64, page_size=16, dtype="float16"),
}


def p50(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e3


def over_grpc(socket: str, layout: PageLayout, repeats: int) -> tuple[float, float]:
    """(publish p50, empty round trip p50) in ms, each publish of a fresh prompt."""
    with KVDClient.connect(socket) as c:
        ns = c.register_namespace(f"bench-publish-{layout.page_bytes}", layout)
        ping, publish = [], []
        for i in range(repeats):
            prompt = np.arange(TOKENS, dtype=np.int32) + i * TOKENS  # nothing to dedup against
            c.allocate_with_prefix(ns, [SequenceRequest(f"p{i}", prompt)])
            t = time.perf_counter()
            c.ping()
            ping.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.publish(ns, [f"p{i}"])
            publish.append(time.perf_counter() - t)
            c.release(ns, [f"p{i}"])
        return p50(publish), p50(ping)


def in_process(layout: PageLayout, repeats: int) -> tuple[float, float]:
    """(publish alone, publish + every checksum) p50 in ms, on the core without gRPC."""
    from kvd.cache.manager import KVCacheManager
    from kvd.cache.manager import SequenceRequest as CoreRequest
    from kvd.core.arena import Arena
    from kvd.core.namespaces import NamespaceIdentity, make_layout

    identity = NamespaceIdentity(
        "bench", make_layout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, layout.dtype)
    )
    m = KVCacheManager(
        Arena(1 << 30, 1 << 30, f"/kvdbench-publish-{os.getpid()}", lock_memory=False), prefix_reuse=True
    )
    try:
        session = m.open_session("bench", os.getpid()).id
        ns = m.catalog.register_namespace(identity)
        alone, sealed = [], []
        for i in range(repeats):
            for samples, seal in ((alone, False), (sealed, True)):
                tokens = (np.arange(TOKENS, dtype="<i4") + (2 * i + seal) * TOKENS).tobytes()
                m.allocate(session, ns.id, [CoreRequest("s", tokens)])
                m.integrity.apply(wait=True)  # nothing of the last round still hashing
                t = time.perf_counter()
                m.publish(session, ns.id, [("s", 0)])
                if seal:
                    m.integrity.apply(wait=True)
                samples.append(time.perf_counter() - t)
                m.integrity.apply(wait=True)
                m.release(session, ns.id, ["s"])
        return p50(alone), p50(sealed)
    finally:
        m.close()


def loop_time(layout: PageLayout, repeats: int) -> tuple[float, float, int, float, float]:
    """How long one publish holds the event loop at a time, in process: the servicer runs a
    ``PublishJob`` step by step and lets other calls run between steps. Returns (longest
    step, p50 of all steps, steps per publish, longest recording of a sealed batch, one full
    garbage collection of the heap), ms of the thread's CPU time (on a shared box, wall time
    also counts other processes' turns). The collector is off while steps are timed: a
    full collection lands in whichever step allocates when it is due, and is measured apart."""
    from kvd.cache.manager import KVCacheManager
    from kvd.cache.manager import SequenceRequest as CoreRequest
    from kvd.core.arena import Arena
    from kvd.core.namespaces import NamespaceIdentity, make_layout

    identity = NamespaceIdentity(
        "bench", make_layout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, layout.dtype)
    )
    m = KVCacheManager(Arena(1 << 30, 1 << 30, f"/kvdbench-loop-{os.getpid()}", lock_memory=False), prefix_reuse=True)
    try:
        session = m.open_session("bench", os.getpid()).id
        ns = m.catalog.register_namespace(identity)
        steps, applies, count = [], [], 0
        gc.disable()
        for i in range(repeats):
            tokens = (np.arange(TOKENS, dtype="<i4") + i * TOKENS).tobytes()
            m.allocate(session, ns.id, [CoreRequest("s", tokens)])
            job = m.publish_job(session, ns.id, [("s", 0)])
            done = False
            while not done:
                t = time.thread_time()  # CPU time: a step preempted by another process held no loop work
                done = job.step()
                steps.append(time.thread_time() - t)
                count += 1
            time.sleep(0.5)  # the sealer thread hashes every batch meanwhile
            sealed = 1
            while sealed:  # what the loop runs as each sealed batch comes back: one batch a call
                t = time.thread_time()
                sealed = m.integrity.apply()
                applies.append(time.thread_time() - t)
            m.integrity.apply(wait=True)
            m.release(session, ns.id, ["s"])
        gc.enable()
        t = time.thread_time()
        gc.collect()
        collection = time.thread_time() - t
        return max(steps) * 1e3, p50(steps), count // repeats, max(applies) * 1e3, collection * 1e3
    finally:
        gc.enable()
        m.close()


def killed_after_publish(tmp: str, layout: PageLayout) -> dict:
    """Publishes, kills the daemon as the call returns, restarts it: its recovery stats."""
    socket = os.path.join(tmp, "crash.sock")
    args = ("--host-bytes", "1GiB", "--extent-bytes", "512MiB", "--enable-prefix-reuse", "--log-level", "WARNING")
    daemon = DaemonProcess.start(socket, *args, log_path=os.path.join(tmp, "crash.log"))
    with KVDClient.connect(socket) as c:
        ns = c.register_namespace("bench-crash", layout)
        c.allocate_with_prefix(ns, [SequenceRequest("s", np.arange(TOKENS, dtype=np.int32))])
        c.publish(ns, ["s"])
        daemon.stop(signal.SIGKILL)
    daemon = DaemonProcess.start(socket, *args, log_path=os.path.join(tmp, "crash2.log"))
    try:
        with KVDClient.connect(socket) as c:
            return c.stats()["recovery"]
    finally:
        daemon.stop()
        daemon.clean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    repeats = 5 if args.quick else 20
    with tempfile.TemporaryDirectory() as tmp:
        socket = os.path.join(tmp, "kvd.sock")
        daemon = DaemonProcess.start(
            socket,
            "--host-bytes",
            "1GiB",
            "--enable-prefix-reuse",
            "--log-level",
            "WARNING",
            log_path=os.path.join(tmp, "kvd.log"),
        )
        try:
            print(f"1. publish of a fresh {TOKENS:,}-token prompt over gRPC (records before the reply)")
            for name, layout in LAYOUTS.items():
                publish, rt = over_grpc(socket, layout, repeats)
                print(
                    f"  {name:<14} publish p50 {publish:7.2f} ms vs empty round trip {rt:5.2f} ms "
                    f"= {publish / rt:5.1f}x"
                )
        finally:
            daemon.stop()
            daemon.clean()
        print("2. in process: the publish call alone vs the same call with every checksum before returning")
        for name, layout in LAYOUTS.items():
            alone, sealed = in_process(layout, repeats)
            print(
                f"  {name:<14} {alone:7.2f} ms vs {sealed:7.2f} ms = {sealed / alone:5.2f}x "
                f"({3125 * layout.page_bytes >> 20} MiB of pages)"
            )
        print("3. in process: the loop time one publish holds at a time (steps; sealed batches recorded)")
        for name, layout in LAYOUTS.items():
            longest, typical, count, apply, collection = loop_time(layout, repeats)
            print(
                f"  {name:<14} longest step {longest:5.2f} ms (p50 {typical:5.2f} ms, {count} steps a publish); "
                f"longest sealed batch recorded {apply:5.2f} ms (target <= 3 ms of loop time); "
                f"one full garbage collection of this heap {collection:6.1f} ms"
            )
        print("4. daemon killed as the publish returned, then restarted")
        for name, layout in LAYOUTS.items():
            r = killed_after_publish(tmp, layout)
            gib = r["resealed_pages"] * layout.page_bytes / (1 << 30)
            print(
                f"  {name:<14} recovered {r['recovered_pages']:,} pages, {r['resealed_pages']:,} sealed by recovery, "
                f"start-up recovery {r['seconds'] * 1e3:.1f} ms"
                + (f" ({r['seconds'] * 1e3 / gib:.0f} ms per GiB)" if gib else "")
            )


if __name__ == "__main__":
    main()
