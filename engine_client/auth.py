"""The client half of the tenant handshake (the daemon's half: kvd/handshake.py).

A daemon that isolates tenants listens on ``<socket>.auth`` beside its gRPC socket. The
client connects, sends nothing, and reads one line: ``OK <ticket>`` or ``DENIED <why>``.
The kernel tells the daemon who connected (SO_PEERCRED), which grpc-python cannot; the
ticket, redeemed once by ``OpenSession`` (or an admin call), carries that identity over.
"""
from __future__ import annotations

import errno
import os
import socket as socket_mod

import grpc

from engine_client.types import KVDError
from kvd.wire.paths import auth_socket

MAX_ANSWER = 4096


def fetch_ticket(socket: str, timeout: float = 5.0) -> str:
    """A single-use ticket from the daemon on ``socket``; "" when it has no tenants (no auth socket)."""
    path = auth_socket(socket)
    if not os.path.exists(path):
        return ""
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
            code = grpc.StatusCode.PERMISSION_DENIED if e.errno == errno.EACCES else grpc.StatusCode.UNAVAILABLE
            raise KVDError(code, f"the tenant handshake on {path} failed: {e.strerror or e}") from None
    line = answer.decode(errors="replace").rstrip("\n")
    if line.startswith("OK "):
        return line[3:]
    if line.startswith("DENIED "):
        raise KVDError(grpc.StatusCode.PERMISSION_DENIED, line[7:])
    raise KVDError(grpc.StatusCode.UNAVAILABLE, f"the tenant handshake on {path} gave no ticket (answer {line[:80]!r})")
