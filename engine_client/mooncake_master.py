"""Starting a ``mooncake_master`` on loopback, with its HTTP metadata server: the remote
store that the daemons of a test or benchmark share, as hosts of a fleet would
(tests/test_remote.py, bench/bench_remote.py). Production masters run on their own host."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str:
    """The mooncake_master installed beside this Python (the ``remote`` extra)."""
    found = shutil.which("mooncake_master", path=os.path.dirname(sys.executable)) or shutil.which("mooncake_master")
    assert found, "mooncake_master is not installed: pip install 'kvd-cache[remote]' (make setup does)"
    return found


class MooncakeMaster:
    """One master process; ``kill`` and ``start`` again keep its ports, as a restarted master would."""

    def __init__(self, log_path: str) -> None:
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.admin_port = free_port()  # its metrics/admin server: never the fixed default 9003
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def daemon_args(self, segment_bytes: str = "64MiB") -> tuple[str, ...]:
        """`kvd serve` flags for a daemon that uses this master and lends it ``segment_bytes``."""
        return (
            "--remote-master",
            self.address,
            "--remote-metadata",
            self.metadata,
            "--remote-local-hostname",
            "127.0.0.1",
            "--remote-segment-bytes",
            segment_bytes,
        )

    def start(self, timeout: float = 10.0) -> None:
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [
                    master_binary(),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.rpc_port}",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={self.http_port}",
                    "--enable_metric_reporting=false",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.admin_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mooncake_master exited:\n{open(self.log_path).read()}"
            try:
                for port in (self.rpc_port, self.http_port):
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"mooncake_master did not listen within {timeout} s:\n{open(self.log_path).read()}")

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self.process = None
