"""Finding the daemon: daemon, CLI and client follow one order (kvd/wire/paths.py) and meet.

Real `kvd serve` and `kvd stats` processes and a real client; only the environment and
config file differ between the cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import clean_env, remember_socket, remove_shared_memory

from engine_client import ErrorCode, KVDClient, KVDError
from kvd.wire.paths import SYSTEM_SOCKET, find_socket, user_socket

CLIENT = """
from engine_client import KVDClient
with KVDClient.connect() as kvd:
    print(kvd.stats()["sessions"])
"""


def serve(env: dict, socket: str, tmp_path) -> subprocess.Popen:
    """`kvd serve` with no --socket; returns once ``socket`` accepts calls."""
    remember_socket(socket)
    log = open(tmp_path / "serve.log", "w")
    daemon = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not os.path.exists(socket):
        assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
        time.sleep(0.05)
    return daemon


def stop(daemon: subprocess.Popen, socket: str) -> None:
    daemon.terminate()
    assert daemon.wait(timeout=15) == 0
    remove_shared_memory(socket)


@pytest.mark.parametrize("where", ["KVD_SOCKET", "config file"])
def test_daemon_cli_and_client_meet_without_a_socket_flag(tmp_path, where):
    socket = str(tmp_path / "found.sock")
    if where == "KVD_SOCKET":
        env = clean_env(tmp_path, KVD_SOCKET=socket)
    else:
        config = tmp_path / "kvd.toml"
        config.write_text(f'socket = "{socket}"\n')
        env = clean_env(tmp_path, KVD_CONFIG=str(config))
    daemon = serve(env, socket, tmp_path)
    try:
        stats = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "stats", "--json"], env=env, capture_output=True, text=True, timeout=30
        )
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["sessions"] == 0
        client = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=60)
        assert (client.returncode, client.stdout.strip()) == (0, "1"), client.stderr
    finally:
        stop(daemon, socket)


def test_the_order_flag_env_config_then_defaults(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text('socket = "/from/config.sock"\n')
    env = {"KVD_SOCKET": "/from/env.sock", "KVD_CONFIG": str(config)}
    assert find_socket("/from/flag.sock", env).path == "/from/flag.sock"
    assert find_socket(None, env).path == "/from/env.sock"
    assert find_socket(None, {"KVD_CONFIG": str(config)}).path == "/from/config.sock"
    empty = tmp_path / "empty.toml"
    empty.touch()
    fallback = find_socket(None, {"KVD_CONFIG": str(empty)})
    assert fallback.path == (SYSTEM_SOCKET if os.path.exists(SYSTEM_SOCKET) else user_socket())
    assert any(str(empty) in step for step in fallback.tried)


def test_connect_without_a_daemon_fails_at_once_naming_what_it_tried(tmp_path, monkeypatch):
    missing = str(tmp_path / "missing.sock")
    monkeypatch.setenv("KVD_SOCKET", missing)
    started = time.monotonic()
    with pytest.raises(KVDError) as e:
        KVDClient.connect(timeout=10)
    assert time.monotonic() - started < 1.0, "not after the whole timeout"
    assert e.value.code == ErrorCode.UNAVAILABLE
    assert f"no kvd daemon on {missing}: the socket does not exist" in e.value.message
    assert f"KVD_SOCKET={missing}" in e.value.message and "no socket argument" in e.value.message

    stale = tmp_path / "stale.sock"  # a socket file nobody listens on, as a killed daemon leaves
    import socket as socket_mod

    with socket_mod.socket(socket_mod.AF_UNIX) as s:
        s.bind(str(stale))
    started = time.monotonic()
    with pytest.raises(KVDError, match="nothing listens there"):
        KVDClient.connect(str(stale), timeout=10)
    assert time.monotonic() - started < 1.0
