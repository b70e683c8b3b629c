"""gRPC's status codes as ``ErrorCode``s (kvd/wire/errors.py): the one conversion, used by
the client's transport (engine_client/connection.py) and the admin calls (kvd/wire/admin.py),
so that no gRPC type reaches whoever catches a ``KVDError``.
"""

from __future__ import annotations

import grpc

from kvd.wire.errors import ErrorCode, KVDError


def error_from_rpc(e: grpc.RpcError) -> KVDError:
    """The ``KVDError`` a failed call raises: its status as the code of the same name
    (``ErrorCode`` mirrors every status but OK), its details as the message."""
    return KVDError(ErrorCode[e.code().name], e.details() or "")
