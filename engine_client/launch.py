"""Starting a `kvd serve` child process: for the demo, tests and benchmarks.

Production daemons run under systemd (systemd/kvd.service); this is for programs that
need a private daemon for a while. It runs the daemon as a separate process
(``python -m kvd.cli serve``), so the caller never imports the daemon's modules.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


class DaemonProcess:
    """A running `kvd serve` on ``socket``, logging to ``log_path``."""

    def __init__(self, socket: str, args: tuple[str, ...], log_path: str, env: dict | None = None) -> None:
        self.socket = socket
        self.args = list(args)
        self.log_path = log_path
        self.env = env
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvd.cli", "serve", "--socket", socket, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    @classmethod
    def start(
        cls, socket: str, *args: str, log_path: str, env: dict | None = None, timeout: float = 20.0
    ) -> DaemonProcess:
        """Starts the daemon and returns once it answers calls; kills it and raises otherwise."""
        daemon = cls(socket, args, log_path, env)
        try:
            daemon.wait_ready(timeout)
        except RuntimeError:
            daemon.stop(signal.SIGKILL)
            raise
        return daemon

    def wait_ready(self, timeout: float) -> None:
        from engine_client.client import KVDClient
        from engine_client.types import ErrorCode, KVDError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvd serve exited with {self.process.returncode}:\n{self.log()}")
            if os.path.exists(self.socket):
                try:
                    KVDClient.connect(self.socket, client_name="launcher", timeout=1).close()
                    return
                except KVDError as e:
                    if e.code is ErrorCode.PERMISSION_DENIED:
                        return  # it answers; this uid is just no tenant of it
                except Exception:  # noqa: BLE001 - not accepting calls yet
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"kvd serve did not answer within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def clean(self) -> None:
        """Removes the shared memory the stopped daemon kept for a warm restart (`kvd clean`)."""
        subprocess.run(
            [sys.executable, "-m", "kvd.cli", "clean", "--socket", self.socket],
            capture_output=True,
            check=True,
            env=self.env,
            timeout=60,
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signals the daemon (SIGTERM: graceful) and waits; kills it if it outlives the timeout."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
