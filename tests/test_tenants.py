"""Tenant isolation: config parsing, the ticket handshake, routing, and isolation between
two real OS users (root only; skipped elsewhere with the reason)."""

from __future__ import annotations

import errno
import functools
import grp
import json
import os
import pathlib
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import grpc
import pytest
from conftest import start_daemon
from test_service import free_port, metric_samples

from engine_client import ErrorCode, KVDClient, KVDError, PageLayout, SequenceRequest
from kvd import config as config_mod
from kvd.cache.tenants import IMPLICIT, Peer, Tenants, TicketBook, tenant_prefix
from kvd.config import ConfigError
from kvd.core.errors import NotFound, PermissionDenied
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.admin import fetch_stats, prewarm, reset_prefix_cache
from kvd.wire.auth import admit, fetch_ticket
from kvd.wire.paths import auth_socket, tenant_socket

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")  # 512-byte pages
PREFIX = list(range(1000, 1016))  # 4 full pages
TINY = pb.NamespaceIdentity(  # the identity register_namespace("tiny", LAYOUT) registers
    model="tiny", layout=pb.PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
)
OTHER_UID = 4_000_000 + os.getuid() % 1000  # a uid no process of this test runs as


def load_toml(tmp_path, text: str, **flags) -> config_mod.ServeConfig:
    path = tmp_path / "kvd.toml"
    path.write_text(textwrap.dedent(text))
    return config_mod.load(flags, environ={}, config_file=str(path))


# ---- configuration -------------------------------------------------------------------


def test_tenants_parse(tmp_path):
    root_group = grp.getgrgid(0).gr_name
    cfg = load_toml(
        tmp_path,
        f"""
        host_bytes = "4GiB"
        [tenants.alpha]
        uids = [1001, 1002]
        host_bytes = "2GiB"
        group = "{root_group}"
        [tenants.beta]
        gids = [2001]
        host_bytes = 1000000
    """,
    )
    alpha, beta = cfg.tenants
    assert (alpha.name, alpha.uids, alpha.gids, alpha.host_bytes, alpha.group) == (
        "alpha",
        (1001, 1002),
        (),
        2 << 30,
        0,
    )
    assert (beta.name, beta.uids, beta.gids, beta.host_bytes, beta.group) == ("beta", (), (2001,), 1000000, None)
    assert load_toml(tmp_path, "host_bytes = '1GiB'").tenants == ()


@pytest.mark.parametrize(
    "text, message",
    [
        ("[tenants.a]\nuids = [1]\n", "tenants.a: host_bytes (the tenant's budget"),
        ("[tenants.a]\nhost_bytes = '1MiB'\n", "tenants.a: give uids or gids"),
        ("[tenants.a]\nuids = [1]\nhost_bytes = '1MiB'\nquota = 3\n", "tenants.a: unknown setting 'quota'"),
        ("[tenants.'a-b']\nuids = [1]\nhost_bytes = '1MiB'\n", "tenants.a-b: a tenant name is 1-32 letters"),
        ("[tenants.a]\nuids = 1\nhost_bytes = '1MiB'\n", "tenants.a.uids: expected a list of non-negative integer ids"),
        ("[tenants.a]\nuids = [-1]\nhost_bytes = '1MiB'\n", "tenants.a.uids: expected a list"),
        ("[tenants.a]\nuids = [1]\nhost_bytes = 'lots'\n", "tenants.a.host_bytes: cannot read 'lots'"),
        (
            "[tenants.a]\nuids = [1]\nhost_bytes = '1MiB'\ngroup = 'no-such-group-kvd'\n",
            "no group named 'no-such-group-kvd'",
        ),
        (
            "[tenants.a]\nuids = [1]\nhost_bytes = '1MiB'\n[tenants.b]\nuids = [1]\nhost_bytes = '1MiB'\n",
            "tenants: uid 1 belongs to both 'a' and 'b'",
        ),
        (
            "host_bytes = '1MiB'\n[tenants.a]\nuids = [1]\nhost_bytes = '1MiB'\n"
            "[tenants.b]\nuids = [2]\nhost_bytes = '1MiB'\n",
            "add up to 2097152 bytes, over the daemon's host_bytes of 1048576",
        ),
        ("tenants = 3\n", "tenants: expected one [tenants.NAME] table"),
    ],
)
def test_bad_tenant_configs_say_what_is_wrong(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_toml(tmp_path, text)
    assert message in str(e.value)
    assert str(tmp_path / "kvd.toml") in str(e.value) or "add up" in message


# ---- tickets and routing, without a process boundary ---------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tickets_are_single_use_and_expire():
    clock = Clock()
    book = TicketBook(ttl=5.0, clock=clock)
    peer = Peer(pid=10, uid=1001, gid=1001)
    t = book.issue(peer, "alpha", admin=False)
    assert book.redeem(t.token) == t
    with pytest.raises(PermissionDenied, match="single-use"):
        book.redeem(t.token)
    late = book.issue(peer, "alpha", admin=False)
    clock.now += 5.0
    with pytest.raises(PermissionDenied, match="expired"):
        book.redeem(late.token)
    with pytest.raises(PermissionDenied, match="handshake"):
        book.redeem("")
    book.issue(peer, "alpha", admin=False)
    clock.now += 6.0
    book.issue(peer, "alpha", admin=False)
    assert len(book) == 1  # unused expired tickets are forgotten


def alpha_beta(make_manager, tmp_path) -> Tenants:
    """Tenants alpha (uid 1001) and beta (gid 2002) over two real managers; admin: root."""
    cfg = load_toml(
        tmp_path,
        """
        host_bytes = "64MiB"
        [tenants.alpha]
        uids = [1001]
        host_bytes = "1MiB"
        [tenants.beta]
        gids = [2002]
        host_bytes = "1MiB"
    """,
    )
    return Tenants({"alpha": make_manager(), "beta": make_manager()}, cfg.tenants, admin_uids=frozenset({0}))


def test_routing_by_uid_then_gid(make_manager, tmp_path):
    tenants = alpha_beta(make_manager, tmp_path)
    alpha, beta = tenants.managers()
    assert tenants.tenant_of(Peer(1, 1001, 2002)) == "alpha"  # a uid wins over a gid
    assert tenants.tenant_of(Peer(1, 5, 2002)) == "beta"
    assert tenants.tenant_of(Peer(1, 5, 7, groups=(9, 2002))) == "beta"  # a supplementary group
    assert tenants.tenant_of(Peer(1, 1001, 7, groups=(2002,))) == "alpha"  # the uid still wins
    with pytest.raises(PermissionDenied, match="uid 5 \\(gid 7\\) belongs to no tenant"):
        tenants.handshake(Peer(1, 5, 7))
    m, session = tenants.open_session(tenants.handshake(Peer(42, 5, 2002)).token, "x", 42, "beta")
    assert m is beta and tenants.manager_for(session.id, "beta") is beta and session.pid == 42
    with pytest.raises(PermissionDenied, match="issued to pid 43, not pid 44"):
        tenants.open_session(tenants.handshake(Peer(43, 1001, 1)).token, "x", 44, "alpha")
    for wrong_socket in ("alpha", None):  # another tenant's socket, the main one
        with pytest.raises(PermissionDenied, match="tenant beta's sessions open on its own socket '<socket>.t-beta'"):
            tenants.open_session(tenants.handshake(Peer(42, 5, 2002)).token, "x", 42, wrong_socket)
    admin_only = tenants.handshake(Peer(9, 0, 0))
    assert admin_only.admin and admin_only.tenant is None
    with pytest.raises(PermissionDenied, match="may only make admin calls"):
        tenants.open_session(admin_only.token, "x", 9, None)
    with pytest.raises(PermissionDenied, match="own uid or root"):
        tenants.check_admin(tenants.handshake(Peer(1, 1001, 1)).token)
    tenants.check_admin(tenants.handshake(Peer(9, 0, 0)).token)
    tenants.close_session(beta, session.id)
    assert len(beta.sessions) == 0


def test_a_session_is_valid_only_on_its_tenants_socket(make_manager, tmp_path):
    """A session id that reached another socket is refused exactly like one never issued."""
    tenants = alpha_beta(make_manager, tmp_path)
    alpha, _ = tenants.managers()
    _, session = tenants.open_session(tenants.handshake(Peer(7, 1001, 1)).token, "a", 7, "alpha")
    assert tenants.manager_for(session.id, "alpha") is alpha
    with pytest.raises(NotFound) as never_issued:
        tenants.manager_for("0" * 32, "beta")
    for wrong_socket in ("beta", None):
        with pytest.raises(NotFound) as e:
            tenants.manager_for(session.id, wrong_socket)
        assert str(e.value) == str(never_issued.value)
    tenants.close_session(alpha, session.id)
    assert len(alpha.sessions) == 0


def test_a_peer_in_groups_of_two_tenants_must_be_listed_by_uid(make_manager, tmp_path):
    cfg = load_toml(
        tmp_path,
        """
        host_bytes = "64MiB"
        [tenants.alpha]
        gids = [2001]
        host_bytes = "1MiB"
        [tenants.beta]
        gids = [2002]
        host_bytes = "1MiB"
    """,
    )
    tenants = Tenants({"alpha": make_manager(), "beta": make_manager()}, cfg.tenants, admin_uids=frozenset({0}))
    assert tenants.tenant_of(Peer(1, 5, 2001, groups=(2002,))) == "alpha"  # the primary gid decides
    with pytest.raises(PermissionDenied, match="uid 5 is in groups of tenants alpha, beta; list the uid"):
        tenants.handshake(Peer(1, 5, 7, groups=(2002, 2001)))


def test_implicit_tenant_needs_no_ticket(make_manager):
    m = make_manager()
    tenants = Tenants({IMPLICIT: m})
    got, session = tenants.open_session("", "x", 1, IMPLICIT)
    assert got is m and tenants.manager_for("anything", IMPLICIT) is m
    tenants.check_admin("")


# ---- a real daemon, one OS user: routing by the current uid --------------------------


def tenant_daemon(start, tmp_path, toml: str, name: str = "kvd"):
    """``start``: the daemon_factory fixture, or conftest.start_daemon bound to a directory."""
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(toml))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_") and k != "NOTIFY_SOCKET"}
    env["KVD_CONFIG"] = str(path)
    return start("--enable-prefix-reuse", "--extent-bytes", "16KiB", env=env, name=name)


def test_same_uid_routes_to_its_tenant(daemon_factory, tmp_path):
    d = tenant_daemon(
        daemon_factory,
        tmp_path,
        f"""
        host_bytes = "1MiB"
        [tenants.mine]
        uids = [{os.getuid()}]
        host_bytes = "64KiB"
        [tenants.other]
        uids = [{OTHER_UID}]
        host_bytes = "128KiB"
    """,
    )
    assert stat.S_IMODE(os.stat(auth_socket(d.socket)).st_mode) == 0o660
    with KVDClient.connect(d.socket) as kvd:
        assert kvd.host_bytes == 64 << 10  # the tenant's budget, not the daemon's
        ns = kvd.register_namespace("tiny", LAYOUT)
        [a] = kvd.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX)])
        kvd.publish(ns, ["a"])
        [hit] = kvd.lookup(ns, [SequenceRequest("q", PREFIX)])
        assert hit.hit_tokens == 16
        [warm] = prewarm(d.socket, [PREFIX], identity=TINY)["prompts"]  # no session: the caller's uid picks "mine"
        assert warm["resident_tokens"] == 16 and kvd.stats()["prewarm"]["prompts"] == 1
        kvd.page_array(ns, a.private_pages[0])
        names = [e.name for e in kvd.mapped_extents(ns)]
        shm = config_mod.ServeConfig(socket=d.socket).shm_prefix
        assert names and all(n.startswith(tenant_prefix(shm, "mine") + "-") for n in names)
        mine = kvd.stats()
        assert mine["host_bytes"] == 64 << 10 and [n["model"] for n in mine["namespaces"]] == ["tiny"]
        assert "tenant" not in mine["namespaces"][0]
        assert kvd.check_invariants() == []
        every = fetch_stats(d.socket)  # the daemon's own uid: admin, every tenant
        assert every["host_bytes"] == (64 + 128) << 10
        assert [(n["tenant"], n["model"]) for n in every["namespaces"]] == [("mine", "tiny")]
        meta = os.stat("/dev/shm" + names[0] + ".meta")
        assert stat.S_IMODE(meta.st_mode) == 0o600  # token ids: the daemon alone reads them
        kvd.release(ns, ["a"])
        assert kvd.reset_prefix_cache(ns) == {"dropped_pages": 4, "kept_pages": 0}  # its own tenant's namespace
        with pytest.raises(KVDError) as e:  # namespace ids are per tenant: daemon-wide, only all of them
            reset_prefix_cache(d.socket, ns)
        assert e.value.code == ErrorCode.INVALID_ARGUMENT
        assert reset_prefix_cache(d.socket) == {"dropped_pages": 0, "kept_pages": 0}


def test_metrics_of_a_daemon_with_tenants_are_labelled_by_tenant(daemon_factory, tmp_path):
    port = free_port()
    d = tenant_daemon(
        daemon_factory,
        tmp_path,
        f"""
        host_bytes = "1MiB"
        metrics_port = {port}
        [tenants.mine]
        uids = [{os.getuid()}]
        host_bytes = "64KiB"
        [tenants.other]
        uids = [{OTHER_UID}]
        host_bytes = "128KiB"
    """,
    )
    with KVDClient.connect(d.socket) as kvd:
        ns = kvd.register_namespace("tiny", LAYOUT)
        kvd.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX + [1])])
        kvd.publish(ns, ["a"])
        kvd.allocate_with_prefix(ns, [SequenceRequest("b", PREFIX + [2])])
        mine, every = kvd.stats(), fetch_stats(d.socket)
        assert mine["host_pages_saved"] == 4

        samples = metric_samples(port)  # live values
    for field in ("logical_pages", "physical_pages", "host_pages_saved", "hit_tokens"):
        for tenant, namespace, model, value in (
            ("mine", "all", "all", mine[field]),
            ("mine", str(ns), "tiny", mine["namespaces"][0][field]),
            ("other", "all", "all", 0),
            ("all", "all", "all", every[field]),
        ):
            labels = (("model", model), ("namespace", namespace), ("tenant", tenant))
            assert samples.get((f"kvd_{field}", labels), samples.get((f"kvd_{field}_total", labels))) == value, (
                field,
                tenant,
                namespace,
            )
    assert samples[("kvd_host_budget_bytes", ())] == (64 + 128) << 10


@pytest.mark.skipif(os.geteuid() != 0, reason="setting a client's supplementary groups needs root")
def test_a_supplementary_group_routes_to_its_tenant(daemon_factory, tmp_path):
    d = tenant_daemon(
        daemon_factory,
        tmp_path,
        f"""
        host_bytes = "1MiB"
        [tenants.by_group]
        gids = [{OTHER_UID}]
        host_bytes = "96KiB"
    """,
    )
    probe = "import sys; from engine_client import KVDClient; print(KVDClient.connect(sys.argv[1]).host_bytes)"
    for groups, expected in (([OTHER_UID], 96 << 10), ([], None)):
        r = subprocess.run(
            [sys.executable, "-c", probe, d.socket], extra_groups=groups, capture_output=True, text=True, timeout=60
        )
        if expected is None:  # root without the group: an admin of no tenant
            assert r.returncode != 0 and "belongs to no tenant" in r.stderr
        else:
            assert r.returncode == 0 and int(r.stdout) == expected, r.stderr


def test_tickets_through_the_daemon(daemon_factory, tmp_path):
    d = tenant_daemon(
        daemon_factory,
        tmp_path,
        f"""
        [tenants.mine]
        uids = [{os.getuid()}]
        host_bytes = "64KiB"
    """,
    )
    admission = admit(d.socket)
    assert admission.session_socket == tenant_socket(d.socket, "mine")
    assert stat.S_IMODE(os.stat(admission.session_socket).st_mode) == 0o660  # no group: as the main socket
    with (
        grpc.insecure_channel(f"unix:{d.socket}") as main,
        grpc.insecure_channel(f"unix:{admission.session_socket}") as own,
    ):

        def open_with(channel, ticket: str) -> pb.SessionEvent:
            stub = kvd_pb2_grpc.KVDStub(channel)
            return next(stub.OpenSession(pb.OpenSessionRequest(client_name="t", pid=os.getpid(), ticket=ticket)))

        with pytest.raises(grpc.RpcError) as e:
            open_with(own, "")
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "isolates tenants" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # the main socket holds no tenant's sessions
            open_with(main, fetch_ticket(d.socket))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "its own socket" in e.value.details()
        opened = open_with(own, admission.ticket).opened
        assert opened.host_bytes == 64 << 10
        with pytest.raises(grpc.RpcError) as e:
            open_with(own, admission.ticket)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "single-use" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            kvd_pb2_grpc.KVDStub(main).GetStats(pb.StatsRequest())
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:  # the session exists, but not on the main socket
            kvd_pb2_grpc.KVDStub(main).GetStats(pb.StatsRequest(session=opened.session))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_uid_of_no_tenant_is_refused(daemon_factory, tmp_path):
    d = tenant_daemon(
        daemon_factory,
        tmp_path,
        f"""
        [tenants.other]
        uids = [{OTHER_UID}]
        host_bytes = "64KiB"
    """,
    )
    with pytest.raises(KVDError) as e:
        KVDClient.connect(d.socket, timeout=5)
    assert e.value.code == ErrorCode.PERMISSION_DENIED
    assert f"uid {os.getuid()}" in e.value.message and "belongs to no tenant" in e.value.message
    assert fetch_stats(d.socket)["namespaces"] == []  # still an admin
    with pytest.raises(KVDError) as e:  # but an admin's prewarm names no tenant's cache
        prewarm(d.socket, [PREFIX], identity=TINY)
    assert e.value.code == ErrorCode.PERMISSION_DENIED and "names no tenant" in e.value.message


# ---- two real OS users ---------------------------------------------------------------

CLIENT = """
import json, sys, posix_ipc
from engine_client import KVDClient, KVDError, PageLayout, SequenceRequest
op, socket, foreign = sys.argv[1], sys.argv[2], sys.argv[3:]
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
PREFIX = list(range(1000, 1016))
out = {}
with KVDClient.connect(socket) as kvd:
    ns = kvd.register_namespace("tiny", LAYOUT)
    if op == "publish":
        [a] = kvd.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX)])
        kvd.publish(ns, ["a"])
        kvd.page_array(ns, a.private_pages[0])
        out["extents"] = [e.name for e in kvd.mapped_extents(ns)]
    if op == "fill":  # twice this tenant's whole budget: its own cache must be evicted
        pages = kvd.host_bytes // (512 + 80)  # a page and its metadata record (kvd/core/records.py)
        for round in range(2):
            tokens = [50000 + round * 10000 + i for i in range(pages * 4)]
            kvd.allocate_with_prefix(ns, [SequenceRequest("f", tokens)])
            kvd.publish(ns, ["f"])
            kvd.release(ns, ["f"])  # cached: the next round must evict them
    [hit] = kvd.lookup(ns, [SequenceRequest("q", PREFIX)])
    out["hit_tokens"] = hit.hit_tokens
    out["pinned"] = kvd.pin(ns, PREFIX).pinned_pages
    out["stats"] = kvd.stats()
    out["mapped"] = []
    for name in foreign:
        try:
            posix_ipc.SharedMemory(name).close_fd()
            out["mapped"].append(name)
        except posix_ipc.PermissionsError:
            pass
    try:
        from kvd.wire.admin import fetch_stats
        fetch_stats(socket)
        out["admin"] = True
    except KVDError as e:
        out["admin"] = e.code.name
print(json.dumps(out))
"""


def user_env(**extra: str) -> dict:
    """A bare environment for a process of another OS user; PYTHONPATH stays, so it runs
    the checkout under test."""
    keep = {k: os.environ[k] for k in ("PATH", "PYTHONPATH") if k in os.environ}
    return {**keep, **extra}


@pytest.fixture
def two_users():
    """Two OS users, each in its own group; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create OS users (useradd/groupadd)")
    if not (shutil.which("useradd") and shutil.which("groupadd")):
        pytest.skip("useradd/groupadd are not installed")
    made = []
    opened: list[tuple[pathlib.Path, int]] = []  # directories made traversable, with their old modes
    try:
        # The interpreter, the virtual environment and this checkout may live under private
        # directories (/root/.pyenv, a 0700 temporary clone): let others traverse them, not list.
        paths = (pathlib.Path(sys.executable), pathlib.Path(os.path.realpath(sys.executable)), pathlib.Path(__file__))
        for parent in dict.fromkeys(p for path in paths for p in path.parents):
            mode = stat.S_IMODE(parent.stat().st_mode)
            if not mode & stat.S_IXOTH:
                opened.append((parent, mode))
                parent.chmod(mode | stat.S_IXOTH)
        for name in ("kvdta", "kvdtb"):
            subprocess.run(["userdel", name], capture_output=True)  # left by a run that was killed
            subprocess.run(["groupdel", name], capture_output=True)
            subprocess.run(["groupadd", name], check=True, capture_output=True)
            subprocess.run(
                ["useradd", "-M", "-N", "-g", name, "-s", "/usr/sbin/nologin", name], check=True, capture_output=True
            )
            made.append(name)
        users = [(pwd.getpwnam(n).pw_uid, grp.getgrnam(n).gr_gid) for n in made]
        # Where this host still keeps the users from the interpreter or the checkout (a
        # mount option, a security module), the isolation test cannot run at all.
        uid, gid = users[0]
        probe = subprocess.run(
            [sys.executable, "-c", "import engine_client"],
            user=uid,
            group=gid,
            extra_groups=[],
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=60,
            env=user_env(),
        )
        if probe.returncode != 0:
            pytest.skip(f"a new OS user cannot run this checkout's python here: {probe.stderr.strip()[-300:]}")
        yield users
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)
        for name in ("kvdta", "kvdtb"):
            subprocess.run(["groupdel", name], capture_output=True)
        for parent, mode in opened:
            parent.chmod(mode)


class TwoTenants:
    """A daemon with tenants alpha (user and group kvdta) and beta (kvdtb), its sockets and
    the tests' scripts in a directory both users reach; the main socket is open to all."""

    def __init__(self, users, work: pathlib.Path) -> None:
        (self.ua, self.ga), (self.ub, self.gb) = users
        self.work = work
        self.daemon = tenant_daemon(
            functools.partial(start_daemon, work),
            work,
            f"""
            host_bytes = "1MiB"
            socket_mode = "0666"
            [tenants.alpha]
            uids = [{self.ua}]
            host_bytes = "64KiB"
            group = "kvdta"
            [tenants.beta]
            uids = [{self.ub}]
            host_bytes = "64KiB"
            group = "kvdtb"
        """,
        )

    def script(self, name: str, text: str) -> str:
        path = self.work / name
        path.write_text(text)
        path.chmod(0o644)
        return str(path)

    def popen(self, uid: int, gid: int, script: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, script, *args],
            user=uid,
            group=gid,
            extra_groups=[],
            cwd=str(ROOT),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=user_env(HOME=str(self.work)),
        )

    def run(self, uid: int, gid: int, script: str, *args: str) -> dict:
        out, err = self.popen(uid, gid, script, *args).communicate(timeout=60)
        assert out, err
        return json.loads(out)


@pytest.fixture
def two_tenants(two_users):
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvdt-", dir="/tmp"))
    tenants = None
    try:
        work.chmod(0o755)  # the tenants' processes reach the sockets and the scripts
        tenants = TwoTenants(two_users, work)
        yield tenants
    finally:
        if tenants is not None:
            assert tenants.daemon.stop() == 0, tenants.daemon.log()
        shutil.rmtree(work, ignore_errors=True)


def test_two_os_users_are_isolated(two_tenants):
    t, socket = two_tenants, two_tenants.daemon.socket
    client = t.script("client.py", CLIENT)
    a = t.run(t.ua, t.ga, client, "publish", socket)
    assert a["hit_tokens"] == 16 and a["pinned"] == 4
    for name in a["extents"]:
        st = os.stat("/dev/shm" + name)
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (t.ga, 0o660)
    b = t.run(t.ub, t.gb, client, "fill", socket, *a["extents"])
    assert b["hit_tokens"] == 0 and b["pinned"] == 0  # A's published prefix is invisible to B
    assert b["mapped"] == []  # and the OS refuses to map A's extents
    assert b["admin"] == "PERMISSION_DENIED"  # only the daemon's uid or root sees every tenant
    assert b["stats"]["host_bytes"] == 64 << 10 and b["stats"]["evicted_pages"] > 0
    # B's counters only (two rounds of its budget's pages of 4 tokens): A's lookups absent
    assert b["stats"]["lookup_tokens"] == 2 * 4 * ((64 << 10) // (512 + 80))
    again = t.run(t.ua, t.ga, client, "lookup", socket)
    assert again["hit_tokens"] == 16  # B's pressure evicted nothing of A's
    assert again["stats"]["evicted_pages"] == 0 and again["stats"]["lookup_tokens"] == 16
    every = fetch_stats(socket)
    assert sorted(n["tenant"] for n in every["namespaces"]) == ["alpha", "beta"]


# Tenant A's engine: a sequence with aux state and a pin; prints what a leak would give
# away (its session id, namespace, pin), waits while B uses them, then checks that nothing
# changed and that its session still works.
VICTIM = """
import json, sys
from engine_client import KVDClient, PageLayout, SequenceRequest
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
PREFIX = list(range(1000, 1016))
with KVDClient.connect(sys.argv[1]) as kvd:
    ns = kvd.register_namespace("tiny", LAYOUT)
    kvd.allocate_with_prefix(ns, [SequenceRequest("a", PREFIX + [7, 7])])
    kvd.publish(ns, ["a"])
    kvd.set_aux_state(ns, "a", b"A's recurrent state")
    pin = kvd.pin(ns, PREFIX)
    before = kvd.stats()
    print(json.dumps({"session": kvd.session, "ns": ns, "pin": pin.pin_id}), flush=True)
    sys.stdin.readline()  # B has tried
    out = {"unchanged": kvd.stats() == before, "aux": kvd.get_aux_state(ns, "a").decode(),
           "invariants": kvd.check_invariants()}
    out["extended"] = kvd.extend(ns, "a", 3).num_tokens
    kvd.unpin(pin.pin_id)
    out["released"] = kvd.release(ns, ["a"])
print(json.dumps(out))
"""

# Tenant B's process holding A's leaked session id: every call that names a session, on
# the main socket and on B's own; A's socket itself the kernel refuses to B.
THIEF = """
import json, os, socket as socket_mod, sys
import grpc
from kvd.wire.auth import admit
from kvd.wire import kvd_pb2 as pb, kvd_pb2_grpc
main, own, theirs, leaked = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
ns, pin = leaked["ns"], leaked["pin"]
CALLS = {
    "RegisterNamespace": lambda s: pb.RegisterNamespaceRequest(session=s, identity=pb.NamespaceIdentity(
        model="tiny", layout=pb.PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16"))),
    "DescribeExtents": lambda s: pb.DescribeExtentsRequest(session=s, namespace_id=ns),
    "AllocateWithPrefix": lambda s: pb.AllocateRequest(session=s, namespace_id=ns, sequences=[
        pb.SequenceRequest(seq_id="b", tokens=bytes(64))]),
    "Lookup": lambda s: pb.LookupRequest(session=s, namespace_id=ns, sequences=[
        pb.SequenceRequest(seq_id="b", tokens=bytes(64))]),
    "Publish": lambda s: pb.PublishRequest(session=s, namespace_id=ns, items=[pb.PublishItem(seq_id="a")]),
    "Extend": lambda s: pb.ExtendRequest(session=s, namespace_id=ns, seq_ids=["a"], num_tokens=[4]),
    "Fork": lambda s: pb.ForkRequest(session=s, namespace_id=ns, src_seq_id="a", dst_seq_id="b"),
    "SetState": lambda s: pb.SetStateRequest(session=s, namespace_id=ns, seq_id="a", state=2),
    "SetAuxState": lambda s: pb.SetAuxStateRequest(session=s, namespace_id=ns, seq_id="a", data=b"B was here"),
    "GetAuxState": lambda s: pb.GetAuxStateRequest(session=s, namespace_id=ns, seq_id="a"),
    "DescribeSequences": lambda s: pb.DescribeSequencesRequest(session=s, namespace_id=ns, seq_ids=["a"]),
    "Pin": lambda s: pb.PinRequest(session=s, namespace_id=ns, tokens=bytes(64)),
    "Unpin": lambda s: pb.UnpinRequest(session=s, pin_id=pin),
    "GetStats": lambda s: pb.StatsRequest(session=s),
    "CheckInvariants": lambda s: pb.CheckInvariantsRequest(session=s),
    "Release": lambda s: pb.ReleaseRequest(session=s, namespace_id=ns, seq_ids=["a"]),
}
out = {"own_socket": admit(main).session_socket == own, "calls": {}}
for where, path in (("main", main), ("own", own)):
    with grpc.insecure_channel(f"unix:{path}") as channel:
        stub = kvd_pb2_grpc.KVDStub(channel)
        for name, make in CALLS.items():
            answers = []
            for session in (leaked["session"], "0" * 32):  # A's live id, and one never issued
                try:
                    getattr(stub, name)(make(session), timeout=20)
                    answers.append("OK")
                except grpc.RpcError as e:
                    answers.append(f"{e.code().name}: {e.details()}")
            out["calls"][f"{where} {name}"] = answers
with socket_mod.socket(socket_mod.AF_UNIX) as sock:
    try:
        sock.connect(theirs)
        out["their_socket"] = "connected"
    except OSError as e:
        out["their_socket"] = os.strerror(e.errno)
print(json.dumps(out))
"""


def test_a_session_id_is_useless_to_a_process_of_another_tenant(two_tenants):
    t, socket = two_tenants, two_tenants.daemon.socket
    victim = t.popen(t.ua, t.ga, t.script("victim.py", VICTIM), socket)
    try:
        leaked = victim.stdout.readline()
        assert leaked, victim.stderr.read()
        thief = t.run(
            t.ub,
            t.gb,
            t.script("thief.py", THIEF),
            socket,
            tenant_socket(socket, "beta"),
            tenant_socket(socket, "alpha"),
            leaked,
        )
        victim.stdin.write("done\n")
        victim.stdin.flush()
        out, err = victim.communicate(timeout=60)
    finally:
        victim.kill()
    assert thief["own_socket"] and thief["their_socket"] == os.strerror(errno.EACCES)
    assert len(thief["calls"]) == 2 * 16
    for call, (with_leaked_id, with_unknown_id) in thief["calls"].items():
        assert with_leaked_id.startswith("NOT_FOUND: unknown session"), (call, with_leaked_id)
        assert with_leaked_id == with_unknown_id, call  # nothing tells B that the session exists
    a = json.loads(out)
    assert a["unchanged"] and a["aux"] == "A's recurrent state" and a["invariants"] == [], (a, err)
    assert a["extended"] == 21 and a["released"] == 6  # A's session works: 16 + 2 + 3 tokens, 6 pages
