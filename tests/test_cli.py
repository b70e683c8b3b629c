"""The operator's command line against real daemons: stats, clean, and configuration.

Configuration precedence is built-in defaults < TOML file < KVD_* variables < flags; a
bad setting makes ``kvd serve`` exit 2 with one line naming the setting and its source.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket as socket_mod
import subprocess
import sys
import threading
import time

import pytest
from conftest import clean_env, start_daemon

from engine_client import KVDClient, PageLayout, SequenceRequest
from kvd import config as config_mod
from kvd.cache.stats import STAT_FIELDS
from kvd.core.arena import leftover_segments

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = ROOT / "systemd" / "kvd.toml"

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
PAGE_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # layers * (K, V) * page_size * kv_heads * head_dim * float16
PREFIX = list(range(1000, 1016))  # 4 full pages
SMALL = ("--host-bytes", "64MiB", "--extent-bytes", "4MiB")


def kvd(*args: str, env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def stats_json(socket: str, env: dict, *args: str) -> dict:
    result = kvd("stats", "--json", "--socket", socket, *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def shm_prefix(socket: str) -> str:
    return config_mod.ServeConfig(socket=socket).shm_prefix


def share_prefix(client: KVDClient) -> int:
    """'a' prefills and publishes 16 tokens, 'b' reuses them and adds 3: 9 logical pages, 5 physical."""
    ns = client.register_namespace("tiny", LAYOUT)
    [a] = client.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX)])
    client.publish(ns, ["a"])
    [b] = client.allocate_with_prefix(ns, [SequenceRequest("b", PREFIX + [7, 8, 9])])
    assert b.shared_pages == a.private_pages and len(b.private_pages) == 1
    return ns


# ---- kvd stats -------------------------------------------------------------------------


def test_stats_json_fields_and_values(tmp_path):
    env = clean_env(tmp_path)
    daemon = start_daemon(tmp_path, "--enable-prefix-reuse", *SMALL, env=env)
    try:
        fresh = stats_json(daemon.socket, env)  # no extent yet: the whole budget is free
        assert (fresh["free_pages"], fresh["host_bytes_used"], fresh["host_bytes_free"]) == (0, 0, 64 << 20)
        with KVDClient.connect(daemon.socket) as client:
            ns = share_prefix(client)
            stats = stats_json(daemon.socket, env)
            assert set(stats) == {
                *STAT_FIELDS,
                "host_bytes",
                "host_bytes_used",
                "host_bytes_free",
                "arena_bytes",
                "prefix_reuse",
                "namespaces",
                "shm_refusals",
                "recovery",
                "aux_bytes",
                "aux_bytes_used",
                "aux_bytes_per_sequence",
                "remote",
                "disk",
            }
            assert stats["remote"]["state"] == "off"  # no [remote] table
            assert stats["disk"]["state"] == "off" and stats["disk"]["pages"] == 0  # no [disk] table
            assert (stats["aux_bytes"], stats["aux_bytes_used"], stats["aux_bytes_per_sequence"]) == (
                256 << 20,
                0,
                16 << 20,
            )
            assert stats["host_bytes_used"] == 5 * PAGE_BYTES  # 4 shared + 1 private page
            assert stats["host_bytes_free"] == (64 << 20) - stats["arena_bytes"] + stats["free_pages"] * PAGE_BYTES
            assert stats["shm_refusals"] == 0
            assert stats["recovery"]["recovered_pages"] == 0 and stats["recovery"]["discarded"] == ""
            assert stats["recovery"]["dropped_pages"] == {
                "corrupted": 0,
                "orphaned": 0,
                "mismatch": 0,
                "incomplete_extent": 0,
                "evicted": 0,
            }
            [entry] = stats["namespaces"]
            assert set(entry) == {*STAT_FIELDS, "namespace_id", "model", "page_bytes"}
            assert (entry["namespace_id"], entry["model"], entry["page_bytes"]) == (ns, "tiny", PAGE_BYTES)
            expected = {
                "logical_pages": 9,
                "physical_pages": 5,
                "shared_pages": 4,
                "private_pages": 1,
                "cached_pages": 0,
                "pinned_pages": 0,
                "host_pages_saved": 4,
                "host_bytes_saved": 4 * PAGE_BYTES,
                "refcount_increments": 9,
                "refcount_decrements": 0,
                "lookup_tokens": 16 + 19,
                "hit_tokens": 16,
                "evicted_pages": 0,
                "corrupted_pages": 0,
                "sessions": 1,
                "sequences": 2,
            }
            for view in (stats, entry):
                assert {f: view[f] for f in expected} == expected
                assert 0 < view["free_pages"] <= stats["arena_bytes"] // PAGE_BYTES - 5
            assert (stats["host_bytes"], stats["prefix_reuse"]) == (64 << 20, True)

            # Both released, the prefix pinned: shared pages stay, held by the pin alone;
            # unpinned they become cached (evictable, still indexed).
            pin = client.pin(ns, PREFIX)
            client.release(ns, ["a", "b"])
            stats = stats_json(daemon.socket, env)
            assert {
                f: stats[f]
                for f in (
                    "logical_pages",
                    "physical_pages",
                    "sequences",
                    "pinned_pages",
                    "shared_pages",
                    "private_pages",
                )
            } == {
                "logical_pages": 0,
                "physical_pages": 0,
                "sequences": 0,
                "pinned_pages": 4,
                "shared_pages": 4,
                "private_pages": 0,
            }
            client.unpin(pin.pin_id)
            stats = stats_json(daemon.socket, env)
            assert (stats["cached_pages"], stats["shared_pages"], stats["pinned_pages"]) == (4, 0, 0)
    finally:
        assert daemon.stop() == 0


def table_rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.split()[:1] != []}


def test_stats_table_and_watch(tmp_path):
    env = clean_env(tmp_path)
    daemon = start_daemon(tmp_path, "--enable-prefix-reuse", *SMALL, env=env)
    watcher = None
    try:
        with KVDClient.connect(daemon.socket) as client:
            ns = share_prefix(client)
            table = kvd("stats", "--socket", daemon.socket, env=env)
            assert table.returncode == 0, table.stderr
            lines = table.stdout.splitlines()
            assert lines[0].split() == ["total", "ns", str(ns), "tiny"]
            rows = table_rows(table.stdout)
            for field in STAT_FIELDS:
                assert len(rows[field]) == 2, f"{field}: a total and one namespace column"
            assert rows["logical_pages"] == ["9", "9"] and rows["physical_pages"] == ["5", "5"]
            assert rows["host_bytes_saved"] == [f"{4 * PAGE_BYTES:,}"] * 2
            assert "prefix reuse on" in lines[-2] and f"host budget {64 << 20:,} bytes" in lines[-2]
            assert lines[-1].startswith("last start: recovered 0 published pages")

            # --watch redraws the table: two frames, then a change shows up in a later one.
            watcher = subprocess.Popen(
                [sys.executable, "-m", "kvd.cli", "stats", "--watch", "0.2", "--socket", daemon.socket],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            frames: list[str] = []  # complete tables; a frame ends where the next one starts
            buffer: list[str] = []

            def read_frames() -> None:
                for line in watcher.stdout:
                    if line.startswith("\033[2J\033[H"):
                        if buffer:
                            frames.append("".join(buffer))
                        buffer[:] = [line[len("\033[2J\033[H") :]]
                    else:
                        buffer.append(line)

            reader = threading.Thread(target=read_frames, daemon=True)
            reader.start()
            deadline = time.monotonic() + 10
            while len(frames) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(frames) >= 2, "no two refreshes within 10 s"
            assert table_rows(frames[0])["sequences"] == ["2", "2"]
            client.allocate_with_prefix(ns, [SequenceRequest("c", PREFIX)])
            seen = len(frames)
            while time.monotonic() < deadline and not any(
                table_rows(f)["sequences"] == ["3", "3"] for f in frames[seen:]
            ):
                time.sleep(0.05)
            assert any(table_rows(f)["sequences"] == ["3", "3"] for f in frames[seen:]), frames[-1]
    finally:
        if watcher is not None:
            watcher.kill()
            watcher.wait(timeout=10)
        assert daemon.stop() == 0


def test_stats_without_a_daemon_says_so(tmp_path):
    env = clean_env(tmp_path)
    socket = str(tmp_path / "nobody.sock")
    result = kvd("stats", "--socket", socket, env=env)
    assert result.returncode == 1
    assert f"no answer from the daemon on {socket}" in result.stderr and "Traceback" not in result.stderr
    result = kvd("stats", "--watch", "0", "--socket", socket, env=env)
    assert result.returncode == 2 and "--watch" in result.stderr


def test_stats_piped_into_a_reader_that_stops_ends_quietly(tmp_path):
    """`kvd stats --watch | head` and `--json --watch`: one JSON object per line, no
    BrokenPipeError when the reader goes away, exit 0."""
    env = clean_env(tmp_path)
    daemon = start_daemon(tmp_path, *SMALL, env=env)
    try:
        for args, lines in ((["--json"], 2), ([], 3)):
            watcher = subprocess.Popen(
                [sys.executable, "-m", "kvd.cli", "stats", *args, "--watch", "0.05", "--socket", daemon.socket],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            read = [watcher.stdout.readline() for _ in range(lines)]
            watcher.stdout.close()  # what `head` does once it has its lines
            assert watcher.wait(timeout=30) == 0
            stderr = watcher.stderr.read()
            assert stderr == "", stderr
            if args:
                for line in read:
                    assert json.loads(line)["sessions"] == 0  # one whole object per line
    finally:
        assert daemon.stop() == 0


# ---- usage, version and exit codes ---------------------------------------------------


def test_version_is_the_packages():
    import kvd as kvd_package

    result = kvd("--version", env=dict(os.environ))
    assert (result.returncode, result.stdout.strip()) == (0, f"kvd {kvd_package.__version__}")


@pytest.mark.parametrize("command", ["serve", "stats", "verify", "clean"])
def test_an_unknown_option_prints_the_subcommands_usage_and_exits_2(tmp_path, command):
    result = kvd(command, "--bogus", env=clean_env(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith(f"usage: kvd {command} ") and "unrecognized arguments: --bogus" in result.stderr


def test_serve_never_creates_the_socket_directory(tmp_path):
    socket = tmp_path / "a" / "typo" / "kvd.sock"
    result = kvd("serve", "--socket", str(socket), env=clean_env(tmp_path))
    assert result.returncode == 2, result.stderr
    assert f"directory {socket.parent} does not exist" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "a").exists()


def test_no_daemon_is_a_runtime_failure_exit_1(tmp_path):
    """1 for every subcommand that finds no daemon; the unit's Restart=on-failure reads it so."""
    env = clean_env(tmp_path)
    socket = str(tmp_path / "nobody.sock")
    for command in ("stats", "verify"):
        result = kvd(command, "--socket", socket, env=env)
        assert result.returncode == 1, (command, result.stderr)
        assert f"no answer from the daemon on {socket}" in result.stderr and "Traceback" not in result.stderr


# ---- kvd clean ---------------------------------------------------------------------------


def test_clean_refuses_while_running_and_removes_what_a_killed_daemon_left(tmp_path):
    env = clean_env(tmp_path)
    daemon = start_daemon(tmp_path, "--enable-prefix-reuse", *SMALL, env=env)
    prefix = shm_prefix(daemon.socket)
    try:
        with KVDClient.connect(daemon.socket) as client:
            for model, layout in (("tiny", LAYOUT), ("other", PageLayout(1, 1, 16, 4, "float32"))):
                ns = client.register_namespace(model, layout)
                client.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX)])  # its extent exists now
            extents = leftover_segments(prefix)
            assert len(extents) >= 2
            refused = kvd("clean", "--socket", daemon.socket, env=env)
            assert refused.returncode == 1
            assert f"a daemon is running on {daemon.socket}; stop it first" in refused.stderr
            assert leftover_segments(prefix) == extents and daemon.process.poll() is None
            client.ping()
    finally:
        daemon.stop(signal.SIGKILL)
    assert leftover_segments(prefix) == extents, "SIGKILL leaves the extents in /dev/shm"
    assert os.path.exists(daemon.socket), "and the socket file"

    cleaned = kvd("clean", "--socket", daemon.socket, env=env)
    assert cleaned.returncode == 0, cleaned.stderr
    assert cleaned.stdout.strip() == f"removed {len(extents)} shared-memory extents of {daemon.socket}"
    assert leftover_segments(prefix) == []
    assert not os.path.exists(daemon.socket)
    again = kvd("clean", "--socket", daemon.socket, env=env)
    assert again.returncode == 0 and again.stdout.startswith("removed 0 ")


# ---- configuration -----------------------------------------------------------------------


def write_config(tmp_path, text: str, name: str = "kvd.toml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "layers, host_bytes, prefix_reuse",
    [
        ("file", 32 << 20, True),
        ("file+env", 48 << 20, False),
        ("file+env+flag", 16 << 20, True),
        ("KVD_CONFIG+flag", 32 << 20, False),
    ],
)
def test_precedence_defaults_file_env_flags(tmp_path, layers, host_bytes, prefix_reuse):
    socket = str(tmp_path / "kvd.sock")
    config = write_config(tmp_path, f'socket = "{socket}"\nhost_bytes = "32MiB"\nenable_prefix_reuse = true\n')
    env, args = clean_env(tmp_path), ["--config", str(config)]
    if "env" in layers:
        env.update(KVD_HOST_BYTES="48MiB", KVD_ENABLE_PREFIX_REUSE="off")
    if "flag" in layers:
        args += ["--host-bytes", "16MiB", "--enable-prefix-reuse"]
    if layers == "KVD_CONFIG+flag":
        env["KVD_CONFIG"], args = str(config), ["--no-enable-prefix-reuse"]
    daemon = start_daemon(tmp_path, *args, "--extent-bytes", "1MiB", env=env)
    try:
        # `kvd stats` finds the daemon through the same file, without --socket.
        result = kvd("stats", "--json", "--config", str(config), env=clean_env(tmp_path))
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)
        assert (stats["host_bytes"], stats["prefix_reuse"]) == (host_bytes, prefix_reuse)
        assert f"prefix reuse {'on' if prefix_reuse else 'off'}" in daemon.log()
    finally:
        assert daemon.stop() == 0


def test_shipped_config_turns_prefix_reuse_on(tmp_path):
    env = clean_env(tmp_path)
    daemon = start_daemon(tmp_path, "--config", str(SHIPPED_CONFIG), *SMALL, env=env)
    try:
        with KVDClient.connect(daemon.socket) as client:
            assert client.prefix_reuse
            share_prefix(client)
            stats = stats_json(daemon.socket, env)
            assert stats["prefix_reuse"] and stats["physical_pages"] < stats["logical_pages"]
    finally:
        assert daemon.stop() == 0


BAD_SETTINGS = {
    "unknown key": ({"file": 'hots_bytes = "1GiB"\n'}, ["unknown setting 'hots_bytes'", "kvd.toml"]),
    "not TOML": ({"file": "host_bytes = 8GiB\n"}, ["is not valid TOML"]),
    "size in file": ({"file": 'host_bytes = "lots"\n'}, ["host_bytes", "'lots'", "kvd.toml"]),
    "size in env": ({"env": {"KVD_HOST_BYTES": "-1"}}, ["host_bytes", "from KVD_HOST_BYTES"]),
    "size flag": ({"args": ["--host-bytes", "0"]}, ["host_bytes: must be positive", "from --host-bytes"]),
    "bool in env": (
        {"env": {"KVD_ENABLE_PREFIX_REUSE": "maybe"}},
        ["expected true or false", "KVD_ENABLE_PREFIX_REUSE"],
    ),
    "bool in file": ({"file": 'enable_prefix_reuse = "sometimes"\n'}, ["enable_prefix_reuse", "kvd.toml"]),
    "int in file": ({"file": 'metrics_port = "abc"\n'}, ["metrics_port: cannot use 'abc'", "kvd.toml"]),
    "port range": ({"args": ["--metrics-port", "70000"]}, ["metrics_port", "from --metrics-port"]),
    "log level": ({"file": 'log_level = "LOUD"\n'}, ["log_level", "'LOUD'", "kvd.toml"]),
    "socket mode": ({"env": {"KVD_SOCKET_MODE": "0999"}}, ["socket_mode", "KVD_SOCKET_MODE"]),
    "long socket": ({"args": ["--socket", "/tmp/" + "s" * 120]}, ["socket", "107 bytes"]),
    "aux per sequence over the budget": (
        {"args": ["--aux-bytes", "1MiB", "--aux-bytes-per-sequence", "2MiB"]},
        ["aux_bytes_per_sequence", "set it to at most 1048576"],
    ),
    "missing file": ({"config": "missing.toml"}, ["cannot read config file", "missing.toml"]),
    "flag syntax": ({"args": ["--metrics-port", "abc"]}, ["invalid int value: 'abc'"]),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_bad_settings_stop_serve_with_exit_code_2_and_a_clear_message(tmp_path, case):
    given, fragments = BAD_SETTINGS[case]
    env = clean_env(tmp_path, **given.get("env", {}))
    config = write_config(tmp_path, given.get("file", ""))
    config = tmp_path / given.get("config", config.name)
    socket = str(tmp_path / "kvd.sock")
    result = kvd("serve", "--socket", socket, "--config", str(config), *given.get("args", []), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert not os.path.exists(socket)


def test_busy_metrics_port_stops_serve_with_a_message_and_nothing_left(tmp_path):
    env = clean_env(tmp_path)
    socket = str(tmp_path / "kvd.sock")
    with socket_mod.socket(socket_mod.AF_INET, socket_mod.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = kvd("serve", "--socket", socket, "--metrics-port", str(port), env=env)
    assert result.returncode == 1, result.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr
    assert not os.path.exists(socket) and leftover_segments(shm_prefix(socket)) == []
