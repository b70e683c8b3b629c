"""Sessions (client leases) and the pins they hold.

A session owns the sequences it allocated and the pins it took. It lives exactly as
long as the client's OpenSession stream; when that ends for any reason the manager
drops everything the session owned. Session tokens are random and unguessable.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.errors import NotFound, PermissionDenied
from kvd.token_buffers import TokenBuffer
from kvd.types import NamespaceId, PageId, PinId, SeqId, SessionId


@dataclass
class Pin:
    id: PinId
    session: SessionId
    namespace: NamespaceId
    pages: list[PageId]
    expires_at: float | None  # time.monotonic() deadline, None: until unpinned


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
    pins: dict[PinId, Pin] = field(default_factory=dict)
    listener: EvictionListener | None = None
    closed_by_client: bool = False  # CloseSession was called: the stream's end is no crash
    token_buffer: TokenBuffer | None = None  # OpenTokenBuffer: token ids of large calls (kvd/token_buffers.py)


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[SessionId, Session] = {}
        self._pin_ids = itertools.count(1)

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

    def new_pin_id(self) -> PinId:
        return PinId(next(self._pin_ids))

    def pin_of(self, session: Session, pin_id: int) -> Pin:
        pin = session.pins.get(PinId(pin_id))
        if pin is not None:
            return pin
        if any(PinId(pin_id) in s.pins for s in self._sessions.values()):
            raise PermissionDenied(f"pin {pin_id} belongs to another session")
        raise NotFound(f"pin {pin_id} does not exist (never taken, unpinned or expired)")

    def expired_pins(self, now: float) -> list[Pin]:
        return [
            pin
            for s in self._sessions.values()
            for pin in s.pins.values()
            if pin.expires_at is not None and pin.expires_at <= now
        ]
