"""A daemon's health, asked over its unix socket without a session: whether it serves (gRPC
health: ``kvd health``, the readiness probe of deploy/kubernetes/) and what it is (Ping's
facts: its version and memory locking, for ``kvd doctor``).

The daemon reports SERVING once its sockets accept calls and NOT_SERVING from the moment a
graceful stop begins (kvd/server/daemon.py), so a probe stops sending engines to a daemon that
is going away before its socket does.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.status import error_from_rpc

SERVICE = pb.DESCRIPTOR.services_by_name["KVD"].full_name  # the service whose health kvd reports


def health_status(socket: str, timeout: float = 5.0) -> str:
    """The health of kvd's service on ``socket`` (``SERVING``, ``NOT_SERVING``, ...); a
    ``KVDError`` when nothing answers there within ``timeout`` seconds."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@dataclass(frozen=True)
class DaemonFacts:
    """What a daemon says of itself (Ping); empty from a daemon older than these fields."""

    version: str  # its kvd version
    lock_memory: bool  # its lock_memory setting
    unlocked_bytes: int  # bytes of its host budget its RLIMIT_MEMLOCK leaves unlocked (0: none)


def daemon_facts(socket: str, timeout: float = 5.0) -> DaemonFacts:
    """What the daemon on ``socket`` says of itself: its version and memory locking."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            reply = kvd_pb2_grpc.KVDStub(channel).Ping(pb.PingRequest(), timeout=timeout)
            return DaemonFacts(reply.version, reply.lock_memory, reply.unlocked_bytes)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
