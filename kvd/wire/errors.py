"""A call the daemon refused, as whoever called it sees it: the client library and the
admin calls of ``kvd stats`` / ``verify`` / ``reset`` raise it (``engine_client.KVDError``
is this class). The daemon's own core errors are kvd/errors.py; kvd/service.py maps them
to the gRPC status this error carries.
"""

from __future__ import annotations

import grpc


class KVDError(Exception):
    """A call the daemon refused; ``code`` is the gRPC status, the message says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> KVDError:
        return cls(e.code(), e.details() or "")
