"""A second vLLM process's time to first token on a prompt whose prefix kvd serves from its
disk tier, with and without a prewarm beforehand, beside the same prefix from host memory and
a cold prefill, in one run (CPU backend).

    python bench/bench_vllm_disk.py [--prefix 16384] [--suffix 256] [--rounds 3] [--disk-dir /var/tmp]

One kvd daemon with a disk tier (a directory on a local file system; direct I/O where it
allows, so reads come from the device, not the page cache) and two vLLM processes on the
random Llama of bench/bench_vllm.py. `first` computes three prefixes per round: the `disk`
and `prewarmed` ones, each followed by a reset of kvd's prefix cache (its pages leave host memory as an
eviction takes them: written back to disk, waited for), then the `ram` ones; it stops.
`second`, warmed up by a prefill and a load from kvd, then answers three prompts a round
(a prefix and a suffix of its own, one token generated; its own prefix cache emptied
first), in an order that rotates with the round, so that the box's load falls on all
four alike:

- disk: the prefix is on disk only: kvd promotes it into host memory while the connector's
  lookahead asks again, then the connector loads it;
- prewarmed: the prefix is on disk only, and a router's prewarm (kvd.wire.admin.prewarm)
  promoted it before the request (not timed: a router prewarms ahead of the request);
- ram: the prefix is in host memory;
- cold: a prompt nothing holds; vLLM computes all of it (through the connector, which
  finds nothing: bench/bench_vllm.py measures that overhead against vLLM alone).

Printed: each round's four times and the ratios disk / ram, prewarmed / disk, prewarmed /
ram and disk / cold, and their medians; the pages the disk promoted during each request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from bench_vllm import ttft, write_model
from test_vllm_connector import Engine, unlink_vllm_shared_memory

from engine_client import KVDClient
from engine_client.launch import DaemonProcess
from kvd.wire.admin import prewarm

KINDS = ("disk", "prewarmed", "ram", "cold")
ON_DISK = ("disk", "prewarmed")


def disk_stats(socket: str) -> dict:
    with KVDClient.connect(socket, client_name="bench") as kvd:
        return kvd.stats()["disk"]


def leave_host_memory(socket: str) -> None:
    """Resets kvd's prefix cache (every cached page unpublished, as an eviction would) and
    waits until the disk wrote them all back."""
    with KVDClient.connect(socket, client_name="bench") as kvd:
        written = disk_stats(socket)["written_pages"] + kvd.reset_prefix_cache()["dropped_pages"]
    while (disk := disk_stats(socket))["backlog_bytes"]:
        time.sleep(0.05)
    assert disk["written_pages"] == written, f"not every page dropped was written to disk: {disk}"


def prewarmed(socket: str, prefix: list[int]) -> None:
    """Has kvd promote the prefix from disk, as a router would ahead of its request, and
    waits until the promotion ended."""
    with KVDClient.connect(socket, client_name="bench") as kvd:
        [ns] = kvd.stats()["namespaces"]
        [warm] = prewarm(socket, [prefix], namespace=ns["namespace_id"])["prompts"]
        assert warm["pending_tokens"] > 0, f"nothing of the prefix on disk to prewarm: {warm}"
        while kvd.stats()["prewarm"]["pending_tokens"]:
            time.sleep(0.01)


def timed(second, socket: str, tokens: list[int]) -> tuple[float, int, int]:
    """Seconds to one token on `second` (its own prefix cache emptied), prompt tokens loaded
    from kvd, and pages the disk promoted meanwhile."""
    before = disk_stats(socket)["fetched_pages"]
    seconds, hits = ttft(second, tokens)
    return seconds, hits, disk_stats(socket)["fetched_pages"] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--disk-dir", default="/var/tmp", help="where the disk tier's directory is made")
    args = parser.parse_args()

    os.environ["VLLM_ENGINE_MAX_MODEL_LEN"] = str(args.prefix + args.suffix + 64)  # read by tests/vllm_engine.py
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1, 999, n)]

    prefixes = {kind: [ids(args.prefix) for _ in range(args.rounds)] for kind in (*ON_DISK, "ram")}
    with tempfile.TemporaryDirectory() as workdir, tempfile.TemporaryDirectory(dir=args.disk_dir) as disk:
        model = os.path.join(workdir, "model")
        write_model(model, args.layers, args.hidden)
        socket = os.path.join(workdir, "kvd.sock")
        daemon = DaemonProcess.start(
            socket,
            "--enable-prefix-reuse",
            "--host-bytes", "4GiB",
            "--disk-path", disk, "--disk-bytes", "2GiB",
            log_path=os.path.join(workdir, "kvd.log"),
        )  # fmt: skip
        engines = {name: Engine(name, model, workdir, socket) for name in ("first", "second")}
        try:
            for engine in engines.values():
                engine.wait_ready(timeout=600)
            first, second = engines["first"], engines["second"]
            warm = ids(args.prefix + args.suffix)  # warm-up: a prefill, then a load from kvd
            second.generate([{"tokens": warm}], max_tokens=1)
            ttft(second, warm)
            for prefix in prefixes["disk"] + prefixes["prewarmed"]:
                first.generate([{"tokens": prefix + ids(args.suffix)}], max_tokens=1)
                leave_host_memory(socket)
            for prefix in prefixes["ram"]:
                first.generate([{"tokens": prefix + ids(args.suffix)}], max_tokens=1)
            first.stop()  # its pages stay in kvd; an idle engine would only take CPU from the timed one
            rounds = []
            for r in range(args.rounds):
                got = {}
                for kind in KINDS[r % 4 :] + KINDS[: r % 4]:
                    prefix = prefixes[kind][r] if kind != "cold" else ids(args.prefix)
                    if kind == "prewarmed":
                        prewarmed(socket, prefix)
                    got[kind] = timed(second, socket, prefix + ids(args.suffix))
                rounds.append(got)
                print(
                    f"round {r + 1}: "
                    + ", ".join(f"{k} {got[k][0] * 1000:,.0f} ms ({got[k][1]:,} tokens loaded)" for k in KINDS)
                    + "; pages the disk promoted during the request: "
                    + ", ".join(f"{k} {got[k][2]}" for k in ON_DISK),
                    flush=True,
                )
            report(args, rounds, disk_stats(socket))
        finally:
            for engine in engines.values():
                engine.stop()
            unlink_vllm_shared_memory(set().union(*(engine.shared_memory for engine in engines.values())))
            daemon.stop()
            daemon.clean()


def report(args, rounds: list[dict], disk: dict) -> None:
    med = statistics.median
    times = {k: [r[k][0] for r in rounds] for k in KINDS}
    print(
        f"prompt {args.prefix + args.suffix:,} tokens ({args.prefix:,} prefix + {args.suffix} own), {args.layers} "
        f"layers x hidden {args.hidden}, float32, vLLM CPU backend, {args.rounds} rounds (medians); disk tier "
        f"direct_io={disk['direct_io']}"
    )
    for k in KINDS:
        print(
            f"  {k:9} TTFT {med(times[k]) * 1000:9,.1f} ms   rounds: {', '.join(f'{t * 1000:,.0f}' for t in times[k])}"
        )
    for a, b in (("disk", "ram"), ("prewarmed", "disk"), ("prewarmed", "ram"), ("disk", "cold")):
        per_round = [r[a][0] / r[b][0] for r in rounds]
        print(
            f"  {a} / {b}: {med(times[a]) / med(times[b]):.3f} of medians; per round "
            + ", ".join(f"{x:.3f}" for x in per_round)
        )
    loaded = {k: sorted({r[k][1] for r in rounds}) for k in KINDS}
    promoted = {k: sorted({r[k][2] for r in rounds}) for k in ON_DISK}
    print(f"  tokens loaded from kvd per kind: {loaded}; pages the disk promoted during the request: {promoted}")


if __name__ == "__main__":
    main()
