"""kvd as an installed service: the unit file, readiness, graceful stop, health, metrics, logs.

Every test runs a real ``kvd serve`` process; the unit-file tests need systemd's tools
and skip without them.
"""

from __future__ import annotations

import ctypes.util
import json
import math
import os
import pathlib
import platform
import resource
import shutil
import signal
import socket as socket_mod
import subprocess
import sys
import threading
import time
import typing
import urllib.request
import uuid

import grpc
import pytest
from conftest import clean_env, remember_socket, start_daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine_client import ErrorCode, KVDClient, KVDError, PageLayout, ResetReport, SequenceRequest, Stats, VerifyReport
from kvd import __version__
from kvd import config as config_mod
from kvd.cache.stats import STAT_FIELDS
from kvd.core.arena import leftover_segments
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.paths import DEFAULT_CONFIG_FILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "kvd.service"
SHIPPED_CONFIG = ROOT / "systemd" / "kvd.toml"
SYSUSERS = ROOT / "systemd" / "kvd.sysusers"

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
PREFIX = list(range(1000, 1016))  # 4 full pages


def shm_prefix(socket: str) -> str:
    return config_mod.ServeConfig(socket=socket).shm_prefix


def ping(socket: str, timeout: float = 2.0) -> None:
    """One Ping on a fresh channel; fails at once (no wait_for_ready) if nothing listens."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        kvd_pb2_grpc.KVDStub(channel).Ping(pb.PingRequest(), timeout=timeout)


def share_prefix(client: KVDClient) -> tuple[int, list[int]]:
    """Engine-like scenario: 'a' prefills and publishes 16 tokens, 'b' reuses them and adds 3.

    9 logical pages (4 + 5), 5 physical (4 shared + b's private tail). Returns the
    namespace and the shared page ids, whose K/V hold their own page id.
    """
    ns = client.register_namespace("tiny", LAYOUT)
    [a] = client.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX)])
    for page in a.private_pages:
        client.page_array(ns, page)[...] = page  # [layers, 2, page_size, kv_heads, head_dim]
    client.publish(ns, ["a"])
    [b] = client.allocate_with_prefix(ns, [SequenceRequest("b", PREFIX + [7, 8, 9])])
    assert b.shared_pages == a.private_pages and len(b.private_pages) == 1
    return ns, b.shared_pages


def spawn(tmp_path, *args: str, env: dict, prefix: list[str] = (), name: str = "kvd"):
    """Starts `kvd serve` without waiting; returns (process, socket, log path)."""
    socket = remember_socket(str(tmp_path / f"{name}.sock"))
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvd.cli", "serve", "--socket", socket, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return process, socket, log_path


def wait_until_answers(process: subprocess.Popen, socket: str, log_path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"kvd serve exited with {process.returncode}:\n{log_path.read_text()}"
        try:
            ping(socket, timeout=1)
            return
        except grpc.RpcError:
            time.sleep(0.01)
    process.kill()
    pytest.fail(f"kvd serve did not answer within {timeout} s:\n{log_path.read_text()}")


def free_port() -> int:
    with socket_mod.socket(socket_mod.AF_INET, socket_mod.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the unit file and its companions ------------------------------------------------


def unit_settings(text: str) -> dict[str, list[str]]:
    """Key → values, in order, of a unit file (comments and sections dropped)."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_file_agrees_with_the_shipped_config_and_user():
    unit = unit_settings(UNIT.read_text())
    one = {k: v[-1] for k, v in unit.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["User"] == one["Group"] == "kvd"
    assert one["Restart"] == "on-failure" and one["KillSignal"] == "SIGTERM"
    assert one["RestartPreventExitStatus"] == "2", "a bad setting (exit code 2) must not restart in a loop"
    assert one["LimitMEMLOCK"] == "infinity"
    assert one["RemoveIPC"] == "no", "RemoveIPC=yes unlinks the extents whenever the unit stops"
    assert "DynamicUser" not in unit, "DynamicUser= implies RemoveIPC=yes"
    assert one["UMask"] == "0007", "extents and socket must stay group read-write"
    assert one["RuntimeDirectoryMode"] == "0750"
    # ExecStart reads the shipped config at the place kvd looks by default.
    exec_start = one["ExecStart"].split()
    assert exec_start[1] == "serve"
    assert exec_start[exec_start.index("--config") + 1] == DEFAULT_CONFIG_FILE
    # The socket lives in the unit's RuntimeDirectory, and the grace period fits in TimeoutStopSec.
    shipped = config_mod.load({}, environ={}, config_file=str(SHIPPED_CONFIG))
    assert os.path.dirname(shipped.socket) == f"/run/{one['RuntimeDirectory']}"
    assert shipped.enable_prefix_reuse
    assert shipped.socket_mode == 0o660
    assert float(one["TimeoutStopSec"].rstrip("s")) > shipped.shutdown_grace_seconds + 5
    # The sysusers file creates the unit's user.
    users = [line.split() for line in SYSUSERS.read_text().splitlines() if line.startswith("u ")]
    assert [u[1] for u in users] == [one["User"]]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    # verify insists that ExecStart's binary exists: point it at this checkout's kvd.
    unit = tmp_path / "kvd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/kvd", f"{sys.executable} -m kvd.cli"))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvd.service" not in result.stderr, result.stderr  # no warnings about our unit


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_file_creates_a_system_user_and_group(tmp_path):
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", "-"],
        input=SYSUSERS.read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    [user] = [line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines() if line.startswith("kvd:")]
    [group] = [line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines() if line.startswith("kvd:")]
    assert user[3] == group[2], "the user's primary group is kvd"
    assert int(user[2]) < 1000, "a system user: logind's RemoveIPC= leaves its shared memory alone"
    assert user[6].endswith("nologin")


# A stand-in for systemd's SystemCallFilter= and MemoryDenyWriteExecute=: the same seccomp
# rules, built with libseccomp from the unit file, then exec of the command.
SECCOMP_EXEC = r"""
import ctypes, ctypes.util, errno, mmap, os, re, subprocess, sys

unit, argv = open(sys.argv[1]).read(), sys.argv[2:]
groups, current = {}, None
listing = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
for line in listing.splitlines():
    if line.startswith("@"):
        current = groups.setdefault(line.split()[0], [])
    elif current is not None and line.strip() and not line.strip().startswith("#"):
        current.append(line.strip())

def expand(names):
    return set().union(*[expand(groups[n]) if n.startswith("@") else {n} for n in names])

class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

ALLOW, EPERM, MASKED_EQ = 0x7FFF0000, 0x00050000 | errno.EPERM, 7
lib = ctypes.CDLL(ctypes.util.find_library("seccomp"))
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add_array.argtypes = [
    ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Cmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]

if re.search(r"^MemoryDenyWriteExecute=yes", unit, re.M):
    ctx = lib.seccomp_init(ALLOW)
    wx, x = mmap.PROT_WRITE | mmap.PROT_EXEC, mmap.PROT_EXEC
    for name, mask in (("mmap", wx), ("mprotect", x), ("pkey_mprotect", x), ("shmat", 0o100000)):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        assert lib.seccomp_rule_add_array(ctx, EPERM, nr, 1, ctypes.byref(Cmp(2, MASKED_EQ, mask, mask))) == 0, name
    assert lib.seccomp_load(ctx) == 0

allowed = None
for value in re.findall(r"^SystemCallFilter=(.*)$", unit, re.M):
    names = expand(value.lstrip("~").split())
    allowed = names if allowed is None else allowed - names if value.startswith("~") else allowed | names
if allowed is not None:
    ctx = lib.seccomp_init(EPERM)
    for name in sorted(allowed):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr >= 0:
            lib.seccomp_rule_add_array(ctx, ALLOW, nr, 0, None)
    assert lib.seccomp_load(ctx) == 0
os.execv(argv[0], argv)
"""


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.skipif(ctypes.util.find_library("seccomp") is None, reason="libseccomp is not installed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux only")
def test_daemon_works_under_the_units_syscall_filter_and_memory_deny_write_execute(tmp_path):
    wrapper = tmp_path / "seccomp_exec.py"
    wrapper.write_text(SECCOMP_EXEC)
    check = subprocess.run(
        [
            sys.executable,
            str(wrapper),
            str(UNIT),
            sys.executable,
            "-c",
            "import mmap\ntry:\n mmap.mmap(-1, 4096, prot=7)\nexcept PermissionError:\n print('denied')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check.returncode != 0:
        pytest.skip(f"cannot install seccomp filters here: {check.stderr.strip()[-300:]}")
    assert check.stdout.strip() == "denied", f"the filter is not in force: {check.stdout}{check.stderr}"

    port = free_port()
    process, socket, log_path = spawn(
        tmp_path,
        "--enable-prefix-reuse",
        "--host-bytes",
        "64MiB",
        "--extent-bytes",
        "4MiB",
        "--metrics-port",
        str(port),
        env=clean_env(tmp_path),
        prefix=[sys.executable, str(wrapper), str(UNIT)],
    )
    try:
        wait_until_answers(process, socket, log_path)
        with KVDClient.connect(socket) as writer, KVDClient.connect(socket) as reader:
            ns, shared = share_prefix(writer)
            assert reader.register_namespace("tiny", LAYOUT) == ns
            [c] = reader.allocate_with_prefix(ns, [SequenceRequest("c", PREFIX)])
            assert c.shared_pages == shared
            assert all((reader.page_array(ns, p) == p).all() for p in shared)  # through shared memory
            assert reader.stats()["physical_pages"] == 5
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                assert b"kvd_logical_pages" in reply.read()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log_path.read_text()
    assert leftover_segments(shm_prefix(socket)), "a graceful stop keeps the extents for a warm restart"
    subprocess.run(
        [sys.executable, "-m", "kvd.cli", "clean", "--socket", socket],
        env=clean_env(tmp_path),
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert leftover_segments(shm_prefix(socket)) == []
    log = log_path.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != 0:  # then EPERM can only come from the filter
        assert "cannot mlock host pages (Operation not permitted)" not in log, "the filter must allow @memlock"


# ---- readiness and stop ----------------------------------------------------------------


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notify_ready_only_once_the_socket_answers_and_stopping_on_sigterm(tmp_path, abstract):
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM) as notify:
        if abstract:
            name = f"kvdtest-notify-{uuid.uuid4().hex}"
            notify.bind("\0" + name)
            address = "@" + name
        else:
            address = str(tmp_path / "notify.sock")
            notify.bind(address)
        notify.settimeout(20)
        process, socket, log_path = spawn(tmp_path, env=clean_env(tmp_path, NOTIFY_SOCKET=address))
        try:
            try:
                message = notify.recv(4096).decode()
            except TimeoutError:
                pytest.fail(f"no READY=1 within 20 s:\n{log_path.read_text()}")
            ping(socket)  # at the moment READY=1 arrives, calls are answered
            fields = dict(line.split("=", 1) for line in message.splitlines())
            assert fields["READY"] == "1", message
            assert fields["MAINPID"] == str(process.pid)
            assert socket in fields["STATUS"]
            process.send_signal(signal.SIGTERM)
            assert notify.recv(4096).decode().splitlines()[0] == "STOPPING=1"
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, log_path.read_text()


def test_sigterm_lets_calls_finish_refuses_new_ones_and_cleans_up(tmp_path):
    daemon = start_daemon(
        tmp_path,
        "--enable-prefix-reuse",
        "--host-bytes",
        "64MiB",
        "--extent-bytes",
        "4MiB",
        env=clean_env(tmp_path, KVD_SHUTDOWN_GRACE_SECONDS="1"),
    )
    prefix = shm_prefix(daemon.socket)
    threads, clients = 8, []
    ok_calls = [0] * threads
    endings: list[BaseException | None] = [None] * threads
    warm = [0]  # engines that completed three rounds; no engine ever waits for another
    warm_lock, all_warm = threading.Lock(), threading.Event()
    deadline = time.monotonic() + 60

    def engine(k: int) -> None:
        """Prefill, write, publish, release in a loop, checking every answer, until refused."""
        client = clients[k]
        ns = client.register_namespace("tiny", LAYOUT)
        i = 0
        try:
            while time.monotonic() < deadline:
                tokens = PREFIX + [k, i, 5, 6, 7]
                [plan] = client.allocate_with_prefix(ns, [SequenceRequest(f"{k}-{i}", tokens)])
                assert plan.num_tokens == len(tokens) and plan.suffix_start == plan.shared_prefix_tokens
                assert len(plan.pages) == math.ceil(len(tokens) / LAYOUT.page_size), plan
                ok_calls[k] += 1
                for page in plan.private_pages:
                    client.page_array(ns, page)[...] = k
                [published] = client.publish(ns, [f"{k}-{i}"])
                assert published.seq_id == f"{k}-{i}" and 0 <= published.published_pages <= 5, published
                ok_calls[k] += 1
                assert client.release(ns, [f"{k}-{i}"]) == len(plan.pages)
                ok_calls[k] += 1
                i += 1
                if i == 3:
                    with warm_lock:
                        warm[0] += 1
                        if warm[0] == threads:
                            all_warm.set()
            endings[k] = TimeoutError("the daemon never refused a call")
        except BaseException as e:  # noqa: BLE001 - every ending is inspected below
            endings[k] = e
            all_warm.set()  # a thread that fails before warming up must not hang the test

    try:
        clients = [KVDClient.connect(daemon.socket, client_name=f"engine-{k}") for k in range(threads)]
        workers = [threading.Thread(target=engine, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        if not all_warm.wait(timeout=60) or any(e is not None for e in endings):
            pytest.fail(f"an engine failed or stalled before the stop: {endings}")
        assert leftover_segments(prefix), "the engines' pages live in shared memory"
        daemon.process.send_signal(signal.SIGTERM)
        for w in workers:
            w.join(timeout=40)
        assert daemon.process.wait(timeout=20) == 0, daemon.log()
    finally:
        for c in clients:
            c.close()
        daemon.stop(signal.SIGKILL)

    # A refused call is UNAVAILABLE (the connection went away, or the grace period ended
    # before grpc dispatched it) or CANCELLED (grpc core drops calls that arrive after the
    # stop began). Either way nothing half-done: every answer that came back was checked.
    refused = {ErrorCode.UNAVAILABLE, ErrorCode.CANCELLED}
    for k, ending in enumerate(endings):
        assert isinstance(ending, KVDError) and ending.code in refused, (k, repr(ending))
        assert ok_calls[k] >= 9
    assert leftover_segments(prefix), "a graceful stop keeps the extents for a warm restart"
    assert not os.path.exists(daemon.socket), "the socket file must be removed"
    daemon.clean()
    assert leftover_segments(prefix) == [], "kvd clean removes what the stop kept"
    log = daemon.log()
    assert "stopping: finishing calls in flight" in log and "INFO kvd.server.daemon: stopped" in log, log
    assert "Traceback" not in log, log
    print(f"\n{sum(ok_calls)} calls answered before the stop; daemon exited 0")


def test_daemon_starts_fast(tmp_path):
    started = time.perf_counter()
    process, socket, log_path = spawn(tmp_path, env=clean_env(tmp_path))
    try:
        wait_until_answers(process, socket, log_path)
        elapsed = time.perf_counter() - started
    finally:
        process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    print(f"\nkvd serve answered a Ping {elapsed * 1e3:.0f} ms after spawn")
    assert elapsed < 3.0


def test_second_daemon_on_the_same_socket_fails_and_leaves_the_first_running(tmp_path):
    first = start_daemon(
        tmp_path, "--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB", env=clean_env(tmp_path)
    )
    try:
        with KVDClient.connect(first.socket) as client:
            ns, shared = share_prefix(client)
            extents = leftover_segments(shm_prefix(first.socket))
            second = subprocess.run(
                [sys.executable, "-m", "kvd.cli", "serve", "--socket", first.socket],
                capture_output=True,
                text=True,
                timeout=30,
                env=clean_env(tmp_path),
            )
            assert second.returncode == 1
            assert f"a daemon already serves {first.socket}" in second.stderr
            assert "Traceback" not in second.stderr, second.stderr
            assert first.process.poll() is None
            assert leftover_segments(shm_prefix(first.socket)) == extents, "the second daemon touched the extents"
            client.ping()
            assert all((client.page_array(ns, p) == p).all() for p in shared)
            assert client.stats()["physical_pages"] == 5
    finally:
        assert first.stop() == 0


# ---- health, reflection, metrics, logs --------------------------------------------------


def test_health_and_reflection_over_the_unix_socket(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvd.v1.KVD"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [listing] = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in listing.list_services_response.service}
        assert {"kvd.v1.KVD", "grpc.health.v1.Health"} <= names
        [symbol] = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvd.v1.KVD")]), timeout=5
        )
        assert symbol.file_descriptor_response.file_descriptor_proto, "kvd.v1.KVD's descriptor is served"


def metric_samples(port: int) -> dict[tuple, float]:
    """(sample name, sorted labels) → value, from one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stat_sample(samples: dict, field: str, namespace: str, model: str = "all") -> float | None:
    """A page statistic's value: a gauge ``kvd_<field>`` or a counter ``kvd_<field>_total``."""
    labels = (("model", model), ("namespace", namespace))
    return samples.get((f"kvd_{field}_total", labels), samples.get((f"kvd_{field}", labels)))


def test_metrics_endpoint_matches_kvd_stats(daemon_factory, tmp_path):
    port = free_port()
    daemon = daemon_factory(
        "--enable-prefix-reuse",
        "--host-bytes",
        "64MiB",
        "--extent-bytes",
        "4MiB",
        "--metrics-port",
        str(port),
        env=clean_env(tmp_path),
    )
    with KVDClient.connect(daemon.socket) as client:
        ns, _ = share_prefix(client)
        stats = json_stats(daemon.socket)
        assert stats["physical_pages"] < stats["logical_pages"]

        expected = {f: stats[f] for f in STAT_FIELDS if f != "sessions"}  # sessions: one unlabelled gauge
        samples = metric_samples(port)  # live values: no snapshot to wait for
        assert {f: stat_sample(samples, f, "all") for f in expected} == expected
        per_ns = {f: stat_sample(samples, f, str(ns), model="tiny") for f in expected}  # labelled by id and model
        assert per_ns == {f: stats["namespaces"][0][f] for f in expected}
        assert (samples[("kvd_host_bytes_used", ())], samples[("kvd_host_bytes_free", ())]) == (
            stats["host_bytes_used"],
            stats["host_bytes_free"],
        )
        assert samples[("kvd_build_info", (("python", platform.python_version()), ("version", __version__)))] == 1
        assert samples[("process_resident_memory_bytes", ())] > 0 and ("process_cpu_seconds_total", ()) in samples
        client.allocate_with_prefix(ns, [SequenceRequest("more", PREFIX + [5, 6])])
        assert stat_sample(metric_samples(port), "sequences", "all") == stats["sequences"] + 1, "live, not a snapshot"
        for state in ("shared", "private", "cached", "pinned", "free"):  # pages by state
            assert stat_sample(samples, f"{state}_pages", "all") is not None
        assert samples[("kvd_sessions", ())] == stats["sessions"] == 1
        assert samples[("kvd_host_budget_bytes", ())] == 64 << 20
        assert samples[("kvd_shm_refusals_total", ())] == stats["shm_refusals"] == 0
        assert samples[("kvd_recovery_recovered_pages", ())] == 0
        assert {
            samples[("kvd_recovery_dropped_pages", (("reason", r),))] for r in stats["recovery"]["dropped_pages"]
        } == {0}
        # Call latency, by method: the scenario made exactly two allocations and one publish.
        assert samples[("kvd_request_seconds_count", (("method", "AllocateWithPrefix"),))] == 2
        assert samples[("kvd_request_seconds_count", (("method", "Publish"),))] == 1
        assert ("kvd_request_seconds_bucket", (("le", "+Inf"), ("method", "AllocateWithPrefix"))) in samples
        assert samples[("kvd_event_loop_stalls_total", ())] == 0


def json_stats(socket: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "stats", "--json", "--socket", socket],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_log_has_one_info_line_per_session_start_and_end_and_none_per_call(daemon):
    with KVDClient.connect(daemon.socket, client_name="log-test") as client:
        ns = client.register_namespace("tiny", LAYOUT)
        calls = 1
        for i in range(33):
            client.allocate_with_prefix(ns, [SequenceRequest(f"s{i}", PREFIX + [i])])
            client.publish(ns, [f"s{i}"])
            client.release(ns, [f"s{i}"])
            calls += 3
        assert calls == 100
        session = client.session
    deadline = time.monotonic() + 10
    while f"session {session[:8]} of log-test closed" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    info = [line for line in daemon.log().splitlines() if " INFO " in line]
    ours = [line for line in info if f"session {session[:8]}" in line]
    assert len(ours) == 2 and "opened by log-test" in ours[0] and "of log-test closed" in ours[1], info
    # Start-up, the fixture's readiness probe session and ours: nothing that grows with calls.
    assert len(info) <= 6, "\n".join(info)


def test_start_up_line_names_version_and_metrics_endpoint(daemon_factory, tmp_path):
    port = free_port()
    plain = daemon_factory(name="plain")
    served = daemon_factory("--metrics-port", str(port), name="metrics")
    assert f"kvd {__version__} serving on {plain.socket}" in plain.log()
    assert "metrics off (--metrics-port)" in plain.log()
    assert f"metrics on http://127.0.0.1:{port}/metrics" in served.log()


CRASHING_CLIENT = """
import os, sys
from engine_client import KVDClient, PageLayout, SequenceRequest
kvd = KVDClient.connect(sys.argv[1], client_name="crasher")
ns = kvd.register_namespace("tiny", PageLayout(2, 2, 8, 4, "float16"))
kvd.allocate_with_prefix(ns, [SequenceRequest("a", list(range(9)))])
print(kvd.session[:8], flush=True)
os._exit(1)  # no close(): as a crash
"""


def test_a_crashed_clients_session_is_logged_apart_from_a_clean_close(daemon):
    with KVDClient.connect(daemon.socket, client_name="tidy") as client:
        tidy = client.session[:8]
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_CLIENT, daemon.socket], capture_output=True, text=True, timeout=60
    )
    crasher = crashed.stdout.strip()
    assert len(crasher) == 8, crashed.stderr
    deadline = time.monotonic() + 10
    while f"session {crasher} of crasher" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = daemon.log().splitlines()
    [tidy_end] = [line for line in lines if f"session {tidy} of tidy" in line]
    [crash_end] = [line for line in lines if f"session {crasher} of crasher" in line]
    assert " INFO " in tidy_end and tidy_end.endswith("closed")
    assert " WARNING " in crash_end and "ended without a close" in crash_end, crash_end
    assert "released 1 sequences and 0 pins" in crash_end


def test_debug_log_level_shows_kvds_own_lines(daemon_factory):
    d = daemon_factory("--log-level", "DEBUG", "--enable-prefix-reuse")
    with KVDClient.connect(d.socket) as client:
        ns = client.register_namespace("tiny", LAYOUT)
        client.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX)])
    debug = [line for line in d.log().splitlines() if " DEBUG kvd." in line]
    assert any("AllocateWithPrefix" in line for line in debug), d.log()


def test_every_core_error_class_maps_to_a_status_through_its_hierarchy():
    """A subclass (shm.ShmFull is a ResourceExhausted) maps like its base, not to a KeyError."""
    import grpc

    from kvd.core import errors
    from kvd.core.shm import ShmFull
    from kvd.server.service import status_for

    assert status_for(ShmFull("/dev/shm is full")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(errors.NotFound("x")) == grpc.StatusCode.NOT_FOUND
    for cls in errors.KVDError.__subclasses__():
        assert isinstance(status_for(cls("x")), grpc.StatusCode), cls


def test_the_client_raises_its_own_error_codes_never_grpc_types(daemon, tmp_path):
    """``KVDError.code`` is an ``ErrorCode`` (gRPC's statuses by name and number, without a
    gRPC type): for a refused call, an admin call and a daemon that is not there alike."""
    import grpc

    from kvd.wire.admin import reset_prefix_cache

    statuses = {s.name: s.value[0] for s in grpc.StatusCode if s is not grpc.StatusCode.OK}
    assert {c.name: c.value for c in ErrorCode} == statuses
    with KVDClient.connect(daemon.socket) as client:
        with pytest.raises(KVDError) as refused:
            client.release(client.register_namespace("tiny", LAYOUT), ["never"])
    with pytest.raises(KVDError) as admin:
        reset_prefix_cache(daemon.socket, 99)
    with pytest.raises(KVDError) as absent:
        KVDClient.connect(str(tmp_path / "nobody.sock"))
    codes = [e.value.code for e in (refused, admin, absent)]
    assert codes == [ErrorCode.NOT_FOUND, ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE], codes
    assert str(refused.value) == f"NOT_FOUND: {refused.value.message}" and "'never'" in refused.value.message
    with pytest.raises(TypeError, match="ErrorCode"):
        KVDError(grpc.StatusCode.NOT_FOUND, "a code of the old API")


def _check_typed(value: dict, declared: type, where: str) -> None:
    """``value`` holds the keys the typed dict ``declared`` names (optional ones may be
    missing) and no other, each of its declared type; nested typed dicts and lists (of
    them, or of plain values) too."""
    hints = typing.get_type_hints(declared)
    assert declared.__required_keys__ <= value.keys() <= hints.keys(), (where, set(value) ^ set(hints))
    for key, item in value.items():
        hint = hints[key]
        if typing.is_typeddict(hint):
            _check_typed(item, hint, f"{where}.{key}")
        elif typing.get_origin(hint) is list:
            [element] = typing.get_args(hint)
            for i, each in enumerate(item):
                if typing.is_typeddict(element):
                    _check_typed(each, element, f"{where}.{key}[{i}]")
                else:
                    assert isinstance(each, element), (where, key, i, each)
        else:
            assert isinstance(item, typing.get_origin(hint) or hint), (where, key, item)


def test_stats_verify_and_reset_answer_the_typed_dicts_they_declare(daemon):
    """Every field the daemon sends is declared (kvd/wire/reports.py), with its type: a
    field added to the wire and not to the declarations fails here."""
    from kvd.wire.admin import fetch_stats

    with KVDClient.connect(daemon.socket) as client:
        ns = client.register_namespace("tiny", LAYOUT)
        client.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX)])
        stats = client.stats()
        assert len(stats["namespaces"]) == 1 and stats["remote"]["state"] == "off"
        _check_typed(stats, Stats, "stats()")
        _check_typed(fetch_stats(daemon.socket), Stats, "fetch_stats")
        _check_typed(client.verify_pages(), VerifyReport, "verify_pages()")
        _check_typed(client.reset_prefix_cache(ns), ResetReport, "reset_prefix_cache()")
