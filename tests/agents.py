"""Engine-process bodies for integration tests, run in spawned processes.

Each function connects its own session to the daemon, so the tests exercise real
sessions, real shared memory and real process boundaries.
"""

from __future__ import annotations

import time

import numpy as np

from engine_client import KVDClient, PageLayout, SequenceRequest

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float16")
MODEL = "agents-test-model"


def prompt(prefix_tokens: int, agent: int, private_tokens: int) -> np.ndarray:
    """A shared prefix (ids 0..prefix-1) followed by tokens only this agent has."""
    shared = np.arange(prefix_tokens, dtype=np.int32) % 30000
    own = 30000 + agent * 1000 + np.arange(private_tokens, dtype=np.int32)
    return np.concatenate([shared, own])


def kv_value(token_id: int, position: int) -> float:
    """The synthetic K/V every test process writes for a token: a function of (token, position)."""
    return float((token_id * 7 + position) % 1000)


def write_kv(client: KVDClient, ns: int, pages: list[int], tokens: np.ndarray, start: int) -> None:
    """Writes synthetic K/V for tokens [start, len(tokens)) into the sequence's pages."""
    size = LAYOUT.page_size
    for pos in range(start, len(tokens)):
        page = client.page(ns, pages[pos // size])
        page[:, :, pos % size] = kv_value(int(tokens[pos]), pos)


def read_token_kv(client: KVDClient, ns: int, pages: list[int], pos: int) -> float:
    page = client.page(ns, pages[pos // LAYOUT.page_size])
    values = page[:, :, pos % LAYOUT.page_size].float()
    assert bool((values == values.flatten()[0]).all()), f"position {pos} holds mixed values"
    return float(values.flatten()[0])


def run_agents(
    socket: str, agents: list[int], prefix_tokens: int, private_tokens: int, start_barrier, done_barrier, results
) -> None:
    """One engine process: prefills its agents (suffix only on a hit), publishes, checks the
    prefix KV it did not write, then holds its sequences until the test has read the stats."""
    with KVDClient.connect(socket, client_name=f"engine-{agents[0]}") as client:
        ns = client.register_namespace(MODEL, LAYOUT)
        start_barrier.wait()
        requests = [SequenceRequest(f"agent-{a}", prompt(prefix_tokens, a, private_tokens)) for a in agents]
        allocations = client.allocate_with_prefix(ns, requests)
        computed = 0
        for req, alloc in zip(requests, allocations):
            write_kv(client, ns, alloc.pages, req.token_ids, alloc.suffix_start)
            computed += alloc.num_tokens - alloc.suffix_start
        published = client.publish(ns, [r.seq_id for r in requests])
        rebinds = sum(len(p.rebinds) for p in published)
        # Every token's KV, shared or own, must read back as the value its writer stored.
        bad = 0
        for req, alloc, pub in zip(requests, allocations, published):
            pages = list(alloc.pages)
            for r in pub.rebinds:
                pages[r.position] = r.new_page
            for pos in range(0, alloc.num_tokens, 7):
                if read_token_kv(client, ns, pages, pos) != kv_value(int(req.token_ids[pos]), pos):
                    bad += 1
        results.put(
            {
                "agents": agents,
                "computed": computed,
                "hit_tokens": sum(a.shared_prefix_tokens for a in allocations),
                "rebinds": rebinds,
                "bad_reads": bad,
            }
        )
        done_barrier.wait()  # the test reads stats while every session still holds its sequences
        done_barrier.wait()


def hold_and_wait(socket: str, prompt_tokens: int, ready) -> None:
    """Allocates a sequence, writes half a private page, pins the prefix, then waits to be killed."""
    with KVDClient.connect(socket, client_name="victim") as client:
        ns = client.register_namespace(MODEL, LAYOUT)
        tokens = prompt(prompt_tokens, 99, 5)
        [alloc] = client.allocate_with_prefix(ns, [SequenceRequest("victim", tokens)])
        write_kv(client, ns, alloc.pages, tokens, 0)
        client.publish(ns, ["victim"])
        client.pin(ns, tokens[:prompt_tokens])
        client.extend(ns, "victim", 8)
        ready.set()
        time.sleep(60)  # the test kills this process long before
