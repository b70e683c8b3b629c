"""The launcher: owns server options, health, reflection, signals, readiness and shutdown.

``kvd serve`` runs ``serve(config)``: asyncio on uvloop, grpc.aio on a unix socket. With
tenants, one more grpc.aio server per tenant on the same loop, each on the tenant's own
socket and serving only its sessions (kvd/cache/tenants.py says why); all share one core.
The daemon tells systemd it is ready (``READY=1`` on ``$NOTIFY_SOCKET``) only once the
socket accepts calls. SIGTERM/SIGINT stop it gracefully: no new calls, calls in flight
finish, the disk tier writes the pages host memory holds (kvd/disk/stop_writes.py, for at
most ``[disk] stop_write_seconds``), the remote store's client closes (it and the calls in
flight within ``shutdown_grace_seconds``; a client whose master is gone is left unclosed
and ``serve`` exits without Mooncake's teardown, kvd/remote/link.py says why), then the
arena is unmapped and unlinked. A
daemon that dies instead (``kill -9``, a crash) leaves its extents and their metadata;
the next one on the same socket re-attaches them and serves the published pages again
(warm restart, kvd/durability/recovery.py): it answers at once, and verifies and indexes
them while it serves, for up to ``FOREGROUND_SECONDS`` before its first answer, then
between calls (kvd/durability/reindexing.py). The disk tier's pages are read and indexed
the same way, after the same short wait (kvd/disk/opening.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket as socket_mod
import sys
import time

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvd import __version__, collector
from kvd.cache import pins, token_buffers
from kvd.cache.events import Consumer, EventLog
from kvd.cache.manager import KVCacheManager
from kvd.cache.requests import Limits
from kvd.cache.tenants import IMPLICIT, Tenants, tenant_prefix
from kvd.config import ServeConfig
from kvd.core.arena import Arena, daemon_segments, memlock_limit, unlink_segments
from kvd.core.shm import SHM_DIR, shm_free_bytes
from kvd.durability import recovery
from kvd.durability.reindexing import FOREGROUND_SECONDS, Reindexing
from kvd.server import handshake
from kvd.server.loop_watch import LoopWatch
from kvd.server.messages import SERVICE
from kvd.server.offload import Offload
from kvd.server.service import KvdServicer, add_to_server
from kvd.wire import kvd_pb2 as pb
from kvd.wire.limits import MAX_MESSAGE_BYTES
from kvd.wire.paths import auth_socket, tenant_socket

log = logging.getLogger(__name__)

SERVICE_NAME = SERVICE.full_name

SERVER_OPTIONS = [
    # Batches of 50K-token prompts and large aux states exceed gRPC's 4 MiB default; a
    # bound still matters, as a request is received whole before any check (kvd/wire/limits.py).
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A unix socket serves one host; reusing a port makes no sense and hides a second daemon.
    ("grpc.so_reuseport", 0),
    # Session streams are long-lived and idle; let clients ping them to detect a dead daemon.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
]

GIL_SWITCH_SECONDS = 0.0002


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why (``kvd serve`` prints it, exits 1)."""


class DaemonRunning(StartupError):
    """Another daemon answers on the socket."""


def notify_systemd(message: str) -> bool:
    """Sends an sd_notify message when started by systemd (Type=notify); False otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(message.encode())
    return True


def socket_answers(path: str) -> bool:
    """True when a process accepts connections on the unix socket."""
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
            return True
        except OSError:
            return False


def _prepare_socket(path: str) -> None:
    try:
        if os.path.exists(path):
            if socket_answers(path):
                raise DaemonRunning(f"a daemon already serves {path}; stop it first or choose another socket")
            os.unlink(path)  # left behind by a daemon that died
    except OSError as e:
        raise StartupError(f"cannot prepare socket {path}: {e.strerror}") from None


async def _listen(server: grpc.aio.Server, path: str, mode: int, group: int | None = None) -> None:
    """Starts ``server`` on the unix socket ``path``, created with mode 0600 so that nobody
    connects before it has its group and ``mode``; raises StartupError when it cannot."""
    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, mode)
    except (RuntimeError, OSError) as e:
        await server.stop(None)
        raise StartupError(f"cannot listen on {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        os.umask(old_umask)


def _event_log(config: ServeConfig, publisher: Consumer | None) -> EventLog:
    """A tenant's KV events (kvd/cache/events.py): batches close once the call that made them is
    done, and go to the ZMQ publisher when there is one."""
    events = EventLog(config.events_buffer_batches)
    events.schedule = asyncio.get_running_loop().call_soon
    if publisher is not None:
        events.attach(publisher)
    return events


def _new_manager(
    config: ServeConfig, budget: int, prefix: str, group: int | None, meta_mode: int, publisher: Consumer | None
) -> KVCacheManager:
    arena = Arena(budget, min(config.extent_bytes, budget), prefix, config.lock_memory, group, meta_mode)
    return KVCacheManager(
        arena,
        prefix_reuse=config.enable_prefix_reuse,
        limits=Limits(max_aux_bytes=config.aux_bytes_per_sequence),
        aux_budget=config.aux_budget(budget),
        events=_event_log(config, publisher),
    )


def _recovered_manager(
    config: ServeConfig,
    budget: int,
    prefix: str,
    publisher: Consumer | None,
    group: int | None = None,
    meta_mode: int = 0o660,
) -> KVCacheManager:
    """A manager holding what a killed daemon on this socket left (kvd/durability/recovery.py), or an empty one."""
    unlink_segments(token_buffers.leftovers(prefix))
    manager = _new_manager(config, budget, prefix, group, meta_mode, publisher)
    try:
        recovery.recover(manager)
    except Exception:  # noqa: BLE001 - never refuse to start over leftovers: start empty
        log.exception("warm restart failed; discarding the previous daemon's shared memory and starting empty")
        if publisher is not None:
            manager.events.detach(publisher)  # its pages were never served: no one hears of them
        manager.close(unlink=True)
        unlink_segments(daemon_segments(prefix))
        manager = _new_manager(config, budget, prefix, group, meta_mode, publisher)
    return manager


def _tenants(config: ServeConfig, publisher: Consumer | None) -> Tenants:
    """One manager per tenant (kvd/cache/tenants.py), or the implicit one over the whole budget."""
    if not config.tenants:
        return Tenants({IMPLICIT: _recovered_manager(config, config.host_bytes, config.shm_prefix, publisher)})
    managers = {}
    for t in config.tenants:  # metadata holds token ids: only the daemon reads it
        managers[t.name] = _recovered_manager(
            config, t.host_bytes, tenant_prefix(config.shm_prefix, t.name), publisher, t.group, 0o600
        )
    return Tenants(managers, config.tenants)


def _event_publisher(config: ServeConfig):
    """The ZMQ publisher of every tenant's KV events, when ``events_endpoint`` is set; only
    then is zmq imported."""
    if not config.events_endpoint:
        return None
    from kvd.server.event_publisher import EventPublisherError, ZmqEventPublisher

    try:
        return ZmqEventPublisher(
            config.events_endpoint, config.events_replay_endpoint, config.events_topic, config.events_buffer_batches
        )
    except EventPublisherError as e:
        raise StartupError(f"events_endpoint: {e}") from None


def _check_shm_room(tenants: Tenants) -> None:
    """Warns when /dev/shm cannot hold the rest of the host budget (a container's default is
    64 MiB): extents beyond it will be refused with RESOURCE_EXHAUSTED, never a SIGBUS."""
    needed = sum(m.arena.shm_bytes_to_come for m in tenants.managers())
    free = shm_free_bytes()
    if free < needed:
        log.warning(
            "%s has %d bytes free but the host budget needs %d more; calls beyond what fits will be refused "
            "with RESOURCE_EXHAUSTED. Give %s more room (docker run --shm-size) or lower --host-bytes",
            SHM_DIR,
            free,
            needed,
            SHM_DIR,
        )


def _disk_tiers(config: ServeConfig, tenants: Tenants, loop: asyncio.AbstractEventLoop) -> list:
    """Each tenant's disk tier (kvd/disk/tier.py), attached first (RAM → disk → store); none
    without [disk]. Its file is opened now (a directory that cannot hold the store is a
    StartupError); the page headers on disk are read in the background, and the pages a
    previous run (or boot) left become hittable as the tier learns them (kvd/disk/opening.py)."""
    disk = config.disk
    if disk is None:
        return []
    from kvd.disk.tier import DiskTier
    from kvd.diskstore.results import OpenRefused
    from kvd.diskstore.store import DiskStore

    budgets = {t.name: t.host_bytes for t in config.tenants}
    tiers = []
    for name, manager in tenants.items():
        directory, budget = disk.share(name if config.tenants else None, budgets.get(name, 0), config.host_bytes)
        if config.tenants:
            try:
                os.makedirs(directory, mode=0o700, exist_ok=True)
            except OSError as e:
                _close_disk(tiers)
                raise StartupError(f"disk.path: cannot create {directory}: {e.strerror}") from None
        opening = DiskStore.opening(directory, budget, chunk_bytes=disk.chunk_bytes)
        if isinstance(opening, OpenRefused):
            _close_disk(tiers)
            raise StartupError(f"disk.path: {directory}: {opening.reason.value}: {opening.detail}")
        tier = DiskTier(opening, name, disk, manager.tier_ports(), loop)
        manager.tiers.attach(tier)
        tiers.append(tier)
    return tiers


def _close_disk(tiers: list) -> None:
    """Waits for the disk transfers in flight: before host memory is unmapped."""
    for tier in tiers:
        tier.close()


def _remote_link(config: ServeConfig, tenants: Tenants, loop: asyncio.AbstractEventLoop):
    """The remote store's link, shared by every tenant's tier (kvd/remote/tier.py); None without [remote]."""
    remote = config.remote
    if remote is None:
        return None
    from kvd.remote.link import RemoteLink
    from kvd.remote.mooncake_store import MooncakeSettings  # the store's client loads only with [remote]
    from kvd.remote.tier import RemoteTier

    link = RemoteLink(
        MooncakeSettings(
            master=remote.master,
            metadata=remote.metadata_server,
            local_hostname=remote.local_hostname or socket_mod.gethostname(),
            protocol=remote.protocol,
            rdma_devices=remote.rdma_devices,
            segment_bytes=remote.segment_bytes,
        )
    )
    for name, manager in tenants.items():  # beside each tenant's page core, which it hears through Tier
        manager.tiers.attach(RemoteTier(link, name, remote, manager.tier_ports()))
    link.start(loop.call_soon_threadsafe)  # once every tier listens: the first UP offers recovered pages
    return link


def _close_all(tenants: Tenants, link, keep_cache: bool, seconds: float) -> bool:
    """Unmaps every tenant's extents; keeps them (sealed, consistent) for a warm restart.
    The remote link stops first, within ``seconds``: its worker must not touch memory being
    unmapped. False when the store's client was left unclosed (kvd/remote/link.py): a call
    of its may still read pages, so the extents stay mapped, only the pending seals are
    recorded, and the process leaves at once (``serve``)."""
    closed = link is None or link.close(seconds)
    for manager in tenants.managers():
        if closed:
            manager.close(unlink=not keep_cache)
        else:
            manager.integrity.close()
    return closed


def _about(config: ServeConfig) -> pb.PingReply:
    """What Ping tells any process that reaches the socket (``kvd doctor`` reads it): the
    version, and how much of the budget the daemon's memlock limit leaves unlocked."""
    limit = memlock_limit()
    unlocked = 0 if limit is None else max(0, config.host_bytes - limit)
    return pb.PingReply(version=__version__, lock_memory=config.lock_memory, unlocked_bytes=unlocked)


class _Daemon:
    """A daemon's caches and servers: built, started (its main socket last), stopped."""

    def __init__(self, config: ServeConfig, metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.publisher = _event_publisher(config)
        self.tenants = _tenants(config, self.publisher)
        _check_shm_room(self.tenants)
        loop = asyncio.get_running_loop()
        self.disk = _disk_tiers(config, self.tenants, loop)
        self.link = _remote_link(config, self.tenants, loop)
        self.reindexing = [m.catalog.reindexing for m in self.tenants.managers() if m.catalog.reindexing is not None]
        deadline = time.perf_counter() + FOREGROUND_SECONDS  # once every tier listens: they hear each page restored
        for each in self.reindexing:
            each.run_for(deadline - time.perf_counter())
        for tier in self.disk:  # the rest of the time: what the disk holds (kvd/disk/opening.py)
            tier.opening.run_for(max(0.0, deadline - time.perf_counter()))
        self.background: asyncio.Task | None = None  # what is left of them, between calls
        for manager in self.tenants.managers():
            manager.integrity.sealer.notify = functools.partial(loop.call_soon_threadsafe, manager.integrity.apply)
        self.offload = Offload()  # a large call's work that needs no core (kvd/server/offload.py)
        self.servicer = KvdServicer(
            self.tenants,
            self.offload,
            observe_latency=metrics.observe_latency if metrics else None,
            about=_about(config),
        )
        self.health = health.aio.HealthServicer()
        self.servers: list[grpc.aio.Server] = []
        self.auth: asyncio.AbstractServer | None = None  # the tenant handshake (kvd/server/handshake.py)
        self.store_left_open = False  # the remote store's client was abandoned on close (serve says why it matters)

    async def start(self) -> None:
        """Serves metrics, then each tenant's socket and the handshake, then the main socket:
        once that answers, so do the others. A failure leaves nothing behind (StartupError)."""
        try:
            if self.metrics is not None:  # before the sockets: a busy port must not half-start the daemon
                try:
                    self.metrics.start(self.tenants, self.config.metrics_host, self.config.metrics_port)
                except OSError as e:
                    raise StartupError(
                        f"cannot serve metrics on {self.config.metrics_host}:{self.config.metrics_port}: {e.strerror}"
                    ) from None
            await self._listen_tenants()
            server = self._main_server()
            await _listen(server, self.config.socket, self.config.socket_mode)
            self.servers.append(server)
        except StartupError:
            await self._close(grace=None, keep_cache=False)
            raise
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if not all(each.done for each in self.reindexing):
            self.background = asyncio.create_task(_reindex(self.reindexing))

    def _main_server(self) -> grpc.aio.Server:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        add_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        return server

    async def _listen_tenants(self) -> None:
        config = self.config
        for t in config.tenants:
            server = grpc.aio.server(options=SERVER_OPTIONS)
            add_to_server(self.servicer.on_socket(t.name), server)
            # Only the tenant's group connects; without a group the socket is as open as
            # the main one, the same limit the tenant's extents have.
            mode = config.socket_mode if t.group is None else 0o660
            await _listen(server, tenant_socket(config.socket, t.name), mode, t.group)
            self.servers.append(server)
        if config.tenants:
            try:
                self.auth = await handshake.listen(auth_socket(config.socket), config.socket_mode, self.tenants)
            except OSError as e:
                raise StartupError(f"cannot listen on {auth_socket(config.socket)}: {e.strerror}") from None

    async def stop(self, keep_cache: bool = True) -> None:
        """No new calls, sessions ended, calls in flight finished; the cache stays for a warm
        restart unless ``keep_cache`` is False (an in-process daemon of a benchmark)."""
        log.info("stopping: finishing calls in flight")
        notify_systemd("STOPPING=1")
        await self.health.enter_graceful_shutdown()
        if self.background is not None:  # what it has not verified stays in shared memory for the next start
            self.background.cancel()
        self._close_handshake()
        self.servicer.end_sessions()
        await self._close(grace=self.config.shutdown_grace_seconds, keep_cache=keep_cache)
        for path in self.config.socket_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _close_handshake(self) -> None:
        if self.auth is not None:
            self.auth.close()
            self.auth = None

    async def _close(self, grace: float | None, keep_cache: bool) -> None:
        # The servers' grace and the remote store's close together take at most the shutdown grace.
        deadline = time.monotonic() + self.config.shutdown_grace_seconds
        self._close_handshake()
        await asyncio.gather(*(each.stop(grace) for each in self.servers))
        self.offload.close()  # before the caches close: no call's work runs past them
        for manager in self.tenants.managers():
            manager.integrity.sealer.notify = None  # the loop stops taking callbacks; close() applies what is left
        left = max(0.0, deadline - time.monotonic())  # the remote store's share of the grace
        if grace is not None and self.disk:  # a graceful stop: a reboot finds what host memory held on disk
            from kvd.disk.stop_writes import write_host_pages

            await write_host_pages(self.disk, self.config.disk.stop_write_seconds)
        # Kept, published pages stay in shared memory, sealed, so `kvd serve` finds them again
        # (systemctl restart keeps the cache); `kvd clean` removes them for good.
        _close_disk(self.disk)
        self.store_left_open = not _close_all(self.tenants, self.link, keep_cache, left)
        if self.publisher is not None:
            self.publisher.close()  # after the last call's batch: the loop ran it before the servers stopped
        if self.metrics is not None:
            self.metrics.stop()


def _prepare_sockets(config: ServeConfig) -> None:
    _prepare_socket(config.socket)
    if config.tenants or os.path.exists(auth_socket(config.socket)):
        _prepare_socket(auth_socket(config.socket))  # a stale one would lead clients into a dead handshake
    for t in config.tenants:
        _prepare_socket(tenant_socket(config.socket, t.name))


def _log_serving(config: ServeConfig, metrics: bool, started: float) -> None:
    log.info(
        "kvd %s serving on %s (host budget %d bytes, prefix reuse %s%s; metrics %s) after %.0f ms",
        __version__,
        config.socket,
        config.host_bytes,
        "on" if config.enable_prefix_reuse else "off",
        f", tenants {', '.join(t.name for t in config.tenants)}" if config.tenants else "",
        f"on http://{config.metrics_host}:{config.metrics_port}/metrics" if metrics else "off (--metrics-port)",
        (time.perf_counter() - started) * 1e3,
    )


async def _reindex(reindexing: list[Reindexing]) -> None:
    """The warm restart's pages left after the first answer, verified and indexed between calls."""
    for each in reindexing:
        await each.run()


async def _sweep_pins(tenants: Tenants) -> None:
    while True:
        await asyncio.sleep(pins.SWEEP_SECONDS)
        for manager in tenants.managers():
            manager.expire_pins(time.monotonic())


async def run(config: ServeConfig, metrics=None) -> bool:
    """Serves until SIGTERM or SIGINT; True when the remote store's client was left unclosed."""
    _prepare_sockets(config)
    started = time.perf_counter()
    daemon = _Daemon(config, metrics)
    await daemon.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sweeper = asyncio.create_task(_sweep_pins(daemon.tenants))
    watch = LoopWatch(on_stall=metrics.count_stall if metrics is not None else None)
    watch.start()
    # Everything built so far (recovered pages, servers) lives as long as the daemon.
    gc_policy = collector.Collector().install()
    _log_serving(config, metrics is not None, started)
    notify_systemd(f"READY=1\nSTATUS=serving on {config.socket}\nMAINPID={os.getpid()}")
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a repeated signal must not cut the graceful stop short
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    sweeper.cancel()
    watch.stop()
    await daemon.stop()
    gc_policy.uninstall()
    log.info("stopped")
    return daemon.store_left_open


def serve(config: ServeConfig, metrics=None) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # DEBUG is for kvd's own lines (one per call, kvd/server/service.py); grpc's would drown them.
    logging.getLogger("grpc").setLevel(max(logging.INFO, logging.getLogger().level))
    # The loop shares the GIL with the sealer and extent-builder threads; a thread that
    # holds it keeps it up to the switch interval (5 ms by default) once the loop asks,
    # and every call waits that long. 0.2 ms keeps that wait under an empty round trip.
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    if uvloop.run(run(config, metrics)):
        # The remote store's client could not be closed (its master is gone): Mooncake's
        # teardown at exit would wait on the same RPC timeouts, holding the GIL, for ~10 s.
        # Everything of kvd's own is closed and sealed by now; leave without that teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
