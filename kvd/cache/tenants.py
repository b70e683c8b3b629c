"""Tenants: which cache a session may see, and the tickets that prove who opened it.

A daemon configured with ``[tenants.NAME]`` tables (kvd/config.py) keeps one
``KVCacheManager`` per tenant, each over its own ``Arena``: its own extents (named
``{shm_prefix}-t-{NAME}-N``, group-owned by the tenant's group, mode 0660, their metadata
0600), its own prefix index, namespaces, pins and host budget. Isolation therefore needs
no check inside the core: a lookup, pin, allocation or eviction in tenant A runs on A's
manager and cannot reach B's pages, and the OS refuses to map B's extents to A's users.

A process proves its tenant through the handshake on ``<socket>.auth`` (kvd/server/handshake.py):
the daemon reads the peer's uid, gid and pid from the kernel and answers with a ticket and
the tenant's name. The tenant's sessions live on a socket of its own,
``<socket>.t-<NAME>`` (kvd/wire/paths.py), group-owned by the tenant's group with mode
0660: ``OpenSession`` redeems the ticket there, every later call names the session, and
this module routes it to the tenant's manager only when it arrived on that socket.

Why a socket per tenant: a session id is a bearer token, and grpc-python tells a handler
nothing about the process calling (``context.peer()`` is ``unix:`` for every client, the
auth context of a unix socket names no user). Which socket a call came in on is the one
thing the kernel vouches for per call, and the kernel lets only the tenant's group connect
to the tenant's socket. So a session id that leaks to another tenant's process is useless
to it: on its own socket, or on the daemon's main one, the id is as unknown as one never
issued (NOT_FOUND, the same message). Within a tenant the id stays a bearer token: every
process of the tenant's group may connect to the socket. A tenant without ``group`` gets a
socket as open as the daemon's main one (the daemon's group), like its extents, so a
leaked id then reaches its sessions from any process of the daemon's group.

The tenant of a peer is the one listing its uid, else the one listing its primary gid,
else the one listing one of its supplementary groups (a peer in groups of two tenants
must be listed by uid); a peer matching none is refused.

Admin calls without a session (daemon-wide ``GetStats``, ``CheckInvariants``,
``VerifyPages``: ``kvd stats``, ``kvd verify``) cover every tenant, so they need an admin
ticket, which only the daemon's own uid and root get.

Without tenants there is one implicit tenant, no handshake and no ticket: every session
reaches the single manager.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvd.cache.manager import KVCacheManager
from kvd.cache.sessions import UNKNOWN_SESSION, Session
from kvd.config import TenantConfig
from kvd.core.errors import NotFound, PermissionDenied
from kvd.core.types import SessionId

IMPLICIT = ""  # the one tenant of a daemon without [tenants]
TICKET_SECONDS = 10.0  # a ticket is redeemed right after the handshake; longer only widens theft


def tenant_prefix(shm_prefix: str, tenant: str) -> str:
    """Shared-memory name prefix of one tenant's extents."""
    return f"{shm_prefix}-t-{tenant}"


@dataclass(frozen=True)
class Peer:
    """Credentials the kernel reported for a connecting process (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()  # supplementary groups (SO_PEERGROUPS)


@dataclass(frozen=True)
class Ticket:
    token: str
    peer: Peer
    tenant: str | None  # None: an admin ticket of a uid that belongs to no tenant
    admin: bool
    expires_at: float


class TicketBook:
    """Single-use, short-lived tickets: redeeming one removes it."""

    def __init__(self, ttl: float = TICKET_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._tickets: dict[str, Ticket] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def issue(self, peer: Peer, tenant: str | None, admin: bool) -> Ticket:
        now = self.clock()
        self._tickets = {k: t for k, t in self._tickets.items() if t.expires_at > now}  # forget unused ones
        ticket = Ticket(secrets.token_hex(16), peer, tenant, admin, now + self.ttl)
        self._tickets[ticket.token] = ticket
        return ticket

    def redeem(self, token: str) -> Ticket:
        if not token:
            raise PermissionDenied(
                "this daemon isolates tenants: get a ticket from the handshake on '<socket>.auth' first "
                "(engine_client's KVDClient.connect does it)"
            )
        ticket = self._tickets.pop(token, None)
        if ticket is None:
            raise PermissionDenied("unknown ticket: a ticket is single-use; do the handshake again")
        if ticket.expires_at <= self.clock():
            raise PermissionDenied(f"the ticket expired ({self.ttl:g} s after the handshake); do the handshake again")
        return ticket


class Tenants:
    """The managers of a daemon by tenant, and which tenant each open session belongs to."""

    def __init__(
        self,
        managers: dict[str, KVCacheManager],
        configs: tuple[TenantConfig, ...] = (),
        admin_uids: frozenset[int] | None = None,
        tickets: TicketBook | None = None,
    ) -> None:
        assert configs or list(managers) == [IMPLICIT], "a daemon without tenants has exactly the implicit one"
        assert not configs or set(managers) == {t.name for t in configs}, "one manager per configured tenant"
        self._managers = managers
        self.isolated = bool(configs)
        self._by_uid = {uid: t.name for t in configs for uid in t.uids}
        self._by_gid = {gid: t.name for t in configs for gid in t.gids}
        self.admin_uids = frozenset({0, os.getuid()}) if admin_uids is None else admin_uids
        self.tickets = tickets or TicketBook()
        self._session_tenant: dict[SessionId, str] = {}

    def items(self) -> Iterator[tuple[str, KVCacheManager]]:
        return iter(list(self._managers.items()))

    def managers(self) -> list[KVCacheManager]:
        return list(self._managers.values())

    def tenant_of(self, peer: Peer) -> str | None:
        """By uid, else primary gid, else supplementary groups; raises when those name two tenants."""
        tenant = self._by_uid.get(peer.uid, self._by_gid.get(peer.gid))
        if tenant is not None:
            return tenant
        by_groups = sorted({self._by_gid[g] for g in peer.groups if g in self._by_gid})
        if len(by_groups) > 1:
            raise PermissionDenied(
                f"uid {peer.uid} is in groups of tenants {', '.join(by_groups)}; list the uid in one "
                "[tenants.NAME] table to choose"
            )
        return by_groups[0] if by_groups else None

    # ---- handshake and sessions ---------------------------------------------------

    def handshake(self, peer: Peer) -> Ticket:
        """A ticket for the peer's tenant (and admin rights for the daemon's uid or root)."""
        tenant, admin = self.tenant_of(peer), peer.uid in self.admin_uids
        if tenant is None and not admin:
            raise PermissionDenied(
                f"uid {peer.uid} (gid {peer.gid}) belongs to no tenant of this daemon; "
                "ask its operator to add it to a [tenants.NAME] table"
            )
        return self.tickets.issue(peer, tenant, admin)

    def open_session(
        self, ticket: str, client_name: str, pid: int, socket_tenant: str | None
    ) -> tuple[KVCacheManager, Session]:
        """A session of the ticket's tenant; ``socket_tenant``: the tenant whose socket the
        call came in on (None: the main socket of a daemon with tenants, which holds none)."""
        if not self.isolated:
            manager = self._managers[IMPLICIT]
            return manager, manager.open_session(client_name, pid)
        t = self.tickets.redeem(ticket)
        if t.tenant is None:
            raise PermissionDenied(
                f"uid {t.peer.uid} (gid {t.peer.gid}) belongs to no tenant of this daemon; it may only make "
                "admin calls (stats, verify)"
            )
        if pid and pid != t.peer.pid:
            raise PermissionDenied(f"the ticket was issued to pid {t.peer.pid}, not pid {pid}")
        if t.tenant != socket_tenant:
            raise PermissionDenied(
                f"tenant {t.tenant}'s sessions open on its own socket '<socket>.t-{t.tenant}', which the handshake "
                "names (engine_client's KVDClient.connect goes there)"
            )
        manager = self._managers[t.tenant]
        session = manager.open_session(client_name, t.peer.pid)
        self._session_tenant[session.id] = t.tenant
        return manager, session

    def close_session(self, manager: KVCacheManager, session_id: SessionId, daemon_stopping: bool = False) -> None:
        self._session_tenant.pop(session_id, None)
        manager.close_session(session_id, daemon_stopping)

    def manager_for(self, session_id: str, socket_tenant: str | None) -> KVCacheManager:
        """The manager of the session's tenant when the call came in on that tenant's
        socket; the manager itself checks the session. A session of another tenant is
        refused exactly like one that does not exist: the caller learns nothing."""
        if not self.isolated:
            return self._managers[IMPLICIT]
        tenant = self._session_tenant.get(SessionId(session_id))
        if tenant is None or tenant != socket_tenant:
            raise NotFound(UNKNOWN_SESSION)
        return self._managers[tenant]

    def manager_by_ticket(self, ticket: str) -> KVCacheManager:
        """The cache of the ticket's tenant, for a call that needs no session (a router's
        Prewarm): the caller's uid picks its tenant, as the handshake does. An admin ticket of
        a uid in no tenant names no cache."""
        if not self.isolated:
            return self._managers[IMPLICIT]
        t = self.tickets.redeem(ticket)
        if t.tenant is None:
            raise PermissionDenied(
                f"uid {t.peer.uid} belongs to no tenant of this daemon, so it names no tenant's cache; "
                "call from a uid of the tenant, or through a session of it"
            )
        return self._managers[t.tenant]

    def check_admin(self, ticket: str) -> None:
        """Daemon-wide admin calls: anyone without tenants, an admin ticket with them."""
        if self.isolated and not self.tickets.redeem(ticket).admin:
            raise PermissionDenied(
                "daemon-wide admin calls (stats, verify, invariants of every tenant) are for the daemon's "
                "own uid or root; a tenant passes its session to see its own stats"
            )
