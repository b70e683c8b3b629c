"""Shared fixtures: a real daemon process, a real core over real shared memory."""

from __future__ import annotations

import itertools
import os
import time

import pytest

from engine_client.launch import DaemonProcess
from kvd.cache.manager import KVCacheManager
from kvd.config import ServeConfig
from kvd.core.arena import SHM_DIR, Arena, leftover_segments, unlink_segments
from kvd.core.namespaces import NamespaceIdentity, make_layout
from kvd.core.records import HEADER_BYTES, record_size
from kvd.core.types import SequenceState
from kvd.server.daemon import socket_answers

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


def allocate_in_steps(m: KVCacheManager, session_id: str, namespace_id: int, requests):
    """``m.allocate`` as the daemon runs it (kvd/cache/allocation.py): the job's room made in
    steps (extents built ahead awaited), then committed."""
    m.sessions.get(session_id)
    with m.allocation(session_id, m.batch(namespace_id, requests)) as job:
        for build in job.steps():
            if build is not None:
                build.result()
        return job.commit()


def budget_for(pages: int, page_bytes: int, page_size: int, extents: int = 1) -> int:
    """The host budget ``pages`` pages in ``extents`` extents take: their data and their
    metadata records and headers, as the arena counts them (kvd/core/arena.py)."""
    return pages * (page_bytes + record_size(page_size)) + extents * HEADER_BYTES


def wait_until(predicate, what: str, timeout: float = 2.0, detail=None):
    """Polls ``predicate`` until it returns something truthy (returned); fails the test after
    ``timeout``, with what ``detail()`` says then (state to read a rare failure by)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout} s" + (f"\n{detail()}" if detail else ""))
        time.sleep(0.005)


def vm_kib(pid: int, field: str) -> int:
    """A memory figure of a process from /proc/<pid>/status (VmRSS, VmHWM, ...), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


# The set_state calls that take a PREFILLED sequence to each state; EVICTED then needs
# memory pressure on the ON_HOLD sequence, which only the daemon applies.
STATE_STEPS: dict[SequenceState, list[SequenceState]] = {
    SequenceState.PREFILLED: [],
    SequenceState.IN_DECODE: [SequenceState.IN_DECODE],
    SequenceState.ON_HOLD: [SequenceState.ON_HOLD],
    SequenceState.EVICTED: [SequenceState.ON_HOLD],
    SequenceState.COMPLETED: [SequenceState.COMPLETED],
}


def clean_env(tmp_path, **extra: str) -> dict:
    """The test's environment without KVD_* settings or a systemd notify socket, and with
    an empty config file, so a kvd installed on this host cannot change the daemon."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_") and k != "NOTIFY_SOCKET"}
    empty = tmp_path / "empty.toml"
    empty.touch()
    env["KVD_CONFIG"] = str(empty)
    env.update(extra)
    return env


def identity(
    model: str = "tiny",
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    page_size: int = 4,
    dtype: str = "float16",
    **kw,
) -> NamespaceIdentity:
    return NamespaceIdentity(model, make_layout(num_layers, num_kv_heads, head_dim, page_size, dtype), **kw)


# Sockets of every daemon the tests started: a graceful stop keeps their shared memory
# for a warm restart, so the tests remove it (remove_shared_memory) once they are stopped.
_SOCKETS: set[str] = set()


def remember_socket(socket: str) -> str:
    _SOCKETS.add(socket)
    return socket


def remove_shared_memory(socket: str) -> None:
    """Unlinks every segment of the stopped daemon on ``socket`` (tenants' too), like `kvd clean`."""
    base = ServeConfig(socket=socket).shm_prefix.lstrip("/") + "-"
    unlink_segments(["/" + n for n in os.listdir(SHM_DIR) if n.startswith(base)])


@pytest.fixture(scope="session", autouse=True)
def _remove_test_daemons_shared_memory():
    yield
    for socket in _SOCKETS:
        if not socket_answers(socket):
            remove_shared_memory(socket)


def start_daemon(tmp_path, *args: str, env: dict | None = None, name: str = "kvd") -> DaemonProcess:
    """Starts `kvd serve` on a fresh socket under tmp_path and waits until it answers."""
    socket = remember_socket(str(tmp_path / f"{name}.sock"))
    return DaemonProcess.start(socket, *args, log_path=str(tmp_path / f"{name}.log"), env=env)


def stop_cleanly(d: DaemonProcess) -> None:
    """Stops a daemon a module shared; it must have lived, exited 0 and logged no exception."""
    alive = d.process.poll() is None
    rc = d.stop()
    log = d.log()
    assert alive, f"the daemon died during the module:\n{log}"
    assert rc == 0, f"kvd serve exited with {rc}:\n{log}"
    assert "Traceback" not in log, f"the daemon logged an exception:\n{log}"


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
    for d in started:
        remove_shared_memory(d.socket)  # what a graceful stop keeps for a warm restart


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A daemon with prefix reuse on and a 64 MiB budget."""
    return daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")


def raw_page(client, ns: int, page: int):
    """A writable numpy view of any page, past the client's read-only views of published
    pages: what a bit flip in /dev/shm or a process writing the segment directly changes.
    For integrity tests only."""
    client.page_array(ns, page)  # maps its extent
    extent = next(e for e in client.mapped_extents(ns) if e.first_page <= page < e.first_page + e.num_pages)
    return extent.array[page - extent.first_page]
