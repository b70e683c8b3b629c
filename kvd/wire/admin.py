"""Session-less admin calls (stats, verify, reset), for ``kvd stats`` / ``verify`` / ``reset``,
monitoring, and the client library's ``stats()`` / ``verify()`` / ``reset_prefix_cache()``,
and their replies as the typed dicts of kvd/wire/reports.py. It lives in kvd/wire/ so that
the daemon's CLI uses it without depending on the client.

A daemon with tenants answers them only for its own uid or root: each call first fetches
an admin ticket through the handshake (kvd/wire/auth.py), when the daemon has one.
"""

from __future__ import annotations

import grpc

from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.auth import fetch_ticket
from kvd.wire.reports import RecoveryStats, ResetReport, Stats, VerifyReport
from kvd.wire.status import error_from_rpc


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


# RecoveryStats fields that count pages the last start dropped, by reason.
DROP_REASONS = {
    "corrupted": "corrupted_pages",
    "orphaned": "orphaned_pages",
    "mismatch": "mismatch_pages",
    "incomplete_extent": "incomplete_pages",
    "evicted": "evicted_pages",
}


def recovery_dict(msg: pb.RecoveryStats) -> RecoveryStats:
    """What the daemon's start found in shared memory, with the pages it dropped by reason."""
    found = _fields(msg)
    return {**found, "dropped_pages": {reason: found[name] for reason, name in DROP_REASONS.items()}}


def stats_dict(reply: pb.StatsReply) -> Stats:
    """The flat JSON form: totals at top level, one entry per namespace."""
    return {
        **_fields(reply.totals),
        "host_bytes": reply.host_bytes,
        "host_bytes_used": reply.host_bytes_used,
        "host_bytes_free": reply.host_bytes_free,
        "aux_bytes": reply.aux_bytes,
        "aux_bytes_used": reply.aux_bytes_used,
        "aux_bytes_per_sequence": reply.aux_bytes_per_sequence,
        "arena_bytes": reply.arena_bytes,
        "prefix_reuse": reply.prefix_reuse,
        "shm_refusals": reply.shm_refusals,
        "recovery": recovery_dict(reply.recovery),
        "remote": _fields(reply.remote) | {"state": reply.remote.state or "off"},
        "disk": _fields(reply.disk)
        | {"state": reply.disk.state or "off", "promotion_buckets": list(reply.disk.promotion_buckets)},
        "namespaces": [
            {
                "namespace_id": n.namespace_id,
                "model": n.model,
                "page_bytes": n.page_bytes,
                **_fields(n.pages),
                **({"tenant": n.tenant} if n.tenant else {}),
            }
            for n in reply.namespaces
        ],
    }


def _admin_call(socket: str, method: str, request, timeout: float):
    """The reply of ``method`` from the daemon on ``socket``; a ``KVDError`` when it fails."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            return getattr(kvd_pb2_grpc.KVDStub(channel), method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None


def fetch_stats(socket: str, timeout: float = 5.0) -> Stats:
    request = pb.StatsRequest(ticket=fetch_ticket(socket, timeout))
    return stats_dict(_admin_call(socket, "GetStats", request, timeout))


def verify_dict(reply: pb.VerifyPagesReply) -> VerifyReport:
    return {**_fields(reply), "recovery": recovery_dict(reply.recovery)}


def verify_pages(socket: str, timeout: float = 600.0) -> VerifyReport:
    """Runs VerifyPages: every published page re-hashed (~35 ms per GiB), corrupted ones dropped."""
    request = pb.VerifyPagesRequest(ticket=fetch_ticket(socket))
    return verify_dict(_admin_call(socket, "VerifyPages", request, timeout))


def reset_dict(reply: pb.ResetPrefixCacheReply) -> ResetReport:
    return _fields(reply)


def reset_prefix_cache(socket: str, namespace: int | None = None, timeout: float = 60.0) -> ResetReport:
    """Runs ResetPrefixCache daemon-wide (every tenant): cached pages dropped, pages in use kept."""
    request = pb.ResetPrefixCacheRequest(
        ticket=fetch_ticket(socket), has_namespace=namespace is not None, namespace_id=namespace or 0
    )
    return reset_dict(_admin_call(socket, "ResetPrefixCache", request, timeout))
