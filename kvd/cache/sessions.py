"""Sessions (client leases).

A session owns the sequences it allocated and the pins it took, filed with the sequences
(``SequenceTable.of_session``, kvd/cache/sequences.py) and the pins (kvd/cache/pins.py).
It lives exactly as long as the client's OpenSession stream; when that ends for any
reason the manager drops everything the session owned. Session tokens are random and unguessable.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.cache.token_buffers import TokenBuffer
from kvd.core.errors import NotFound
from kvd.core.types import NamespaceId, SeqId, SessionId

log = logging.getLogger(__name__)

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
    listener: EvictionListener | None = None
    closed_by_client: bool = False  # CloseSession was called: the stream's end is no crash
    token_buffer: TokenBuffer | None = None  # OpenTokenBuffer: token ids of large calls (kvd/cache/token_buffers.py)


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
        log.info("session %s opened by %s (pid %d)", session.id[:8], client_name or "?", pid)
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(SessionId(session_id))
        if session is None:
            raise NotFound(UNKNOWN_SESSION)
        return session

    def set_token_buffer(self, session: Session, buffer: TokenBuffer) -> None:
        """Gives the session a new token buffer, closing its earlier one."""
        if session.token_buffer is not None:
            session.token_buffer.close()
        session.token_buffer = buffer

    def remove(self, session: Session, daemon_stopping: bool, released: tuple[int, int]) -> None:
        """Forgets the ended session (its sequences and pins are gone: ``released`` counts them)
        and logs why it ended: closed by its client, the daemon stopping, or else the client
        went away without closing it."""
        if session.token_buffer is not None:
            session.token_buffer.close()
        del self._sessions[session.id]
        name = session.client_name or "?"
        if session.closed_by_client:
            log.info("session %s of %s closed", session.id[:8], name)
        elif daemon_stopping:
            log.info("session %s of %s ended: the daemon is stopping", session.id[:8], name)
        else:
            log.warning(
                "session %s of %s (pid %d) ended without a close: the client crashed, was killed or lost "
                "its connection; released %d sequences and %d pins",
                session.id[:8],
                name,
                session.pid,
                *released,
            )
