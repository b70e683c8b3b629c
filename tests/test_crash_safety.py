"""Crash safety at the dangerous instants (issue 11): a kill -9 while an extent is being
created, right after a publish returned, and a /dev/shm smaller than the host budget."""
from __future__ import annotations

import signal

import numpy as np
import pytest

import agents
from conftest import clean_env
from engine_client import KVDClient, SequenceRequest
from test_restart import ARGS, PAGE, holds, publish_prefix


@pytest.mark.parametrize("step", ["extent-meta", "extent-data"])
def test_a_kill_while_an_extent_is_created_keeps_the_published_cache(daemon_factory, tmp_path, step):
    """The namespace's second extent is built when its first runs low; the daemon dies
    right after ``step`` of that build. The restart drops only the incomplete extent."""
    d = daemon_factory(*ARGS, env=clean_env(tmp_path, KVD_CRASH_AT=f"{step}:2"))
    client = KVDClient.connect(d.socket)
    ns, tokens, alloc = publish_prefix(client, 40)
    extent_pages = (4 << 20) // agents.LAYOUT.page_bytes
    try:  # runs the first extent low: its successor is built, and the daemon dies building it
        client.allocate_with_prefix(ns, [SequenceRequest("filler", np.arange(extent_pages * PAGE // 2 + PAGE) + 900_000)])
    except Exception:  # noqa: BLE001 - the daemon may die before it replies
        pass
    assert d.process.wait(timeout=20) == -signal.SIGKILL, d.log()
    client.close()

    d2 = daemon_factory(*ARGS)
    with KVDClient.connect(d2.socket) as c:
        assert c.register_namespace(agents.MODEL, agents.LAYOUT) == ns
        [hit] = c.allocate_with_prefix(ns, [SequenceRequest("again", tokens)])
        assert hit.shared_prefix_tokens == 40 * PAGE and hit.shared_pages == alloc.pages[:40]
        assert all(holds(c, ns, page, tokens, i) for i, page in enumerate(hit.shared_pages))
        assert c.check_invariants() == []
    assert "discarding" not in d2.log(), d2.log()
