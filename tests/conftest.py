"""Shared fixtures: a real daemon process, a real core over real shared memory."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from kvd.arena import Arena, leftover_segments
from kvd.manager import KVCacheManager
from kvd.namespaces import NamespaceIdentity, make_layout

_counter = itertools.count()


def unique_prefix() -> str:
    return f"/kvdtest-{os.getpid()}-{next(_counter)}"


@pytest.fixture
def make_manager():
    """Builds KVCacheManagers over real shared memory; closes and unlinks them after the test."""
    made: list[KVCacheManager] = []

    def make(budget_bytes: int = 16 << 20, extent_bytes: int = 1 << 20, prefix_reuse: bool = True) -> KVCacheManager:
        arena = Arena(budget_bytes, extent_bytes, unique_prefix(), lock_memory=False)
        manager = KVCacheManager(arena, prefix_reuse=prefix_reuse)
        made.append(manager)
        return manager

    yield make
    for m in made:
        prefix = m.arena.name_prefix
        m.close()
        assert leftover_segments(prefix) == [], f"extents of {prefix} leaked"


def identity(model: str = "tiny", num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8,
             page_size: int = 4, dtype: str = "float16", **kw) -> NamespaceIdentity:
    return NamespaceIdentity(model, make_layout(num_layers, num_kv_heads, head_dim, page_size, dtype), **kw)


@dataclass
class Daemon:
    """A running `kvd serve` process."""

    socket: str
    process: subprocess.Popen
    log_path: str
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def start_daemon(tmp_path, *args: str, env: dict | None = None, name: str = "kvd") -> Daemon:
    """Starts `kvd serve` on a fresh socket under tmp_path and waits until it answers."""
    from engine_client import KVDClient
    socket = str(tmp_path / f"{name}.sock")
    log_path = str(tmp_path / f"{name}.log")
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--socket", socket, *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    daemon = Daemon(socket, process, log_path, list(args))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvd serve exited with {process.returncode}:\n{daemon.log()}")
        if os.path.exists(socket):
            try:
                KVDClient.connect(socket, timeout=1).close()
                return daemon
            except Exception:
                pass
        time.sleep(0.05)
    daemon.stop(signal.SIGKILL)
    raise RuntimeError(f"kvd serve did not answer within 20 s:\n{daemon.log()}")


@pytest.fixture
def daemon_factory(tmp_path):
    """Starts daemons with the given flags; stops each (SIGTERM) after the test."""
    started: list[Daemon] = []

    def start(*args: str, env: dict | None = None, name: str = "kvd") -> Daemon:
        d = start_daemon(tmp_path, *args, env=env, name=name)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    """A daemon with prefix reuse on and a 64 MiB budget."""
    return daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
