"""The tenant handshake: a raw unix socket beside the gRPC one that answers with a ticket.

Why a second socket: the daemon must know which OS user a client runs as to route it to
its tenant, and only the kernel can say that truthfully (SO_PEERCRED on a unix socket:
pid, uid and gid at connect time, and SO_PEERGROUPS: its supplementary groups; all
unforgeable by the client). grpc-python does not expose
the peer credentials of a unix-socket call (``context.peer()`` is just "unix:"), so the
daemon also listens on ``<socket>.auth`` (same mode as the gRPC socket). For each
connection it reads SO_PEERCRED, maps the uid/gid to a tenant (kvd/cache/tenants.py) and writes
one line, then closes::

    OK <ticket> <tenant>\\n a single-use ticket, valid for a few seconds, and the peer's tenant
    OK <ticket>\\n          an admin ticket of a uid that belongs to no tenant
    DENIED <message>\\n     the peer belongs to no tenant (and is not an admin)

The client sends nothing. It opens its session on the tenant's socket
(``tenant_socket(socket, tenant)``, kvd/wire/paths.py); ``OpenSession`` carries the
ticket, and the session belongs to the ticket's tenant. The ticket is single-use,
short-lived and checked against the pid the client reports, which catches a ticket reused
by mistake; like a session token, it is worth as much as the process holding it, so a
process should not hand it on.
engine_client does this transparently whenever ``<socket>.auth`` exists; a daemon
without tenants does not create it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket as socket_mod
import struct

from kvd.cache.tenants import Peer, Tenants
from kvd.core.errors import PermissionDenied

log = logging.getLogger(__name__)

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERGROUPS = getattr(socket_mod, "SO_PEERGROUPS", 59)  # Linux ≥ 4.13; Python 3.11 does not name it
_MAX_GROUPS = 65536  # NGROUPS_MAX


def peer_of(sock: socket_mod.socket) -> Peer:
    pid, uid, gid = _CREDS.unpack(sock.getsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_PEERCRED, _CREDS.size))
    return Peer(pid, uid, gid, _peer_groups(sock))


def _peer_groups(sock: socket_mod.socket) -> tuple[int, ...]:
    """The peer's supplementary groups as the kernel recorded them at connect time."""
    count = 64
    while True:
        try:
            raw = sock.getsockopt(socket_mod.SOL_SOCKET, SO_PEERGROUPS, count * 4)
        except OSError as e:
            if e.errno != errno.ERANGE or count >= _MAX_GROUPS:
                raise
            count *= 16  # more groups than the buffer holds
            continue
        return struct.unpack(f"{len(raw) // 4}I", raw)


def answer(tenants: Tenants, peer: Peer) -> bytes:
    """The one line the daemon writes to a peer."""
    try:
        ticket = tenants.handshake(peer)
    except PermissionDenied as e:
        log.warning("handshake refused pid %d uid %d gid %d: %s", peer.pid, peer.uid, peer.gid, e)
        return f"DENIED {e}\n".encode()
    log.info(
        "handshake: pid %d uid %d → tenant %s%s", peer.pid, peer.uid, ticket.tenant, " (admin)" if ticket.admin else ""
    )
    return f"OK {ticket.token}{'' if ticket.tenant is None else ' ' + ticket.tenant}\n".encode()


async def listen(path: str, mode: int, tenants: Tenants) -> asyncio.AbstractServer:
    """Starts answering handshakes on ``path`` (created with ``mode``)."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(answer(tenants, peer_of(writer.get_extra_info("socket"))))
            await writer.drain()
        except OSError:
            pass  # the peer left before its answer
        finally:
            writer.close()

    old_umask = os.umask(0o177)  # nobody connects before the chmod below
    try:
        server = await asyncio.start_unix_server(on_connect, path)
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    return server
