"""Host-side benchmarks of kvd: memory against the ideal, control-plane latency, data-plane bandwidth.

Every figure is printed as a ratio measured side by side in one run (these machines are
shared and noisy):

1. workload: 4 agents x a 50,000-token shared prefix + 1,000 private tokens (page_size 16),
   prefilled one after another and concurrently: physical/logical and physical/ideal pages.
2. control plane: p50/p99 of allocate_with_prefix for one 50K-token prompt (miss and hit)
   at page sizes 16, 64 and 256, against an empty gRPC round trip in the same run; calls/s
   and p50/p99 of decode-step extend batches of 64 sequences from 1 and 8 client processes
   and of 256 sequences from 8.
3. data plane: bytes/s writing and reading pages through page() views against numpy.copyto
   of the same bytes; reading published pages, whose views come from the read-only map.

    python bench/bench_host.py [--quick] [--allocate-only]

``--allocate-only`` runs section 2's 50K-token allocates alone (a figure to compare builds
with: run each build's tree in turn, e.g. ``PYTHONPATH=../other python bench/bench_host.py``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time

import numpy as np

from engine_client import ExtendItem, KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess

SPAWN = multiprocessing.get_context("spawn")
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float16")
BIG_LAYOUT = PageLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")  # 2 MiB pages


def agent_prompt(prefix: int, private: int, agent: int) -> np.ndarray:
    return np.concatenate(
        [np.arange(prefix, dtype=np.int32) % 50000, 50000 + agent * private + np.arange(private, dtype=np.int32)]
    )


def _agent(socket: str, model: str, agent: int, prefix: int, private: int, start, done, out) -> None:
    with KVDClient.connect(socket) as c:
        ns = c.register_namespace(model, LAYOUT)
        start.wait()
        c.allocate_with_prefix(ns, [SequenceRequest(f"agent{agent}", agent_prompt(prefix, private, agent))])
        c.publish(ns, [f"agent{agent}"])
        out.put(ns)
        done.wait()  # hold the sequences while the parent reads stats
        done.wait()


def workload(socket: str, concurrent: bool, prefix: int = 50_000, private: int = 1_000, agents: int = 4) -> dict:
    """Agent processes, each publishing before the next allocates, or all allocating at once."""
    model = "bench-concurrent" if concurrent else "bench-sequential"
    start = SPAWN.Barrier(agents if concurrent else 1)
    done = SPAWN.Barrier(agents + 1)
    out = SPAWN.Queue()
    procs = []
    with KVDClient.connect(socket) as observer:
        for i in range(agents):
            p = SPAWN.Process(target=_agent, args=(socket, model, i, prefix, private, start, done, out))
            p.start()
            procs.append(p)
            if not concurrent:
                ns = out.get()
        if concurrent:
            ns = [out.get() for _ in range(agents)][0]
        done.wait()
        [stats] = [n for n in observer.stats()["namespaces"] if n["namespace_id"] == ns]
        done.wait()
    for p in procs:
        p.join()
    ideal = prefix // 16 + agents * (-(-(prefix + private) // 16) - prefix // 16)
    return {"logical": stats["logical_pages"], "physical": stats["physical_pages"], "ideal": ideal}


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1e3, q))


PAGE_SIZES = (16, 64, 256)


def control_plane(socket: str, repeats: int) -> None:
    """allocate_with_prefix of one 50K-token prompt, miss and hit, at each page size; every
    call timed right after an empty round trip, so both see the same load."""
    with KVDClient.connect(socket) as c:
        prompt = np.arange(50_000, dtype=np.int32)
        for page_size in PAGE_SIZES:
            layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=page_size, dtype="float16")
            ns = c.register_namespace(f"bench-control-{page_size}", layout)
            ping, miss, hit = [], [], []
            for i in range(repeats):
                p = prompt.copy()
                p[0] = i + 1  # a fresh first page: the whole prompt misses
                t = time.perf_counter()
                c.ping()
                ping.append(time.perf_counter() - t)
                t = time.perf_counter()
                c.allocate_with_prefix(ns, [SequenceRequest(f"miss{i}", p)])
                miss.append(time.perf_counter() - t)
                c.release(ns, [f"miss{i}"])
            c.allocate_with_prefix(ns, [SequenceRequest("base", prompt)])
            c.publish(ns, ["base"])
            for i in range(repeats):
                t = time.perf_counter()
                c.ping()
                ping.append(time.perf_counter() - t)
                t = time.perf_counter()
                c.allocate_with_prefix(ns, [SequenceRequest(f"hit{i}", prompt)])
                hit.append(time.perf_counter() - t)
                c.release(ns, [f"hit{i}"])
            rt = percentile(ping, 50)
            print(f"  page_size {page_size:3}: empty round trip p50 {rt:6.3f} ms  p99 {percentile(ping, 99):6.3f} ms")
            for name, s, target in (("50K allocate, miss", miss, 1.3), ("50K allocate, hit", hit, 1.0)):
                print(
                    f"    {name:<20} p50 {percentile(s, 50):6.3f} ms  p99 {percentile(s, 99):6.3f} ms"
                    f"  = {percentile(s, 50) / rt:5.2f}x round trip  (target p50 <= {target} ms)"
                )
            c.release(ns, ["base"])


def _decoder(socket: str, tag: str, steps: int, batch: int, barrier, out) -> None:
    """One engine's decode loop: ``batch`` sequences, one token each per step.

    First ``steps`` extend batches back to back (throughput), then ``steps`` pairs of an
    empty round trip and an extend batch, timed one right after the other, so both see
    the same load from the other clients."""
    with KVDClient.connect(socket) as c:
        ns = c.register_namespace("bench-decode", LAYOUT)
        ids = [f"{tag}-{i}" for i in range(batch)]
        c.allocate_with_prefix(ns, [SequenceRequest(s, np.arange(100, dtype=np.int32)) for s in ids])
        items = [ExtendItem(s, 1, [7]) for s in ids]
        barrier.wait()
        t = time.perf_counter()
        for _ in range(steps):
            c.extend_batch(ns, items)
        rate = steps / (time.perf_counter() - t)
        barrier.wait()
        ping, extend = [], []
        for _ in range(steps):
            t = time.perf_counter()
            c.ping()
            ping.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.extend_batch(ns, items)
            extend.append(time.perf_counter() - t)
        out.put((rate, ping, extend))
        c.release(ns, ids)


def decode_batches(socket: str, clients: int, steps: int, batch: int = 64) -> None:
    barrier, out = SPAWN.Barrier(clients), SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_decoder, args=(socket, f"c{i}-{batch}", steps, batch, barrier, out))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    rate = sum(r[0] for r in results)
    ping = [x for r in results for x in r[1]]
    extend = [x for r in results for x in r[2]]
    rt = percentile(ping, 50)
    print(
        f"  {batch}-seq extend batch, {clients} client(s): {rate:8.0f} calls/s in all; side by side, extend p50"
        f" {percentile(extend, 50):6.3f} ms p99 {percentile(extend, 99):6.3f} ms vs empty round trip p50"
        f" {rt:6.3f} ms p99 {percentile(ping, 99):6.3f} ms = {percentile(extend, 50) / rt:4.2f}x (p50),"
        f" {percentile(extend, 99) / rt:4.2f}x (p99 / round trip p50)"
    )


def data_plane(socket: str, pages: int) -> None:
    with KVDClient.connect(socket) as c:
        ns = c.register_namespace("bench-data", BIG_LAYOUT)
        [a] = c.allocate_with_prefix(ns, [SequenceRequest("data", np.arange(pages * 16, dtype=np.int32))])
        import torch

        views = [c.page(ns, p) for p in a.pages]
        src = torch.randn(BIG_LAYOUT.page_shape).to(torch.bfloat16)
        dst = torch.empty_like(src)
        plain_src = np.random.randint(0, 1 << 16, size=BIG_LAYOUT.page_shape, dtype=np.uint16)
        plain = [np.empty_like(plain_src) for _ in range(pages)]
        nbytes = pages * BIG_LAYOUT.page_bytes
        for v in views:  # warm both sides
            v.copy_(src)
        for p in plain:
            np.copyto(p, plain_src)
        timings = {}
        for name, fn in (
            ("numpy.copyto write", lambda: [np.copyto(p, plain_src) for p in plain]),
            ("page() view write", lambda: [v.copy_(src) for v in views]),
            ("numpy.copyto read", lambda: [np.copyto(plain_src, p) for p in plain]),
            ("page() view read", lambda: [dst.copy_(v) for v in views]),
        ):
            best = min(_timed(fn) for _ in range(5))
            timings[name] = nbytes / best
        c.publish(ns, ["data"])  # published pages come through the read-only map
        published = [c.page(ns, p) for p in a.pages[:pages]]
        assert not c.page_array(ns, a.pages[0]).flags.writeable
        for v in published:
            dst.copy_(v)
        timings["page() view read, published"] = nbytes / min(
            _timed(lambda: [dst.copy_(v) for v in published]) for _ in range(5)
        )
        for kind, base_kind in (("write", "write"), ("read", "read"), ("read, published", "read")):
            ours, base = timings[f"page() view {kind}"], timings[f"numpy.copyto {base_kind}"]
            print(
                f"  {kind:<15} {ours / 1e9:6.2f} GB/s through page() vs {base / 1e9:6.2f} GB/s numpy.copyto"
                f" = {ours / base:4.2f} (target >= 0.8)"
            )
        c.release(ns, ["data"])
        c.reset_prefix_cache(ns)  # a second run must write fresh private pages, not hit these


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--allocate-only", action="store_true", help="only section 2's 50K-token allocates")
    args = ap.parse_args()
    repeats = 30 if args.quick else 200
    with tempfile.TemporaryDirectory() as tmp:
        socket = os.path.join(tmp, "kvd.sock")
        daemon = DaemonProcess.start(
            socket,
            "--host-bytes",
            "2GiB",
            "--enable-prefix-reuse",
            "--log-level",
            "WARNING",
            log_path=os.path.join(tmp, "kvd.log"),
        )
        try:
            if args.allocate_only:
                print("2. control plane")
                control_plane(socket, repeats)
                return
            print("1. workload: 4 agents x 50,000 shared + 1,000 private tokens, page_size 16")
            for concurrent in (False, True):
                r = workload(socket, concurrent)
                print(
                    f"  {'concurrent' if concurrent else 'sequential'} prefill: "
                    f"logical {r['logical']} physical {r['physical']}"
                    f" ideal {r['ideal']}: physical/logical {r['physical'] / r['logical']:.3f},"
                    f" physical/ideal {r['physical'] / r['ideal']:.3f} (target 1.00)"
                )
            print("2. control plane")
            control_plane(socket, repeats)
            for clients, batch in ((1, 64), (8, 64), (8, 256)):
                decode_batches(socket, clients, 100 if args.quick else 500, batch)
            print("3. data plane (2 MiB pages, 256 MiB)")
            data_plane(socket, 128)
        finally:
            daemon.stop()
            daemon.clean()


if __name__ == "__main__":
    main()
