"""A real `kvd serve` process with real engine processes sharing real shared memory."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import agents
import numpy as np
import pytest

from engine_client import ErrorCode, ExtendItem, KVDClient, KVDError, SequenceRequest

SPAWN = multiprocessing.get_context("spawn")
PREFIX = 5000
PRIVATE = 100


def ideal_pages(num_agents: int, prefix: int = PREFIX, private: int = PRIVATE, page: int = 16) -> int:
    """Shared full prefix pages once, plus each agent's own pages."""
    shared = prefix // page
    per_agent = -(-(prefix + private) // page) - shared
    return shared + num_agents * per_agent


def run_engines(socket: str, groups: list[list[int]], observer: KVDClient, concurrent: bool):
    """One engine process per group of agents; returns their reports and the stats read while they hold.

    Sequential: each engine publishes before the next allocates. Concurrent: all allocate at
    the same moment, so nobody has published yet and all prefill the prefix.
    """
    start = SPAWN.Barrier(len(groups) if concurrent else 1)  # kept alive until the children unpickle it
    done = SPAWN.Barrier(len(groups) + 1)
    results = SPAWN.Queue()
    procs, outs = [], []
    for group in groups:
        p = SPAWN.Process(target=agents.run_agents, args=(socket, group, PREFIX, PRIVATE, start, done, results))
        p.start()
        procs.append(p)
        if not concurrent:
            outs.append(results.get(timeout=60))
    if concurrent:
        outs = [results.get(timeout=60) for _ in groups]
    done.wait(timeout=60)
    stats, violations = observer.stats(), observer.check_invariants()
    done.wait(timeout=60)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"engine process exited with {p.exitcode}"
    return outs, stats, violations


def test_four_agents_in_three_processes_store_the_prefix_once(daemon):
    with KVDClient.connect(daemon.socket) as observer:
        outs, stats, violations = run_engines(daemon.socket, [[0, 1], [2], [3]], observer, concurrent=False)
    assert violations == []
    assert all(o["bad_reads"] == 0 for o in outs), outs
    assert stats["physical_pages"] == ideal_pages(4)
    assert stats["logical_pages"] == 4 * -(-(PREFIX + PRIVATE) // 16)
    assert stats["host_pages_saved"] == stats["logical_pages"] - stats["physical_pages"]
    # The first engine's two agents allocate in one batch before anything is published:
    # both prefill, and publishing dedups the second onto the first's pages.
    full_prefix = PREFIX // 16 * 16
    assert outs[0]["hit_tokens"] == 0 and outs[0]["rebinds"] == PREFIX // 16
    # Every later engine hits the whole shared prefix and computes only its suffix.
    assert [o["hit_tokens"] for o in outs[1:]] == [full_prefix, full_prefix]
    assert [o["computed"] for o in outs[1:]] == [PREFIX + PRIVATE - full_prefix] * 2
    assert stats["sessions"] == 4  # three engines and the observer


def test_concurrent_identical_prefills_dedup_to_the_ideal(daemon):
    with KVDClient.connect(daemon.socket) as observer:
        outs, stats, violations = run_engines(daemon.socket, [[0], [1], [2], [3]], observer, concurrent=True)
    assert violations == []
    assert all(o["bad_reads"] == 0 for o in outs), outs
    assert all(o["hit_tokens"] == 0 for o in outs), "nobody had published when they allocated"
    # Three of the four engines lost the publish race for each shared page and were rebound.
    assert sum(o["rebinds"] for o in outs) == 3 * (PREFIX // 16)
    assert stats["physical_pages"] == ideal_pages(4)


def test_prefix_reuse_disabled_shares_nothing_with_the_same_api(daemon_factory):
    d = daemon_factory("--host-bytes", "64MiB", "--extent-bytes", "4MiB")
    with KVDClient.connect(d.socket) as observer:
        assert observer.prefix_reuse is False
        outs, stats, violations = run_engines(d.socket, [[0, 1], [2], [3]], observer, concurrent=False)
    assert violations == []
    assert all(o["bad_reads"] == 0 and o["hit_tokens"] == 0 and o["rebinds"] == 0 for o in outs)
    assert stats["physical_pages"] == stats["logical_pages"] == 4 * -(-(PREFIX + PRIVATE) // 16)
    assert stats["host_pages_saved"] == 0 and stats["cached_pages"] == 0


def test_fork_copies_the_partial_tail_and_shares_full_pages(daemon):
    with KVDClient.connect(daemon.socket) as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = agents.prompt(40, 0, 0)  # 2 full pages + 8 tokens
        [src] = client.allocate_with_prefix(ns, [SequenceRequest("src", tokens)])
        agents.write_kv(client, ns, src.pages, tokens, 0)
        client.set_aux_state(ns, "src", b"recurrent-state")
        client.publish(ns, ["src"])
        dst = client.fork(ns, "src", "dst")
        assert dst.shared_pages == src.pages[:2]
        assert len(dst.private_pages) == 1 and dst.private_pages[0] != src.pages[2]
        assert dst.num_tokens == 40 and dst.shared_prefix_tokens == 32
        assert np.array_equal(client.page_array(ns, dst.private_pages[0]), client.page_array(ns, src.pages[2]))
        assert client.get_aux_state(ns, "dst") == b"recurrent-state"
        # Writing dst's tail leaves src's tail alone.
        before = client.page_array(ns, src.pages[2]).copy()
        client.page(ns, dst.private_pages[0])[:, :, 8:] = 5.0
        assert np.array_equal(client.page_array(ns, src.pages[2]), before)
        assert client.stats()["physical_pages"] == 4
        assert client.check_invariants() == []


def test_sigkill_of_a_client_releases_its_references_within_a_second(daemon):
    ready = SPAWN.Event()
    victim = SPAWN.Process(target=agents.hold_and_wait, args=(daemon.socket, 64, ready))
    victim.start()
    try:
        assert ready.wait(60)
        with KVDClient.connect(daemon.socket) as observer:
            held = observer.stats()
            assert held["sequences"] == 1 and held["pinned_pages"] == 4 and held["sessions"] == 2
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            while time.monotonic() - killed_at < 1.0:
                after = observer.stats()
                if after["sessions"] == 1:
                    break
                time.sleep(0.02)
            assert after["sessions"] == 1, "the dead client's session is still open after 1 s"
            assert after["sequences"] == 0 and after["pinned_pages"] == 0
            assert after["private_pages"] == 0 and after["shared_pages"] == 0
            assert after["cached_pages"] == 4, "its published prefix pages stay cached for others"
            assert observer.check_invariants() == []
    finally:
        victim.kill()
        victim.join(timeout=10)


def test_bad_input_gets_a_status_that_says_what_was_wrong_and_changes_nothing(daemon):
    with KVDClient.connect(daemon.socket) as a, KVDClient.connect(daemon.socket) as b:
        ns = a.register_namespace(agents.MODEL, agents.LAYOUT, vocab_size=50000)
        b.register_namespace(agents.MODEL, agents.LAYOUT, vocab_size=50000)
        a.allocate_with_prefix(ns, [SequenceRequest("mine", agents.prompt(20, 0, 0))])
        before = a.stats()
        cases = [
            (
                lambda: a.allocate_with_prefix(ns + 7, [SequenceRequest("x", [1])]),
                ErrorCode.NOT_FOUND,
                "namespace",
            ),
            (lambda: a.release(ns, ["nope"]), ErrorCode.NOT_FOUND, "'nope'"),
            (lambda: b.release(ns, ["mine"]), ErrorCode.PERMISSION_DENIED, "another session"),
            (
                lambda: a.allocate_with_prefix(ns, [SequenceRequest("x", b"\x01\x00\x00")]),
                ErrorCode.INVALID_ARGUMENT,
                "multiple of 4",
            ),
            (
                lambda: a.allocate_with_prefix(ns, [SequenceRequest("x", [1, 60000])]),
                ErrorCode.INVALID_ARGUMENT,
                "out of range",
            ),
            (
                lambda: a.allocate_with_prefix(ns, [SequenceRequest(f"s{i}", [1]) for i in range(5000)]),
                ErrorCode.INVALID_ARGUMENT,
                "over the limit",
            ),
            (
                lambda: a.publish(ns, ["mine"], num_tokens={"mine": 20}),
                ErrorCode.INVALID_ARGUMENT,
                "only full pages",
            ),
            (lambda: a.page(ns, 10**9), ErrorCode.NOT_FOUND, "not a page"),
            (lambda: a.set_state(ns, "mine", "EVICTED"), ErrorCode.FAILED_PRECONDITION, "PREFILLED to EVICTED"),
            (lambda: a.set_states(ns, ["mine", "nope"], "IN_DECODE"), ErrorCode.NOT_FOUND, "'nope'"),
            (lambda: b.set_states(ns, ["mine"], "IN_DECODE"), ErrorCode.PERMISSION_DENIED, "another session"),
            (lambda: a.extend(ns, "mine", 10**8), ErrorCode.INVALID_ARGUMENT, "over the limit"),
        ]
        for call, code, words in cases:
            with pytest.raises(KVDError) as e:
                call()
            assert e.value.code == code, e.value
            assert words in e.value.message, e.value
        after = a.stats()
        assert after == before
        a.release(ns, ["mine"])
        with pytest.raises(KVDError) as e:
            a.release(ns, ["mine"])
        assert e.value.code == ErrorCode.NOT_FOUND and "already released" in e.value.message
        assert a.check_invariants() == []


def test_extend_batch_mixes_sequences_with_and_without_token_ids(daemon):
    """One decode batch gives ids for some sequences (a list, a numpy array, bytes) and not for
    others: each grows, and only the pages whose ids are all known can be published and hit."""
    page = agents.LAYOUT.page_size
    with KVDClient.connect(daemon.socket) as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)
        prompts = {s: agents.prompt(0, i, page - 1).tolist() for i, s in enumerate("abcd")}  # a token short of a page
        client.allocate_with_prefix(ns, [SequenceRequest(s, p) for s, p in prompts.items()])
        new_ids = {
            "a": [40001],
            "c": np.array([40002, 40003]),
            "d": np.arange(41000, 41000 + page + 1, dtype="<i4").tobytes(),
        }
        results = client.extend_batch(
            ns,
            [
                ExtendItem("a", 1, new_ids["a"]),
                ExtendItem("b", 1),
                ExtendItem("c", 2, new_ids["c"]),
                ExtendItem("d", page + 1, new_ids["d"]),
            ],
        )
        assert [(r.seq_id, r.num_tokens, len(r.new_pages)) for r in results] == [
            ("a", page, 0),
            ("b", page, 0),
            ("c", page + 1, 1),
            ("d", 2 * page, 1),
        ]
        assert len({p for r in results for p in r.new_pages}) == 2
        # b's new id was never given: its first page cannot be published, and ids cannot follow the gap.
        published = client.publish(ns, list("abcd"))
        assert [p.published_pages for p in published] == [1, 0, 1, 2]
        with pytest.raises(KVDError) as e:
            client.extend(ns, "b", 1, [7])
        assert e.value.code == ErrorCode.FAILED_PRECONDITION and "never given" in e.value.message
        # The recorded ids are the given ones, in order: the published pages hit.
        full = {
            "a": prompts["a"] + new_ids["a"],
            "b": prompts["b"] + [7],
            "c": prompts["c"] + new_ids["c"].tolist(),
            "d": prompts["d"] + np.frombuffer(new_ids["d"], "<i4").tolist(),
        }
        hits = client.lookup(ns, [SequenceRequest(f"{s}2", ids) for s, ids in full.items()])
        assert [h.hit_tokens for h in hits] == [page, 0, page, 2 * page]
        # A batch of lists only (a decode step's usual shape), then one with an id count that
        # does not match: refused whole, nothing grows.
        results = client.extend_batch(ns, [ExtendItem("a", 1, [40004]), ExtendItem("c", 1, [40005])])
        assert [(r.num_tokens, len(r.new_pages)) for r in results] == [(page + 1, 1), (page + 2, 0)]
        with pytest.raises(KVDError) as e:
            client.extend_batch(ns, [ExtendItem("a", 1, [40006]), ExtendItem("c", 2, [40007])])
        assert e.value.code == ErrorCode.INVALID_ARGUMENT
        assert "sequence 'c': 1 token ids given for 2 new tokens" in e.value.message
        assert [r.num_tokens for r in client.extend_batch(ns, [ExtendItem("a", 1), ExtendItem("c", 1)])] == [
            page + 2,
            page + 3,
        ]
        assert client.check_invariants() == []


def test_budget_exhaustion_is_resource_exhausted_and_rolls_back(daemon_factory):
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", "1MiB", "--extent-bytes", "256KiB")
    with KVDClient.connect(d.socket) as client:
        ns = client.register_namespace(agents.MODEL, agents.LAYOUT)  # 2 KiB pages: 512 fit
        client.allocate_with_prefix(ns, [SequenceRequest("a", agents.prompt(16 * 300, 0, 0))])
        before = client.stats()
        with pytest.raises(KVDError) as e:
            client.allocate_with_prefix(
                ns,
                [
                    SequenceRequest("b", agents.prompt(16 * 100, 1, 0)),
                    SequenceRequest("c", agents.prompt(16 * 200, 2, 0)),
                ],
            )
        assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED and "host budget" in e.value.message
        after = client.stats()
        assert {k: after[k] for k in ("logical_pages", "physical_pages", "free_pages", "sequences")} == {
            k: before[k] for k in ("logical_pages", "physical_pages", "free_pages", "sequences")
        }
        assert after["arena_bytes"] <= after["host_bytes"]
        assert client.check_invariants() == []
