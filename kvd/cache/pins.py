"""Pins: prefixes a session keeps from eviction, with an optional time to live.

One home for pins: the ``Pin`` records, who holds which, their expiry and their page
references (through ``PagePool.acquire_all``/``release_all`` with ``pin=True``, so the
pool stays the only class that changes a refcount). The manager finds the pages a pin
covers and calls ``take``; a prewarm that brings the rest from a tier calls ``extend``
(kvd/cache/prewarm.py); a session's end calls ``drop_session``; the daemon's sweep
(kvd/server/daemon.py, every ``SWEEP_SECONDS``) calls ``expire``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvd.core.errors import NotFound, PermissionDenied
from kvd.core.eviction import release_order
from kvd.core.pool import PagePool
from kvd.core.types import NamespaceId, PageId, PinId, SessionId

SWEEP_SECONDS = 0.5  # how late an expired pin may be dropped


@dataclass
class Pin:
    id: PinId
    session: SessionId
    namespace: NamespaceId
    pages: list[PageId]
    expires_at: float | None  # time.monotonic() deadline, None: until unpinned


class PinTable:
    """Every live pin of one manager; each holds one pin reference on each of its pages."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._pins: dict[PinId, Pin] = {}
        self._ids = itertools.count(1)

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    def take(self, session: SessionId, namespace: NamespaceId, pages: list[PageId], expires_at: float | None) -> Pin:
        self._pool.acquire_all(pages, pin=True)
        pin = Pin(PinId(next(self._ids)), session, namespace, pages, expires_at)
        self._pins[pin.id] = pin
        return pin

    def extend(self, pin_id: PinId, pages: list[PageId]) -> None:
        """A pin's prefix now reaches further (``pages``: the whole prefix, the pin's own pages
        first; kvd/cache/prewarm.py brought the rest): holds the pages past the pin's, if the
        pin is still held."""
        pin = self._pins.get(pin_id)
        if pin is None:
            return
        assert pages[: len(pin.pages)] == pin.pages, f"pin {pin_id}: its prefix {pin.pages} changed under it"
        more = pages[len(pin.pages) :]
        self._pool.acquire_all(more, pin=True)
        pin.pages += more

    def of(self, session: SessionId, pin_id: int) -> Pin:
        """The session's pin ``pin_id``; another session's pin is refused, not revealed."""
        pin = self._pins.get(PinId(pin_id))
        if pin is None:
            raise NotFound(f"pin {pin_id} does not exist (never taken, unpinned or expired)")
        if pin.session != session:
            raise PermissionDenied(f"pin {pin_id} belongs to another session")
        return pin

    def held_by(self, session: SessionId) -> list[Pin]:
        return [pin for pin in self._pins.values() if pin.session == session]

    def drop(self, pin: Pin) -> None:
        self._pool.release_all(release_order(pin.pages), pin=True)
        del self._pins[pin.id]

    def drop_session(self, session: SessionId) -> int:
        """Drops every pin of a session that ended; returns how many."""
        held = self.held_by(session)
        for pin in held:
            self.drop(pin)
        return len(held)

    def expire(self, now: float) -> int:
        """Drops every pin whose deadline is at or before ``now``; returns how many."""
        due = [pin for pin in self._pins.values() if pin.expires_at is not None and pin.expires_at <= now]
        for pin in due:
            self.drop(pin)
        return len(due)
