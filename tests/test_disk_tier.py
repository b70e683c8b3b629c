"""The disk tier through a real daemon and a real directory: pages RAM evicts are written
back, found again by a later prompt (pending, then a hit with the same bytes), found again
after a restart on a fresh /dev/shm, dropped when their bytes changed on disk; a full disk
evicts, a vanished directory refuses, and RAM keeps serving."""

from __future__ import annotations

import os
import re
import shutil
import time

import numpy as np
import pytest
from conftest import budget_for, remove_shared_memory, wait_until

from engine_client import KVDClient, PageLayout, SequenceRequest
from kvd import config
from kvd.diskstore.layout import FILE_NAME
from kvd.tiers.fetches import RECHECK_SECONDS as RECHECK

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")  # 16 KiB pages
PAGE_BYTES = 16 << 10
MODEL = "disk-tiny"
PAGES = 8  # a prompt's full pages
RAM_PAGES = 24  # three prompts fit in host memory
CHUNK = 1 << 20  # 51 slots of 16 KiB pages


def daemon_args(disk_dir, disk_bytes: int = 4096 + 8 * CHUNK) -> tuple[str, ...]:
    host = budget_for(RAM_PAGES, PAGE_BYTES, LAYOUT.page_size)
    return (
        "--enable-prefix-reuse",
        "--host-bytes", str(host), "--extent-bytes", str(host),
        "--disk-path", str(disk_dir), "--disk-bytes", str(disk_bytes), "--disk-chunk-bytes", str(CHUNK),
    )  # fmt: skip


def prompt(seed: int, pages: int = PAGES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, pages * LAYOUT.page_size, dtype=np.int32)


def publish(client: KVDClient, ns: int, seed: int) -> list[np.ndarray]:
    """Publishes prompt ``seed`` with random K/V and releases it (its pages become CACHED)."""
    seq = f"p{seed}"
    [alloc] = client.allocate_with_prefix(ns, [SequenceRequest(seq, prompt(seed))])
    rng = np.random.default_rng(seed)
    for page in alloc.private_pages:
        view = client.page_array(ns, page)
        view[...] = rng.standard_normal(view.shape).astype(view.dtype)
    client.publish(ns, [seq])
    pages = [client.page_array(ns, page).copy() for page in alloc.pages]
    client.release(ns, [seq])
    return pages


def evict(client: KVDClient, ns: int, seeds: range) -> None:
    """Publishes other prompts until the first ones are evicted from host memory."""
    for seed in seeds:
        publish(client, ns, seed)


def lookup(client: KVDClient, ns: int, seed: int):
    [r] = client.lookup(ns, [SequenceRequest("ask", prompt(seed))])
    return r


def settled_hit(client: KVDClient, ns: int, seed: int) -> int:
    """Asks like the vLLM connector's lookahead: again while pages are pending."""

    def settled():
        r = lookup(client, ns, seed)
        return r if r.remote_pending_tokens == 0 else None

    return wait_until(settled, "the disk's promotion ended", 10).hit_tokens


def hit_bytes(client: KVDClient, ns: int, seed: int) -> list[np.ndarray]:
    [alloc] = client.allocate_with_prefix(ns, [SequenceRequest(f"hit{seed}", prompt(seed))])
    pages = [client.page_array(ns, page).copy() for page in alloc.shared_pages]
    client.release(ns, [f"hit{seed}"])
    return pages


def written(client: KVDClient, pages: int) -> None:
    wait_until(lambda: client.stats()["disk"]["written_pages"] >= pages, f"{pages} pages written to disk", 10)


def admitted(client: KVDClient, pages: int) -> None:
    """Waits until ``pages`` evicted pages reached the disk or were given up by its policy (a
    page given up before its batch is written is not written)."""

    def done():
        s = client.stats()["disk"]
        return s["pages"] + s["evicted_pages"] >= pages

    wait_until(done, f"{pages} pages written to disk or given up", 10)


def evicted_to_disk(client: KVDClient, ns: int) -> list[np.ndarray]:
    """Publishes prompt 1, evicts it from host memory and waits until it is on disk; its pages' bytes."""
    want = publish(client, ns, 1)
    evict(client, ns, range(2, 6))
    written(client, PAGES)  # at once: its allocation's miss on disk left no recheck delay
    return want


def test_an_evicted_prompt_is_promoted_from_disk_with_equal_bytes_and_survives_a_restart(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        want = evicted_to_disk(c, ns)
        first = lookup(c, ns, 1)
        assert first.hit_tokens < PAGES * LAYOUT.page_size and first.remote_pending_tokens > 0
        assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size
        got = hit_bytes(c, ns, 1)
        assert len(got) == PAGES and all(np.array_equal(a, b) for a, b in zip(got, want))
        s = c.stats()["disk"]
        assert s["state"] == "on" and s["fetched_pages"] >= PAGES and s["hit_tokens"] >= PAGES * LAYOUT.page_size
        assert s["pages"] >= PAGES and s["bytes"] == s["pages"] * PAGE_BYTES
        assert c.check_invariants() == []
    assert d.stop() == 0 and "Traceback" not in d.log()
    remove_shared_memory(d.socket)  # a reboot: a fresh /dev/shm, the disk as it was

    again = daemon_factory(*daemon_args(disk), name="again")
    with KVDClient.connect(again.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        assert c.stats()["disk"]["recovered_pages"] >= PAGES
        assert lookup(c, ns, 1).hit_tokens == 0
        assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size
        got = hit_bytes(c, ns, 1)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_page_changed_on_disk_is_a_miss_and_dropped(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        want = evicted_to_disk(c, ns)
        raw = bytearray((disk / FILE_NAME).read_bytes())
        at = raw.find(want[3].tobytes()[:4096])  # page 3 of the prompt, in its slot
        assert at > 0
        with open(disk / FILE_NAME, "r+b") as f:
            f.seek(at + 100)
            f.write(bytes([raw[at + 100] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        assert settled_hit(c, ns, 1) == 3 * LAYOUT.page_size  # the chain ends before the changed page
        assert c.stats()["disk"]["rejected_pages"] == 1
        got = hit_bytes(c, ns, 1)
        assert all(np.array_equal(a, b) for a, b in zip(got, want[:3]))
        time.sleep(RECHECK)
        assert settled_hit(c, ns, 1) == 3 * LAYOUT.page_size  # dropped from the disk: not read again
        assert c.stats()["disk"]["rejected_pages"] == 1


def test_a_full_disk_evicts_its_oldest_pages(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk, disk_bytes=4096 + CHUNK))  # 51 pages on disk
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        for seed in range(1, 13):
            publish(c, ns, seed)
        admitted(c, 9 * PAGES)  # prompts 1-9 left host memory (a page given up in its batch is not written)
        s = c.stats()["disk"]
        assert s["pages"] == 51 and s["evicted_pages"] == 9 * PAGES - 51 and s["errors"] == s["refused_pages"] == 0
        assert settled_hit(c, ns, 1) < PAGES * LAYOUT.page_size  # the oldest prompt left the disk
        assert settled_hit(c, ns, 9) == PAGES * LAYOUT.page_size  # a recent one, evicted from RAM, is there
        assert c.check_invariants() == []


def test_a_vanished_directory_refuses_writes_and_ram_keeps_serving(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        shutil.rmtree(disk)
        publish(c, ns, 1)
        evict(c, ns, range(2, 6))
        wait_until(lambda: c.stats()["disk"]["refused_pages"] >= PAGES, "writes refused", 10)
        assert c.stats()["disk"]["written_pages"] == 0
        want = publish(c, ns, 7)
        assert lookup(c, ns, 7).hit_tokens == PAGES * LAYOUT.page_size  # RAM serves
        assert all(np.array_equal(a, b) for a, b in zip(hit_bytes(c, ns, 7), want))
    assert d.process.poll() is None


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"disk_bytes": "1GiB"}, "disk.path (an existing directory) is required"),
        ({"disk_path": "relative/dir", "disk_bytes": "1GiB"}, "disk.path: expected an absolute path"),
        ({"disk_path": "/tmp"}, "disk.bytes (the budget on disk"),
        ({"disk_path": "/tmp", "disk_bytes": "1MiB"}, "disk.bytes: 1048576 holds no chunk"),
        ({"disk_path": "/tmp", "disk_bytes": "1GiB", "disk_chunk_bytes": "5000"}, "disk.chunk_bytes: a multiple"),
        ({"disk_path": "/tmp", "disk_bytes": "lots"}, "disk.bytes: cannot read 'lots'"),
        (
            {"disk_path": "/tmp", "disk_bytes": "1GiB", "disk_stop_write_seconds": "-1"},
            "disk.stop_write_seconds: expected",
        ),
        (
            {"disk_path": "/tmp", "disk_bytes": "1GiB", "disk_stop_write_seconds": "soon"},
            "stop_write_seconds: expected",
        ),
        (
            {"disk_path": "/tmp", "disk_bytes": "1GiB", "disk_policy": "fifo"},
            "disk.policy: expected one of ['arc', 'lru']",
        ),
        (
            {"disk_path": "/tmp", "disk_bytes": "1GiB", "disk_min_uses": "0"},
            "disk.min_uses: expected a number of uses >= 1",
        ),
        (
            {"disk_path": "/tmp", "disk_bytes": "1GiB", "disk_min_uses": "two"},
            "disk.min_uses: expected an integer, got 'two' (from --disk-min-uses)",
        ),
    ],
)
def test_bad_disk_settings_are_refused_with_their_source(flags, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load(flags, environ={}, config_file=None)


def test_disk_settings_from_file_environment_and_flags(tmp_path):
    path = tmp_path / "kvd.toml"
    path.write_text(
        'host_bytes = "4GiB"\n[disk]\npath = "/var/lib/kvd"\nbytes = "100GiB"\npolicy = "lru"\nmin_uses = 3\n'
        '[tenants.alpha]\nuids = [1001]\nhost_bytes = "1GiB"\n'
    )
    flags = {"disk_backlog_bytes": "64MiB", "disk_stop_write_seconds": "2.5"}
    environ = {"KVD_DISK_BYTES": "200GiB", "KVD_DISK_MIN_USES": "2"}
    cfg = config.load(flags, environ=environ, config_file=str(path))
    assert cfg.disk == config.DiskConfig(
        "/var/lib/kvd", 200 << 30, backlog_bytes=64 << 20, stop_write_seconds=2.5, policy="lru", min_uses=2
    )
    assert cfg.disk.share("alpha", 1 << 30, cfg.host_bytes) == ("/var/lib/kvd/alpha", 50 << 30)
    assert config.load({}, environ={}, config_file=None).disk is None
    default = config.load({"disk_path": "/tmp", "disk_bytes": "1GiB"}, environ={}, config_file=None).disk
    assert (default.policy, default.min_uses) == ("arc", 1)


def test_a_missing_directory_stops_the_start_with_a_clear_error(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "serve", "--socket", str(tmp_path / "k.sock"),
         "--disk-path", str(tmp_path / "nowhere"), "--disk-bytes", "8MiB", "--disk-chunk-bytes", "1MiB"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1 and "disk.path" in out.stderr and "missing" in out.stderr, out.stderr


def test_each_tenant_has_its_own_directory_and_share_of_the_budget(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    host = budget_for(RAM_PAGES, PAGE_BYTES, LAYOUT.page_size)
    path = tmp_path / "kvd.toml"
    path.write_text(
        f"host_bytes = {2 * host}\n"
        f"[tenants.mine]\nuids = [{os.getuid()}]\nhost_bytes = {host}\n"
        f"[tenants.other]\nuids = [{os.getuid() + 1}]\nhost_bytes = {host}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_") and k != "NOTIFY_SOCKET"}
    env["KVD_CONFIG"] = str(path)
    flags = list(daemon_args(disk, disk_bytes=2 * (4096 + 8 * CHUNK)))
    flags[flags.index("--host-bytes") + 1] = str(2 * host)
    d = daemon_factory(*flags, env=env)
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        want = evicted_to_disk(c, ns)
        assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size
        assert all(np.array_equal(a, b) for a, b in zip(hit_bytes(c, ns, 1), want))
        assert c.stats()["disk"]["capacity_bytes"] == 4096 + 8 * CHUNK  # mine's half
    assert sorted(os.listdir(disk)) == ["mine", "other"]
    assert all((disk / t / FILE_NAME).exists() for t in ("mine", "other"))


@pytest.mark.parametrize("policy, kept", [("arc", True), ("lru", False)])
def test_the_policy_decides_what_a_full_disk_keeps(tmp_path, daemon_factory, policy, kept):
    """A prompt read back from disk (used again) and then a stream of prompts used once
    through a disk of 51 pages: ARC, the default, keeps the prompt used again; LRU lets it go."""
    disk = tmp_path / "disk"
    disk.mkdir()
    flags = () if policy == "arc" else ("--disk-policy", policy)
    d = daemon_factory(*daemon_args(disk, disk_bytes=4096 + CHUNK), *flags)
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        evicted_to_disk(c, ns)
        assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size
        evict(c, ns, range(6, 20))  # prompts 2-16 written (1 again: on disk still), 120 pages
        admitted(c, 16 * PAGES)
        s = c.stats()["disk"]
        assert s["pages"] == 51 and s["evicted_pages"] == 16 * PAGES - 51
        assert (settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size) is kept
        assert settled_hit(c, ns, 16) == PAGES * LAYOUT.page_size  # the latest, either way
    assert f"disk tier: {policy.upper()} of 51 pages" in d.log()


def test_min_uses_writes_only_the_pages_used_that_often(tmp_path, daemon_factory):
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk), "--disk-min-uses", "2")
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        want = publish(c, ns, 1)
        hit_bytes(c, ns, 1)  # its second use: an allocation hits it
        evict(c, ns, range(2, 6))  # prompts 1 and 2 leave host memory, 2 after one use
        written(c, PAGES)
        assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size
        assert all(np.array_equal(a, b) for a, b in zip(hit_bytes(c, ns, 1), want))
        assert settled_hit(c, ns, 2) == 0
        s = c.stats()["disk"]
        assert s["written_pages"] == PAGES and s["skipped_pages"] == s["refused_pages"] == 0


def test_the_disk_answers_at_once_and_again_and_before_its_writes_end(tmp_path, daemon_factory):
    """A prompt the disk cannot help is answered 0 at once, however often asked (no pending:
    the remote tier below hears of the miss in the same call, tests/test_remote.py); a prompt evicted
    just now is promoted even while its write may still be on its way (its copy serves it);
    and promoted, evicted and asked again within the fetch recheck delay, it is promoted again."""
    disk = tmp_path / "disk"
    disk.mkdir()
    d = daemon_factory(*daemon_args(disk))
    with KVDClient.connect(d.socket) as c:
        ns = c.register_namespace(MODEL, LAYOUT)
        want = publish(c, ns, 1)
        evict(c, ns, range(2, 5))  # prompt 1 leaves host memory: asked at once, on disk or on its way
        assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size
        assert all(np.array_equal(a, b) for a, b in zip(hit_bytes(c, ns, 1), want))
        written(c, PAGES)
        assert lookup(c, ns, 99).remote_pending_tokens == 0  # nothing of it on disk (a disk to look in)
        assert lookup(c, ns, 99).remote_pending_tokens == 0, "asked again: still nothing to wait for"
        evict(c, ns, range(5, 9))  # prompt 1 leaves host memory again, well within RECHECK
        first = lookup(c, ns, 1)
        assert first.hit_tokens == 0 and first.remote_pending_tokens > 0
        assert settled_hit(c, ns, 1) == PAGES * LAYOUT.page_size
        assert all(np.array_equal(a, b) for a, b in zip(hit_bytes(c, ns, 1), want))
        assert c.check_invariants() == []
