"""Restart and disk figures of issue 41 at a real host's page counts, against real daemons.

Each figure is a function returning a dict (bench/bench_scale.py calls them beside its own):

- ``warm_restart``: a daemon holding ``pages`` host pages is killed (``kill -9``); a new one
  on the same socket is started: the seconds until it answers a call (from the spawn, and
  the daemon's own figure from its start), and until every page is hittable (its recovery
  has nothing pending and the last prompt published hits whole), each per million pages;
- ``reboot_start``: a daemon with the disk tier holding ``pages`` host pages stops
  gracefully (it writes them to disk: the stop's write rate beside the disk's sequential
  write bandwidth), its shared memory is removed as a reboot would, and a new one starts:
  the seconds until it answers (and how many disk pages were indexed then: the tier opens
  in the background) and until the disk pages are all indexed, and the daemon's
  private memory (RssAnon) per disk page indexed over an idle daemon's.

Pages are 4 KiB (16 tokens, 1 layer, 1 KV head, head_dim 64, float16), filled through the
client as distinct 50K-token prompts (allocate with prefix, publish, release), as the
issue measured them.

    python bench/scale_tiers.py --pages 1000000 [--disk-dir /var/tmp] [--only warm_restart]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time

import numpy as np

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess

LAYOUT = PageLayout(num_layers=1, num_kv_heads=1, head_dim=64, page_size=16, dtype="float16")
PAGE_BYTES = 4096
CHAIN_PAGES = 3125  # a 50K-token prompt
MODEL = "scale-tiers"


def chain_tokens(chain: int) -> np.ndarray:
    return (np.arange(CHAIN_PAGES * LAYOUT.page_size, dtype=np.int64) + chain * 100_000).astype(np.int32)


def daemon_args(pages: int, *extra: str) -> tuple[str, ...]:
    host = pages * (PAGE_BYTES + 128) * 21 // 20 + (256 << 20)  # pages, their records, slack
    return ("--enable-prefix-reuse", "--host-bytes", str(host), "--extent-bytes", "64MiB", *extra)


def fill(client: KVDClient, pages: int) -> tuple[int, int, float]:
    """Publishes ``pages`` (rounded down to whole prompts); returns the namespace, the prompts
    and the seconds it took."""
    ns = client.register_namespace(MODEL, LAYOUT)
    chains = pages // CHAIN_PAGES
    start = time.perf_counter()
    for chain in range(chains):
        client.allocate_with_prefix(ns, [SequenceRequest(f"c{chain}", chain_tokens(chain))])
        client.publish(ns, [f"c{chain}"])
        client.release(ns, [f"c{chain}"])
    client.verify_pages()  # every page sealed
    return ns, chains, time.perf_counter() - start


def _serving_ms(daemon: DaemonProcess) -> float:
    found = re.search(r"serving on .* after (\d+) ms", daemon.log())
    return float(found.group(1)) if found else float("nan")


def _first_answer(daemon: DaemonProcess, started: float) -> float:
    daemon.wait_ready(600)
    return time.perf_counter() - started


def _until(predicate, timeout: float = 1200.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.25)  # a lookup of a 50K-token prompt costs the daemon ~10 ms


def _cpu_seconds(pid: int) -> float:
    """User and system CPU the process used so far: a figure a loaded box changes less than wall time."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def warm_restart(pages: int, work: str) -> dict:
    """Kill -9 a daemon holding ``pages`` pages, start another: first answer, all hittable."""
    socket, log = os.path.join(work, "warm.sock"), os.path.join(work, "warm.log")
    args = daemon_args(pages)
    first = DaemonProcess.start(socket, *args, log_path=log)
    try:
        with KVDClient.connect(socket) as client:
            ns, chains, fill_seconds = fill(client, pages)
        first.stop(signal.SIGKILL)
        started = time.perf_counter()
        second = DaemonProcess(socket, tuple(args), log + ".2")
        answered = _first_answer(second, started)
        answered_cpu = _cpu_seconds(second.process.pid)
        with KVDClient.connect(socket) as client:
            client.register_namespace(MODEL, LAYOUT)
            # Parents first: the last prompt's last page is among the last verified. (Not
            # stats: at a million pages it walks every page, ~1 s of the event loop.)
            probe = [SequenceRequest("probe", chain_tokens(chains - 1))]
            _until(lambda: len(client.lookup(ns, probe)[0].hit_pages) == CHAIN_PAGES)
            hittable = time.perf_counter() - started
            hittable_cpu = _cpu_seconds(second.process.pid)
            [hit] = client.lookup(ns, probe)
            recovery = client.stats()["recovery"]
        second.stop()
        second.clean()
    finally:
        if first.process.poll() is None:
            first.stop()
        first.clean()
    restored = chains * CHAIN_PAGES
    assert len(hit.hit_pages) == CHAIN_PAGES and recovery["recovered_pages"] == restored, (hit, recovery)
    return {
        "pages": restored,
        "fill_seconds": round(fill_seconds, 1),
        "fill_pages_per_second": round(restored / fill_seconds),
        "first_answer_seconds": round(answered, 3),
        "first_answer_daemon_cpu_seconds": round(answered_cpu, 2),
        "daemon_serving_after_ms": _serving_ms(second),
        "all_hittable_seconds": round(hittable, 2),
        "all_hittable_daemon_cpu_seconds": round(hittable_cpu, 2),
        "all_hittable_seconds_per_million": round(hittable * 1e6 / restored, 2),
        "recovery_seconds": round(recovery["seconds"], 2),
    }


def reboot_start(pages: int, work: str, disk_dir: str) -> dict:
    """A graceful stop writes ``pages`` host pages to disk; after a reboot (shared memory
    gone) a new daemon starts on the disk tier: first answer, all indexed, memory per page."""
    socket, log = os.path.join(work, "disk.sock"), os.path.join(work, "disk.log")
    disk_bytes = pages * (PAGE_BYTES + 4096) + (256 << 20)  # each page and its slot header, slack
    args = daemon_args(pages, "--disk-path", disk_dir, "--disk-bytes", str(disk_bytes))
    args += ("--disk-stop-write-seconds", "3600")
    first = DaemonProcess.start(socket, *args, log_path=log)
    try:
        with KVDClient.connect(socket) as client:
            _, chains, _ = fill(client, pages)
        stopping = time.perf_counter()
        first.stop(timeout=3600)
        stop_seconds = time.perf_counter() - stopping
        stop_log = first.log()
        first.clean()  # a reboot: host memory is gone, the disk stays
        started = time.perf_counter()
        second = DaemonProcess(socket, tuple(args), log + ".2")
        answered = _first_answer(second, started)
        answered_cpu = _cpu_seconds(second.process.pid)
        with KVDClient.connect(socket) as client:
            at_answer = client.stats()["disk"]  # the tier opens in the background (kvd/disk/opening.py)
            _until(lambda: client.stats()["disk"]["state"] == "on")
            indexed = time.perf_counter() - started
            disk_pages = client.stats()["disk"]["pages"]
        loaded = _rss_anon_bytes(second.process.pid)
        second.stop()
        second.clean()
    finally:
        if first.process.poll() is None:
            first.stop()
        first.clean()
    idle_rss = _idle_rss(work, args, disk_dir)
    written = re.search(r"wrote (\d+) pages host memory held in ([\d.]+) s", stop_log)
    written_pages, write_seconds = int(written.group(1)), float(written.group(2))
    return {
        "host_pages": chains * CHAIN_PAGES,
        "disk_pages": disk_pages,
        "stop_seconds": round(stop_seconds, 2),
        "stop_written_pages": written_pages,
        "stop_write_pages_per_second": round(written_pages / write_seconds),
        "stop_write_mb_per_second": round(written_pages * PAGE_BYTES / write_seconds / 1e6, 1),
        "first_answer_seconds": round(answered, 3),
        "first_answer_daemon_cpu_seconds": round(answered_cpu, 2),
        "daemon_serving_after_ms": _serving_ms(second),
        "disk_pages_indexed_at_first_answer": at_answer["pages"],
        "all_indexed_seconds": round(indexed, 2),
        "all_indexed_seconds_per_million": round(indexed * 1e6 / max(disk_pages, 1), 2),
        "daemon_private_bytes_per_disk_page": round((loaded - idle_rss) / max(disk_pages, 1)),
    }


def _idle_rss(work: str, args: tuple[str, ...], disk_dir: str) -> int:
    """RssAnon of a daemon of the same settings over an empty disk directory."""
    empty = tempfile.mkdtemp(dir=os.path.dirname(disk_dir.rstrip("/")) or ".")
    idle_args = tuple(empty if a == disk_dir else a for a in args)
    socket = os.path.join(work, "idle.sock")
    idle = DaemonProcess.start(socket, *idle_args, log_path=os.path.join(work, "idle.log"))
    try:
        with KVDClient.connect(socket) as client:
            client.register_namespace(MODEL, LAYOUT)
        return _rss_anon_bytes(idle.process.pid)
    finally:
        idle.stop()
        idle.clean()
        for name in os.listdir(empty):
            os.unlink(os.path.join(empty, name))
        os.rmdir(empty)


def disk_write_bandwidth(disk_dir: str, gib: float = 1.0) -> dict:
    """The disk's sequential write bandwidth as bench/bench_disk.py measures its fill."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_disk import fill as disk_fill
    from bench_disk import open_store

    from kvd.diskstore.layout import BLOCK

    page_bytes, chunk_bytes = 2 << 20, 64 << 20
    count = int(gib * (1 << 30)) // page_bytes
    directory = tempfile.mkdtemp(dir=disk_dir)
    try:
        opened = open_store(directory, BLOCK + count * page_bytes * 2 + chunk_bytes, chunk_bytes)
        _, seconds = disk_fill(opened.store, count, page_bytes)
        opened.store.close()
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    return {"disk_write_mb_per_second": round(count * page_bytes / seconds / 1e6, 1)}


FIGURES = ("warm_restart", "reboot_start", "disk_write_bandwidth")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=1_000_000)
    p.add_argument("--disk-dir", default="/var/tmp")
    p.add_argument("--only", choices=FIGURES, action="append")
    a = p.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "pages": a.pages}
    with tempfile.TemporaryDirectory() as work:
        for figure in a.only or FIGURES:
            if figure == "warm_restart":
                results[figure] = warm_restart(a.pages, work)
            elif figure == "reboot_start":
                disk_dir = tempfile.mkdtemp(dir=a.disk_dir)
                try:
                    results[figure] = reboot_start(a.pages, work, disk_dir)
                finally:
                    for name in os.listdir(disk_dir):
                        os.unlink(os.path.join(disk_dir, name))
                    os.rmdir(disk_dir)
            else:
                results[figure] = disk_write_bandwidth(a.disk_dir)
            print(figure, json.dumps(results[figure]), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
