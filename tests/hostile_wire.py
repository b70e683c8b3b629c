"""What the hostile tests (tests/test_hostile.py, tests/test_hostile_machine.py) share: a
real `kvd serve` with a tiny host budget, raw stubs over its unix socket, and the checks
every call is held to.

Raw stubs (no client library in the way) send whatever the proto allows. The daemon has
two namespaces, "A" (checks token ids against a vocabulary) and "B" (accepts any id >= 0),
and a budget so small that eviction, extent reclaim and RESOURCE_EXHAUSTED happen within
a few steps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from conftest import start_daemon, stop_cleanly, wait_until

from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc

Code = grpc.StatusCode
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]

HOST_BYTES = 16 << 10  # 32 pages of namespace A: a few sequences fill it
EXTENT_BYTES = 1 << 12
VOCAB_A = 1000  # namespace A checks ids against its vocabulary; B accepts any id >= 0
PAGE_SIZE = {"A": 4, "B": 8}
MAX_TOKENS = 1 << 22  # kvd.cache.manager.Limits.max_tokens_per_sequence
UNKNOWN_NS = 999
M32 = (1 << 32) - 1  # the largest uint32

# Stats that only calls change (free_pages also moves when a background extent is adopted).
STATE_FIELDS = (
    "logical_pages",
    "physical_pages",
    "shared_pages",
    "private_pages",
    "cached_pages",
    "pinned_pages",
    "sequences",
    "refcount_increments",
    "refcount_decrements",
    "lookup_tokens",
    "hit_tokens",
    "evicted_pages",
)


def tok(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def layout(page_size: int, **kw) -> pb.PageLayout:
    fields = dict(num_layers=1, num_kv_heads=1, head_dim=32, page_size=page_size, dtype="float16")
    fields.update(kw)
    return pb.PageLayout(**fields)


@dataclass
class Outcome:
    reply: object
    code: grpc.StatusCode | None
    details: str


class Wire:
    """Raw stubs over the daemon's unix socket."""

    def __init__(self, socket: str) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket}", options=CHANNEL_OPTIONS)
        self.stub = kvd_pb2_grpc.KVDStub(self.channel)

    def open_session(self, name: str):
        stream = self.stub.OpenSession(pb.OpenSessionRequest(client_name=name, pid=os.getpid()))
        return next(stream).opened.session, stream

    def call(self, method: str, request, timeout: float = 60.0) -> Outcome:
        try:
            return Outcome(getattr(self.stub, method)(request, timeout=timeout), None, "")
        except grpc.RpcError as e:
            return Outcome(None, e.code(), e.details() or "")

    def ok(self, method: str, request):
        out = self.call(method, request)
        assert out.code is None, f"{method} failed: {out.code}: {out.details}"
        return out.reply

    def stats(self) -> pb.StatsReply:
        return self.ok("GetStats", pb.StatsRequest())

    def snapshot(self) -> dict:
        s = self.stats()
        return {f: getattr(s.totals, f) for f in STATE_FIELDS}

    def close(self) -> None:
        self.channel.close()


@dataclass
class Env:
    daemon: object
    wire: Wire
    ns: dict  # "A"/"B" -> namespace id


def register(wire: Wire, session: str, model: str, lay: pb.PageLayout, vocab: int = 0) -> int:
    return wire.ok(
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(
            session=session,
            identity=pb.NamespaceIdentity(model=model, layout=lay, vocab_size=vocab),
        ),
    ).namespace_id


@contextmanager
def hostile_daemon(tmp: Path) -> Iterator[Env]:
    """The daemon with namespaces A and B registered (by a session that has ended since)."""
    d = start_daemon(tmp, "--enable-prefix-reuse", "--host-bytes", str(HOST_BYTES), "--extent-bytes", str(EXTENT_BYTES))
    wire = Wire(d.socket)
    session, stream = wire.open_session("setup")
    ns = {
        "A": register(wire, session, "hostile-a", layout(PAGE_SIZE["A"]), VOCAB_A),
        "B": register(wire, session, "hostile-b", layout(PAGE_SIZE["B"])),
    }
    stream.cancel()
    wait_until(lambda: wire.stats().totals.sessions == 0, "the setup session did not end")
    try:
        yield Env(d, wire, ns)
    finally:
        wire.close()
        stop_cleanly(d)


def assert_healthy(env: Env) -> pb.StatsReply:
    assert env.daemon.process.poll() is None, f"the daemon died:\n{env.daemon.log()}"
    violations = env.wire.ok("CheckInvariants", pb.CheckInvariantsRequest()).violations
    assert list(violations) == [], violations
    s = env.wire.stats()
    assert s.arena_bytes <= s.host_bytes, (s.arena_bytes, s.host_bytes)
    return s


def extend_request(session, ns, seq_ids, num_tokens, counts=None, token_ids=b""):
    """An ExtendRequest from its columns; ``counts`` defaults to no ids for any sequence."""
    return "Extend", pb.ExtendRequest(
        session=session,
        namespace_id=ns,
        seq_ids=seq_ids,
        num_tokens=num_tokens,
        token_id_counts=[0] * len(seq_ids) if counts is None else counts,
        token_ids=token_ids,
    )
