"""Prewarms and pins across tiers through a real daemon with a real disk tier: a router's
session-less prewarm (kvd/wire/admin.py, ``kvd prewarm``) and a client's promote a prompt
that was only on disk into host memory before its request, with KV events and counters;
beyond the budget a prewarm is partial and says so; a hostile or unknown identity and bad
token ids are refused; a flood of prewarms leaves an engine's allocations within a bound;
a pin of a prompt on disk extends to its pages once they land."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_until
from google.protobuf import json_format
from test_disk_tier import LAYOUT, MODEL, PAGES, daemon_args, evict, evicted_to_disk, lookup, prompt
from test_service import free_port, metric_samples

from engine_client import BlockStored, KVDClient, KVDError, SequenceRequest, messages
from kvd.wire import kvd_pb2 as pb
from kvd.wire.admin import prewarm

FULL = PAGES * LAYOUT.page_size


def identity(model: str = MODEL) -> pb.NamespaceIdentity:
    """The identity ``register_namespace(model, LAYOUT)`` registers."""
    return messages.identity(model, LAYOUT, "", 0, 1, "gqa", 0, {})


@pytest.fixture
def on_disk(tmp_path, daemon_factory):
    """A daemon with a disk tier, a client, its namespace, and prompt 1 on disk only."""
    (tmp_path / "disk").mkdir()
    d = daemon_factory(*daemon_args(tmp_path / "disk"))
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        evicted_to_disk(c, ns)
        yield d, c, ns


def kvd_prewarm(socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli", "prewarm", "--socket", socket, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def settled(client: KVDClient) -> dict:
    """The prewarm stats once nothing is queued or in flight."""
    return wait_until(lambda: (s := client.stats()["prewarm"])["pending_tokens"] == 0 and s, "the prewarms settled", 10)


def test_a_router_prewarm_promotes_a_prompt_from_disk_before_its_request(tmp_path, daemon_factory):
    (tmp_path / "disk").mkdir()
    port = free_port()
    d = daemon_factory(*daemon_args(tmp_path / "disk"), "--metrics-port", str(port))
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        evicted_to_disk(c, ns)
        stream = c.subscribe_events()
        stored: list[BlockStored] = []
        reader = threading.Thread(target=lambda: stored.extend(e for b in stream for e in b.events))
        reader.start()
        fetched = c.stats()["disk"]["fetched_pages"]
        report = prewarm(d.socket, [prompt(1).tolist()], identity=identity())
        [p] = report["prompts"]
        assert not report["partial"] and p["requested_tokens"] == FULL and p["over_budget_tokens"] == 0
        assert p["resident_tokens"] + p["pending_tokens"] == FULL and p["pending_tokens"] > 0
        s = settled(c)
        assert s["promoted_tokens"] == p["pending_tokens"] and s["not_found_tokens"] == 0
        assert s["prompts"] == 1 and s["requested_tokens"] == FULL and s["resident_tokens"] == p["resident_tokens"]
        assert c.stats()["disk"]["fetched_pages"] - fetched == p["pending_tokens"] // LAYOUT.page_size
        samples = metric_samples(port)
        assert samples[("kvd_prewarm_promoted_tokens_total", ())] == p["pending_tokens"]
        assert samples[("kvd_prewarm_requested_tokens_total", ())] == FULL
        assert samples[("kvd_prewarm_pending_tokens", ())] == 0
        first = lookup(c, ns, 1)  # the request's first ask hits all of it: nothing left to fetch
        assert first.hit_tokens == FULL and first.remote_pending_tokens == 0

        def host() -> list[int]:
            return [t for e in stored if isinstance(e, BlockStored) and e.medium == "CPU" for t in e.token_ids]

        wait_until(lambda: len(host()) >= p["pending_tokens"], "the promoted pages' KV events", 5)
        stream.cancel()
        reader.join()
        assert host() == prompt(1).tolist()[p["resident_tokens"] :]  # published like any promotion
        # A second prewarm finds it resident and starts nothing; a prompt on no tier is not found at once.
        again, nowhere = c.prewarm(ns, [SequenceRequest("again", prompt(1)), SequenceRequest("new", prompt(77))])
        assert again.resident_tokens == FULL and again.pending_tokens == again.not_found_tokens == 0
        assert nowhere.not_found_tokens == FULL and nowhere.pending_tokens == nowhere.resident_tokens == 0
        assert c.stats()["prewarm"]["not_found_tokens"] == FULL


def test_a_prewarm_beyond_the_budget_is_partial_and_says_so(on_disk):
    d, c, ns = on_disk
    held = 20  # pages a live sequence holds: 4 of the 24 are left to spare
    c.allocate_with_prefix(ns, [SequenceRequest("held", prompt(99, held))])
    [p] = c.prewarm(ns, [SequenceRequest("p", prompt(1))])
    assert p.resident_tokens == 0 and p.pending_tokens == 4 * LAYOUT.page_size
    assert p.over_budget_tokens == FULL - p.pending_tokens
    s = settled(c)
    assert s["promoted_tokens"] == 4 * LAYOUT.page_size and s["over_budget_tokens"] == p.over_budget_tokens
    report = prewarm(d.socket, [prompt(1).tolist()], namespace=ns)  # its hit is not given up for the rest
    [again] = report["prompts"]
    assert report["partial"] and again["resident_tokens"] == 4 * LAYOUT.page_size
    assert again["pending_tokens"] == again["not_found_tokens"] == 0 and again["over_budget_tokens"] == FULL / 2
    [still] = c.describe_sequences(ns, ["held"])  # never evicted for a prewarm
    assert still.num_tokens == held * LAYOUT.page_size
    assert c.check_invariants() == []


@pytest.mark.parametrize(
    "call, code, message",
    [
        (lambda s, ns: prewarm(s, [[1, 2, 3]], identity=identity("never-registered")), "NOT_FOUND", "no engine"),
        (lambda s, ns: prewarm(s, [[1, 2, 3]], identity=identity("x" * 5000)), "INVALID_ARGUMENT", "model name"),
        (lambda s, ns: prewarm(s, [[1, 2, 3]], namespace=ns + 7), "NOT_FOUND", "namespace"),
        (lambda s, ns: prewarm(s, [[1, -2, 3]], namespace=ns), "INVALID_ARGUMENT", "token"),
    ],
    ids=["unknown-identity", "hostile-identity", "unknown-namespace", "bad-token-ids"],
)
def test_a_prewarm_of_a_bad_identity_or_bad_tokens_is_refused(daemon_factory, call, code, message):
    d = daemon_factory("--enable-prefix-reuse")
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        with pytest.raises(KVDError) as e:
            call(d.socket, ns)
        assert e.value.code.name == code and message in str(e.value), str(e.value)
        assert c.stats()["prewarm"]["prompts"] == 0


def test_a_flood_of_prewarms_leaves_engines_allocations_within_a_bound(tmp_path, daemon_factory):
    (tmp_path / "disk").mkdir()
    d = daemon_factory(*daemon_args(tmp_path / "disk"))
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        evict(c, ns, range(1, 12))  # prompts 1-8 end on disk, the last three in host memory
        wait_until(lambda: c.stats()["disk"]["pages"] >= 8 * PAGES, "prompts on disk", 10)
        stop = threading.Event()
        calls = []

        def flood():
            with KVDClient.connect(d.socket) as router:
                while not stop.is_set():
                    router.prewarm(ns, [SequenceRequest(str(s), prompt(s)) for s in range(1, 9)] * 32)
                    calls.append(1)

        flooding = threading.Thread(target=flood)
        flooding.start()
        try:
            wait_until(lambda: len(calls) >= 3, "the flood under way", 10)
            slowest = 0.0
            for n in range(20):
                start = time.perf_counter()
                c.allocate_with_prefix(ns, [SequenceRequest(f"e{n}", prompt(100 + n, 2))])
                slowest = max(slowest, time.perf_counter() - start)
                c.release(ns, [f"e{n}"])
        finally:
            stop.set()
            flooding.join()
        assert slowest < 1.0, f"an engine's allocate took {slowest:.3f} s under a flood of prewarms"
        s = settled(c)
        assert s["prompts"] >= 3 * 256 and s["promoted_tokens"] > 0
        assert c.check_invariants() == []


def test_a_pin_of_a_prompt_on_disk_promotes_it_and_then_holds_it(on_disk):
    _, c, ns = on_disk
    pin = c.pin(ns, prompt(1))
    assert pin.pending_tokens > 0 and pin.pinned_tokens + pin.pending_tokens == FULL
    wait_until(lambda: c.stats()["pinned_pages"] == PAGES, "the pin extended to the promoted pages", 10)
    evict(c, ns, range(20, 26))  # a flood that evicts every cached page
    assert lookup(c, ns, 1).hit_tokens == FULL
    c.unpin(pin.pin_id)
    assert c.check_invariants() == []


def test_kvd_prewarm_cli(tmp_path, on_disk):
    d, c, ns = on_disk
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt(1).tolist(), [1, 2, 3]]))
    ident = tmp_path / "identity.json"
    ident.write_text(json_format.MessageToJson(identity()))
    run = kvd_prewarm(d.socket, "--identity", str(ident), "--prompts", str(prompts), "--json")
    assert run.returncode == 0, run.stderr
    first, short = json.loads(run.stdout)["prompts"]
    assert first["pending_tokens"] > 0 and short["requested_tokens"] == 0
    settled(c)
    text = kvd_prewarm(d.socket, "--namespace", str(ns), "--prompts", str(prompts))
    assert text.returncode == 0 and f"{FULL} tokens in full pages, {FULL} resident" in text.stdout, text.stdout
    bad = kvd_prewarm(d.socket, "--namespace", str(ns + 5), "--prompts", str(prompts))
    assert bad.returncode == 1 and "namespace" in bad.stderr
    usage = kvd_prewarm(d.socket, "--namespace", str(ns), "--prompts", str(ident))
    assert usage.returncode == 2 and "a list of token ids" in usage.stderr
