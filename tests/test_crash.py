"""Engine processes killed with SIGKILL at awkward moments.

A killed client cannot say goodbye: the daemon notices its session stream end and must
drop every reference the client held within a second. What the client had published
stays cached for others; what it had not published (a page it was half-way through
writing) is freed, never indexed. The client library never unlinks or resizes the
daemon's shared memory, so the daemon's extents and the pages in them outlive any client.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import agents
import numpy as np
import pytest
from conftest import wait_until

from engine_client import KVDClient, SequenceRequest
from kvd.config import ServeConfig
from kvd.core.arena import SHM_DIR, leftover_segments

SPAWN = multiprocessing.get_context("spawn")
PAGE = agents.LAYOUT.page_size
RELEASE_WITHIN = 1.0  # seconds from SIGKILL until the daemon has dropped the session


# ---- page contents: each token's K/V is a function of (token id, position) -----------


def page_values(tokens: np.ndarray, first_pos: int) -> np.ndarray:
    """K/V values of one full page, [page_size]."""
    positions = first_pos + np.arange(len(tokens))
    return ((tokens.astype(np.int64) * 7 + positions) % 1000).astype(np.float16)


def write_page(client: KVDClient, ns: int, page: int, tokens: np.ndarray, first_pos: int) -> None:
    # page: [num_layers, 2, page_size, num_kv_heads, head_dim]
    client.page_array(ns, page)[...] = page_values(tokens, first_pos)[None, None, :, None, None]


def write_all(client: KVDClient, ns: int, pages: list[int], tokens: np.ndarray, start_page: int = 0) -> None:
    for i in range(start_page, len(pages)):
        write_page(client, ns, pages[i], tokens[i * PAGE : (i + 1) * PAGE], i * PAGE)


def page_holds(client: KVDClient, ns: int, page: int, tokens: np.ndarray, first_pos: int) -> bool:
    want = page_values(tokens, first_pos)[None, None, :, None, None]
    return bool((client.page_array(ns, page) == want).all())


# ---- victims: engine processes that the tests kill ------------------------------------


def allocate_loop(socket: str, tag: int, iterations, ready) -> None:
    """Allocates, publishes and releases without end; counts finished iterations."""
    with KVDClient.connect(socket, client_name=f"looper-{tag}") as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
        ready.set()
        i = 0
        while True:
            batch = [
                SequenceRequest(f"loop-{tag}-{i}-{j}", agents.prompt(64 + 16 * j, tag * 10 + j, 5 + i % 20))
                for j in range(3)
            ]
            allocs = client.allocate_with_prefix(ns, batch)
            client.publish(ns, [batch[0].seq_id])
            client.extend(ns, batch[1].seq_id, 3)
            if i >= 2:  # keep the last two iterations' sequences alive
                client.release(ns, [f"loop-{tag}-{i - 2}-{j}" for j in range(3)])
            assert len(allocs) == 3
            i += 1
            iterations.value = i


def write_forever(socket: str, prompt_pages: int, published_pages: int, ready) -> None:
    """Writes a prompt's pages, publishes the first few, then keeps rewriting the rest."""
    with KVDClient.connect(socket, client_name="writer") as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = agents.prompt(prompt_pages * PAGE, 7, 0)
        [alloc] = client.allocate_with_prefix(ns, [SequenceRequest("writer", tokens)])
        write_all(client, ns, alloc.pages, tokens)
        client.publish(ns, ["writer"], num_tokens={"writer": published_pages * PAGE})
        ready.set()
        junk = 0.0
        while True:  # half-written private pages: never published
            for page in alloc.pages[published_pages:]:
                arr = client.page_array(ns, page)
                arr[: len(arr) // 2] = junk
                arr[len(arr) // 2 :] = -junk
            junk += 1.0


def publish_page_by_page(socket: str, prompt_pages: int, attempted, done) -> None:
    """Publishes a written prompt one page per call; records each call before and after."""
    with KVDClient.connect(socket, client_name="publisher") as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = agents.prompt(prompt_pages * PAGE, 8, 0)
        [alloc] = client.allocate_with_prefix(ns, [SequenceRequest("publisher", tokens)])
        write_all(client, ns, alloc.pages, tokens)
        for k in range(1, prompt_pages + 1):
            attempted.value = k
            client.publish(ns, ["publisher"], num_tokens={"publisher": k * PAGE})
            done.value = k
        time.sleep(60)  # killed long before


def hold_pins(socket: str, prompt_tokens: int, ready) -> None:
    """Pins a prefix someone else published, twice, and holds an on-hold sequence on it."""
    with KVDClient.connect(socket, client_name="pinner") as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = agents.prompt(prompt_tokens, 0, 0)
        first = client.pin(ns, tokens)
        second = client.pin(ns, tokens, ttl=3600)
        assert first.pinned_tokens == second.pinned_tokens == prompt_tokens // PAGE * PAGE, (first, second)
        [alloc] = client.allocate_with_prefix(ns, [SequenceRequest("pinner", tokens)])
        assert alloc.shared_prefix_tokens == prompt_tokens // PAGE * PAGE
        client.set_state(ns, "pinner", "ON_HOLD")
        ready.set()
        time.sleep(60)  # killed long before


def map_every_extent(socket: str, prompt_tokens: int, ready) -> None:
    """Maps every extent of the namespace (reads one page of each), then waits or exits."""
    with KVDClient.connect(socket, client_name="mapper") as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = agents.prompt(prompt_tokens, 0, 0)
        [hit] = client.lookup(ns, [SequenceRequest("probe", tokens)])
        assert hit.hit_pages, "the observer's prefix is not cached"
        for p in hit.hit_pages:
            client.page_array(ns, p).max()  # reads through the mapping
        [alloc] = client.allocate_with_prefix(ns, [SequenceRequest(f"mapper-{os.getpid()}", tokens)])
        write_all(client, ns, alloc.pages, tokens, start_page=len(alloc.shared_pages))
        for extent in client.mapped_extents(ns):
            extent.array[-1].max()
        if ready is not None:
            ready.set()
            time.sleep(60)  # killed long before


# ---- the observer's side --------------------------------------------------------------


def observer(socket: str) -> KVDClient:
    """A session of the test itself, once it is the only one (the launcher's probe has gone)."""
    client = KVDClient.connect(socket, client_name="observer")
    wait_until(lambda: client.stats()["sessions"] == 1, "other sessions did not end", timeout=5)
    return client


def kill_and_wait_released(obs: KVDClient, procs) -> float:
    """SIGKILLs the processes; returns the seconds until only the observer's session is left."""
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == -signal.SIGKILL, f"victim exited with {p.exitcode} before the kill"
    while obs.stats()["sessions"] != 1:
        assert time.monotonic() - killed_at < RELEASE_WITHIN, (
            f"the killed clients' sessions are still open {RELEASE_WITHIN} s after SIGKILL: {obs.stats()}"
        )
        time.sleep(0.005)
    return time.monotonic() - killed_at


def assert_nothing_held(obs: KVDClient) -> dict:
    stats = obs.stats()
    held = {k: stats[k] for k in ("sequences", "pinned_pages", "private_pages", "shared_pages", "logical_pages")}
    assert held == dict.fromkeys(held, 0), f"references survived the kill: {held}"
    assert obs.check_invariants() == []
    assert stats["arena_bytes"] <= stats["host_bytes"]
    return stats


def start(target, *args):
    p = SPAWN.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def finish(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)


# ---- tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("kill_after", [0, 3, 40])
def test_sigkill_mid_allocation_loop_releases_everything(daemon, kill_after):
    with observer(daemon.socket) as obs:
        counters = [SPAWN.Value("i", 0) for _ in range(3)]
        readies = [SPAWN.Event() for _ in range(3)]
        procs = [start(allocate_loop, daemon.socket, tag, counters[tag], readies[tag]) for tag in range(3)]
        try:
            for r in readies:
                assert r.wait(60)
            wait_until(
                lambda: all(c.value >= kill_after for c in counters), f"loops did not reach {kill_after}", timeout=60
            )
            assert all(p.is_alive() for p in procs), "a looper died on its own"
            took = kill_and_wait_released(obs, procs)
        finally:
            finish(procs)
        stats = assert_nothing_held(obs)
        print(f"\n3 loopers killed after >= {kill_after} iterations; released in {took * 1e3:.0f} ms")
        if kill_after:
            assert stats["cached_pages"] > 0, "the loopers' published pages should stay cached"
        # Their sequence ids are free again: nobody owns them any more.
        [again] = obs.allocate_with_prefix(
            obs.register_namespace(agents.MODEL, agents.LAYOUT),
            [SequenceRequest("loop-0-0-0", agents.prompt(64, 0, 5))],
        )
        assert again.num_tokens == 69


def test_sigkill_while_writing_private_pages_never_publishes_them(daemon):
    prompt_pages, published = 10, 4
    with observer(daemon.socket) as obs:
        ns = obs.register_namespace(agents.MODEL, agents.LAYOUT)
        ready = SPAWN.Event()
        procs = [start(write_forever, daemon.socket, prompt_pages, published, ready)]
        try:
            assert ready.wait(60)
            time.sleep(0.05)  # several rounds of rewriting
            kill_and_wait_released(obs, procs)
        finally:
            finish(procs)
        stats = assert_nothing_held(obs)
        assert stats["cached_pages"] == published, "only the pages published before the kill stay cached"
        tokens = agents.prompt(prompt_pages * PAGE, 7, 0)
        [hit] = obs.lookup(ns, [SequenceRequest("probe", tokens)])
        assert hit.hit_tokens == published * PAGE, "a page the writer never published was indexed"
        for i, page in enumerate(hit.hit_pages):
            assert page_holds(obs, ns, page, tokens[i * PAGE : (i + 1) * PAGE], i * PAGE), f"published page {i} changed"
        # A new engine reuses the published pages and must compute the rest itself.
        [alloc] = obs.allocate_with_prefix(ns, [SequenceRequest("after", tokens)])
        assert alloc.shared_pages == hit.hit_pages and alloc.suffix_start == published * PAGE
        assert len(alloc.private_pages) == prompt_pages - published
        assert obs.check_invariants() == []


def test_sigkill_between_publish_calls_keeps_exactly_the_published_prefix(daemon):
    prompt_pages = 1500
    with observer(daemon.socket) as obs:
        ns = obs.register_namespace(agents.MODEL, agents.LAYOUT)
        attempted, done = SPAWN.Value("i", 0), SPAWN.Value("i", 0)
        procs = [start(publish_page_by_page, daemon.socket, prompt_pages, attempted, done)]
        try:
            wait_until(lambda: done.value >= 20, "the publisher did not publish 20 pages", timeout=60)
            kill_and_wait_released(obs, procs)
        finally:
            finish(procs)
        lo, hi = done.value, attempted.value
        assert lo < prompt_pages, "the publisher finished before the kill; the test proved nothing"
        stats = assert_nothing_held(obs)
        tokens = agents.prompt(prompt_pages * PAGE, 8, 0)
        [hit] = obs.lookup(ns, [SequenceRequest("probe", tokens)])
        hits = hit.hit_tokens // PAGE
        assert lo <= hits <= hi, f"{hits} pages hit; the publisher had finished {lo} publish calls and begun {hi}"
        assert stats["cached_pages"] == hits, "a page past the published prefix stayed cached"
        for i in (0, hits // 2, hits - 1):
            assert page_holds(obs, ns, hit.hit_pages[i], tokens[i * PAGE : (i + 1) * PAGE], i * PAGE)


def test_sigkill_while_holding_pins_unpins(daemon):
    prompt_tokens = 8 * PAGE
    with observer(daemon.socket) as obs:
        ns = obs.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = agents.prompt(prompt_tokens, 0, 0)
        [alloc] = obs.allocate_with_prefix(ns, [SequenceRequest("owner", tokens)])
        write_all(obs, ns, alloc.pages, tokens)
        obs.publish(ns, ["owner"])
        obs.release(ns, ["owner"])
        ready = SPAWN.Event()
        procs = [start(hold_pins, daemon.socket, prompt_tokens, ready)]
        try:
            assert ready.wait(60)
            held = obs.stats()
            assert held["pinned_pages"] == 8 and held["sequences"] == 1 and held["shared_pages"] == 8
            kill_and_wait_released(obs, procs)
        finally:
            finish(procs)
        stats = assert_nothing_held(obs)
        assert stats["cached_pages"] == 8, "the observer's published prefix stays cached, unpinned"
        [hit] = obs.lookup(ns, [SequenceRequest("probe", tokens)])
        assert hit.hit_pages == alloc.pages


def shm_files(prefix: str) -> dict[str, tuple[int, int]]:
    """name -> (inode, size) of the daemon's segments in /dev/shm."""
    found = {}
    for name in leftover_segments(prefix):
        st = os.stat(SHM_DIR + name)
        found[name] = (st.st_ino, st.st_size)
    return found


def test_clients_never_unlink_or_resize_the_daemons_extents(daemon):
    prefix = ServeConfig(socket=daemon.socket).shm_prefix
    with observer(daemon.socket) as obs:
        ns = obs.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = agents.prompt(2300 * PAGE, 0, 0)  # 2 KiB pages: more than one 4 MiB extent holds
        [alloc] = obs.allocate_with_prefix(ns, [SequenceRequest("base", tokens)])
        write_all(obs, ns, alloc.pages, tokens)
        obs.publish(ns, ["base"])
        before = shm_files(prefix)
        extents = obs.mapped_extents(ns)
        assert len(before) >= 2 and {e.name for e in extents} <= set(before), (before, extents)
        snapshot = {p: obs.page_array(ns, p).copy() for p in alloc.pages[::97]}

        # Clients that come and go: two exit normally, two are killed while mapping every extent.
        for _ in range(2):
            p = start(map_every_extent, daemon.socket, len(tokens), None)
            p.join(timeout=60)
            assert p.exitcode == 0
        readies = [SPAWN.Event() for _ in range(2)]
        procs = [start(map_every_extent, daemon.socket, len(tokens), r) for r in readies]
        try:
            for r in readies:
                assert r.wait(60)
            kill_and_wait_released(obs, procs)
        finally:
            finish(procs)

        after = shm_files(prefix)
        assert {n: after.get(n) for n in before} == before, "a client unlinked, recreated or resized an extent"
        for e in extents:
            assert after[e.name][1] >= e.num_pages * agents.LAYOUT.page_bytes
        # The observer's own mappings and a fresh client's both still see the pages written before.
        for p, want in snapshot.items():
            assert np.array_equal(obs.page_array(ns, p), want), f"page {p} changed"
        with KVDClient.connect(daemon.socket, client_name="fresh") as fresh:
            fresh_ns = fresh.register_namespace(agents.MODEL, agents.LAYOUT)
            [hit] = fresh.lookup(fresh_ns, [SequenceRequest("probe", tokens)])
            assert hit.hit_pages == alloc.pages[: len(tokens) // PAGE]
            for p, want in snapshot.items():
                assert np.array_equal(fresh.page_array(fresh_ns, p), want), f"a fresh mapping of page {p} differs"
        assert obs.check_invariants() == []
