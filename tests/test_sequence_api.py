"""The sequence API as an engine author reads it in the README, against a real daemon: the
life-cycle table (all 25 pairs), reading a sequence's state, when an eviction is known,
and the non-KV state budget."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from conftest import STATE_STEPS, clean_env, wait_until

from engine_client import (
    ErrorCode,
    ExtendItem,
    KVDClient,
    KVDError,
    PageLayout,
    SequenceRequest,
    SequenceState,
    SequenceStatus,
)
from kvd import config as config_mod
from kvd.config import ConfigError

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")  # 512-byte pages
PAGE_BYTES = 512
BUDGET = 64 * PAGE_BYTES

# The README's table, written out here so that a change to it shows up as a failing test.
ALLOWED = {
    SequenceState.PREFILLED: {SequenceState.IN_DECODE, SequenceState.ON_HOLD, SequenceState.COMPLETED},
    SequenceState.IN_DECODE: {SequenceState.ON_HOLD, SequenceState.COMPLETED},
    SequenceState.ON_HOLD: {SequenceState.IN_DECODE, SequenceState.COMPLETED},
    SequenceState.EVICTED: {SequenceState.COMPLETED},
    SequenceState.COMPLETED: set(),
}


@pytest.fixture
def small(daemon_factory):
    """A daemon whose budget a test can fill: 64 pages of 512 bytes in one extent."""
    return daemon_factory(
        "--enable-prefix-reuse",
        "--host-bytes",
        str(BUDGET),
        "--extent-bytes",
        str(BUDGET),
        "--aux-bytes",
        "64KiB",
        "--aux-bytes-per-sequence",
        "16KiB",
    )


def prompt(start: int, num_tokens: int) -> list[int]:
    return list(range(start, start + num_tokens))


def free_pages(kvd: KVDClient) -> int:
    return kvd.stats()["host_bytes_free"] // PAGE_BYTES


def press(kvd: KVDClient, ns: int, extra_pages: int, seq_id: str = "pressure") -> set[tuple[int, str]]:
    """Allocates every free page and ``extra_pages`` more (taken from ON_HOLD sequences), then
    releases it; returns what ``take_evicted()`` holds right after the allocation returned."""
    kvd.allocate_with_prefix(ns, [SequenceRequest(seq_id, prompt(90_000, (free_pages(kvd) + extra_pages) * 4))])
    evicted = kvd.take_evicted()
    kvd.release(ns, [seq_id])
    return evicted


def status(kvd: KVDClient, ns: int, seq_id: str) -> SequenceStatus:
    [s] = kvd.describe_sequences(ns, [seq_id])
    return s


def move_to(kvd: KVDClient, ns: int, seq_id: str, state: SequenceState) -> None:
    """Takes the PREFILLED ``seq_id`` to ``state`` as a client and the daemon would."""
    for step in STATE_STEPS[state]:
        kvd.set_state(ns, seq_id, step)
    if state is SequenceState.EVICTED:
        assert press(kvd, ns, extra_pages=2) == {(ns, seq_id)}


def test_every_pair_of_states_is_allowed_exactly_as_the_table_says(small):
    pairs = [(a, b) for a in SequenceState for b in SequenceState]
    assert len(pairs) == 25
    with KVDClient.connect(small.socket) as kvd:
        ns = kvd.register_namespace("tiny", LAYOUT)
        for start, target in pairs:
            seq_id = f"{start.name}-{target.name}"
            kvd.allocate_with_prefix(ns, [SequenceRequest(seq_id, prompt(1000, 6))])  # 2 private pages
            move_to(kvd, ns, seq_id, start)
            before = kvd.stats()
            if target in ALLOWED[start]:
                assert kvd.set_state(ns, seq_id, target) is start, seq_id
                if target is SequenceState.COMPLETED:
                    with pytest.raises(KVDError) as gone:
                        kvd.describe_sequences(ns, [seq_id])
                    assert gone.value.code == ErrorCode.NOT_FOUND
                else:
                    assert status(kvd, ns, seq_id).state is target
                    kvd.release(ns, [seq_id])
                continue
            with pytest.raises(KVDError) as refused:
                kvd.set_state(ns, seq_id, target)
            if start is SequenceState.COMPLETED:  # the sequence is gone; its id means nothing
                assert refused.value.code == ErrorCode.NOT_FOUND, seq_id
            else:
                assert refused.value.code == ErrorCode.FAILED_PRECONDITION, seq_id
                assert f"cannot go from {start.name} to {target.name}" in refused.value.message
                assert status(kvd, ns, seq_id).state is start  # refused: nothing changed
                kvd.release(ns, [seq_id])
            assert kvd.stats()["sequences"] == before["sequences"] - (start is not SequenceState.COMPLETED)
        assert kvd.stats()["sequences"] == 0 and kvd.check_invariants() == []


def test_a_sequence_can_be_read_without_changing_it(small):
    with KVDClient.connect(small.socket) as kvd, KVDClient.connect(small.socket) as other:
        ns = kvd.register_namespace("tiny", LAYOUT)
        [a] = kvd.allocate_with_prefix(ns, [SequenceRequest("a", prompt(0, 10))])
        kvd.publish(ns, ["a"])
        [b] = kvd.allocate_with_prefix(ns, [SequenceRequest("b", prompt(0, 9))])  # hits 2 pages
        kvd.extend(ns, "b", 4)  # token ids not given
        kvd.set_aux_state(ns, "b", b"recurrent")
        before = (kvd.stats(), kvd.take_evicted())
        got = kvd.describe_sequences(ns, ["a", "b", "a"])
        assert got == [
            SequenceStatus("a", SequenceState.PREFILLED, 10, 10, 2, 1, 0, 0),
            SequenceStatus("b", SequenceState.PREFILLED, 13, 9, 2, 2, 8, 9),
            SequenceStatus("a", SequenceState.PREFILLED, 10, 10, 2, 1, 0, 0),
        ]
        assert (a.num_tokens, b.shared_prefix_tokens) == (10, 8)
        assert (kvd.stats(), kvd.take_evicted()) == before  # reading changes nothing
        kvd.set_state(ns, "b", "ON_HOLD")
        assert status(kvd, ns, "b").state is SequenceState.ON_HOLD
        press(kvd, ns, extra_pages=2)
        assert status(kvd, ns, "b") == SequenceStatus("b", SequenceState.EVICTED, 0, 0, 0, 0, 8, 9)
        for who, ids, code in (
            (kvd, ["a", "never"], ErrorCode.NOT_FOUND),
            (other, ["a"], ErrorCode.PERMISSION_DENIED),
        ):
            with pytest.raises(KVDError) as refused:
                who.describe_sequences(ns, ids)
            assert refused.value.code == code


def test_the_call_that_evicted_has_told_take_evicted_when_it_returns(small):
    """allocate, extend_batch and fork: right after each returns, take_evicted() names what it
    evicted (no waiting for the session stream), and names it once."""
    with KVDClient.connect(small.socket) as kvd:
        ns = kvd.register_namespace("tiny", LAYOUT)
        kvd.allocate_with_prefix(ns, [SequenceRequest(s, prompt(100 * i, 6)) for i, s in enumerate("hgf")])
        for s in "hgf":
            kvd.set_state(ns, s, "ON_HOLD")
        assert press(kvd, ns, extra_pages=1) == {(ns, "h")}  # the oldest on hold goes first

        kvd.allocate_with_prefix(ns, [SequenceRequest("grow", [7] * 4)])
        kvd.allocate_with_prefix(ns, [SequenceRequest("fill", prompt(50_000, free_pages(kvd) * 4))])
        kvd.extend_batch(ns, [ExtendItem("grow", 4)])  # a second page: g's
        assert kvd.take_evicted() == {(ns, "g")}

        kvd.release(ns, ["fill"])
        kvd.allocate_with_prefix(ns, [SequenceRequest("src", [8] * 7)])  # 2 private pages to copy
        kvd.allocate_with_prefix(ns, [SequenceRequest("fill", prompt(60_000, free_pages(kvd) * 4))])
        kvd.fork(ns, "src", "copy")
        assert kvd.take_evicted() == {(ns, "f")}

        statuses = kvd.describe_sequences(ns, ["h", "g", "f"])
        assert [s.state for s in statuses] == [SequenceState.EVICTED] * 3
        time.sleep(0.2)  # time for a stream notice to arrive, were one sent
        assert kvd.take_evicted() == set(), "an eviction the reply named came again on the stream"


OTHER_SESSION = """
import sys
from engine_client import KVDClient, PageLayout, SequenceRequest
layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
with KVDClient.connect(sys.argv[1]) as kvd:
    ns = kvd.register_namespace("tiny", layout)
    free = kvd.stats()["host_bytes_free"] // 512
    kvd.allocate_with_prefix(ns, [SequenceRequest("theirs", list(range(70_000, 70_000 + (free + 1) * 4)))])
    print(sorted(kvd.take_evicted()))
"""


def test_an_eviction_another_process_caused_arrives_on_the_session_stream(small, tmp_path):
    with KVDClient.connect(small.socket) as kvd:
        ns = kvd.register_namespace("tiny", LAYOUT)
        kvd.allocate_with_prefix(ns, [SequenceRequest("held", prompt(0, 6))])
        kvd.set_state(ns, "held", "ON_HOLD")
        run = subprocess.run(
            [sys.executable, "-c", OTHER_SESSION, small.socket],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(tmp_path),
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "[]"  # the other process evicted nothing of its own
        assert wait_until(kvd.take_evicted, "no eviction notice on the stream") == {(ns, "held")}


def test_aux_state_has_a_per_sequence_limit_and_a_shared_budget(daemon_factory):
    d = daemon_factory("--aux-bytes", "4KiB", "--aux-bytes-per-sequence", "2KiB", "--host-bytes", str(BUDGET))
    with KVDClient.connect(d.socket) as kvd:
        ns = kvd.register_namespace("tiny", LAYOUT)
        kvd.allocate_with_prefix(ns, [SequenceRequest(s, [1, 2]) for s in "abcd"])
        with pytest.raises(KVDError) as too_big:
            kvd.set_aux_state(ns, "a", bytes(2049))
        assert too_big.value.code == ErrorCode.INVALID_ARGUMENT
        assert "2048 bytes per sequence" in too_big.value.message
        kvd.set_aux_state(ns, "a", bytes(2048))
        kvd.set_aux_state(ns, "b", bytes(2000))
        with pytest.raises(KVDError) as full:
            kvd.set_aux_state(ns, "c", bytes(100))
        assert full.value.code == ErrorCode.RESOURCE_EXHAUSTED and "aux_bytes" in full.value.message
        stats = kvd.stats()
        assert (stats["aux_bytes"], stats["aux_bytes_used"], stats["aux_bytes_per_sequence"]) == (4096, 4048, 2048)
        kvd.release(ns, ["a"])  # its state goes with it, and others fit again
        kvd.set_aux_state(ns, "c", bytes(2048))
        assert kvd.stats()["aux_bytes_used"] == 4048 and kvd.check_invariants() == []


def test_aux_state_is_kept_while_evicted_and_through_reentry(small):
    with KVDClient.connect(small.socket) as kvd:
        ns = kvd.register_namespace("tiny", LAYOUT)
        kvd.allocate_with_prefix(ns, [SequenceRequest("a", prompt(0, 6))])
        kvd.set_aux_state(ns, "a", b"step 6")
        kvd.set_state(ns, "a", "ON_HOLD")
        assert press(kvd, ns, extra_pages=2) == {(ns, "a")}
        assert kvd.get_aux_state(ns, "a") == b"step 6"
        kvd.set_aux_state(ns, "a", b"checkpoint")  # not KV: an evicted sequence may update it
        [again] = kvd.allocate_with_prefix(ns, [SequenceRequest("a", prompt(0, 6))])
        assert status(kvd, ns, "a").state is SequenceState.PREFILLED
        assert kvd.get_aux_state(ns, "a") == b"checkpoint"
        assert kvd.stats()["aux_bytes_used"] == len(b"checkpoint") and kvd.check_invariants() == []


def test_aux_settings_merge_like_every_setting(tmp_path):
    path = tmp_path / "kvd.toml"
    path.write_text(textwrap.dedent('aux_bytes = "1MiB"\naux_bytes_per_sequence = "64KiB"\n'))
    cfg = config_mod.load({}, environ={}, config_file=str(path))
    assert (cfg.aux_bytes, cfg.aux_bytes_per_sequence) == (1 << 20, 64 << 10)
    cfg = config_mod.load(
        {"aux_bytes_per_sequence": "128KiB"}, environ={"KVD_AUX_BYTES": "2MiB"}, config_file=str(path)
    )
    assert (cfg.aux_bytes, cfg.aux_bytes_per_sequence) == (2 << 20, 128 << 10)
    for aux, per_sequence in (("1MiB", "2MiB"), ("1GiB", "65MiB")):  # over the budget; over one message
        with pytest.raises(ConfigError, match="aux_bytes_per_sequence"):
            config_mod.load({"aux_bytes": aux, "aux_bytes_per_sequence": per_sequence}, environ={}, config_file=None)


def test_a_tenant_gets_its_share_of_the_aux_budget(tmp_path):
    path = tmp_path / "kvd.toml"
    path.write_text('host_bytes = "4GiB"\naux_bytes = "1GiB"\n[tenants.a]\nuids = [4000001]\nhost_bytes = "1GiB"\n')
    cfg = config_mod.load({}, environ={}, config_file=str(path))
    assert cfg.aux_budget(cfg.tenants[0].host_bytes) == 256 << 20
