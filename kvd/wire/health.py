"""A daemon's health, asked over its unix socket without a session: whether it serves (gRPC
health: ``kvd health``, the readiness probe of deploy/kubernetes/) and what it is (Ping's
facts: its version and memory locking, for ``kvd doctor``).

The daemon reports SERVING once its sockets accept calls and NOT_SERVING from the moment a
graceful stop begins (kvd/server.py), so a probe stops sending engines to a daemon that
is going away before its socket does.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.errors import KVDError

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
            raise KVDError.from_rpc(e) from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def daemon_facts(socket: str, timeout: float = 5.0) -> pb.PingReply:
    """What the daemon on ``socket`` says of itself (Ping): its version and memory locking;
    empty fields from a daemon older than them."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            return kvd_pb2_grpc.KVDStub(channel).Ping(pb.PingRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise KVDError.from_rpc(e) from None
