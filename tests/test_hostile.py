"""Hostile input through the gRPC surface of a real `kvd serve`: a table of bad inputs.

Raw stubs (tests/hostile_wire.py) send what the proto allows but the daemon must refuse:
wrong lengths, out-of-range ids, unknown enum values, other sessions' sequences, dead
session tokens, oversize batches, bad namespace identities. Each refused call must come
back with its documented status code and a message, having changed nothing, and the
daemon must be alive with its invariants clean. tests/test_hostile_machine.py draws
random interleavings of such calls across two sessions.

One daemon serves the whole module; each case opens its own sessions and closes them.
"""

from __future__ import annotations

import math
import secrets
import time

import pytest
from conftest import vm_kib, wait_until
from hostile_wire import (
    M32,
    MAX_TOKENS,
    UNKNOWN_NS,
    VOCAB_A,
    Code,
    Env,
    Outcome,
    assert_healthy,
    extend_request,
    hostile_daemon,
    layout,
    register,
    tok,
)

from kvd.wire import kvd_pb2 as pb


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with hostile_daemon(tmp_path_factory.mktemp("hostile")) as e:
        yield e


def refused(env: Env, method: str, request, codes: set) -> Outcome:
    """The call must fail with one of ``codes``, a message, and change nothing."""
    before = env.wire.snapshot()
    out = env.wire.call(method, request)
    assert out.code is not None, f"{method} accepted a request it must refuse: {str(request)[:300]}"
    assert out.code in codes, f"{method}: {out.code} ({out.details}), expected one of {codes}"
    assert out.details.strip(), f"{method}: {out.code} without a message"
    assert env.wire.snapshot() == before, f"the refused {method} changed the daemon's state"
    assert_healthy(env)
    return out


@pytest.fixture
def two_sessions(env):
    """Two live sessions; 'mine' (4 tokens + 2, ns A) belongs to the first. Closed after."""
    a, stream_a = env.wire.open_session("hostile-a")
    b, stream_b = env.wire.open_session("hostile-b")
    env.wire.ok(
        "AllocateWithPrefix",
        pb.AllocateRequest(
            session=a, namespace_id=env.ns["A"], sequences=[pb.SequenceRequest(seq_id="mine", tokens=tok(range(6)))]
        ),
    )
    yield a, b
    stream_a.cancel()
    stream_b.cancel()
    wait_until(lambda: env.wire.stats().totals.sessions == 0, "the two sessions did not end")
    assert env.wire.stats().totals.sequences == 0


def _alloc(session, ns, *seqs):
    return "AllocateWithPrefix", pb.AllocateRequest(session=session, namespace_id=ns, sequences=list(seqs))


def _seq(seq_id="x", tokens=None, extra=()):
    tokens = tok([1, 2, 3]) if tokens is None else tokens
    return pb.SequenceRequest(seq_id=seq_id, tokens=tokens, extra_keys=list(extra))


BAD_CASES = {
    # name: (build(env, a, b) -> (method, request), code)
    "tokens not a multiple of 4": (
        lambda e, a, b: _alloc(a, e.ns["A"], _seq(tokens=b"\x01\x00\x00")),
        Code.INVALID_ARGUMENT,
    ),
    "negative token id": (lambda e, a, b: _alloc(a, e.ns["B"], _seq(tokens=tok([5, -1]))), Code.INVALID_ARGUMENT),
    "int32 min token id": (lambda e, a, b: _alloc(a, e.ns["B"], _seq(tokens=tok([-(1 << 31)]))), Code.INVALID_ARGUMENT),
    "token id = vocab": (lambda e, a, b: _alloc(a, e.ns["A"], _seq(tokens=tok([VOCAB_A]))), Code.INVALID_ARGUMENT),
    "token id = 2^31-1 over vocab": (
        lambda e, a, b: _alloc(a, e.ns["A"], _seq(tokens=tok([(1 << 31) - 1]))),
        Code.INVALID_ARGUMENT,
    ),
    "more tokens than the limit": (
        lambda e, a, b: _alloc(a, e.ns["B"], _seq(tokens=bytes(4 * (MAX_TOKENS + 1)))),
        Code.INVALID_ARGUMENT,
    ),
    "more tokens than the budget": (
        lambda e, a, b: _alloc(a, e.ns["A"], _seq(tokens=bytes(4 * 100_000))),
        Code.RESOURCE_EXHAUSTED,
    ),
    "empty seq id": (lambda e, a, b: _alloc(a, e.ns["A"], _seq(seq_id="")), Code.INVALID_ARGUMENT),
    "10K-char seq id": (lambda e, a, b: _alloc(a, e.ns["A"], _seq(seq_id="x" * 10_000)), Code.INVALID_ARGUMENT),
    "10K-emoji seq id": (
        lambda e, a, b: _alloc(a, e.ns["A"], _seq(seq_id="\U0001f600" * 10_000)),
        Code.INVALID_ARGUMENT,
    ),
    # Calls on one named sequence echo its id in NOT_FOUND: the message must still arrive.
    "10K-char id: set_state": (
        lambda e, a, b: (
            "SetState",
            pb.SetStateRequest(session=a, namespace_id=e.ns["A"], seq_id="x" * 10_000, state=pb.ON_HOLD),
        ),
        Code.NOT_FOUND,
    ),
    "10K-char id: set aux": (
        lambda e, a, b: (
            "SetAuxState",
            pb.SetAuxStateRequest(session=a, namespace_id=e.ns["A"], seq_id="x" * 10_000, data=b"x"),
        ),
        Code.NOT_FOUND,
    ),
    "10K-emoji id: get aux": (
        lambda e, a, b: (
            "GetAuxState",
            pb.GetAuxStateRequest(session=a, namespace_id=e.ns["A"], seq_id="\U0001f600" * 10_000),
        ),
        Code.NOT_FOUND,
    ),
    "10K-emoji id: fork source": (
        lambda e, a, b: (
            "Fork",
            pb.ForkRequest(session=a, namespace_id=e.ns["A"], src_seq_id="\U0001f600" * 10_000, dst_seq_id="f"),
        ),
        Code.NOT_FOUND,
    ),
    "duplicate seq ids": (lambda e, a, b: _alloc(a, e.ns["A"], _seq("d"), _seq("d")), Code.INVALID_ARGUMENT),
    "huge batch": (lambda e, a, b: _alloc(a, e.ns["A"], *[_seq(f"s{i}") for i in range(5000)]), Code.INVALID_ARGUMENT),
    "unknown namespace": (lambda e, a, b: _alloc(a, UNKNOWN_NS, _seq()), Code.NOT_FOUND),
    "namespace 0": (lambda e, a, b: _alloc(a, 0, _seq()), Code.NOT_FOUND),
    "unknown session": (lambda e, a, b: _alloc(secrets.token_hex(16), e.ns["A"], _seq()), Code.NOT_FOUND),
    "empty session": (lambda e, a, b: _alloc("", e.ns["A"], _seq()), Code.NOT_FOUND),
    "extra key kind 0": (
        lambda e, a, b: _alloc(a, e.ns["A"], _seq(extra=[pb.ExtraKey(kind=0, value=b"v")])),
        Code.INVALID_ARGUMENT,
    ),
    "extra key kind 9": (
        lambda e, a, b: _alloc(a, e.ns["A"], _seq(extra=[pb.ExtraKey(kind=9, value=b"v")])),
        Code.INVALID_ARGUMENT,
    ),
    "empty LoRA value": (
        lambda e, a, b: _alloc(a, e.ns["A"], _seq(extra=[pb.ExtraKey(kind=pb.ExtraKey.LORA)])),
        Code.INVALID_ARGUMENT,
    ),
    "multimodal item past the prompt": (
        lambda e, a, b: _alloc(
            a, e.ns["A"], _seq(extra=[pb.ExtraKey(kind=pb.ExtraKey.MULTIMODAL, value=b"img", offset=2, length=2)])
        ),
        Code.INVALID_ARGUMENT,
    ),
    "multimodal offset near 2^32": (
        lambda e, a, b: _alloc(
            a,
            e.ns["A"],
            _seq(
                extra=[
                    pb.ExtraKey(kind=pb.ExtraKey.MULTIMODAL, value=b"img", offset=(1 << 32) - 1, length=(1 << 32) - 1)
                ]
            ),
        ),
        Code.INVALID_ARGUMENT,
    ),
    "another session's sequence: allocate": (
        lambda e, a, b: _alloc(b, e.ns["A"], _seq("mine")),
        Code.PERMISSION_DENIED,
    ),
    "another session's sequence: release": (
        lambda e, a, b: ("Release", pb.ReleaseRequest(session=b, namespace_id=e.ns["A"], seq_ids=["mine"])),
        Code.PERMISSION_DENIED,
    ),
    "another session's sequence: extend": (
        lambda e, a, b: extend_request(b, e.ns["A"], ["mine"], [1]),
        Code.PERMISSION_DENIED,
    ),
    "another session's sequence: publish": (
        lambda e, a, b: (
            "Publish",
            pb.PublishRequest(session=b, namespace_id=e.ns["A"], items=[pb.PublishItem(seq_id="mine")]),
        ),
        Code.PERMISSION_DENIED,
    ),
    "another session's sequence: fork": (
        lambda e, a, b: (
            "Fork",
            pb.ForkRequest(session=b, namespace_id=e.ns["A"], src_seq_id="mine", dst_seq_id="theirs"),
        ),
        Code.PERMISSION_DENIED,
    ),
    "fork onto another session's sequence": (
        lambda e, a, b: (
            "Fork",
            pb.ForkRequest(session=a, namespace_id=e.ns["A"], src_seq_id="mine", dst_seq_id="mine"),
        ),
        Code.FAILED_PRECONDITION,
    ),
    "another session's sequence: set_state": (
        lambda e, a, b: (
            "SetState",
            pb.SetStateRequest(session=b, namespace_id=e.ns["A"], seq_id="mine", state=pb.IN_DECODE),
        ),
        Code.PERMISSION_DENIED,
    ),
    "another session's sequence: aux": (
        lambda e, a, b: ("GetAuxState", pb.GetAuxStateRequest(session=b, namespace_id=e.ns["A"], seq_id="mine")),
        Code.PERMISSION_DENIED,
    ),
    "another session's sequence: describe": (
        lambda e, a, b: (
            "DescribeSequences",
            pb.DescribeSequencesRequest(session=b, namespace_id=e.ns["A"], seq_ids=["mine"]),
        ),
        Code.PERMISSION_DENIED,
    ),
    "another session's sequence: set aux": (
        lambda e, a, b: (
            "SetAuxState",
            pb.SetAuxStateRequest(session=b, namespace_id=e.ns["A"], seq_id="mine", data=b"x"),
        ),
        Code.PERMISSION_DENIED,
    ),
    "SequenceState 0": (
        lambda e, a, b: ("SetState", pb.SetStateRequest(session=a, namespace_id=e.ns["A"], seq_id="mine", state=0)),
        Code.INVALID_ARGUMENT,
    ),
    "SequenceState 7": (
        lambda e, a, b: ("SetState", pb.SetStateRequest(session=a, namespace_id=e.ns["A"], seq_id="mine", state=7)),
        Code.INVALID_ARGUMENT,
    ),
    "SequenceState 99": (
        lambda e, a, b: ("SetState", pb.SetStateRequest(session=a, namespace_id=e.ns["A"], seq_id="mine", state=99)),
        Code.INVALID_ARGUMENT,
    ),
    "PREFILLED -> EVICTED": (
        lambda e, a, b: (
            "SetState",
            pb.SetStateRequest(session=a, namespace_id=e.ns["A"], seq_id="mine", state=pb.EVICTED),
        ),
        Code.FAILED_PRECONDITION,
    ),
    "extend by 0": (lambda e, a, b: extend_request(a, e.ns["A"], ["mine"], [0]), Code.INVALID_ARGUMENT),
    "extend by 2^32-1": (
        lambda e, a, b: extend_request(a, e.ns["A"], ["mine"], [(1 << 32) - 1]),
        Code.INVALID_ARGUMENT,
    ),
    "extend ids of the wrong count": (
        lambda e, a, b: extend_request(a, e.ns["A"], ["mine"], [3], [1], tok([1])),
        Code.INVALID_ARGUMENT,
    ),
    "extend with odd token bytes": (
        lambda e, a, b: extend_request(a, e.ns["A"], ["mine"], [1], [0], b"\x01"),
        Code.INVALID_ARGUMENT,
    ),
    "extend with ids over vocab": (
        lambda e, a, b: extend_request(a, e.ns["A"], ["mine"], [1], [1], tok([VOCAB_A])),
        Code.INVALID_ARGUMENT,
    ),
    "extend past the budget": (
        lambda e, a, b: extend_request(a, e.ns["A"], ["mine"], [100_000]),
        Code.RESOURCE_EXHAUSTED,
    ),
    "publish a partial page": (
        lambda e, a, b: (
            "Publish",
            pb.PublishRequest(session=a, namespace_id=e.ns["A"], items=[pb.PublishItem(seq_id="mine", num_tokens=3)]),
        ),
        Code.INVALID_ARGUMENT,
    ),
    "publish 2^32-4 tokens": (
        lambda e, a, b: (
            "Publish",
            pb.PublishRequest(
                session=a, namespace_id=e.ns["A"], items=[pb.PublishItem(seq_id="mine", num_tokens=(1 << 32) - 4)]
            ),
        ),
        Code.INVALID_ARGUMENT,
    ),
    "unknown sequence": (
        lambda e, a, b: ("Release", pb.ReleaseRequest(session=a, namespace_id=e.ns["A"], seq_ids=["never"])),
        Code.NOT_FOUND,
    ),
    "release twice in one batch": (
        lambda e, a, b: ("Release", pb.ReleaseRequest(session=a, namespace_id=e.ns["A"], seq_ids=["mine", "mine"])),
        Code.INVALID_ARGUMENT,
    ),
    "right id, wrong namespace": (
        lambda e, a, b: ("Release", pb.ReleaseRequest(session=a, namespace_id=e.ns["B"], seq_ids=["mine"])),
        Code.NOT_FOUND,
    ),
    "fork into an empty id": (
        lambda e, a, b: ("Fork", pb.ForkRequest(session=a, namespace_id=e.ns["A"], src_seq_id="mine", dst_seq_id="")),
        Code.INVALID_ARGUMENT,
    ),
    "fork into a 10K-char id": (
        lambda e, a, b: (
            "Fork",
            pb.ForkRequest(session=a, namespace_id=e.ns["A"], src_seq_id="mine", dst_seq_id="y" * 10_000),
        ),
        Code.INVALID_ARGUMENT,
    ),
    "pin with negative ttl": (
        lambda e, a, b: ("Pin", pb.PinRequest(session=a, namespace_id=e.ns["A"], tokens=tok(range(8)), ttl_seconds=-1)),
        Code.INVALID_ARGUMENT,
    ),
    "pin with NaN ttl": (
        lambda e, a, b: (
            "Pin",
            pb.PinRequest(session=a, namespace_id=e.ns["A"], tokens=tok(range(8)), ttl_seconds=math.nan),
        ),
        Code.INVALID_ARGUMENT,
    ),
    "pin with infinite ttl": (
        lambda e, a, b: (
            "Pin",
            pb.PinRequest(session=a, namespace_id=e.ns["A"], tokens=tok(range(8)), ttl_seconds=math.inf),
        ),
        Code.INVALID_ARGUMENT,
    ),
    "pin with odd token bytes": (
        lambda e, a, b: ("Pin", pb.PinRequest(session=a, namespace_id=e.ns["A"], tokens=b"\x00" * 5)),
        Code.INVALID_ARGUMENT,
    ),
    "unpin an unknown pin": (
        lambda e, a, b: ("Unpin", pb.UnpinRequest(session=a, pin_id=(1 << 64) - 1)),
        Code.NOT_FOUND,
    ),
    "unpin with an unknown session": (
        lambda e, a, b: ("Unpin", pb.UnpinRequest(session="nope", pin_id=1)),
        Code.NOT_FOUND,
    ),
    "extents of an unknown namespace": (
        lambda e, a, b: ("DescribeExtents", pb.DescribeExtentsRequest(session=a, namespace_id=UNKNOWN_NS)),
        Code.NOT_FOUND,
    ),
    "extents with an unknown session": (
        lambda e, a, b: ("DescribeExtents", pb.DescribeExtentsRequest(session="", namespace_id=e.ns["A"])),
        Code.NOT_FOUND,
    ),
    "lookup with a 10K-char id": (
        lambda e, a, b: ("Lookup", pb.LookupRequest(session=a, namespace_id=e.ns["A"], sequences=[_seq("z" * 10_000)])),
        Code.INVALID_ARGUMENT,
    ),
    "lookup with ids over vocab": (
        lambda e, a, b: (
            "Lookup",
            pb.LookupRequest(session=a, namespace_id=e.ns["A"], sequences=[_seq(tokens=tok([1, 5000]))]),
        ),
        Code.INVALID_ARGUMENT,
    ),
    "aux over the limit": (
        lambda e, a, b: (
            "SetAuxState",
            pb.SetAuxStateRequest(session=a, namespace_id=e.ns["A"], seq_id="mine", data=bytes((64 << 20) + 1)),
        ),
        Code.INVALID_ARGUMENT,
    ),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_gets_its_status_and_changes_nothing(env, two_sessions, case):
    build, code = BAD_CASES[case]
    method, request = build(env, *two_sessions)
    refused(env, method, request, {code})


BAD_EXTEND_BATCHES = {
    # name: (seq_ids, num_tokens, token_id_counts, token_ids, words the message must hold)
    "a num_tokens missing": (["mine"], [], [0], b"", "1 seq_ids, 0 num_tokens and 1 token_id_counts"),
    "a count missing": (["mine", "other"], [1, 1], [0], b"", "2 seq_ids, 2 num_tokens and 1 token_id_counts"),
    "a num_tokens too many": (["mine"], [1, 1], [0], b"", "1 seq_ids, 2 num_tokens and 1 token_id_counts"),
    "ids not whole int32": (["mine"], [1], [1], tok([6]) + b"\x01", "token_ids has 5 bytes, not a multiple of 4"),
    "fewer ids than counted": (
        ["mine", "other"],
        [1, 1],
        [1, 1],
        tok([6]),
        "add up to 2 token ids but token_ids holds 1",
    ),
    "more ids than counted": (["mine"], [1], [0], tok([6]), "add up to 0 token ids but token_ids holds 1"),
    "count neither 0 nor num_tokens": (
        ["mine", "other"],
        [1, 3],
        [1, 1],
        tok([6, 13]),
        "sequence 'other': 1 token ids given for 3 new tokens",
    ),
    "an id over the vocabulary": (
        ["mine", "other"],
        [1, 1],
        [1, 1],
        tok([6, VOCAB_A]),
        f"sequence 'other': token id {VOCAB_A} at position 0 is out of range [0, {VOCAB_A})",
    ),
}


@pytest.mark.parametrize("case", list(BAD_EXTEND_BATCHES))
def test_bad_extend_batches_say_what_is_wrong_and_change_nothing(env, two_sessions, case):
    a, _ = two_sessions
    ns = env.ns["A"]
    env.wire.ok(*_alloc(a, ns, _seq("other", tok(range(10, 13)))))
    seq_ids, num_tokens, counts, token_ids, words = BAD_EXTEND_BATCHES[case]
    out = refused(env, *extend_request(a, ns, seq_ids, num_tokens, counts, token_ids), {Code.INVALID_ARGUMENT})
    assert words in out.details, out.details
    # Neither sequence grew nor recorded an id: ids for their next positions are still accepted.
    reply = env.wire.ok(*extend_request(a, ns, ["mine", "other"], [1, 1], [1, 1], tok([6, 13])))
    assert list(reply.num_tokens) == [7, 4] and list(reply.new_page_counts) == [0, 0]


def test_pin_of_another_session_is_permission_denied(env, two_sessions):
    a, b = two_sessions
    ns = env.ns["A"]
    prompt = tok(range(100, 108))
    env.wire.ok("AllocateWithPrefix", pb.AllocateRequest(session=a, namespace_id=ns, sequences=[_seq("p", prompt)]))
    assert (
        env.wire.ok("Publish", pb.PublishRequest(session=a, namespace_id=ns, items=[pb.PublishItem(seq_id="p")]))
        .results[0]
        .published_pages
        == 2
    )
    pin = env.wire.ok("Pin", pb.PinRequest(session=a, namespace_id=ns, tokens=prompt))
    assert pin.pinned_pages == 2
    refused(env, "Unpin", pb.UnpinRequest(session=b, pin_id=pin.pin_id), {Code.PERMISSION_DENIED})
    env.wire.ok("Unpin", pb.UnpinRequest(session=a, pin_id=pin.pin_id))
    refused(env, "Unpin", pb.UnpinRequest(session=a, pin_id=pin.pin_id), {Code.NOT_FOUND})


def test_short_pin_ttl_expires(env, two_sessions):
    a, _ = two_sessions
    ns = env.ns["A"]
    prompt = tok(range(200, 208))
    env.wire.ok("AllocateWithPrefix", pb.AllocateRequest(session=a, namespace_id=ns, sequences=[_seq("t", prompt)]))
    env.wire.ok("Publish", pb.PublishRequest(session=a, namespace_id=ns, items=[pb.PublishItem(seq_id="t")]))
    env.wire.ok("Release", pb.ReleaseRequest(session=a, namespace_id=ns, seq_ids=["t"]))
    pin = env.wire.ok("Pin", pb.PinRequest(session=a, namespace_id=ns, tokens=prompt, ttl_seconds=1e-3))
    assert pin.pinned_pages == 2
    wait_until(lambda: env.wire.stats().totals.pinned_pages == 0, "a 1 ms pin did not expire", timeout=3)
    refused(env, "Unpin", pb.UnpinRequest(session=a, pin_id=pin.pin_id), {Code.NOT_FOUND})
    assert_healthy(env)


BAD_IDENTITIES = {
    "no layout": pb.NamespaceIdentity(model="m"),
    "no model": pb.NamespaceIdentity(layout=layout(4)),
    "zero page size": pb.NamespaceIdentity(model="m", layout=layout(0)),
    "zero layers": pb.NamespaceIdentity(model="m", layout=layout(4, num_layers=0)),
    "unknown dtype": pb.NamespaceIdentity(model="m", layout=layout(4, dtype="float7")),
    "empty dtype": pb.NamespaceIdentity(model="m", layout=layout(4, dtype="")),
    "tp rank over size": pb.NamespaceIdentity(model="m", layout=layout(4), tp_rank=3, tp_size=2),
    "unsupported attention": pb.NamespaceIdentity(model="m", layout=layout(4), attention="dsa"),
    "mla attention on K/V pages": pb.NamespaceIdentity(model="m", layout=layout(4), attention="mla"),
    "latent pages without mla": pb.NamespaceIdentity(model="m", layout=layout(4, head_dim=576, kind="latent")),
    "latent pages of two heads": pb.NamespaceIdentity(
        model="m", layout=layout(4, num_kv_heads=2, head_dim=576, kind="latent"), attention="mla"
    ),
    "unknown page kind": pb.NamespaceIdentity(model="m", layout=layout(4, kind="kv2")),
    # page_bytes = 4 * 2 * (2^32-1)^4: more than the uint64 the reply (and every later
    # GetStats) must carry it in.
    "page bytes beyond uint64": pb.NamespaceIdentity(
        model="m", layout=layout(M32, num_layers=M32, num_kv_heads=M32, head_dim=M32, dtype="float32")
    ),
}


@pytest.mark.parametrize("case", list(BAD_IDENTITIES))
def test_bad_namespace_identity_is_invalid_argument(env, case):
    session, stream = env.wire.open_session("identity")
    try:
        before = len(env.wire.stats().namespaces)
        refused(
            env,
            "RegisterNamespace",
            pb.RegisterNamespaceRequest(session=session, identity=BAD_IDENTITIES[case]),
            {Code.INVALID_ARGUMENT},
        )
        assert len(env.wire.stats().namespaces) == before, "a refused identity was registered"
    finally:
        stream.cancel()
    wait_until(lambda: env.wire.stats().totals.sessions == 0, "the session did not end")
    refused(
        env,
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(session=session, identity=pb.NamespaceIdentity(model="m", layout=layout(4))),
        {Code.NOT_FOUND},
    )  # a closed session is unknown


def test_multimodal_extra_keys_cannot_amplify_daemon_memory(env):
    session, stream = env.wire.open_session("amplifier")
    try:
        ns = register(
            env.wire, session, "hostile-mm", layout(1, head_dim=256, dtype="uint8")
        )  # 1-token pages of 512 bytes
        n = 256 << 10
        request = pb.LookupRequest(
            session=session,
            namespace_id=ns,
            sequences=[
                pb.SequenceRequest(
                    seq_id="mm",
                    tokens=bytes(4 * n),
                    extra_keys=[pb.ExtraKey(kind=pb.ExtraKey.MULTIMODAL, value=b"v" * 1024, offset=0, length=n)],
                )
            ],
        )
        pid = env.daemon.process.pid
        before = vm_kib(pid, "VmHWM")
        started = time.perf_counter()
        env.wire.ok("Lookup", request)
        took = time.perf_counter() - started
        grown_mib = (vm_kib(pid, "VmHWM") - before) / 1024
    finally:
        stream.cancel()
    assert_healthy(env)
    # The request is 1 MiB; the daemon may need a few times that, not hundreds of MiB.
    assert grown_mib < 64, f"a 1 MiB Lookup raised the daemon's peak memory by {grown_mib:.0f} MiB ({took:.2f} s)"
