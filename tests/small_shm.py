"""A daemon whose host budget /dev/shm cannot hold, filled by a client (issue 11).

tests/test_crash_safety.py runs this inside a private mount namespace whose /dev/shm is a
small tmpfs (``unshare -m``), so daemon and client see the same small /dev/shm. It prints
one JSON object saying what happened; the test judges it.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess
from engine_client.types import KVDError

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float16")  # 2 KiB pages
CHUNK = 512 * LAYOUT.page_size  # tokens of one allocation: 1 MiB of pages


def allocate_and_touch(client: KVDClient, ns: int, seq_id: str, first_token: int) -> None:
    [alloc] = client.allocate_with_prefix(ns, [SequenceRequest(seq_id, np.arange(CHUNK) + first_token)])
    for page in alloc.pages:  # every page written: a page the tmpfs cannot back would SIGBUS here
        client.page_array(ns, page)[...] = 1


def main(workdir: str) -> None:
    daemon = DaemonProcess.start(
        f"{workdir}/kvd.sock", "--host-bytes", "64MiB", "--extent-bytes", "4MiB", log_path=f"{workdir}/kvd.log"
    )
    out: dict = {"allocated": 0}
    try:
        with KVDClient.connect(daemon.socket) as client:
            ns = client.register_namespace("small-shm", LAYOUT)
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
            out["alive"] = daemon.process.poll() is None
            out["shm_refusals"] = client.stats()["shm_refusals"]
            client.release(ns, ["s0"])
            allocate_and_touch(client, ns, "after-release", 2 * 10**6)  # what fits is still served
            out["served_after_release"] = True
    finally:
        out["exit"] = daemon.stop()
        out["log"] = daemon.log()
        print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
