"""`KVDLink`: an engine adapter's connection to kvd that fails open.

An engine that uses kvd as a cache must keep serving when kvd cannot: the daemon is not
started yet, stopped, hung, restarting or refusing a call. The link opens a session and
registers the adapter's namespace on first use (that first connect is waited for, at most
`connect_timeout + call_timeout`, so an engine that starts beside a running daemon hits
from its first request). After that, a thread of the link's own keeps it connected:
while the link has no live session it opens one at once, then every `retry_seconds`,
doubling up to `max_retry_seconds`, and leaves it for the engine's next call to take;
while it has one, it checks every `retry_seconds` that the session still lives. So no
later engine call waits for a connect, and the first call after kvd is back finds a
session ready.

`attempt` is the one door for every call: it answers `None` when kvd cannot serve. A call
that finds the daemon gone, or that takes longer than `call_timeout` (a daemon that
hangs), drops the session locally, without a call to the daemon that just failed to
answer: the daemon ends the session, and whatever the call did with it, once it sees
the session's stream end. So a hung daemon costs the engine one call timeout, then kvd is
skipped until the thread has a new session. One warning is logged per outage, and one
line when kvd is back. A call that takes over `SLOW_CALL_SECONDS` is logged with its time
(the daemon logs its own side of a call over a second, kvd/server/service.py, and a loop
held that long, kvd/server/loop_watch.py: a slow call neither logs waited for CPU or in
transport). A call the daemon refuses for another reason (budget exhausted, a
sequence it no longer knows) is logged and also answers `None`, as does a call that maps
kvd's pages into this process (`maps_memory`: the worker half's) and cannot.

`session` names the current session: sequences and pins belong to it and end with it.
One thread makes the link's calls (the engine's, or one the adapter keeps for them);
any thread may read `session`, `instance` and `page_keys`.

`instance` names the daemon instance of the current session (`SessionOpened.daemon_instance`):
page ids are meaningful only within one instance, so processes that hand page ids to each
other (vLLM's scheduler and workers) compare it. `serving_instance()` says the same for a
process that reports whether its link can serve (vLLM's workers to the scheduler).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from engine_client import ErrorCode, KVDClient, KVDError, PageLayout

log = logging.getLogger(__name__)

T = TypeVar("T")

# A call that fails with one of these has no session behind it any more.
SLOW_CALL_SECONDS = 1.0
SESSION_GONE = (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED)


@dataclass(frozen=True)
class NamespaceSpec:
    """What `register_namespace` is called with: everything that makes KV bytes equal."""

    model: str
    layout: PageLayout
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    attention: str = "gqa"  # "mla" for latent pages (kvd/wire/layout.py)
    extra: tuple[tuple[str, str], ...] = ()  # engine-specific identity, e.g. a page byte order

    def register(self, client: KVDClient) -> int:
        """Registers this namespace in the client's session; its id there."""
        return client.register_namespace(
            self.model,
            self.layout,
            revision=self.revision,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            attention=self.attention,
            extra=dict(self.extra),
        )

    def of_rank(self, tp_rank: int) -> NamespaceSpec:
        """The namespace of tensor-parallel rank `tp_rank`'s pages (its own KV heads)."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {self.tp_size})")
        return dataclasses.replace(self, tp_rank=tp_rank)


@dataclass(frozen=True)
class _Session:
    """A session with the namespace registered in it."""

    client: KVDClient
    namespaces: tuple[int, ...]  # the link's namespace first, then its peers

    @property
    def alive(self) -> bool:
        return not self.client.session_lost.is_set()


class KVDLink:
    """A lazily opened, self-healing session with its namespace registered (and `peers`,
    other namespaces its calls name too: the scheduler half's, every tensor-parallel rank's)."""

    def __init__(
        self,
        socket: str | None,
        client_name: str,
        namespace: NamespaceSpec,
        retry_seconds: float = 0.5,
        max_retry_seconds: float = 5.0,
        connect_timeout: float = 2.0,
        call_timeout: float = 5.0,
        peers: tuple[NamespaceSpec, ...] = (),
    ) -> None:
        self.socket = socket
        self.client_name = client_name
        self.namespace = namespace
        self.peers = peers
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self._session: _Session | None = None  # the calling thread's alone: only it sets and drops it
        self._opened: _Session | None = None  # opened by the reconnect thread, not taken yet; under _lock
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._first_try = threading.Event()  # the reconnect thread tried once
        self._reconnector: threading.Thread | None = None
        self._why_down = "no connect finished"
        self._warned = False
        # kvd names sequences per namespace, not per session: ours carry this process's mark
        self.seq_prefix = f"{client_name}-{os.getpid()}-{secrets.token_hex(4)}/"

    @property
    def session(self) -> str:
        current = self._session  # read once: another thread may read while the link's thread drops it
        return current.client.session if current is not None else ""

    @property
    def instance(self) -> str:
        current = self._session
        return current.client.daemon_instance if current is not None else ""

    def page_keys(self, token_ids, extra_keys, first_page: int = 0, parent: bytes | None = None) -> list[bytes] | None:
        """kvd's keys of these tokens' full pages in the link's namespace (computed here, no
        call: any thread may ask), or None before the first session."""
        current = self._session
        if current is None:
            return None
        return current.client.page_keys(
            current.namespaces[0], token_ids, extra_keys, first_page=first_page, parent=parent
        )

    def seq_id(self, request_id: str) -> str:
        """The kvd sequence id of an engine request, unique to this link."""
        return self.seq_prefix + request_id

    def attempt(self, what: str, action: Callable[[KVDClient, int], T], maps_memory: bool = False) -> T | None:
        """`action(client, namespace_id)`, or None when kvd cannot serve it now (`attempt_all`)."""
        return self.attempt_all(what, lambda client, namespaces: action(client, namespaces[0]), maps_memory)

    def attempt_all(
        self, what: str, action: Callable[[KVDClient, tuple[int, ...]], T], maps_memory: bool = False
    ) -> T | None:
        """`action(client, namespace_ids)` (the link's namespace, then its peers'), or None
        when kvd cannot serve it now.

        An action that `maps_memory` (maps kvd's pages into this process, registers them
        with CUDA) fails open on any error, not only kvd's: a page that cannot be mapped
        is a failed copy, logged, never the engine's crash. Any other action's own error
        is a bug and is raised."""
        current = self._current()
        if current is None:
            return None
        start = time.perf_counter()
        try:
            return action(current.client, current.namespaces)
        except KVDError as e:
            if e.code in SESSION_GONE:
                self._drop(f"{what}: {e.message}")
                self._warn_once()
            else:
                log.warning("kvd refused %s: %s", what, e)
            return None
        except Exception as e:
            if not maps_memory:
                raise
            log.warning("kvd %s failed: %s", what, e)
            return None
        finally:
            seconds = time.perf_counter() - start
            if seconds > SLOW_CALL_SECONDS:
                log.warning("kvd %s took %.2f s (timeout %g s)", what, seconds, self.call_timeout)

    def serving_instance(self) -> str:
        """The daemon instance this link's calls go to now, "" while kvd cannot serve them
        (takes a session the reconnect thread opened; waits only for the first connect)."""
        self._current()
        return self.instance

    def _current(self) -> _Session | None:
        """The live session calls use now, or None. The first use starts the reconnect
        thread and waits for its first try (a bounded while); later ones take what it
        opened, never wait."""
        if self._reconnector is None:
            self._reconnector = threading.Thread(target=self._keep_connected, name="kvd-link", daemon=True)
            self._reconnector.start()
            self._first_try.wait(self.connect_timeout + self.call_timeout)
        if self._session is not None and not self._session.alive:
            self._drop("the session ended")
        if self._session is None:
            with self._lock:
                opened, self._opened = self._opened, None
            if opened is not None:
                self._adopt(opened)  # should it have ended meanwhile, the call fails and drops it
            else:
                self._warn_once()
        return self._session

    def _warn_once(self) -> None:
        """One warning per outage: the first time a call finds kvd unable to serve."""
        if not self._warned:
            log.warning(
                "kvd on %s cannot serve (%s); the engine computes without it and reconnects in the background",
                self.socket or "the default socket",
                self._why_down,
            )
            self._warned = True

    def _adopt(self, opened: _Session) -> None:
        self._session = opened
        if self._warned:
            log.warning(
                "kvd on %s is back (daemon instance %s); prefix hits resume",
                self.socket or "the default socket",
                self.instance,
            )
        self._warned = False

    def _drop(self, why: str) -> None:
        """Lets the session go without a call to the daemon (it may be the one not answering);
        the reconnect thread opens the next one."""
        self._session.client.drop()
        self._session, self._why_down = None, why

    def _keep_connected(self) -> None:
        """The reconnect thread: while the link has no live session (neither the engine's
        nor one waiting for it), opens one at once, then again after each `delay`."""
        delay = self.retry_seconds
        while not self._closing.is_set():
            if self._has_live_session():
                delay = self.retry_seconds
                self._closing.wait(self.retry_seconds)
                continue
            try:
                opened = self._open()
            except Exception:  # noqa: BLE001 - a bug in one try must not end the reconnects
                log.exception("kvd link: a reconnect failed unexpectedly")
                opened = None
            self._first_try.set()
            if opened is None:
                self._closing.wait(delay)
                delay = min(delay * 2, self.max_retry_seconds)
        self._first_try.set()

    def _has_live_session(self) -> bool:
        current = self._session
        with self._lock:
            if self._opened is not None and not self._opened.alive:
                self._opened.client.drop()
                self._opened = None
            return self._opened is not None or (current is not None and current.alive)

    def _open(self) -> _Session | None:
        """Opens a session and registers the namespace, for the engine's thread to take;
        None (and why, in `_why_down`) when kvd cannot."""
        try:
            client = KVDClient.connect(self.socket, client_name=self.client_name, timeout=self.connect_timeout)
        except KVDError as e:
            self._why_down = f"cannot connect: {e.message}"
            return None
        client.call_timeout = self.call_timeout
        try:
            namespaces = tuple(spec.register(client) for spec in (self.namespace, *self.peers))
        except KVDError as e:
            client.drop()
            self._why_down = f"cannot register the namespace: {e.message}"
            return None
        opened = _Session(client, namespaces)
        with self._lock:
            if self._closing.is_set():
                client.close()
            else:
                self._opened = opened
        return opened

    def close(self) -> None:
        """Ends the link: its reconnect thread stops (a connect under way is waited for at
        most `connect_timeout` more), and its session is closed."""
        self._closing.set()
        if self._reconnector is not None:
            self._reconnector.join(timeout=self.connect_timeout)
        with self._lock:
            opened, self._opened = self._opened, None
        for s in (self._session, opened):
            if s is not None:
                s.client.close()
        self._session = None
