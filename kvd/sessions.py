"""Sessions (client leases).

A session owns the sequences it allocated and the pins it took (kept in kvd/pins.py).
It lives exactly as long as the client's OpenSession stream; when that ends for any
reason the manager drops everything the session owned. Session tokens are random and unguessable.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.errors import NotFound
from kvd.types import NamespaceId, SeqId, SessionId

UNKNOWN_SESSION = (
    "unknown session; open one with OpenSession and keep its stream open "
    "(a daemon restart or a closed stream ends sessions)"
)

# Called with (namespace, evicted seq ids) when the daemon evicts a session's sequences.
EvictionListener = Callable[[NamespaceId, list[SeqId]], None]


@dataclass
class Session:
    id: SessionId
    client_name: str
    pid: int
    opened_at: float = field(default_factory=time.monotonic)
    sequences: set[tuple[NamespaceId, SeqId]] = field(default_factory=set)
    listener: EvictionListener | None = None
    closed_by_client: bool = False  # CloseSession was called: the stream's end is no crash


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[SessionId, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def open(self, client_name: str, pid: int) -> Session:
        session = Session(SessionId(secrets.token_hex(16)), client_name, pid)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(SessionId(session_id))
        if session is None:
            raise NotFound(UNKNOWN_SESSION)
        return session

    def remove(self, session: Session) -> None:
        del self._sessions[session.id]
