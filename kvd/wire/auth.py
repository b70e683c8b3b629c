"""The client half of the tenant handshake (the daemon's half: kvd/server/handshake.py), shared by
the client library and the daemon's admin commands.

A daemon that isolates tenants listens on ``<socket>.auth`` beside its gRPC socket. The
client connects, sends nothing, and reads one line: ``OK <ticket>`` or ``DENIED <why>``.
The kernel tells the daemon who connected (SO_PEERCRED), which grpc-python cannot; the
ticket, redeemed once by ``OpenSession`` (or an admin call), carries that identity over.
The answer also names the tenant, whose own socket is where the session must live: only
there are its session ids valid (kvd/cache/tenants.py).
"""

from __future__ import annotations

import errno
import os
import socket as socket_mod
from dataclasses import dataclass

from kvd.wire.errors import ErrorCode, KVDError
from kvd.wire.paths import auth_socket, tenant_socket

MAX_ANSWER = 4096


@dataclass(frozen=True)
class Admission:
    """What the handshake gave this process."""

    ticket: str  # single-use; "" from a daemon without tenants
    session_socket: str  # where to open a session: the tenant's socket, else the daemon's own
    tenant: str = ""  # the tenant the daemon put this process in; "" without tenants (or for an admin)


def fetch_ticket(socket: str, timeout: float = 5.0) -> str:
    """A single-use ticket from the daemon on ``socket``; "" when it has no tenants (no auth socket)."""
    return admit(socket, timeout).ticket


def admit(socket: str, timeout: float = 5.0) -> Admission:
    """The handshake with the daemon on ``socket`` (nothing to do when it has no tenants)."""
    path = auth_socket(socket)
    if not os.path.exists(path):
        return Admission("", socket)
    answer = b""
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            while not answer.endswith(b"\n") and len(answer) < MAX_ANSWER:
                chunk = sock.recv(MAX_ANSWER)
                if not chunk:
                    break
                answer += chunk
        except OSError as e:
            code = ErrorCode.PERMISSION_DENIED if e.errno == errno.EACCES else ErrorCode.UNAVAILABLE
            raise KVDError(code, f"the tenant handshake on {path} failed: {e.strerror or e}") from None
    line = answer.decode(errors="replace").rstrip("\n")
    if line.startswith("OK "):
        ticket, _, tenant = line[3:].partition(" ")
        return Admission(ticket, tenant_socket(socket, tenant) if tenant else socket, tenant)
    if line.startswith("DENIED "):
        raise KVDError(ErrorCode.PERMISSION_DENIED, line[7:])
    raise KVDError(ErrorCode.UNAVAILABLE, f"the tenant handshake on {path} gave no ticket (answer {line[:80]!r})")
