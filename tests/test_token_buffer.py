"""Token ids through a session's token buffer (kvd/cache/token_buffers.py), against a real daemon.

The client library takes this path on its own for large calls; raw stubs below send what
the proto allows: spans outside the buffer, spans beside inline ids, spans without a
buffer, another session's buffer, a client that rewrites its buffer while the daemon
reads it, and one that shrinks it. Every refusal has its status and changes nothing. One
test drives a ``TokenBuffer`` directly: closed while another thread reads it.
"""

from __future__ import annotations

import mmap
import os
import signal
import threading

import grpc
import numpy as np
import posix_ipc
import pytest

from engine_client import ErrorCode, KVDClient, PageLayout, SequenceRequest
from engine_client.token_buffer import MIN_TOKENS
from kvd.cache.token_buffers import NAME_INFIX, TokenBuffer
from kvd.config import ServeConfig
from kvd.core.errors import FailedPrecondition
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.codec import token_ids_array

PAGE_SIZE = 16
VOCAB = 1000
LAYOUT = PageLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE_SIZE, dtype="float16")
PROMPT = np.arange(50_000, dtype=np.int32) % VOCAB


def token_segments(socket: str) -> list[str]:
    """Token-buffer segments of the daemon on ``socket`` that can still be opened by name."""
    base = ServeConfig(socket=socket).shm_prefix.lstrip("/") + "-" + NAME_INFIX
    return [n for n in os.listdir("/dev/shm") if n.startswith(base)]


class Raw:
    """One session over raw stubs, with its token buffer mapped."""

    def __init__(self, socket: str, name: str) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        self.stub = kvd_pb2_grpc.KVDStub(self.channel)
        self.stream = self.stub.OpenSession(pb.OpenSessionRequest(client_name=name, pid=os.getpid()))
        self.session = next(self.stream).opened.session
        self.ns = self.stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(
                session=self.session,
                identity=pb.NamespaceIdentity(
                    model="tokens",
                    vocab_size=VOCAB,
                    layout=pb.PageLayout(
                        num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE_SIZE, dtype="float16"
                    ),
                ),
            )
        ).namespace_id
        self.ids: np.ndarray | None = None

    def open_buffer(self, size: int) -> str:
        reply = self.stub.OpenTokenBuffer(pb.OpenTokenBufferRequest(session=self.session, size_bytes=size))
        shm = posix_ipc.SharedMemory(reply.shm_name)
        self.ids = np.frombuffer(mmap.mmap(shm.fd, reply.size_bytes), dtype="<i4")
        shm.close_fd()
        return reply.shm_name

    def allocate(self, *sequences: pb.SequenceRequest):
        return self.stub.AllocateWithPrefix(
            pb.AllocateRequest(session=self.session, namespace_id=self.ns, sequences=list(sequences))
        )

    def code_of(self, call, *args) -> grpc.StatusCode | None:
        try:
            call(*args)
        except grpc.RpcError as e:
            assert e.details(), "a refusal says why"
            return e.code()
        return None

    def totals(self) -> pb.PageStats:
        return self.stub.GetStats(pb.StatsRequest()).totals

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def span(seq_id: str, offset: int, num_tokens: int, tokens: bytes = b"") -> pb.SequenceRequest:
    at = pb.TokenSpan(offset=offset, num_tokens=num_tokens)
    return pb.SequenceRequest(seq_id=seq_id, tokens=tokens, tokens_at=at)


@pytest.fixture
def raw(daemon):
    sessions = []

    def make(name: str = "raw") -> Raw:
        sessions.append(Raw(daemon.socket, name))
        return sessions[-1]

    yield make
    for s in sessions:
        s.close()


def test_client_passes_large_calls_through_the_buffer_with_the_same_results(daemon):
    with KVDClient.connect(daemon.socket) as c:
        ns = c.register_namespace("tokens", LAYOUT, vocab_size=VOCAB)
        [inline] = c.allocate_with_prefix(ns, [SequenceRequest("inline", PROMPT[: MIN_TOKENS - 16])])
        assert token_segments(daemon.socket) == [], "a call under MIN_TOKENS ids goes inline"
        c.publish(ns, ["inline"])
        [big] = c.allocate_with_prefix(ns, [SequenceRequest("big", PROMPT)])
        # The hit was confirmed against the stored ids: the first pages are shared.
        assert big.shared_pages == inline.private_pages[: (MIN_TOKENS - 16) // PAGE_SIZE]
        assert big.num_tokens == len(PROMPT)
        c.publish(ns, ["big"])
        [found] = c.lookup(ns, [SequenceRequest("again", PROMPT)])
        assert found.hit_tokens == len(PROMPT) // PAGE_SIZE * PAGE_SIZE
        assert found.hit_pages == big.shared_pages + big.private_pages[: len(found.hit_pages) - len(big.shared_pages)]
        # A call over kvd/server/offload.py's thresholds (sequences, token ids) is checked and
        # answered on the offload thread: the same answers.
        wide = c.lookup(ns, [SequenceRequest(f"again{i}", PROMPT) for i in range(6)])
        assert [(x.hit_pages, x.hit_tokens) for x in wide] == [(found.hit_pages, found.hit_tokens)] * 6
        many = c.allocate_with_prefix(ns, [SequenceRequest(f"m{i}", PROMPT[:1024]) for i in range(80)])
        assert {tuple(a.shared_pages) for a in many} == {tuple(big.shared_pages[: 1024 // PAGE_SIZE])}
        c.release(ns, [f"m{i}" for i in range(80)])
        # Once a call named a span of it, the buffer has no name: no other process can open it.
        assert token_segments(daemon.socket) == []
        # Ids out of the vocabulary are refused from the buffer as inline.
        bad = PROMPT.copy()
        bad[40_000] = VOCAB
        with pytest.raises(Exception, match="out of range") as e:
            c.allocate_with_prefix(ns, [SequenceRequest("bad", bad)])
        assert e.value.code == ErrorCode.INVALID_ARGUMENT
        assert c.check_invariants() == []


@pytest.mark.parametrize(
    "case, offset, num_tokens, inline, code",
    [
        ("past the end", 4096 - 4, 2, b"", grpc.StatusCode.INVALID_ARGUMENT),
        ("far past the end", 1 << 62, 1, b"", grpc.StatusCode.INVALID_ARGUMENT),
        ("more ids than the call limit", 0, 1 << 40, b"", grpc.StatusCode.INVALID_ARGUMENT),
        ("unaligned offset", 2, 4, b"", grpc.StatusCode.INVALID_ARGUMENT),
        ("span beside inline ids", 0, 4, b"\1\0\0\0", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_spans_are_invalid_argument_and_change_nothing(raw, case, offset, num_tokens, inline, code):
    r = raw()
    r.open_buffer(4096)
    r.ids[:] = 1
    before = r.totals()
    assert r.code_of(r.allocate, span("s", offset, num_tokens, inline)) == code, case
    assert r.code_of(r.allocate, span("ok", 0, 8), span("s", offset, num_tokens, inline)) == code, case
    assert r.totals() == before
    assert r.allocate(span("fine", 0, 1024)).sequences[0].num_tokens == 1024


def test_buffer_size_is_bounded_and_a_span_without_a_buffer_is_refused(raw):
    r = raw()
    assert r.code_of(r.allocate, span("s", 0, 4)) == grpc.StatusCode.FAILED_PRECONDITION
    for size in (0, (1 << 25) + 1):
        assert r.code_of(r.open_buffer, size) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_session_reads_only_its_own_buffer(raw, daemon):
    a, b = raw("a"), raw("b")
    name = a.open_buffer(4096)
    a.ids[:] = 7
    # Until a's first call the name exists; b knows nothing of it, and its spans name its own buffer.
    assert b.code_of(b.allocate, span("s", 0, 4)) == grpc.StatusCode.FAILED_PRECONDITION
    assert a.allocate(span("s", 0, 4)).sequences[0].num_tokens == 4
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(name)  # unlinked at a's first span: nobody else maps it from now on
    b.open_buffer(4096)
    b.ids[:] = 9
    b.allocate(span("t", 0, 4 * PAGE_SIZE))
    b.stub.Publish(pb.PublishRequest(session=b.session, namespace_id=b.ns, items=[pb.PublishItem(seq_id="t")]))
    a.ids[:] = 9  # the same ids in a's buffer hit b's published pages (the same namespace), read from a's buffer
    assert a.allocate(span("u", 0, 4 * PAGE_SIZE)).sequences[0].shared_prefix_tokens == 4 * PAGE_SIZE
    a.close()
    assert token_segments(daemon.socket) == []


def test_read_back_returns_what_the_client_wrote_and_refuses_what_it_cannot_read(raw, daemon):
    """ReadTokenBuffer (kvd doctor's proof of shared memory): the ids the session wrote, as
    the daemon reads them; a session without a buffer, a span past its end or one over
    1,024 ids is refused and changes nothing; another session's buffer is out of reach."""
    a, b = raw("a"), raw("b")

    def read_back(r: Raw, offset: int, num_tokens: int) -> bytes:
        request = pb.ReadTokenBufferRequest(session=r.session, span=pb.TokenSpan(offset=offset, num_tokens=num_tokens))
        return r.stub.ReadTokenBuffer(request).token_ids

    assert a.code_of(read_back, a, 0, 4) == grpc.StatusCode.FAILED_PRECONDITION
    a.open_buffer(8192)
    a.ids[:] = np.arange(2048) * 7
    before = a.totals()
    assert read_back(a, 64, 1024) == (np.arange(16, 16 + 1024, dtype="<i4") * 7).tobytes()
    assert a.code_of(read_back, a, 0, 1025) == grpc.StatusCode.INVALID_ARGUMENT
    assert a.code_of(read_back, a, 8192 - 8, 4) == grpc.StatusCode.INVALID_ARGUMENT
    assert b.code_of(read_back, b, 0, 4) == grpc.StatusCode.FAILED_PRECONDITION  # b has no buffer of its own
    assert a.totals() == before and token_segments(daemon.socket) == []  # read like a call: the name is gone


def test_a_buffer_rewritten_during_calls_is_checked_on_the_daemons_copy(raw):
    """A writer flips the buffer between a valid prompt and out-of-vocabulary ids while
    calls read it. The daemon copies, then checks and matches the copy: each call is
    refused, or stored exactly the valid prompt (its hit covers every full page)."""
    r = raw()
    r.open_buffer(len(PROMPT) * 4)
    r.ids[:] = PROMPT
    r.allocate(span("base", 0, len(PROMPT)))
    r.stub.Publish(pb.PublishRequest(session=r.session, namespace_id=r.ns, items=[pb.PublishItem(seq_id="base")]))
    bad = np.full(len(PROMPT), VOCAB + 1, dtype=np.int32)
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            for chunk in range(0, len(PROMPT), 1000):  # torn states: part valid, part not
                r.ids[chunk : chunk + 1000] = bad[chunk : chunk + 1000]
            r.ids[:] = PROMPT

    writer = threading.Thread(target=rewrite)
    writer.start()
    outcomes = {"ok": 0, "refused": 0}
    try:
        for i in range(60):
            try:
                [seq] = r.allocate(span(f"s{i}", 0, len(PROMPT))).sequences
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
                outcomes["refused"] += 1
                continue
            outcomes["ok"] += 1
            assert seq.shared_prefix_tokens == len(PROMPT) // PAGE_SIZE * PAGE_SIZE
            r.stub.Release(pb.ReleaseRequest(session=r.session, namespace_id=r.ns, seq_ids=[f"s{i}"]))
    finally:
        stop.set()
        writer.join()
    assert sum(outcomes.values()) == 60
    assert not r.stub.CheckInvariants(pb.CheckInvariantsRequest()).violations


def test_a_buffer_its_client_shrank_is_refused_and_the_daemon_keeps_serving(raw):
    """The client maps its buffer read-write, so it may shrink it (``ftruncate``). The daemon
    reads spans with ``pread``, never through a mapping of its own, so a span past the new
    end is refused; a mapped read there would have killed the daemon with SIGBUS."""
    r = raw()
    name = r.open_buffer(1 << 20)
    r.ids[:1024] = 1
    shm = posix_ipc.SharedMemory(name)
    os.ftruncate(shm.fd, 4096)  # the test's own mapping past 4096 bytes is gone too: not touched again
    shm.close_fd()
    before = r.totals()
    try:
        r.allocate(span("past", 0, 100_000))
        pytest.fail("a span past the shrunk buffer was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "shrank to 4096 bytes" in e.details(), e.details()
    assert r.totals() == before
    assert r.allocate(span("inside", 0, 1024)).sequences[0].num_tokens == 1024


def test_a_buffer_closed_while_reads_run_ends_them_cleanly():
    """A large call reads its spans on the offload thread (kvd/server/offload.py) while the loop may
    close the buffer (its session ended, or opened another). A read in flight finishes; one
    that begins after the close is refused (FAILED_PRECONDITION, a clean status); the
    descriptor is closed once, after the last read."""
    fds = len(os.listdir("/proc/self/fd"))
    buffer = TokenBuffer.create(f"/kvd-test-{os.getpid()}", 16 << 20, None)
    outcomes: list[int | str] = []
    reading = threading.Event()

    def reads() -> None:
        for _ in range(100):
            try:
                outcomes.append(len(buffer.read(0, 4 << 20, "sequence 's'")))
            except FailedPrecondition as e:
                assert "closed during the call" in str(e)
                outcomes.append("refused")
            reading.set()

    reader = threading.Thread(target=reads)
    reader.start()
    reading.wait()
    buffer.close()
    reader.join()
    first_refused = outcomes.index("refused")
    assert first_refused > 0 and set(outcomes[:first_refused]) == {16 << 20}
    assert set(outcomes[first_refused:]) == {"refused"}
    assert len(os.listdir("/proc/self/fd")) == fds, "the descriptor leaked"
    buffer.close()  # again: nothing happens (a session's buffer is closed once it is replaced, once at its end)


def test_a_killed_daemons_unused_buffer_is_removed_by_the_next_start(daemon_factory):
    args = ("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
    d = daemon_factory(*args)
    r = Raw(d.socket, "raw")
    r.open_buffer(4096)  # never used: its name stays until the session ends
    assert len(token_segments(d.socket)) == 1
    d.stop(signal.SIGKILL)
    r.close()
    assert len(token_segments(d.socket)) == 1, "a killed daemon leaves it"
    d2 = daemon_factory(*args)
    assert token_segments(d2.socket) == []


@pytest.mark.parametrize(
    "ids, fits",
    [
        (np.array([-(1 << 31), (1 << 31) - 1], np.int32), True),
        (np.array([7, 65535], np.uint16), True),
        (np.array([1, 2], ">i4"), True),  # int32 in the other byte order
        ([(1 << 31) - 1, 3], True),
        (np.array([1, 1 << 31], np.int64), False),
        (np.array([1 << 31], np.uint32), False),
        ([-(1 << 31) - 1], False),
    ],
)
def test_token_ids_are_range_checked_unless_their_type_fits_int32(ids, fits):
    """The client's conversion (a 50K-token call's first step) looks at the values only
    when the dtype could hold one outside int32."""
    if fits:
        assert token_ids_array(ids).tolist() == list(np.asarray(ids).tolist())
        assert token_ids_array(ids).dtype == np.dtype("<i4")
    else:
        with pytest.raises(ValueError, match="fit in int32"):
            token_ids_array(ids)
