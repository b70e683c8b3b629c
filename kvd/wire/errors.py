"""A call the daemon refused, as whoever called it sees it: ``KVDError`` with an ``ErrorCode``.

The client library and the admin calls of ``kvd stats`` / ``verify`` / ``reset`` raise it
(``engine_client.KVDError`` is this class). Its codes are gRPC's status codes by name and
number, so messages, logs and docs read the same on both sides, but no gRPC type reaches
the caller: the transport's statuses become codes in one place (kvd/wire/status.py). The
daemon's own core errors are kvd/core/errors.py; kvd/server/service.py maps them to gRPC statuses.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(Enum):
    """Why a call failed: each of gRPC's status codes but OK, with its name and number."""

    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class KVDError(Exception):
    """A call the daemon refused; ``code`` says what kind of refusal, the message says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        if not isinstance(code, ErrorCode):
            raise TypeError(f"a KVDError's code is an ErrorCode, got {code!r}")
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
