"""Session-less admin calls (stats, verify), for the CLI and monitoring.

A daemon with tenants answers them only for its own uid or root: each call first fetches
an admin ticket through the handshake (engine_client/auth.py), when the daemon has one.
"""
from __future__ import annotations

import grpc

from engine_client.auth import fetch_ticket
from engine_client.types import KVDError
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def stats_dict(reply: pb.StatsReply) -> dict:
    """The flat JSON form: totals at top level, one entry per namespace."""
    return {
        **_fields(reply.totals),
        "host_bytes": reply.host_bytes,
        "host_bytes_used": reply.host_bytes_used,
        "host_bytes_free": reply.host_bytes_free,
        "arena_bytes": reply.arena_bytes,
        "prefix_reuse": reply.prefix_reuse,
        "namespaces": [
            {"namespace_id": n.namespace_id, "model": n.model, "page_bytes": n.page_bytes, **_fields(n.pages),
             **({"tenant": n.tenant} if n.tenant else {})}
            for n in reply.namespaces
        ],
    }


def fetch_stats(socket: str, timeout: float = 5.0) -> dict:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            request = pb.StatsRequest(ticket=fetch_ticket(socket, timeout))
            return stats_dict(kvd_pb2_grpc.KVDStub(channel).GetStats(request, timeout=timeout))
        except grpc.RpcError as e:
            raise KVDError.from_rpc(e) from None


def verify_dict(reply: pb.VerifyPagesReply) -> dict:
    return _fields(reply)


def verify_pages(socket: str, timeout: float = 600.0) -> dict:
    """Runs VerifyPages: every published page re-hashed (~35 ms per GiB), corrupted ones dropped."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            request = pb.VerifyPagesRequest(ticket=fetch_ticket(socket))
            return verify_dict(kvd_pb2_grpc.KVDStub(channel).VerifyPages(request, timeout=timeout))
        except grpc.RpcError as e:
            raise KVDError.from_rpc(e) from None
