"""Where daemon and clients meet by default: part of the contract, like the proto."""
from __future__ import annotations

import os


def default_socket() -> str:
    """$XDG_RUNTIME_DIR/kvd.sock when that directory exists, else /tmp/kvd-<uid>.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvd.sock")
    return f"/tmp/kvd-{os.getuid()}.sock"


def auth_socket(socket: str) -> str:
    """The raw unix socket of the tenant handshake beside a daemon's gRPC socket (kvd/tenants.py)."""
    return socket + ".auth"


def tenant_socket(socket: str, tenant: str) -> str:
    """The gRPC socket that serves one tenant's sessions (kvd/tenants.py): the only socket
    on which that tenant's session ids are valid, reachable by the tenant's group only."""
    return f"{socket}.t-{tenant}"
