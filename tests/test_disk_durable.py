"""The disk tier through a real daemon at its dangerous instants (issue 30): ``kill -9`` while a
write-back is in flight and while the tier frees disk pages to make room, aimed with the
storage engine's crash points (kvd/diskstore/crashpoints.py, ``KVD_DISK_CRASH_AT`` in the daemon's
environment); then a warm restart (the same /dev/shm) and a host reboot (``kvd clean``: a
fresh /dev/shm) find exactly the completed pages on disk, serve them with their own bytes, and
never find a torn one. And a failing disk (``KVD_DISK_FAULT``: EIO at the syscall boundary,
as tests/test_disk_faults.py injects it in process): a read error during a promotion and a
write error during a write-back are counted, logged, a miss or a refusal; host memory keeps
serving and nothing served changes.

Each crash test fails on a build without the protection it tests: the page bytes synced
before their headers (a header would describe bytes that never arrived: ``disk-data-torn``),
the header checksum (a torn header would be recovered: ``disk-header-torn``), zeroing a freed
slot's header before the slot is written again (a victim's header would describe the bytes
of the page written in its place: ``disk-data-written`` of the write after the free)."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from conftest import budget_for, clean_env, remove_shared_memory, wait_until

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess
from kvd.diskstore.layout import BLOCK, SlotClass

# A slot header with 256 token ids spans three 512-byte sectors: a torn one loses token ids.
LAYOUT = PageLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=256, dtype="float16")  # 8 KiB pages
PAGE_BYTES = 8 << 10
MODEL = "disk-durable"
PAGES = 4  # a prompt's full pages
RAM_PAGES = 3 * PAGES  # three prompts fit in host memory
CHUNK = 128 << 10
SLOTS = SlotClass(PAGE_BYTES, LAYOUT.page_size).slots_in(CHUNK)  # 10: two prompts and a half


def daemon_args(disk, chunks: int = 8) -> tuple[str, ...]:
    host = budget_for(RAM_PAGES, PAGE_BYTES, LAYOUT.page_size)
    return (
        "--enable-prefix-reuse",
        "--host-bytes", str(host), "--extent-bytes", str(host),
        "--disk-path", str(disk), "--disk-bytes", str(BLOCK + chunks * CHUNK), "--disk-chunk-bytes", str(CHUNK),
    )  # fmt: skip


class Prompts:
    """Prompts of one namespace, each ``PAGES`` full pages of random K/V named by a seed."""

    def __init__(self, client: KVDClient, model: str = MODEL, layout: PageLayout = LAYOUT) -> None:
        self.client = client
        self.ns = client.register_namespace(model, layout)
        self.prompt_tokens = PAGES * layout.page_size

    def tokens(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 30000, self.prompt_tokens, dtype=np.int32)

    def publish(self, seed: int) -> list[np.ndarray]:
        """Publishes prompt ``seed`` and releases it (CACHED: evicted when three more come); its pages' bytes."""
        c, seq = self.client, f"p{seed}"
        [alloc] = c.allocate_with_prefix(self.ns, [SequenceRequest(seq, self.tokens(seed))])
        rng = np.random.default_rng(seed)
        for page in alloc.private_pages:
            view = c.page_array(self.ns, page)
            view[...] = rng.standard_normal(view.shape).astype(view.dtype)
        c.publish(self.ns, [seq])
        pages = [c.page_array(self.ns, page).copy() for page in alloc.pages]
        c.release(self.ns, [seq])
        return pages

    def served(self, seed: int, want: list[np.ndarray]) -> int:
        """How many of the prompt's pages are served once any promotion from disk ended; each
        must equal ``want``'s."""

        def settled():
            [r] = self.client.lookup(self.ns, [SequenceRequest("ask", self.tokens(seed))])
            return r if r.remote_pending_tokens == 0 else None

        hit = wait_until(settled, f"prompt {seed}'s promotion ended", 10).hit_tokens
        [alloc] = self.client.allocate_with_prefix(self.ns, [SequenceRequest(f"hit{seed}", self.tokens(seed))])
        got = [self.client.page_array(self.ns, page).copy() for page in alloc.shared_pages]
        self.client.release(self.ns, [f"hit{seed}"])
        assert len(got) * self.prompt_tokens // PAGES == hit
        for n, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), f"prompt {seed}'s page {n} served with other bytes"
        return len(got)

    def disk(self) -> dict:
        return self.client.stats()["disk"]


def written(prompts: Prompts, pages: int) -> None:
    wait_until(lambda: prompts.disk()["written_pages"] >= pages, f"{pages} pages written to disk", 10)


def five_prompts(prompts: Prompts) -> dict[int, list[np.ndarray]]:
    """Prompts 1-5 published, each page's bytes: 1 and 2 evicted and written to disk, 3-5
    cached in host memory."""
    want = {seed: prompts.publish(seed) for seed in range(1, 6)}
    written(prompts, 2 * PAGES)
    return want


def crashed(d, prompts: Prompts, seed: int) -> None:
    """Publishes prompt ``seed``, whose eviction of an older prompt leads the daemon to its crash point."""
    try:
        prompts.publish(seed)
    except Exception:  # noqa: BLE001 - the daemon may die before it replies
        pass
    assert d.process.wait(timeout=20) == -signal.SIGKILL, d.log()
    prompts.client.close()


def after_crash(
    daemon_factory, disk, recovered: int, want: dict[int, list[np.ndarray]], in_ram: set[int], on_disk: dict[int, int]
):
    """A warm restart finds exactly the completed pages on disk (``recovered`` of the stats) and
    serves ``in_ram``'s prompts from host memory; killed, then a reboot (``kvd clean``) serves
    ``on_disk``'s leading pages (prompt → how many) from disk, and nothing else, rejecting none.
    (The warm restart promotes nothing: a promotion would evict host pages, written to disk.)"""
    warm = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(warm.socket) as c:
        p = Prompts(c)
        assert p.disk()["recovered_pages"] == recovered, "the pages whose writes completed, not freed"
        assert all(p.served(seed, want[seed]) == PAGES for seed in in_ram)
    warm.process.kill()  # no graceful stop: it would write what host memory holds
    warm.process.wait()
    remove_shared_memory(warm.socket)
    rebooted = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(rebooted.socket) as c:
        p = Prompts(c)
        assert p.disk()["recovered_pages"] == recovered
        for seed in sorted(want):
            assert p.served(seed, want[seed]) == on_disk.get(seed, 0), f"prompt {seed}"
        s = p.disk()
        assert (s["rejected_pages"], s["errors"]) == (0, 0), "a torn page was found on disk"
        assert c.check_invariants() == []


@pytest.mark.parametrize(
    "crash_at, completed",
    [
        ("disk-data-torn:2", False),  # half of the second write-back's page bytes written
        ("disk-data-written:2", False),  # all its bytes, no header yet
        ("disk-header-torn:2", False),  # half of its first header's bytes
        ("disk-header-written:2", True),  # its headers whole, neither synced nor reported
    ],
)
def test_a_kill_while_a_write_back_is_in_flight_keeps_exactly_the_completed_pages(
    tmp_path, daemon_factory, crash_at, completed
):
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk), env=clean_env(tmp_path, KVD_DISK_CRASH_AT=crash_at))
    p = Prompts(KVDClient.connect(d.socket))
    want = {seed: p.publish(seed) for seed in range(1, 5)}  # the fourth evicts prompt 1
    written(p, PAGES)
    crashed(d, p, 5)  # evicts prompt 2: the daemon dies while its pages are written
    on_disk = {1: PAGES, 2: PAGES} if completed else {1: PAGES}
    after_crash(daemon_factory, disk, sum(on_disk.values()), want, in_ram={3, 4}, on_disk=on_disk)


@pytest.mark.parametrize(
    "crash_at",
    [
        "disk-slot-invalidated:2",  # prompt 4's victims' headers zeroed, neither synced nor reported
        "disk-data-written:5",  # prompt 4's bytes in its victims' slots, no header yet
    ],
)
def test_a_kill_while_disk_space_is_reclaimed_keeps_exactly_the_pages_not_freed(tmp_path, daemon_factory, crash_at):
    """One chunk of ten slots, prompts written tail first, each admitted to the disk's policy
    before it is written, the pages it gives up freed first. Prompts 1 and 2 fill eight slots;
    prompt 3 takes the two free ones and the two of prompt 1's pages given up for it (slots
    0-1: the first write run, data write 3, the second run 4). Prompt 4 is given the next four
    (slots 2-5: prompt 1's head and prompt 2's tail) and, as one run, written there: the daemon
    dies freeing them (the second free) or writing into their slots (data write 5)."""
    assert SLOTS == 2 * PAGES + 2
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk, chunks=1), env=clean_env(tmp_path, KVD_DISK_CRASH_AT=crash_at))
    p = Prompts(KVDClient.connect(d.socket))
    want = {seed: p.publish(seed) for seed in range(1, 4)}
    for seed in range(4, 7):  # each evicts one prompt, written as a batch of its own
        want[seed] = p.publish(seed)
        written(p, (seed - 3) * PAGES)
    crashed(d, p, 7)  # evicts prompt 4
    # Prompt 2's head (its last two pages written) and all of prompt 3 are left.
    after_crash(daemon_factory, disk, SLOTS - 4, want, in_ram={5, 6}, on_disk={2: PAGES - 2, 3: PAGES})


def test_a_read_error_during_a_promotion_is_a_miss_and_host_memory_keeps_serving(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk), env=clean_env(tmp_path, KVD_DISK_FAULT="read:EIO"))  # the first read
    with KVDClient.connect(d.socket) as c:
        p = Prompts(c)
        want = five_prompts(p)
        [held] = c.allocate_with_prefix(p.ns, [SequenceRequest("held", p.tokens(5))])  # served from RAM
        held_bytes = [c.page_array(p.ns, page).copy() for page in held.shared_pages]
        assert p.served(1, want[1]) == 0, "a read error is a miss"
        s = p.disk()
        assert s["errors"] == 1 and s["fetched_pages"] == 0
        assert s["pages"] == s["written_pages"] - PAGES, "prompt 1 dropped from disk (its room evicted prompt 3 to it)"
        assert p.served(1, want[1]) == 0, "and not read again"
        assert p.served(2, want[2]) == PAGES, "the disk serves its other pages"
        assert p.served(4, want[4]) == PAGES, "host memory keeps serving"
        assert all(np.array_equal(c.page_array(p.ns, page), b) for page, b in zip(held.shared_pages, held_bytes))
        c.release(p.ns, ["held"])
        assert c.check_invariants() == []
    log = d.log()
    assert "pages not read back" in log and "did not arrive from the disk" in log and "Traceback" not in log


def test_a_write_error_during_a_write_back_is_a_counted_refusal(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    # The first write is the chunk's header; the second, the first write-back's page bytes.
    d = daemon_factory(*daemon_args(disk), env=clean_env(tmp_path, KVD_DISK_FAULT="write:EIO:1"))
    with KVDClient.connect(d.socket) as c:
        p = Prompts(c)
        want = {seed: p.publish(seed) for seed in range(1, 5)}  # prompt 1 evicted: its write fails
        wait_until(lambda: p.disk()["errors"] == PAGES, "the failed write counted", 10)
        assert p.served(1, want[1]) == 0, "not on disk: a miss"
        want[5] = p.publish(5)  # prompt 2 evicted: written in the slots the failed write left free
        written(p, PAGES)
        assert p.served(2, want[2]) == PAGES
        assert all(p.served(seed, want[seed]) == PAGES for seed in (4, 5)), "host memory keeps serving"
        s = p.disk()
        assert (s["errors"], s["refused_pages"], s["pages"]) == (PAGES, 0, s["written_pages"])
        assert c.check_invariants() == []
    assert "pages not written (io-error)" in d.log() and "Traceback" not in d.log()


def test_a_clean_stop_writes_what_host_memory_holds_and_a_reboot_finds_it_warm(tmp_path, daemon_factory):
    """Prompts 1 and 2 were evicted to disk; 3 and 4 are cached in host memory and 5 is still
    held by a sequence at the stop: ``kvd stop``, ``kvd clean`` and a start serve all five."""
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(d.socket) as c:
        p = Prompts(c)
        want = five_prompts(p)
        c.allocate_with_prefix(p.ns, [SequenceRequest("held", p.tokens(5))])  # referenced at the stop
        assert p.disk()["pages"] == 2 * PAGES
    assert d.stop() == 0
    assert f"wrote {3 * PAGES} pages host memory held" in d.log() and "Traceback" not in d.log()
    remove_shared_memory(d.socket)  # a reboot
    again = daemon_factory(*daemon_args(disk), name="again")
    with KVDClient.connect(again.socket) as c:
        p = Prompts(c)
        assert p.disk()["recovered_pages"] == 5 * PAGES
        assert all(p.served(seed, want[seed]) == PAGES for seed in want)
        assert c.check_invariants() == []


@pytest.mark.parametrize("chunks, seconds", [(1, "10"), (8, "0")])
def test_a_clean_stop_writes_no_more_than_the_disk_holds_nor_for_longer_than_its_time(
    tmp_path, daemon_factory, chunks, seconds
):
    """One chunk of ten slots, prompts 1 and 2 on it, three in host memory: the stop writes
    the most recently used two (what the file holds); no time at all: it writes none."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = daemon_args(disk, chunks) + ("--disk-stop-write-seconds", seconds)
    d = daemon_factory(*args)
    with KVDClient.connect(d.socket) as c:
        p = Prompts(c)
        want = five_prompts(p)
    assert d.stop() == 0
    left = 3 * PAGES - SLOTS if chunks == 1 else 3 * PAGES
    assert f"wrote {3 * PAGES - left} pages host memory held" in d.log()
    assert (f"{left} not written" in d.log()) == (seconds == "0"), d.log()
    remove_shared_memory(d.socket)
    again = daemon_factory(*args, name="again")
    with KVDClient.connect(again.socket) as c:
        p = Prompts(c)
        assert p.disk()["recovered_pages"] == (SLOTS if chunks == 1 else 2 * PAGES)
        served = {seed: p.served(seed, want[seed]) for seed in sorted(want)}
    # host memory's most recent pages first (prompt 5, 4, then prompt 3's head), disk's least recent evicted
    assert served == ({1: 0, 2: 0, 3: 2, 4: PAGES, 5: PAGES} if chunks == 1 else {1: PAGES, 2: PAGES, 3: 0, 4: 0, 5: 0})


def test_a_full_disk_of_another_page_size_empties_a_chunk_for_the_refused_pages(tmp_path, daemon_factory):
    """Two chunks of ten slots full of namespace A's pages; namespace B's pages (as large, half
    the tokens: another slot size) find no slot. Freeing A's least recent pages one for one
    would free slots B cannot use: the tier empties A's least recent chunk instead, which is
    formatted for B's size, and B's pages are written there."""
    other = PageLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=128, dtype="float16")  # 8 KiB pages
    extent = max(budget_for(RAM_PAGES, PAGE_BYTES, size) for size in (LAYOUT.page_size, other.page_size))
    disk = tmp_path / "disk"
    disk.mkdir()
    args = daemon_args(disk, chunks=2)
    host = args.index("--host-bytes")
    args = args[:host] + ("--host-bytes", str(2 * extent), "--extent-bytes", str(extent)) + args[host + 4 :]
    d = daemon_factory(*args)
    with KVDClient.connect(d.socket) as c:
        a, b = Prompts(c), Prompts(c, "disk-durable-other", other)  # each namespace builds its one extent
        seed = 0
        while a.disk()["pages"] < 2 * SLOTS:  # A's evicted prompts fill the disk
            seed += 1
            a.publish(seed)
            wait_until(lambda: a.disk()["backlog_bytes"] == 0, "the write-back done", 10)
        before = a.disk()
        want = {seed: b.publish(seed) for seed in range(1, 5)}  # B's prompt 1 (at least) evicted
        wait_until(lambda: a.disk()["backlog_bytes"] == 0, "the write-back done", 10)
        s = a.disk()
        assert s["refused_pages"] == 0 and s["evicted_pages"] - before["evicted_pages"] == SLOTS, s
        b_written = s["written_pages"] - before["written_pages"]  # B's pages host memory evicted, in chunk 0
        assert b_written >= PAGES and s["pages"] == SLOTS + b_written
        assert b.served(1, want[1]) == PAGES
        assert c.check_invariants() == []
    assert d.stop() == 0 and "Traceback" not in d.log(), d.log()  # the stop writes pages of both sizes
    assert "not written" not in d.log()


def test_a_rebooted_daemon_answers_before_its_disk_is_indexed_and_serves_each_page_once_learnt(
    tmp_path, daemon_factory
):
    """A reboot on a disk tier that holds prompts 1-5, its open held once the headers are read
    (``KVD_HOLD_AT=disk-opened``): the daemon answers, says its disk is opening with every page
    pending, misses them all, and queues an eviction without writing it (the slots are not its
    yet); released, every page on disk is announced, every prompt is served with its own
    bytes, a prompt never written is never served, and the queued eviction is written."""
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(d.socket) as c:
        p = Prompts(c)
        want = five_prompts(p)
    assert d.stop() == 0
    remove_shared_memory(d.socket)  # a reboot
    hold = tmp_path / "hold"
    hold.touch()
    env = clean_env(tmp_path, KVD_HOLD_AT="disk-opened", KVD_HOLD_FILE=str(hold))
    again = daemon_factory(*daemon_args(disk), env=env, name="again")
    with KVDClient.connect(again.socket) as c:
        p = Prompts(c)
        s = p.disk()
        assert (s["state"], s["pages"]) == ("opening", 0)
        assert s["pending_pages"] == s["recovered_pages"] == 5 * PAGES
        for seed in want:
            [r] = c.lookup(p.ns, [SequenceRequest("ask", p.tokens(seed))])
            assert (r.hit_tokens, r.remote_pending_tokens) == (0, 0), "a page the disk's index has not learnt"
        events, heard = c.subscribe_events(), []
        reader = threading.Thread(target=lambda: heard.extend(e for batch in events for e in batch.events))
        reader.start()
        new = {}  # host memory holds three: the others are evicted, until the subscription hears a publish
        for seed in range(6, 30):
            new[seed] = p.publish(seed)
            time.sleep(0.05)
            if len(new) >= 4 and heard:
                break
        assert heard, "the subscription never heard a publish"
        assert p.disk()["written_pages"] == 0 and p.disk()["backlog_bytes"] > 0
        hold.unlink()
        wait_until(lambda: p.disk()["state"] == "on", "the disk's pages indexed", 10)
        written(p, PAGES)
        assert p.disk()["pending_pages"] == 0
        found = {k for seed in want for k in c.page_keys(p.ns, p.tokens(seed))}

        def stored() -> set[bytes]:
            return {k for e in list(heard) if getattr(e, "medium", "") == "STORAGE" for k in e.block_hashes}

        wait_until(lambda: stored() >= found and len(stored()) == p.disk()["pages"], "each page on disk announced", 10)
        events.cancel()
        reader.join(5.0)
        assert all(p.served(seed, want[seed]) == PAGES for seed in want)
        assert all(p.served(seed, new[seed]) == PAGES for seed in new)
        assert p.served(99, []) == 0, "a prompt never written"
        assert c.check_invariants() == []


def test_a_kill_while_the_disk_tier_opens_loses_no_page(tmp_path, daemon_factory):
    """``kill -9`` of a rebooted daemon once its store read the headers and before its index
    learnt any page (``KVD_CRASH_AT=disk-opened``): the next start serves every page on disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(d.socket) as c:
        want = five_prompts(Prompts(c))
    assert d.stop() == 0
    remove_shared_memory(d.socket)  # a reboot
    env = clean_env(tmp_path, KVD_CRASH_AT="disk-opened")
    killed = DaemonProcess(d.socket, daemon_args(disk), str(tmp_path / "killed.log"), env)
    assert killed.process.wait(timeout=20) == -signal.SIGKILL, killed.log()
    remove_shared_memory(d.socket)
    again = daemon_factory(*daemon_args(disk), name="again")
    with KVDClient.connect(again.socket) as c:
        p = Prompts(c)
        wait_until(lambda: p.disk()["state"] == "on", "the disk's pages indexed", 10)
        assert p.disk()["pages"] == 5 * PAGES
        assert all(p.served(seed, want[seed]) == PAGES for seed in want)
        assert c.check_invariants() == []
