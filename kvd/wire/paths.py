"""Where daemon and clients meet: part of the contract, like the proto.

Daemon (``kvd serve``), CLI (``kvd stats``, ``verify``, ``clean``) and client
(``KVDClient.connect``) find the socket in one order, the first that gives a path wins:

1. the ``--socket`` flag, or the ``socket`` argument of ``KVDClient.connect``;
2. ``$KVD_SOCKET``;
3. ``socket`` in the config file: ``$KVD_CONFIG``, else ``/etc/kvd/kvd.toml`` when it exists;
4. ``/run/kvd/kvd.sock`` when it exists (the system service, systemd/kvd.service);
5. the per-user default: ``$XDG_RUNTIME_DIR/kvd.sock`` when that directory exists,
   else ``/tmp/kvd-<uid>.sock``.

The daemon reads its whole configuration in the same order (kvd/config.py), so a daemon
and a client given the same environment always meet.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SYSTEM_SOCKET = "/run/kvd/kvd.sock"
DEFAULT_CONFIG_FILE = "/etc/kvd/kvd.toml"


def user_socket() -> str:
    """$XDG_RUNTIME_DIR/kvd.sock when that directory exists, else /tmp/kvd-<uid>.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvd.sock")
    return f"/tmp/kvd-{os.getuid()}.sock"


def default_socket() -> str:
    """Steps 4 and 5: the system service's socket when it exists, else the per-user one."""
    return SYSTEM_SOCKET if os.path.exists(SYSTEM_SOCKET) else user_socket()


def config_file(environ=None, given: str | None = None) -> str | None:
    """The config file to read: ``given`` (``--config``), ``$KVD_CONFIG``, else the system one if present."""
    environ = os.environ if environ is None else environ
    path = given or environ.get("KVD_CONFIG")
    if path is None and os.path.exists(DEFAULT_CONFIG_FILE):
        path = DEFAULT_CONFIG_FILE
    return path


@dataclass(frozen=True)
class SocketChoice:
    """The socket found, and every step looked at on the way (for a message when nobody answers)."""

    path: str
    tried: tuple[str, ...]


def find_socket(given: str | None = None, environ=None) -> SocketChoice:
    """The client's side of the order above (the daemon and CLI merge their whole config in kvd/config.py)."""
    environ = os.environ if environ is None else environ
    tried = []
    if given:
        return SocketChoice(given, (f"socket argument {given}",))
    tried.append("no socket argument")
    if environ.get("KVD_SOCKET"):
        return SocketChoice(environ["KVD_SOCKET"], (*tried, f"KVD_SOCKET={environ['KVD_SOCKET']}"))
    tried.append("KVD_SOCKET unset")
    path = config_file(environ)
    if path is None:
        tried.append(f"no config file ({DEFAULT_CONFIG_FILE} absent, KVD_CONFIG unset)")
    else:
        try:
            with open(path, "rb") as f:
                socket = tomllib.load(f).get("socket")
        except (OSError, tomllib.TOMLDecodeError) as e:
            tried.append(f"config file {path} unreadable ({e})")
        else:
            if isinstance(socket, str) and socket:
                return SocketChoice(socket, (*tried, f"socket = {socket!r} in {path}"))
            tried.append(f"no socket in {path}")
    if os.path.exists(SYSTEM_SOCKET):
        return SocketChoice(SYSTEM_SOCKET, (*tried, f"{SYSTEM_SOCKET} (exists)"))
    tried.append(f"{SYSTEM_SOCKET} absent")
    socket = user_socket()
    return SocketChoice(socket, (*tried, f"per-user default {socket}"))


def auth_socket(socket: str) -> str:
    """The raw unix socket of the tenant handshake beside a daemon's gRPC socket (kvd/cache/tenants.py)."""
    return socket + ".auth"


def tenant_socket(socket: str, tenant: str) -> str:
    """The gRPC socket that serves one tenant's sessions (kvd/cache/tenants.py): the only socket
    on which that tenant's session ids are valid, reachable by the tenant's group only."""
    return f"{socket}.t-{tenant}"
