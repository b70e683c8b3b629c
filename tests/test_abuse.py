"""One hostile or buggy client cannot take the daemon away from the others.

A real `kvd serve` gets requests the proto-level hostile tests (tests/test_hostile.py)
cannot send: bytes that are no protobuf message at all, identities far larger than any
engine's, and huge requests that will be refused. Each must get a clear status with a
message, cost the daemon little, log no traceback, and leave the daemon serving others;
and the largest requests the limits allow must leave the event loop to other sessions
while they are served.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import start_daemon, stop_cleanly, vm_kib, wait_until
from google.protobuf.message import DecodeError

from kvd import __version__
from kvd.wire import kvd_pb2 as pb

Code = grpc.StatusCode
SERVICE = pb.DESCRIPTOR.services_by_name["KVD"]
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]

# Bytes no request message parses: a field with wire type 7 (none exists), a length-
# delimited field longer than the message, a string field (1) that is not UTF-8.
GARBAGE = {
    "wire type 7": b"\x0f\x01\x02\x03",
    "truncated field": b"\x0a\x40abc",
    "string not UTF-8": b"\x0a\x02\xff\xfe",
    # over kvd/server/offload.py's LARGE_REQUEST_BYTES: parsed on the offload thread, refused the same way
    "large, truncated field": b"\x0a\x80\x80\x10" + bytes(70_000),
}


class Raw:
    """Calls any method of the daemon with bytes of the caller's choice."""

    def __init__(self, socket: str) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket}", options=CHANNEL_OPTIONS)

    def call(self, method: str, request, timeout: float = 60.0) -> tuple[Code, str, bytes | None]:
        """(status code, details, reply bytes or None); ``request`` is bytes or a message."""
        m = SERVICE.methods_by_name[method]
        path = f"/{SERVICE.full_name}/{method}"
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            if m.server_streaming:
                reply = next(self.channel.unary_stream(path)(raw, timeout=timeout))
            else:
                reply = self.channel.unary_unary(path)(raw, timeout=timeout)
            return Code.OK, "", reply
        except grpc.RpcError as e:
            return e.code(), e.details() or "", None

    def ok(self, method: str, request, reply_type):
        code, details, raw = self.call(method, request)
        assert code == Code.OK, f"{method}: {code} {details}"
        return reply_type.FromString(raw)

    def open_session(self, name: str):
        """A live session: (its id, the stream to cancel to end it)."""
        stream = self.channel.unary_stream(f"/{SERVICE.full_name}/OpenSession")(
            pb.OpenSessionRequest(client_name=name, pid=os.getpid()).SerializeToString()
        )
        return pb.SessionEvent.FromString(next(stream)).opened.session, stream

    def sessions(self) -> int:
        return self.ok("GetStats", pb.StatsRequest(), pb.StatsReply).totals.sessions


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(
        tmp_path_factory.mktemp("abuse"), "--enable-prefix-reuse", "--host-bytes", "16MiB", "--extent-bytes", "1MiB"
    )
    raw = Raw(d.socket)
    try:
        yield d, raw
    finally:
        raw.channel.close()
        stop_cleanly(d)


@pytest.fixture
def session(daemon):
    d, raw = daemon
    sid, stream = raw.open_session("abuse")
    yield sid
    stream.cancel()
    wait_until(lambda: raw.sessions() == 0, "the session did not end")


# ---- 1. bytes that are not a protobuf message -----------------------------------------


def _refuses(method, raw: bytes) -> bool:
    """Whether the method's request type refuses ``raw`` (a string field 1 of bytes that are
    not UTF-8 parses fine as a message without that field, Ping's for instance)."""
    try:
        getattr(pb, method.input_type.name).FromString(raw)
        return False
    except DecodeError:
        return True


@pytest.mark.parametrize(
    "method, garbage",
    [  # every method, with the garbage its message type refuses
        (m.name, g) for m in SERVICE.methods for g in GARBAGE if _refuses(m, GARBAGE[g])
    ],
)
def test_unparsable_bytes_get_invalid_argument_without_a_traceback(daemon, method, garbage):
    d, raw = daemon
    log_before = len(d.log())
    code, details, _ = raw.call(method, GARBAGE[garbage])
    assert code == Code.INVALID_ARGUMENT, f"{method}: {code} ({details})"
    input_type = SERVICE.methods_by_name[method].input_type.full_name
    assert f"not a valid {input_type}" in details, details
    logged = d.log()[log_before:]
    assert "Traceback" not in logged and len(logged.splitlines()) <= 1, logged
    assert raw.ok("Ping", pb.PingRequest(), pb.PingReply).version == __version__  # still answering


# ---- 2. identities: bounded, registered all or nothing, never exhausting the manifest --


def layout(page_size: int = 4) -> pb.PageLayout:
    return pb.PageLayout(num_layers=1, num_kv_heads=1, head_dim=64, page_size=page_size, dtype="float16")


def register(raw: Raw, session: str, **identity) -> tuple[Code, str]:
    code, details, _ = raw.call(
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(session=session, identity=pb.NamespaceIdentity(layout=layout(), **identity)),
    )
    return code, details


def namespace_count(raw: Raw) -> int:
    return len(raw.ok("GetStats", pb.StatsRequest(), pb.StatsReply).namespaces)


OVERSIZE_IDENTITIES = {
    # name: (identity fields, words the message must hold)
    "a 70,000-character model name": (
        dict(model="m" * 70_000),
        "model name has 70000 characters, over the limit of 1024",
    ),
    "a 1,000-emoji model name": (dict(model="\U0001f600" * 1000), "over the limit of 4096"),
    "a 300-character revision": (
        dict(model="m", revision="r" * 300),
        "revision has 300 characters, over the limit of 256",
    ),
    "33 extra entries": (
        dict(model="m", extra={f"k{i}": "v" for i in range(33)}),
        "33 extra entries, over the limit of 32",
    ),
    "a 100,000-character extra value": (dict(model="m", extra={"quant": "q" * 100_000}), "over the limit of 256"),
    "a 100,000-character extra name": (dict(model="m", extra={"k" * 100_000: "v"}), "over the limit of 256"),
}


@pytest.mark.parametrize("case", list(OVERSIZE_IDENTITIES))
def test_oversize_identities_are_refused_and_others_still_register(daemon, session, case):
    d, raw = daemon
    fields, words = OVERSIZE_IDENTITIES[case]
    before = namespace_count(raw)
    code, details = register(raw, session, **fields)
    assert code == Code.INVALID_ARGUMENT and words in details, (code, details)
    assert namespace_count(raw) == before, "a refused identity was registered"
    other, stream = raw.open_session("another client")  # registration still works for everyone
    try:
        assert register(raw, other, model=f"after {case}") == (Code.OK, "")
    finally:
        stream.cancel()
    assert namespace_count(raw) == before + 1


def test_namespaces_up_to_the_cap_fit_the_manifest_then_resource_exhausted(daemon_factory):
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", "1MiB", "--extent-bytes", "64KiB")
    raw = Raw(d.socket)
    sid, stream = raw.open_session("filler")
    try:
        # Identities of nearly the largest size: the manifest must still hold all of them.
        big = dict(revision="r" * 256, extra={f"k{i}": "v" * 256 for i in range(10)})
        for i in range(128):
            assert register(raw, sid, model=f"{i:04d}" + "m" * 1000, **big) == (Code.OK, ""), i
        code, details = register(raw, sid, model="one too many")
        assert code == Code.RESOURCE_EXHAUSTED and "128 namespaces are registered" in details, (code, details)
        assert register(raw, sid, model="0000" + "m" * 1000, **big) == (Code.OK, "")  # a known one still resolves
        assert namespace_count(raw) == 128
    finally:
        stream.cancel()
        raw.channel.close()
    assert "Traceback" not in d.log(), d.log()


# ---- 3. a refusal costs what was read, not what was asked for ---------------------------


def repeated(head: pb.LookupRequest, sequence: pb.SequenceRequest, times: int) -> bytes:
    """``head`` with ``sequence`` appended ``times`` times, encoded without building them all."""
    return head.SerializeToString() + pb.LookupRequest(sequences=[sequence]).SerializeToString() * times


def lora_keys(n: int) -> list[pb.ExtraKey]:
    return [pb.ExtraKey(kind=pb.ExtraKey.LORA, value=b"a%d" % (i % 10)) for i in range(n)]


def refused_cheaply(daemon, method: str, raw: bytes, words: str, max_growth_mib: float = 50) -> None:
    """Refused with ``words`` in the message, within 2 s (sending included; 6.9 s before the
    request was counted on the wire, well under 0.5 s on a quiet machine), growing the
    daemon's RSS by less than ``max_growth_mib`` (gRPC's receive buffers are most of it)."""
    d, raw_channel = daemon
    pid = d.process.pid
    before = vm_kib(pid, "VmRSS")
    started = time.perf_counter()
    code, details, _ = raw_channel.call(method, raw)
    took = time.perf_counter() - started
    grown_mib = (vm_kib(pid, "VmRSS") - before) / 1024
    print(f"{method} of {len(raw) >> 20} MiB: refused in {took * 1e3:.0f} ms, daemon RSS {grown_mib:+.1f} MiB")
    assert code == Code.INVALID_ARGUMENT and words in details, (code, details)
    assert took < 2.0, f"a {len(raw) >> 20} MiB {method} took {took:.2f} s to refuse"
    assert grown_mib < max_growth_mib, (
        f"refusing a {len(raw) >> 20} MiB {method} grew the daemon by {grown_mib:.0f} MiB"
    )


def test_a_huge_lookup_of_lora_keys_is_refused_at_once(daemon, session):
    d, raw = daemon
    ns = raw.ok(
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(session=session, identity=pb.NamespaceIdentity(model="lora-base", layout=layout())),
        pb.RegisterNamespaceReply,
    ).namespace_id
    head = pb.LookupRequest(session=session, namespace_id=ns)
    bad_first = pb.SequenceRequest(
        seq_id="q", tokens=(-1).to_bytes(4, "little", signed=True), extra_keys=lora_keys(4096)
    )
    request = repeated(head, bad_first, 1024)  # the 29 MB: 1,024 sequences × 4,096 LoRA keys
    assert len(request) > 25 << 20
    refused_cheaply(daemon, "Lookup", request, "more than 65536 fields and repeated elements")
    refused_cheaply(daemon, "AllocateWithPrefix", request, "more than 65536 fields and repeated elements")
    # Within the wire budget, over a per-call limit: refused before a key becomes an object.
    refused_cheaply(
        daemon,
        "Lookup",
        repeated(head, pb.SequenceRequest(seq_id="q", extra_keys=lora_keys(512)), 64),
        "32768 extra keys, over the limit of 16384",
    )
    tokens = repeated(head, pb.SequenceRequest(seq_id="q", tokens=bytes(4 << 22)), 3)
    refused_cheaply(
        daemon,
        "Lookup",
        tokens,
        "12582912 tokens, over the limit of 8388608",
        max_growth_mib=3 * len(tokens) / (1 << 20),
    )  # bytes are parsed: proportional to what was read (the message, its parse, allocator slack)
    # Still served: a normal lookup, and the largest per-call number of LoRA keys.
    reply = raw.ok(
        "Lookup",
        repeated(head, pb.SequenceRequest(seq_id="q", tokens=bytes(64), extra_keys=lora_keys(4)), 4096),
        pb.LookupReply,
    )
    assert len(reply.results) == 4096


# ---- 4. the largest calls leave the event loop to others -----------------------------


def test_a_wide_allocate_is_checked_off_the_loop_while_others_are_served(daemon, session):
    """One session allocates 4,096 sequences with 4 LoRA keys each (the widest batch the
    limits allow) whose last sequence holds an id outside the vocabulary: the daemon
    converts and checks every sequence before it can refuse the call. That work needs
    nothing of the core, so it runs on the offload thread (kvd/server/offload.py), and another
    session's pings are answered meanwhile; when it ran on the event loop, in one piece
    (~0.2 s here), a ping that came meanwhile waited for all of it. Each call is compared
    with itself (its longest overlapping ping against its own duration), and the median
    of seven calls is taken, so a loaded box slows both alike."""
    d, raw = daemon
    ns = raw.ok(
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(
            session=session, identity=pb.NamespaceIdentity(model="wide", vocab_size=1000, layout=layout())
        ),
        pb.RegisterNamespaceReply,
    ).namespace_id
    ids = np.arange(16, dtype="<i4")
    sequences = [pb.SequenceRequest(seq_id=f"w{i}", tokens=ids.tobytes(), extra_keys=lora_keys(4)) for i in range(4096)]
    sequences[-1].tokens = (ids + 5000).tobytes()
    wide = pb.AllocateRequest(session=session, namespace_id=ns, sequences=sequences).SerializeToString()
    before = raw.ok("GetStats", pb.StatsRequest(), pb.StatsReply).totals
    pings: list[tuple[float, float]] = []
    stop = threading.Event()

    def ping() -> None:
        channel = grpc.insecure_channel(f"unix:{d.socket}")
        call = channel.unary_unary(f"/{SERVICE.full_name}/Ping")
        try:
            while not stop.is_set():
                started = time.perf_counter()
                call(pb.PingRequest().SerializeToString(), timeout=60)
                pings.append((started, time.perf_counter()))
        finally:
            channel.close()

    pinger = threading.Thread(target=ping)
    pinger.start()
    calls = []
    try:
        time.sleep(0.2)  # the pinger is connected
        for _ in range(7):
            started = time.perf_counter()
            code, details, _ = raw.call("AllocateWithPrefix", wide)
            calls.append((started, time.perf_counter()))
            assert code == Code.INVALID_ARGUMENT and "token id 5000 at position 0 is out of range" in details, details
    finally:
        stop.set()
        pinger.join()
    assert raw.ok("GetStats", pb.StatsRequest(), pb.StatsReply).totals == before, "a refused call changed something"
    shares = [max(e - s for s, e in pings if s < end and e > start) / (end - start) for start, end in calls]
    print(
        "longest ping during each wide allocate:",
        [f"{x:.0%} of {(b - a) * 1e3:.0f} ms" for x, (a, b) in zip(shares, calls)],
    )
    assert statistics.median(shares) < 0.5, shares
