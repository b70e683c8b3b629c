"""`KVDLink`: an engine adapter's connection to kvd that fails open.

An engine that uses kvd as a cache must keep serving when kvd cannot: the daemon is not
started yet, stopped, restarting or refusing a call. The link opens a session and
registers the adapter's namespace on first use (later reconnects run on a background
thread, so no engine call ever waits for one); when a call finds the daemon gone it
closes the session, logs one warning for the outage and answers "no result" (`None`)
until a reconnect succeeds. Reconnects are tried at most every `retry_seconds`, doubling
up to `max_retry_seconds`, so a dead daemon costs the engine one failed connect now and
then, not one per request. A call that takes longer than `call_timeout` (a daemon that
hangs) is treated the same way, and its session is closed, so whatever the call did is
dropped with it. A call the daemon refuses for another reason (budget exhausted, a
sequence it no longer knows) is logged and also answers `None`.

`session` names the current session: sequences and pins belong to it and end with it.

`instance` names the daemon instance of the current session (`SessionOpened.daemon_instance`):
page ids are meaningful only within one instance, so processes that hand page ids to each
other (vLLM's scheduler and workers) compare it.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from engine_client import KVDClient, KVDError, PageLayout

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class NamespaceSpec:
    """What `register_namespace` is called with: everything that makes KV bytes equal."""

    model: str
    layout: PageLayout
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    extra: tuple[tuple[str, str], ...] = ()  # engine-specific identity, e.g. a page byte order


class KVDLink:
    """A lazily opened, self-healing session with one namespace registered."""

    def __init__(
        self,
        socket: str | None,
        client_name: str,
        namespace: NamespaceSpec,
        retry_seconds: float = 0.5,
        max_retry_seconds: float = 5.0,
        connect_timeout: float = 2.0,
        call_timeout: float = 5.0,
    ) -> None:
        self.socket = socket
        self.client_name = client_name
        self.namespace = namespace
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self._client: KVDClient | None = None
        self._ns = 0
        self._next_try = 0.0
        self._backoff = retry_seconds
        self._warned = False
        self._ever_tried = False
        self._connecting: threading.Thread | None = None
        self._outcome: tuple[KVDClient, int] | str | None = None  # what the last connect left
        self.instance = ""
        self.session = ""
        # kvd names sequences per namespace, not per session: ours carry this process's mark
        self.seq_prefix = f"{client_name}-{os.getpid()}-{secrets.token_hex(4)}/"

    def seq_id(self, request_id: str) -> str:
        """The kvd sequence id of an engine request, unique to this link."""
        return self.seq_prefix + request_id

    def attempt(self, what: str, action: Callable[[KVDClient, int], T]) -> T | None:
        """`action(client, namespace_id)`, or None when kvd cannot serve it now."""
        if not self._ensure_connected():
            return None
        try:
            return action(self._client, self._ns)
        except KVDError as e:
            if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._lost(f"{what}: {e.message}")
            else:
                log.warning("kvd refused %s: %s", what, e)
            return None

    def _ensure_connected(self) -> bool:
        """Whether a session is ready now. Only the first connect waits (an engine that
        starts beside a running daemon hits from its first request); later ones run in the
        background, so that a daemon that hangs never stalls the engine for a connect."""
        if self._client is not None and not self._client.session_lost.is_set():
            return True
        if self._client is not None:
            self._lost("the session ended")
        if self._connecting is not None and not self._connecting.is_alive():
            self._connecting.join()
            self._connecting = None
            if self._take_outcome():
                return True
        now = time.monotonic()
        if self._connecting is not None or now < self._next_try:
            return False
        if not self._ever_tried:
            self._ever_tried = True
            self._connect()
            return self._take_outcome()
        self._connecting = threading.Thread(target=self._connect, name="kvd-link-connect", daemon=True)
        self._connecting.start()
        return False

    def _take_outcome(self) -> bool:
        """Adopts what the last connect left (True), or schedules the next try (False)."""
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, tuple):
            self._adopt(*outcome)
            return True
        self._schedule_retry(time.monotonic(), outcome or "no connect finished")
        return False

    def _connect(self) -> None:
        """Opens a session and registers the namespace; leaves (client, namespace id) or why not in `_outcome`."""
        try:
            client = KVDClient.connect(self.socket, client_name=self.client_name, timeout=self.connect_timeout)
        except KVDError as e:
            self._outcome = f"cannot connect: {e.message}"
            return
        client.call_timeout = self.call_timeout
        try:
            spec = self.namespace
            ns = client.register_namespace(
                spec.model,
                spec.layout,
                revision=spec.revision,
                tp_rank=spec.tp_rank,
                tp_size=spec.tp_size,
                extra=dict(spec.extra),
            )
        except KVDError as e:
            client.close()
            self._outcome = f"cannot register the namespace: {e.message}"
            return
        self._outcome = (client, ns)

    def _adopt(self, client: KVDClient, ns: int) -> None:
        self._client, self._ns = client, ns
        self.instance, self.session = client.daemon_instance, client.session
        self._backoff = self.retry_seconds
        if self._warned:
            log.warning(
                "kvd on %s is back (daemon instance %s); prefix hits resume",
                self.socket or "the default socket",
                self.instance,
            )
        self._warned = False

    def _lost(self, why: str) -> None:
        if self._client is not None:
            self._client.close()
        self._client, self.instance, self.session = None, "", ""
        self._schedule_retry(time.monotonic(), why)

    def _schedule_retry(self, now: float, why: str) -> None:
        if not self._warned:
            log.warning(
                "kvd on %s cannot serve (%s); the engine computes without it and retries",
                self.socket or "the default socket",
                why,
            )
            self._warned = True
        self._next_try = now + self._backoff
        self._backoff = min(self._backoff * 2, self.max_retry_seconds)

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.join()
            if isinstance(self._outcome, tuple):
                self._outcome[0].close()
        if self._client is not None:
            self._client.close()
            self._client = None
