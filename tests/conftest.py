"""Shared fixtures: a real daemon process, a real core over real shared memory."""
from __future__ import annotations

import itertools
import os

import pytest

from engine_client.launch import DaemonProcess
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


def start_daemon(tmp_path, *args: str, env: dict | None = None, name: str = "kvd") -> DaemonProcess:
    """Starts `kvd serve` on a fresh socket under tmp_path and waits until it answers."""
    return DaemonProcess.start(str(tmp_path / f"{name}.sock"), *args, log_path=str(tmp_path / f"{name}.log"), env=env)


@pytest.fixture
def daemon_factory(tmp_path):
    """Starts daemons with the given flags; stops each (SIGTERM) after the test."""
    started: list[DaemonProcess] = []

    def start(*args: str, env: dict | None = None, name: str = "kvd") -> DaemonProcess:
        d = start_daemon(tmp_path, *args, env=env, name=name)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A daemon with prefix reuse on and a 64 MiB budget."""
    return daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
