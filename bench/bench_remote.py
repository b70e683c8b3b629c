"""The remote tier: host B obtaining a 50K-token prefix that host A computed, through Mooncake Store.

One ``mooncake_master`` and two daemons on loopback stand for two hosts. A publishes a
prompt of ``--tokens`` tokens (random K/V in pages of ``--page-kib`` KiB) and stores it
(write-behind); B then looks the prompt up until every page is fetched, verified and
published locally. Beside it, in the same run:

- A's local hit: the same prompt allocated on A, where it is cached (computing nothing);
- the same bytes over one plain loopback TCP socket (a child process sends, this one
  receives into a preallocated buffer), and one memcpy of them (each the best of three).

Prints each time and each throughput, and the ratios. Needs the ``remote`` extra.

    python bench/bench_remote.py --tokens 50000 --page-kib 256
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess
from engine_client.mooncake_master import MooncakeMaster

PAGE_SIZE = 16


def layout_for(page_kib: int) -> PageLayout:
    """float16 pages of 16 tokens, 8 KV heads of 128: ``page_kib`` KiB means page_kib / 64 layers."""
    layers = max(1, page_kib // 64)
    return PageLayout(num_layers=layers, num_kv_heads=8, head_dim=128, page_size=PAGE_SIZE, dtype="float16")


def start(workdir: str, name: str, master: MooncakeMaster, host_bytes: int, segment_bytes: int) -> DaemonProcess:
    args = ["--enable-prefix-reuse", "--host-bytes", str(host_bytes), "--extent-bytes", str(256 << 20)]
    args += master.daemon_args(str(segment_bytes))
    socket_path, log_path = os.path.join(workdir, f"{name}.sock"), os.path.join(workdir, f"{name}.log")
    return DaemonProcess.start(socket_path, *args, log_path=log_path)


def wait(predicate, what: str, timeout: float = 600.0, poll: float = 0.001):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout} s")
        time.sleep(poll)
    return value


def _send(port: int, nbytes: int) -> None:
    data = np.ones(nbytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(memoryview(data))


def socket_copy_seconds(nbytes: int) -> float:
    """Seconds to receive ``nbytes`` over one loopback TCP connection from another process."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf[::4096] = 0  # fault the buffer in first, as kvd's extents are
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = multiprocessing.get_context("spawn").Process(target=_send, args=(server.getsockname()[1], nbytes))
        sender.start()
        conn, _ = server.accept()
        with conn:
            got, started = 0, time.perf_counter()
            while got < nbytes:
                n = conn.recv_into(view[got:], min(nbytes - got, 8 << 20))
                if not n:
                    raise SystemExit("the sender stopped early")
                got += n
            seconds = time.perf_counter() - started
        sender.join()
    return seconds


def memcpy_seconds(nbytes: int) -> float:
    """The best of three copies of ``nbytes`` between resident buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return best


@dataclass
class Measured:
    publish: float  # seconds: A's publish call
    store: float  # seconds: publish to every page stored
    local: float  # seconds: A's local hit
    fetch: float  # seconds: B asks until the whole prefix hits
    equal: bool  # B's pages hold A's bytes
    remote: dict  # B's remote stats


def measure(a: KVDClient, b: KVDClient, layout, tokens: np.ndarray, pages: int) -> Measured:
    """A publishes the prompt into the store; B, which never saw it, obtains it from there."""
    for c in (a, b):
        wait(lambda c=c: c.stats()["remote"]["state"] == "up", "the store is up", 30, 0.05)
    ns_a, ns_b = a.register_namespace("bench", layout), b.register_namespace("bench", layout)
    # B has built its extents already, as a host that has served for a while has.
    other = np.random.default_rng(1).integers(0, 32000, len(tokens), dtype=np.int32)
    b.allocate_with_prefix(ns_b, [SequenceRequest("warm", other)])
    b.release(ns_b, ["warm"])

    [alloc] = a.allocate_with_prefix(ns_a, [SequenceRequest("p", tokens)])
    for i, page in enumerate(alloc.pages):
        a.page_array(ns_a, page)[...] = i % 251 + 1  # any bytes: the page's number
    started = time.perf_counter()
    a.publish(ns_a, ["p"])
    publish = time.perf_counter() - started
    wait(lambda: a.stats()["remote"]["stored_pages"] >= pages, "A stores the prompt")
    store = time.perf_counter() - started
    a.release(ns_a, ["p"])

    started = time.perf_counter()
    [hit] = a.allocate_with_prefix(ns_a, [SequenceRequest("again", tokens)])
    local = time.perf_counter() - started
    assert hit.shared_prefix_tokens == len(tokens), hit.shared_prefix_tokens
    a.release(ns_a, ["again"])

    started = time.perf_counter()
    ask = [SequenceRequest("ask", tokens)]
    wait(
        lambda: (r := b.lookup(ns_b, ask)[0]).hit_tokens == len(tokens) and not r.remote_pending_tokens,
        "B fetches the prompt",
    )
    fetch = time.perf_counter() - started
    [got] = b.allocate_with_prefix(ns_b, [SequenceRequest("q", tokens)])
    assert got.shared_prefix_tokens == len(tokens)
    equal = all(
        np.array_equal(b.page_array(ns_b, x), a.page_array(ns_a, y)) for x, y in zip(got.shared_pages, alloc.pages)
    )
    return Measured(publish, store, local, fetch, equal, b.stats()["remote"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=50_000)
    p.add_argument("--page-kib", type=int, default=256)
    args = p.parse_args()
    layout = layout_for(args.page_kib)
    pages = args.tokens // PAGE_SIZE
    tokens = np.random.default_rng(0).integers(0, 32000, pages * PAGE_SIZE, dtype=np.int32)
    page_bytes = layout.num_layers * 2 * PAGE_SIZE * layout.num_kv_heads * layout.head_dim * 2
    nbytes = pages * page_bytes
    host_bytes = nbytes + (512 << 20)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-remote-") as workdir:
        master = MooncakeMaster(os.path.join(workdir, "master.log"))
        master.start()
        daemons = []
        try:
            daemons = [start(workdir, name, master, host_bytes, nbytes + (256 << 20)) for name in ("a", "b")]
            with KVDClient.connect(daemons[0].socket) as a, KVDClient.connect(daemons[1].socket) as b:
                m = measure(a, b, layout, tokens, pages)
        finally:
            for d in daemons:
                d.stop()
                d.clean()
            master.kill()
    tcp = min(socket_copy_seconds(nbytes) for _ in range(3))
    copy = memcpy_seconds(nbytes)
    gb = nbytes / 1e9
    print(f"prompt: {len(tokens):,} tokens, {pages:,} pages of {page_bytes >> 10} KiB = {nbytes / 2**20:,.0f} MiB")
    print(f"A publish (gRPC, returns before the store):       {m.publish * 1e3:9.1f} ms")
    print(f"A store, publish to all pages stored:             {m.store * 1e3:9.1f} ms  {gb / m.store:6.2f} GB/s")
    print(f"A local hit (allocate, computes nothing):         {m.local * 1e3:9.1f} ms")
    print(f"B obtains the prefix from the store (ask → hit):  {m.fetch * 1e3:9.1f} ms  {gb / m.fetch:6.2f} GB/s")
    print(f"same bytes over one loopback TCP socket:          {tcp * 1e3:9.1f} ms  {gb / tcp:6.2f} GB/s")
    print(f"same bytes, one memcpy:                           {copy * 1e3:9.1f} ms  {gb / copy:6.2f} GB/s")
    print(
        f"B's fetch / local hit {m.fetch / m.local:.1f}x; / socket copy {m.fetch / tcp:.2f}x; "
        f"/ memcpy {m.fetch / copy:.1f}x"
    )
    print(
        f"B fetched {m.remote['fetched_pages']:,} pages, rejected {m.remote['rejected_pages']}; "
        f"bytes equal to A's: {m.equal}"
    )


if __name__ == "__main__":
    main()
