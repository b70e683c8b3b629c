"""The daemon's link to the remote store: one worker thread, the link's state, and back-off.

The daemon is the only store client on its host, and the store's calls block, so every
call runs here, on one worker thread, in the order it was submitted; the event loop only
submits jobs (``run``) and gets each outcome back through ``post`` (the loop's
``call_soon_threadsafe``). The loop therefore never waits on the store, whatever the
store does.

States: CONNECTING until the client is set up, UP, DOWN after a call found the master
unreachable. A job that finds it unreachable fails with ``StoreUnavailable``; the link
logs one line, turns DOWN, and probes again after 0.25 s, doubling up to 10 s, until
the master answers and the store takes a small object (a restarted master refuses puts
until the clients have mounted their segments again; a client is set up if there was
none); then it logs one line and turns UP. While it is not UP the tiers (kvd/remote.py) submit nothing, so the daemon
serves from host memory alone.

Memory the store may read or write is registered here too: before each job the link
brings the store's registrations in line with the extents its submitter named (new
extents registered, released ones unregistered), in the same queue, so a job never
names memory the store does not know.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvd.mooncake_store import MooncakeSettings, MooncakeStore, StoreUnavailable

log = logging.getLogger(__name__)

FIRST_RETRY_SECONDS = 0.25
MAX_RETRY_SECONDS = 10.0
HEARTBEAT_SECONDS = 1.0  # an idle link still notices an outage (and its state metric says so) this soon

Region = tuple[int, int]  # (address, size) of a mapped extent


class RemoteState(enum.Enum):
    OFF = "off"  # no [remote] configured
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"


class RemoteLink:
    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-remote")
        self._stop = threading.Event()
        self._store = None
        # Worker only: what the store has registered, and each owner's regions as last synced.
        self._registered: dict[int, int] = {}  # address -> size
        self._owned: dict[str, frozenset[Region]] = {}
        self.state = RemoteState.CONNECTING  # written by the worker, read by the loop
        self.outages = 0  # times the link went DOWN
        self.post: Callable[..., Any] = lambda fn, *args: fn(*args)  # the loop's call_soon_threadsafe
        self._worker.submit(self._recover, 0.0)
        self._heart = threading.Thread(target=self._heartbeat, name="kvd-remote-heartbeat", daemon=True)
        self._heart.start()

    @property
    def up(self) -> bool:
        return self.state is RemoteState.UP

    def run(self, owner: str, regions: frozenset[Region], job: Callable, done: Callable) -> None:
        """Runs ``job(store)`` on the worker after registering ``owner``'s ``regions``; then
        ``done(result, error)`` on the loop, error a ``StoreUnavailable`` or None."""
        if not self._stop.is_set():  # a job posted before close() may run after it: dropped
            self._worker.submit(self._job, owner, regions, job, done)

    def close(self) -> None:
        """Stops the worker (a job in flight finishes, queued ones are dropped) and closes the client."""
        self._stop.set()
        self._heart.join()
        self._worker.shutdown(wait=True, cancel_futures=True)
        if self._store is not None:
            self._store.close()
            self._store = None

    # ---- on the worker ----------------------------------------------------------------

    def _job(self, owner: str, regions: frozenset[Region], job: Callable, done: Callable) -> None:
        if self._stop.is_set():
            return
        result, error = None, None
        try:
            if self._store is None:
                raise StoreUnavailable("the store's master has not answered yet")
            self._sync(owner, regions)
            result = job(self._store)
        except StoreUnavailable as e:
            error = e
            self._went_down(e)
        except Exception as e:  # noqa: BLE001 - a broken job must not stop the worker; its owner counts it
            log.exception("remote store job failed")
            error = StoreUnavailable(f"the job failed: {e}")
        self.post(self._deliver, done, result, error)

    def _deliver(self, done: Callable, result, error) -> None:
        """On the loop: hands a job's outcome to its owner, unless the link closed meanwhile
        (the managers may have unmapped their memory since)."""
        if not self._stop.is_set():
            done(result, error)

    def _sync(self, owner: str, regions: frozenset[Region]) -> None:
        """Registers the owner's new regions and unregisters the ones it no longer names."""
        for address, _size in self._owned.get(owner, frozenset()) - regions:
            if self._registered.pop(address, None) is not None:
                self._store.unregister(address)
        for address, size in regions:
            if self._registered.get(address) != size:
                if address in self._registered:
                    self._store.unregister(address)
                    del self._registered[address]
                self._store.register(address, size)
                self._registered[address] = size
        self._owned[owner] = regions

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if self.state is RemoteState.UP:
                self._worker.submit(self._beat)

    def _beat(self) -> None:
        if self._stop.is_set() or self.state is not RemoteState.UP:
            return
        try:
            self._store.probe()
        except StoreUnavailable as e:
            self._went_down(e)

    def _went_down(self, error: StoreUnavailable) -> None:
        if self.state is RemoteState.DOWN:
            return
        self.state = RemoteState.DOWN
        self.outages += 1
        log.warning("remote store unreachable (%s); serving from host memory and retrying", error)
        self._worker.submit(self._recover, FIRST_RETRY_SECONDS)

    def _recover(self, delay: float) -> None:
        """Probes the master after ``delay``; UP when it answers, else again later."""
        if self._stop.wait(delay):
            return
        try:
            if self._store is None:
                self._store = MooncakeStore(self.settings)
            self._store.probe(write=True)
        except StoreUnavailable as e:
            if self.state is RemoteState.CONNECTING and delay == 0.0:
                log.warning("remote store at %s not reachable yet (%s); retrying", self.settings.master, e)
            self._worker.submit(self._recover, min(MAX_RETRY_SECONDS, max(FIRST_RETRY_SECONDS, 2 * delay)))
            return
        was = self.state
        self.state = RemoteState.UP
        if was is RemoteState.DOWN:
            log.warning("remote store at %s is back; storing and fetching pages again", self.settings.master)
        else:
            log.info("remote store at %s connected", self.settings.master)
