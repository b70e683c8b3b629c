"""The disk tier seen from outside, through a real daemon and a real directory: its KV
events (medium STORAGE, decoded with vLLM's own classes off the ZMQ stream) keep a
router's view of which pages this host holds, on which medium, equal to the daemon's; its
metrics (bytes each way, the promotion latency histogram) and its `kvd stats` lines.

A router's view here is what vLLM's subscribers build: per medium, the block hashes
stored minus those removed since the last ``AllBlocksCleared``."""

from __future__ import annotations

import tempfile
import threading

import pytest
from conftest import remove_shared_memory, wait_until
from test_disk_tier import CHUNK, LAYOUT, MODEL, PAGE_BYTES, PAGES, daemon_args, evict, prompt, publish, settled_hit
from test_events import Subscriber, needs_vllm
from test_service import free_port, metric_samples

from engine_client import KVDClient
from kvd.cli import stats_table

try:
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored
except ImportError:
    pass

DISK_PAGES = 51  # one chunk of 16 KiB slots (CHUNK): the disk fills after 51 pages


class RouterView:
    """Block hashes per medium, as a KV-aware router keeps them from the events."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}
        self.removed: dict[str, set[bytes]] = {}

    def take(self, reader: Subscriber) -> None:
        """Applies every batch published so far."""
        while not reader.quiet():
            for event in reader.next().events:
                if isinstance(event, AllBlocksCleared):
                    self.held.clear()
                elif isinstance(event, BlockStored):
                    assert (
                        event.block_size == LAYOUT.page_size
                        and len(event.token_ids) == len(event.block_hashes) * LAYOUT.page_size
                    )
                    self.held.setdefault(event.medium, set()).update(event.block_hashes)
                else:
                    assert isinstance(event, BlockRemoved)
                    held = self.held.setdefault(event.medium, set())
                    assert set(event.block_hashes) <= held, f"{event.medium} removal of pages never announced"
                    held.difference_update(event.block_hashes)
                    self.removed.setdefault(event.medium, set()).update(event.block_hashes)

    def on(self, medium: str) -> set[bytes]:
        return self.held.get(medium, set())


def buffered(client: KVDClient, removals_only: bool = False) -> list:
    """Every event the daemon buffered, from seq 0, on the gRPC stream (``removals_only``:
    as the vLLM connector's scheduler half, a client holding host pages, gets them)."""
    stream = client.subscribe_events(0, removals_only=removals_only)
    got: list = []

    def read() -> None:
        for batch in stream:
            got.extend(batch.events)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(1.0)
    stream.cancel()
    reader.join(5.0)
    return got


@pytest.fixture
def endpoints():
    with tempfile.TemporaryDirectory(prefix="kvdev") as d:  # short: an ipc path holds 107 bytes
        yield f"ipc://{d}/events", f"ipc://{d}/replay"


@needs_vllm
def test_pages_moving_to_disk_and_back_are_announced_per_medium_and_counted(tmp_path, daemon_factory, endpoints):
    disk = tmp_path / "disk"
    disk.mkdir()
    port = free_port()
    publish_at, replay_at = endpoints
    args = (
        *daemon_args(disk, 4096 + CHUNK),
        "--events-endpoint", publish_at, "--events-replay-endpoint", replay_at, "--metrics-port", str(port),
    )  # fmt: skip
    d = daemon_factory(*args)
    reader, view = Subscriber(publish_at, replay_at), RouterView()
    try:
        with KVDClient.connect(d.socket) as c:
            ns = c.register_namespace(MODEL, LAYOUT)
            first = set(c.page_keys(ns, prompt(1)))
            publish(c, ns, 1)
            evict(c, ns, range(2, 6))  # prompt 1 leaves host memory for the disk
            wait_until(lambda: c.stats()["disk"]["written_pages"] >= PAGES, "prompt 1 written to disk", 10)
            view.take(reader)
            assert not first & view.on(MEDIUM_CPU), "RAM's eviction was announced"
            assert first <= view.on(MEDIUM_STORAGE), "the pages written to disk are announced STORAGE"

            assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size  # promoted back into host memory
            view.take(reader)
            assert first <= view.on(MEDIUM_CPU) and first <= view.on(MEDIUM_STORAGE), "in RAM and still on disk"

            evict(c, ns, range(6, 16))  # more than the disk holds: its oldest pages are freed
            wait_until(lambda: c.stats()["disk"]["backlog_bytes"] == 0, "every write done", 10)
            view.take(reader)
            s = c.stats()
            assert s["disk"]["evicted_pages"] > 0 and view.removed.get(MEDIUM_STORAGE)
            assert len(view.on(MEDIUM_STORAGE)) == s["disk"]["pages"] <= DISK_PAGES, "the router's disk view is exact"
            in_ram = s["cached_pages"] + s["shared_pages"]
            assert len(view.on(MEDIUM_CPU)) == in_ram, "and its host-memory view too"

            heard = buffered(c, removals_only=True)
            assert heard and {e.medium for e in heard if hasattr(e, "medium")} == {"CPU"}, (
                "a removals-only subscriber (a client holding host pages) hears no disk removal"
            )
            on_disk = [e for e in buffered(c) if getattr(e, "medium", "") == MEDIUM_STORAGE]
            assert on_disk and {e.namespace_id for e in on_disk} == {ns}, "the gRPC stream names the namespace"

            # What an operator sees: bytes each way, the promotion latency, the backlog.
            disk_stats = s["disk"]
            assert disk_stats["written_bytes"] == disk_stats["written_pages"] * PAGE_BYTES
            assert disk_stats["read_bytes"] >= PAGES * PAGE_BYTES and sum(disk_stats["promotion_buckets"]) >= 1
            samples = metric_samples(port)
            assert samples[("kvd_disk_written_bytes_total", ())] == disk_stats["written_bytes"]
            assert samples[("kvd_disk_read_bytes_total", ())] == disk_stats["read_bytes"]
            count = samples[("kvd_disk_promotion_seconds_count", ())]
            assert (
                count
                == sum(disk_stats["promotion_buckets"])
                == samples[("kvd_disk_promotion_seconds_bucket", (("le", "+Inf"),))]
            )
            assert 0 < samples[("kvd_disk_promotion_seconds_sum", ())] == pytest.approx(disk_stats["promotion_seconds"])
            table = stats_table(s)
            assert f"disk tier I/O: {disk_stats['written_bytes']:,} bytes written" in table
            assert "promotion reads p50 <= " in table
        assert d.stop() == 0
    finally:
        reader.close()
    remove_shared_memory(d.socket)  # a reboot: a fresh /dev/shm, the disk as it was

    again = daemon_factory(*args, name="again")
    reader, after = Subscriber(publish_at, replay_at), RouterView()
    try:
        after.take(reader)
        with KVDClient.connect(again.socket) as c:
            recovered = c.stats()["disk"]["recovered_pages"]
            announced = [e for e in buffered(c) if getattr(e, "medium", "") == MEDIUM_STORAGE]
            assert {e.namespace_id for e in announced} == {0}, "a namespace no engine registered yet: id 0"
        assert len(after.on(MEDIUM_STORAGE)) == recovered > 0, "what the disk holds, announced at start"
        assert view.on(MEDIUM_STORAGE) <= after.on(MEDIUM_STORAGE)
        assert not after.on(MEDIUM_CPU)
    finally:
        reader.close()
