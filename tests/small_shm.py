"""Daemons whose host budget /dev/shm cannot hold, driven by a client (issues 11 and 22)
or examined by `kvd doctor` (issue 26).

tests/test_crash_safety.py runs this inside a private mount namespace whose /dev/shm is a
small tmpfs (``unshare -m``), so daemon and client see the same small /dev/shm:
``python small_shm.py SCENARIO WORKDIR``. It prints one JSON object saying what happened,
the daemon's log and exit status included; the test judges it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess
from engine_client.types import KVDError

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float16")  # 2 KiB pages
CHUNK = 512 * LAYOUT.page_size  # tokens of one allocation: 1 MiB of pages
EXTENT_ARGS = ("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
EXTENT_TOKENS = 2048 * LAYOUT.page_size  # an extent's pages
# Issue 22's reproduction: 64 KiB pages, an extent of 16 MiB holds one 4,096-token prompt.
RACE_LAYOUT = PageLayout(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16, dtype="float16")
RACE_ARGS = ("--enable-prefix-reuse", "--host-bytes", "512MiB", "--extent-bytes", "16MiB")
RACE_PROMPTS, RACE_TOKENS = 12, 4096


def allocate_and_touch(client: KVDClient, ns: int, seq_id: str, first_token: int, num_tokens: int = CHUNK) -> None:
    [alloc] = client.allocate_with_prefix(ns, [SequenceRequest(seq_id, np.arange(num_tokens) + first_token)])
    for page in alloc.pages:  # every page written: a page the tmpfs cannot back would SIGBUS here
        client.page_array(ns, page)[...] = 1


def start(workdir: str, *args: str, **env: str) -> DaemonProcess:
    return DaemonProcess.start(
        f"{workdir}/kvd.sock", *args, log_path=f"{workdir}/kvd.log", env={**os.environ, **env} if env else None
    )


def budget_over_shm(workdir: str, out: dict) -> None:
    """A client fills what /dev/shm holds; further calls are refused, the rest still served."""
    daemon = start(workdir, *EXTENT_ARGS)
    with finished(daemon, out), KVDClient.connect(daemon.socket) as client:
        ns = client.register_namespace("small-shm", LAYOUT)
        out["allocated"] = 0
        for i in range(64):
            try:
                allocate_and_touch(client, ns, f"s{i}", i * CHUNK)
            except KVDError as e:
                out["refused"] = [e.code.name, str(e)]
                break
            out["allocated"] += 1
        try:
            allocate_and_touch(client, ns, "again", 10**6)
        except KVDError as e:
            out["refused_again"] = e.code.name
        out["shm_refusals"] = client.stats()["shm_refusals"]
        client.release(ns, ["s0"])
        allocate_and_touch(client, ns, "after-release", 2 * 10**6)  # what fits is still served
        out["served_after_release"] = True


def fill_after_reservation(workdir: str, out: dict) -> None:
    """/dev/shm fills up right after the first extent is reserved (``KVD_FILL_SHM_AT``). A whole
    extent of pages is published (a record for each: the metadata segment is written page by
    page) and released; an allocation of as many pages finds no room for a second extent, and
    is served from the cached pages."""
    daemon = start(workdir, *EXTENT_ARGS, KVD_FILL_SHM_AT="extent-reserved")
    with finished(daemon, out), KVDClient.connect(daemon.socket) as client:
        ns = client.register_namespace("small-shm", LAYOUT)  # builds the first extent, then fills /dev/shm
        allocate_and_touch(client, ns, "a", 0, EXTENT_TOKENS)
        out["published"] = client.publish(ns, ["a"])[0].published_pages
        client.release(ns, ["a"])
        allocate_and_touch(client, ns, "b", 10**6, EXTENT_TOKENS)
        out["published_after"] = client.publish(ns, ["b"])[0].published_pages
        out["stats"] = client.stats()


def evict_when_refused(grow: str) -> Callable[[str, dict], None]:
    """/dev/shm holds one extent. Half of it is published and released; then ``grow``
    ("allocate": AllocateWithPrefix, which makes room in steps; "extend": Extend, in one
    piece) asks for more pages than are free, and the second extent it needs is refused."""

    def scenario(workdir: str, out: dict) -> None:
        daemon = start(workdir, *EXTENT_ARGS)
        with finished(daemon, out), KVDClient.connect(daemon.socket) as client:
            ns = client.register_namespace("small-shm", LAYOUT)  # its first extent, built ahead
            half = EXTENT_TOKENS // 2
            # Half the extent in use leaves as many free pages as keep the next build from starting.
            client.allocate_with_prefix(
                ns, [SequenceRequest("a", np.arange(half - LAYOUT.page_size)), SequenceRequest("s", [7])]
            )
            client.publish(ns, ["a"])
            client.release(ns, ["a"])
            out["before"] = client.stats()
            if grow == "allocate":
                allocate_and_touch(client, ns, "b", 10**6, half + half // 2)
            else:
                client.extend(ns, "s", half + half // 2)
            out["served"] = True
            out["stats"] = client.stats()

    return scenario


def race(workdir: str, out: dict) -> None:
    """Issue 22's reproduction: prompts allocated, published without writing their pages and
    released back to back, while extents are built ahead on a worker thread until /dev/shm
    is full; the cached pages serve the prompts from then on."""
    daemon = start(workdir, *RACE_ARGS)
    with finished(daemon, out), KVDClient.connect(daemon.socket) as client:
        ns = client.register_namespace("race", RACE_LAYOUT)
        for i in range(RACE_PROMPTS):
            client.allocate_with_prefix(ns, [SequenceRequest(f"p{i}", np.arange(RACE_TOKENS) + i * RACE_TOKENS)])
            client.publish(ns, [f"p{i}"])
            client.release(ns, [f"p{i}"])
        out["served"] = RACE_PROMPTS
        out["stats"] = client.stats()


def doctor(workdir: str, out: dict) -> None:
    """`kvd doctor` beside a daemon whose host budget this /dev/shm cannot hold."""
    daemon = start(workdir, *EXTENT_ARGS)
    with finished(daemon, out):
        run = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "doctor", "--json", "--socket", daemon.socket],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out["doctor"] = [run.returncode, json.loads(run.stdout)]


@contextlib.contextmanager
def finished(daemon: DaemonProcess, out: dict) -> Iterator[None]:
    """Records what a scenario's daemon left: whether it lived, its exit status and log, and
    the error that ended the scenario (a daemon killed by a signal fails the calls after it)."""
    try:
        yield
    except KVDError as e:
        out["error"] = [e.code.name, str(e)]
    finally:
        out["alive"] = daemon.process.poll() is None
        out["exit"] = daemon.stop()
        out["log"] = daemon.log()


SCENARIOS = {
    "budget-over-shm": budget_over_shm,
    "fill-after-reservation": fill_after_reservation,
    "evict-when-refused-allocate": evict_when_refused("allocate"),
    "evict-when-refused-extend": evict_when_refused("extend"),
    "race": race,
    "doctor": doctor,
}


if __name__ == "__main__":
    result: dict = {}
    SCENARIOS[sys.argv[1]](sys.argv[2], result)
    print(json.dumps(result))
