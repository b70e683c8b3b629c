"""Session-less admin calls (stats, verify), for the CLI and monitoring."""
from __future__ import annotations

import grpc

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
        "arena_bytes": reply.arena_bytes,
        "prefix_reuse": reply.prefix_reuse,
        "namespaces": [
            {"namespace_id": n.namespace_id, "model": n.model, "page_bytes": n.page_bytes, **_fields(n.pages)}
            for n in reply.namespaces
        ],
    }


def fetch_stats(socket: str, timeout: float = 5.0) -> dict:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            return stats_dict(kvd_pb2_grpc.KVDStub(channel).GetStats(pb.StatsRequest(), timeout=timeout))
        except grpc.RpcError as e:
            raise KVDError.from_rpc(e) from None


def verify_dict(reply: pb.VerifyPagesReply) -> dict:
    return _fields(reply)


def verify_pages(socket: str, timeout: float = 600.0) -> dict:
    """Runs VerifyPages: every published page re-hashed (~35 ms per GiB), corrupted ones dropped."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            return verify_dict(kvd_pb2_grpc.KVDStub(channel).VerifyPages(pb.VerifyPagesRequest(), timeout=timeout))
        except grpc.RpcError as e:
            raise KVDError.from_rpc(e) from None
