"""Room made by reclaiming another namespace's extent (kvd/cache/room.py): the chains that ran
through it leave the index with it, so what stays indexed, counted and announced is what
still hits."""

from __future__ import annotations

import queue
import threading

import agents
import numpy as np
from conftest import budget_for
from test_events import read_into

from engine_client import BlockRemoved, KVDClient, PageLayout, SequenceRequest

LAYOUT = agents.LAYOUT  # 16-token pages of 2 KiB: 64 pages an extent of 128 KiB
OTHER = PageLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=16, dtype="float16")  # also 2 KiB
PAGE = LAYOUT.page_size


def removed_keys(batches: queue.Queue) -> list[bytes]:
    keys = []
    while not batches.empty():
        for event in batches.get().events:
            if isinstance(event, BlockRemoved):
                keys += event.block_hashes
    return keys


def test_a_reclaimed_extent_takes_the_tail_of_every_chain_through_it(daemon_factory):
    # 4 extents of 64 pages: a 256-page conversation fills them, its first 64 pages in the
    # first extent, the one another namespace takes
    budget = budget_for(256, LAYOUT.page_bytes, PAGE, extents=4)
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", "128KiB")
    with KVDClient.connect(d.socket, client_name="a") as c, KVDClient.connect(d.socket, client_name="b") as other:
        ns = c.register_namespace(agents.MODEL, LAYOUT)
        conversation = np.arange(256 * PAGE, dtype=np.int32)
        # the head first, into the first extent (the one reclaimed first), the rest after it
        [head] = c.allocate_with_prefix(ns, [SequenceRequest("head", conversation[: 64 * PAGE])])
        assert sorted(head.pages) == list(range(64))
        c.publish(ns, ["head"])
        [alloc] = c.allocate_with_prefix(ns, [SequenceRequest("talk", conversation)])
        assert alloc.shared_pages == head.pages
        c.publish(ns, ["talk"])
        keys = c.page_keys(ns, conversation)
        c.release(ns, ["head", "talk"])  # all 256 cached, nothing referenced: every extent reclaimable
        stream = c.subscribe_events()
        batches: queue.Queue = queue.Queue()
        reading = threading.Thread(target=read_into, args=(stream, batches), daemon=True)
        reading.start()

        theirs = other.register_namespace("another-model", OTHER)
        [taken] = other.allocate_with_prefix(theirs, [SequenceRequest("x", np.arange(64 * PAGE, dtype=np.int32))])
        assert len(taken.private_pages) == 64

        [hit] = c.lookup(ns, [SequenceRequest("again", conversation)])
        stats = c.stats()
        ours = next(n for n in stats["namespaces"] if n["namespace_id"] == ns)
        assert hit.hit_pages == [], "the conversation's head went with the extent"
        assert ours["cached_pages"] == len(hit.hit_pages), "cached pages that can never hit"
        assert c.check_invariants() == []
        stream.cancel()
        reading.join(timeout=10)
        assert sorted(removed_keys(batches)) == sorted(keys), "every page that stopped being findable is announced"
