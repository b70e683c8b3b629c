"""Warm restart and page integrity: a daemon killed with SIGKILL comes back with its
published pages, verified against their checksums; corrupted pages are never served."""

from __future__ import annotations

import re
import signal
import time

import agents
import numpy as np
import pytest
from conftest import clean_env, raw_page, wait_until

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.types import KVDError
from kvd.cache import invariants
from kvd.cache.manager import KVCacheManager
from kvd.cache.manager import SequenceRequest as CoreRequest
from kvd.config import ServeConfig
from kvd.core.arena import SHM_DIR, Arena, daemon_segments
from kvd.core.namespaces import NamespaceIdentity, make_layout
from kvd.core.records import manifest_name
from kvd.durability import recovery
from kvd.durability.reindexing import STEP_PAGES

PAGE = agents.LAYOUT.page_size
ARGS = ("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")


def page_values(tokens: np.ndarray, first_pos: int) -> np.ndarray:
    return ((tokens.astype(np.int64) * 7 + first_pos + np.arange(len(tokens))) % 1000).astype(np.float16)


def write_all(client: KVDClient, ns: int, pages: list[int], tokens: np.ndarray) -> None:
    for i, page in enumerate(pages):
        # page: [num_layers, 2, page_size, num_kv_heads, head_dim]
        client.page_array(ns, page)[...] = page_values(tokens[i * PAGE : (i + 1) * PAGE], i * PAGE)[
            None, None, :, None, None
        ]


def holds(client: KVDClient, ns: int, page: int, tokens: np.ndarray, i: int) -> bool:
    want = page_values(tokens[i * PAGE : (i + 1) * PAGE], i * PAGE)[None, None, :, None, None]
    return bool((client.page_array(ns, page) == want).all())


def publish_prefix(client: KVDClient, pages: int, seed: int = 1):
    """Publishes a prompt of ``pages`` full pages with real KV bytes; waits until it is sealed."""
    ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
    tokens = agents.prompt(pages * PAGE + 5, seed, 0)
    [alloc] = client.allocate_with_prefix(ns, [SequenceRequest("base", tokens)])
    write_all(client, ns, alloc.pages[:pages], tokens)
    client.publish(ns, ["base"])
    client.verify_pages()  # returns once the sealer has recorded every checksum
    return ns, tokens, alloc


def assert_prefix_served(c: KVDClient, ns: int, tokens: np.ndarray, alloc, pages: int) -> None:
    """After a restart: the namespace id is the same and the first ``pages`` pages published
    before it hit again, at the same page ids, with the same bytes."""
    assert c.register_namespace(agents.MODEL, agents.LAYOUT) == ns, "namespace ids survive"
    [hit] = c.allocate_with_prefix(ns, [SequenceRequest("again", tokens)])
    assert hit.shared_prefix_tokens == pages * PAGE and hit.shared_pages == alloc.pages[:pages]
    assert all(holds(c, ns, page, tokens, i) for i, page in enumerate(hit.shared_pages))
    assert c.check_invariants() == []


def kill_and_restart(daemon_factory, daemon, *args: str):
    daemon.stop(signal.SIGKILL)
    return daemon_factory(*(args or ARGS))


def test_warm_restart_serves_the_published_prefix_and_frees_private_pages(daemon_factory):
    d = daemon_factory(*ARGS)
    client = KVDClient.connect(d.socket)
    ns, tokens, alloc = publish_prefix(client, 40)
    client.allocate_with_prefix(ns, [SequenceRequest("private", np.arange(10 * PAGE + 3) + 700_000)])  # never published
    before = client.stats()
    assert before["private_pages"] == 1 + 11 and before["shared_pages"] == 40
    d2 = kill_and_restart(daemon_factory, d)
    client.close()

    with KVDClient.connect(d2.socket) as c:
        assert c.register_namespace(agents.MODEL, agents.LAYOUT) == ns, "namespace ids survive"
        stats = c.stats()
        assert (stats["cached_pages"], stats["private_pages"], stats["shared_pages"]) == (40, 0, 0)
        assert stats["arena_bytes"] == before["arena_bytes"], "recovered extents count against the budget"
        assert stats["free_pages"] == before["free_pages"] + 12, "private pages of the dead session are free"
        [hit] = c.allocate_with_prefix(ns, [SequenceRequest("again", tokens)])
        assert hit.shared_prefix_tokens == 40 * PAGE and hit.shared_pages == alloc.pages[:40]
        assert all(holds(c, ns, page, tokens, i) for i, page in enumerate(hit.shared_pages))
        assert c.check_invariants() == []
    line = re.search(r"warm restart: recovered 40 published pages .* in ([\d.]+) ms \((\d+) bytes verified,", d2.log())
    assert line, d2.log()  # a few hundred KiB: no "ms per GiB" extrapolated from them
    assert "per GiB" not in d2.log()
    print(f"\nwarm restart of 40 pages ({int(line.group(2)) >> 10} KiB): {line.group(1)} ms")


def test_a_graceful_stop_keeps_the_published_cache_for_the_next_start(daemon_factory):
    d = daemon_factory(*ARGS)
    with KVDClient.connect(d.socket) as client:
        ns, tokens, alloc = publish_prefix(client, 12)
    assert d.stop() == 0  # SIGTERM, as `systemctl restart` sends
    d2 = daemon_factory(*ARGS)
    with KVDClient.connect(d2.socket) as c:
        assert_prefix_served(c, ns, tokens, alloc, 12)


def test_recovery_cost_per_gib(tmp_path):
    """Bench-style: recover 256 MiB of published 256 KiB pages in-process and print the cost."""
    prefix = f"/kvdtest-restart-{time.time_ns()}"
    identity = NamespaceIdentity("bench", make_layout(4, 8, 128, 16, "float16"))  # 256 KiB pages
    first = KVCacheManager(Arena(512 << 20, 64 << 20, prefix, lock_memory=False), prefix_reuse=True)
    try:
        session = first.open_session("bench", 1).id
        ns = first.catalog.register_namespace(identity)
        tokens = np.arange(1024 * 16, dtype="<i4").tobytes()
        [plan] = first.allocate(session, ns.id, [CoreRequest("s", tokens)]).result
        for page in plan.private_pages:
            first.arena.page_bytes_view(page)[:] = page % 251
        first.publish(session, ns.id, [("s", 0)])
        first.integrity.apply(wait=True)
        first.close(unlink=False)  # what kill -9 leaves
        second = KVCacheManager(Arena(512 << 20, 64 << 20, prefix, lock_memory=False), prefix_reuse=True)
        try:
            assert recovery.recover(second).pending_pages == 1024
            second.catalog.reindexing.finish()  # what a daemon does between calls
            report = second.catalog.last_recovery
            assert report.recovered_pages == 1024 and report.corrupted_pages == 0 and report.discarded is None
            assert invariants.violations(second) == []
            hits = second.lookup(second.open_session("bench", 1).id, ns.id, [CoreRequest("probe", tokens)])[0]
            assert hits.hit_pages == plan.pages
            # recovery re-inserts pages in chain order, so the chain comes back as one run
            assert len(second.index._numbered) == 1
            print(
                f"\nrecovered {report.verified_bytes >> 20} MiB in {report.seconds * 1e3:.1f} ms: "
                f"{report.ms_per_gib:.0f} ms per GiB"
            )
        finally:
            second.close()
    finally:
        for name in daemon_segments(prefix):
            import posix_ipc

            posix_ipc.unlink_shared_memory(name)


def test_a_page_corrupted_while_the_daemon_was_down_is_not_served(daemon_factory):
    d = daemon_factory(*ARGS)
    client = KVDClient.connect(d.socket)
    ns, tokens, alloc = publish_prefix(client, 8)
    d.stop(signal.SIGKILL)
    raw_page(client, ns, alloc.pages[5])[0, 0, 0, 0, 0] += 1  # one value changes in /dev/shm
    client.close()
    d2 = daemon_factory(*ARGS)
    with KVDClient.connect(d2.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        [hit] = c.lookup(ns, [SequenceRequest("probe", tokens)])
        # Pages 6 and 7 verified, but their parent did not: a lookup walks the chain from
        # page 0, so they could never hit and are freed with it.
        assert hit.hit_pages == alloc.pages[:5]
        stats = c.stats()
        assert (stats["corrupted_pages"], stats["cached_pages"]) == (1, 5)
        assert stats["recovery"]["recovered_pages"] == 5
        assert stats["recovery"]["dropped_pages"] == {
            "corrupted": 1,
            "orphaned": 2,
            "mismatch": 0,
            "incomplete_extent": 0,
            "evicted": 0,
        }
        assert c.check_invariants() == []
    assert "failed their checksum" in d2.log() and "1 failed their checksum, 2 dropped" in d2.log()


def test_verify_drops_pages_whose_bytes_changed(daemon):
    with KVDClient.connect(daemon.socket) as c:
        ns, tokens, alloc = publish_prefix(c, 6)
        c.release(ns, ["base"])  # all six cached
        [held] = c.allocate_with_prefix(ns, [SequenceRequest("held", tokens[: 6 * PAGE])])
        assert held.shared_pages == alloc.pages[:6]
        c.release(ns, ["held"])
        [held] = c.allocate_with_prefix(ns, [SequenceRequest("held", tokens[: 2 * PAGE])])  # references pages 0, 1
        raw_page(c, ns, alloc.pages[4])[...] = 0  # a cached page scribbled on
        raw_page(c, ns, alloc.pages[1])[1, 1, 1, 1, 1] = 3  # a referenced page scribbled on
        result = c.verify_pages()
        assert (result["checked_pages"], result["corrupted_pages"]) == (6, 2)
        stats = c.stats()
        assert stats["corrupted_pages"] == 2
        assert c.lookup(ns, [SequenceRequest("probe", tokens)])[0].hit_pages == alloc.pages[:1]
        assert c.check_invariants() == []
        # pages 2-5 followed the referenced corrupted page 1: no match reaches them without
        # it, so they left the index with it (freed, being cached; page 4 was corrupted too)
        c.release(ns, ["held"])  # the corrupted page is freed, never cached
        stats = c.stats()
        assert stats["cached_pages"] == 1 and stats["free_pages"] >= 5 and stats["shared_pages"] == 0
        assert c.verify_pages()["corrupted_pages"] == 0
        assert c.check_invariants() == []


def test_kvd_verify_cli(daemon):
    import subprocess
    import sys

    with KVDClient.connect(daemon.socket) as c:
        ns, _, alloc = publish_prefix(c, 3)
        clean = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "verify", "--socket", daemon.socket], capture_output=True, text=True
        )
        assert clean.returncode == 0 and "verified 3 published pages" in clean.stdout, clean
        raw_page(c, ns, alloc.pages[2])[...] = 1
        bad = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "verify", "--socket", daemon.socket], capture_output=True, text=True
        )
        assert bad.returncode == 1 and "1 corrupted pages dropped" in bad.stdout, bad


def _garbage_manifest(socket: str) -> None:
    with open(SHM_DIR + manifest_name(ServeConfig(socket=socket).shm_prefix), "r+b") as f:
        f.write(b"not a manifest at all")


@pytest.mark.parametrize(
    "change, args, reason",
    [
        ("budget", ("--enable-prefix-reuse", "--host-bytes", "32MiB", "--extent-bytes", "4MiB"), "host budget shrank"),
        (
            "extent size",
            ("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "2MiB"),
            "extent size changed",
        ),
        ("manifest", ARGS, "magic"),
    ],
)
def test_a_restart_that_does_not_match_starts_empty(daemon_factory, change, args, reason):
    d = daemon_factory(*ARGS)
    with KVDClient.connect(d.socket) as client:
        ns, tokens, _ = publish_prefix(client, 4)
        d.stop(signal.SIGKILL)
    if change == "manifest":
        _garbage_manifest(d.socket)
    d2 = daemon_factory(*args)
    assert "discarding" in d2.log() and reason in d2.log(), d2.log()
    with KVDClient.connect(d2.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        assert c.lookup(ns, [SequenceRequest("probe", tokens)])[0].hit_tokens == 0
        stats = c.stats()
        assert stats["cached_pages"] == 0 and c.check_invariants() == []
        assert stats["recovery"]["dropped_pages"]["mismatch"] == 4 and reason in stats["recovery"]["discarded"]
        assert c.verify_pages()["recovery"]["mismatch_pages"] == 4


def test_clients_fail_fast_and_reconnect_after_a_restart(daemon_factory):
    d = daemon_factory(*ARGS)
    client = KVDClient.connect(d.socket)
    ns, tokens, alloc = publish_prefix(client, 4)
    d.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(KVDError) as e:
        client.allocate_with_prefix(ns, [SequenceRequest("x", tokens)])
    assert time.monotonic() - start < 2
    assert e.value.code.name == "UNAVAILABLE" and "reconnect()" in e.value.message
    assert client.session_lost.wait(2)

    d2 = daemon_factory(*ARGS)
    old_session = client.session
    assert client.reconnect() == {ns: ns}
    assert client.session != old_session and not client.session_lost.is_set()
    with pytest.raises(KVDError) as e:
        client.release(ns, ["base"])
    assert e.value.code.name == "NOT_FOUND" and "do not survive a daemon restart" in e.value.message
    [hit] = client.allocate_with_prefix(ns, [SequenceRequest("base", tokens)])
    assert hit.shared_pages == alloc.pages[:4]
    assert all(holds(client, ns, page, tokens, i) for i, page in enumerate(hit.shared_pages))
    client.close()
    d2.stop()


CHAINS, CHAIN_PAGES = 20, 3125  # 62,500 pages of 1 KiB: twenty 50K-token prompts
SMALL = PageLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=16, dtype="float16")
BIG_ARGS = ("--enable-prefix-reuse", "--host-bytes", "96MiB", "--extent-bytes", "4MiB")


def chain_tokens(chain: int) -> np.ndarray:
    return (np.arange(CHAIN_PAGES * PAGE, dtype=np.int32) + chain * 1_000_000) % 2_000_000_000


def test_a_restart_answers_at_once_and_serves_no_page_before_it_is_verified(daemon_factory, tmp_path):
    """The daemon answers before its recovery indexed anything past a held step; a page
    corrupted after the kill is never served, not while the recovery runs nor after it, and
    is counted; a prompt published again meanwhile takes its keys, and the recovered copies
    of those pages are dropped, not indexed twice."""
    d = daemon_factory(*BIG_ARGS)
    client = KVDClient.connect(d.socket)
    ns = client.register_namespace("small", SMALL)
    for chain in range(CHAINS):
        client.allocate_with_prefix(ns, [SequenceRequest(f"c{chain}", chain_tokens(chain))])
        client.publish(ns, [f"c{chain}"])
        client.release(ns, [f"c{chain}"])
    [first] = client.lookup(ns, [SequenceRequest("probe", chain_tokens(3))])
    client.verify_pages()  # every page sealed
    corrupted = raw_page(client, ns, first.hit_pages[1000])
    d.stop(signal.SIGKILL)
    corrupted[0, 0, 0, 0, 0] += 1  # chain 3's page 1000 changes in /dev/shm
    client.close()

    # Parents first: step k covers the pages of chain index < k * STEP_PAGES / CHAINS of every chain.
    held_steps = 60
    verified = held_steps * STEP_PAGES // CHAINS
    hold = tmp_path / "hold"
    hold.touch()
    env = clean_env(tmp_path, KVD_HOLD_AT=f"recovery-step:{held_steps}", KVD_HOLD_FILE=str(hold))
    d2 = daemon_factory(*BIG_ARGS, env=env)
    serving = re.search(r"serving on .* after (\d+) ms", d2.log())
    assert serving and int(serving.group(1)) < 1000, d2.log()
    with KVDClient.connect(d2.socket) as c:
        assert c.register_namespace("small", SMALL) == ns
        # It runs between calls up to the held step, and stands there.
        wait_until(lambda: c.stats()["recovery"]["recovered_pages"] == held_steps * STEP_PAGES, "the held step", 30)
        recovery_now = c.stats()["recovery"]
        assert recovery_now["pending_pages"] == CHAINS * CHAIN_PAGES - held_steps * STEP_PAGES
        assert recovery_now["recovered_pages"] == held_steps * STEP_PAGES
        [during] = c.lookup(ns, [SequenceRequest("probe", chain_tokens(3))])
        assert during.hit_pages == first.hit_pages[:verified], "a miss past what is verified"
        # Chain 5 published again meanwhile: its pages past the verified ones are new pages
        # under the keys the recovery holds unverified.
        [again] = c.allocate_with_prefix(ns, [SequenceRequest("again", chain_tokens(5))])
        assert again.shared_prefix_tokens == verified * PAGE
        c.publish(ns, ["again"])
        c.release(ns, ["again"])
        assert c.check_invariants() == []

        hold.unlink()
        c.verify_pages()  # waits for the recovery: its report counts every page
        stats = c.stats()
        dropped = stats["recovery"]["dropped_pages"]
        chain_5_again = CHAIN_PAGES - verified
        assert dropped["corrupted"] == 1 and dropped["orphaned"] == CHAIN_PAGES - 1001 + chain_5_again
        assert stats["recovery"]["pending_pages"] == 0
        assert stats["recovery"]["recovered_pages"] == CHAINS * CHAIN_PAGES - 1 - dropped["orphaned"]
        [after] = c.lookup(ns, [SequenceRequest("probe", chain_tokens(3))])
        assert after.hit_pages == first.hit_pages[:1000]
        [five] = c.lookup(ns, [SequenceRequest("probe", chain_tokens(5))])
        assert five.hit_pages == again.pages[:CHAIN_PAGES]
        [other] = c.lookup(ns, [SequenceRequest("probe", chain_tokens(7))])
        assert other.hit_tokens == CHAIN_PAGES * PAGE
        assert c.check_invariants() == []


def test_an_allocation_short_of_room_takes_the_deepest_pages_the_recovery_holds(daemon_factory, tmp_path):
    """A full cache restarted, its recovery held before its first step: a new prompt's pages
    come from the pages the recovery holds unverified, the deepest in their chains, so no
    page left to recover loses its parent; they are counted evicted."""
    args = ("--enable-prefix-reuse", "--host-bytes", "16MiB", "--extent-bytes", "4MiB")
    d = daemon_factory(*args)
    with KVDClient.connect(d.socket) as client:
        ns = client.register_namespace("small", SMALL)
        for chain in range(5):  # more than the budget holds: the cache ends full of cached pages
            client.allocate_with_prefix(ns, [SequenceRequest(f"c{chain}", chain_tokens(chain))])
            client.publish(ns, [f"c{chain}"])
            client.release(ns, [f"c{chain}"])
        client.verify_pages()
        before = client.stats()
    d.stop(signal.SIGKILL)
    hold = tmp_path / "hold"
    hold.touch()
    d2 = daemon_factory(*args, env=clean_env(tmp_path, KVD_HOLD_AT="recovery-step:0", KVD_HOLD_FILE=str(hold)))
    with KVDClient.connect(d2.socket) as c:
        assert c.register_namespace("small", SMALL) == ns
        found = before["cached_pages"]
        assert c.stats()["recovery"]["pending_pages"] == found
        [new] = c.allocate_with_prefix(ns, [SequenceRequest("new", chain_tokens(99))])
        assert len(new.pages) == CHAIN_PAGES and new.shared_prefix_tokens == 0
        short = CHAIN_PAGES - before["free_pages"]
        recovery_now = c.stats()["recovery"]
        assert (recovery_now["recovered_pages"], recovery_now["evicted_pages"]) == (0, short)
        assert recovery_now["pending_pages"] == found - short
        assert c.check_invariants() == []
        hold.unlink()
        c.verify_pages()
        recovery_now = c.stats()["recovery"]
        assert recovery_now["pending_pages"] == 0 and recovery_now["dropped_pages"]["orphaned"] == 0
        assert recovery_now["recovered_pages"] == found - short
        assert c.check_invariants() == []
