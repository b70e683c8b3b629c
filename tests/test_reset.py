"""Runtime reset of the prefix cache (issue 11): cached pages go, pages in use stay."""

from __future__ import annotations

import json
import subprocess
import sys

import agents
import numpy as np
import pytest

from engine_client import KVDClient, SequenceRequest
from engine_client.types import ErrorCode, KVDError

PAGE = agents.LAYOUT.page_size


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.arange(pages * PAGE) + seed * 100_000


def test_reset_drops_cached_pages_and_leaves_pages_in_use(daemon):
    with KVDClient.connect(daemon.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        other = c.register_namespace("another-model", agents.LAYOUT)
        held, cached, pinned, elsewhere = prompt(1, 4), prompt(2, 5), prompt(3, 3), prompt(4, 2)
        for seq_id, tokens, space in (
            ("held", held, ns),
            ("cached", cached, ns),
            ("pinned", pinned, ns),
            ("elsewhere", elsewhere, other),
        ):
            c.allocate_with_prefix(space, [SequenceRequest(seq_id, tokens)])
            c.publish(space, [seq_id])
        c.release(ns, ["cached", "pinned"])
        c.release(other, ["elsewhere"])
        pin = c.pin(ns, pinned)
        assert pin.pinned_pages == 3 and c.stats()["cached_pages"] == 5 + 2

        assert c.reset_prefix_cache(ns) == {"dropped_pages": 5, "kept_pages": 4 + 3}
        hits = {
            name: c.lookup(space, [SequenceRequest("probe", tokens)])[0].hit_pages
            for name, tokens, space in (
                ("held", held, ns),
                ("cached", cached, ns),
                ("pinned", pinned, ns),
                ("elsewhere", elsewhere, other),
            )
        }
        assert [len(hits[n]) for n in ("held", "cached", "pinned", "elsewhere")] == [4, 0, 3, 2]
        assert c.check_invariants() == []

        assert c.reset_prefix_cache() == {"dropped_pages": 2, "kept_pages": 7}, "every namespace"
        assert c.lookup(other, [SequenceRequest("probe", elsewhere)])[0].hit_pages == []
        c.unpin(pin.pin_id)
        c.release(ns, ["held"])
        assert c.reset_prefix_cache() == {"dropped_pages": 7, "kept_pages": 0}
        stats = c.stats()
        assert (stats["cached_pages"], stats["shared_pages"]) == (0, 0) and c.check_invariants() == []
        with pytest.raises(KVDError) as e:
            c.reset_prefix_cache(99)
        assert e.value.code == ErrorCode.NOT_FOUND


def test_kvd_reset_cli(daemon):
    with KVDClient.connect(daemon.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        c.allocate_with_prefix(ns, [SequenceRequest("s", prompt(1, 3))])
        c.publish(ns, ["s"])
        c.release(ns, ["s"])
        run = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "reset", "--socket", daemon.socket, "--namespace", str(ns), "--json"],
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0 and json.loads(run.stdout) == {"dropped_pages": 3, "kept_pages": 0}, run
        run = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "reset", "--socket", daemon.socket], capture_output=True, text=True
        )
        assert run.returncode == 0 and "dropped 0 cached pages" in run.stdout, run
