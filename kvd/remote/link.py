"""The daemon's link to the remote store: one worker thread, the link's state, and back-off.

The daemon is the only store client on its host, and the store's calls block, so every
call runs here, on one worker thread, in the order it was submitted; the event loop only
submits jobs (``run``) and gets each outcome back through the loop's
``call_soon_threadsafe`` (given to ``start``). The loop therefore never waits on the store, whatever the
store does.

States: CONNECTING until the client is set up, UP, DOWN after a call found the master
unreachable. A job that finds it unreachable fails with ``StoreUnavailable``; the link
logs one line, turns DOWN, and probes again after 0.25 s, doubling up to 10 s, until
the master answers and the store takes a small object (a restarted master refuses puts
until the clients have mounted their segments again; a client is set up if there was
none); then it logs one line and turns UP. While it is not UP the tiers
(kvd/remote/tier.py) submit nothing, so the daemon serves from host memory alone.

Memory the store may read or write is registered here too: before each job the link
brings the store's registrations in line with the extents its submitter named (new
extents registered, released ones unregistered), in the same queue, so a job never
names memory the store does not know.

Each time the link turns UP (connected first, or back after an outage) it calls the
``on_up`` callbacks on the loop: a restarted master has lost everything, so the tiers
offer their pages again (kvd/remote/tier.py). A master that restarted unseen (between two
heartbeats, or while this process was stopped) answers as if nothing happened; the
heartbeat then finds this host's canary gone (kvd/remote/mooncake_store.py) and the link
goes through DOWN and UP as after an outage, so the tiers offer again. Coming back UP
from DOWN without the canary counts a reset: the store had lost this host's objects.

``close`` is bounded: when the master cannot be reached, closing the client would wait
on Mooncake's RPC timeouts (seconds, holding the GIL, kvd/remote/mooncake_store.py), so the
client is abandoned instead; the worker is a daemon thread, so a job stuck in a call
does not hold the process either.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvd.remote.mooncake_store import MooncakeSettings, MooncakeStore, StoreUnavailable, master_unreachable

log = logging.getLogger(__name__)

FIRST_RETRY_SECONDS = 0.25
MAX_RETRY_SECONDS = 10.0
HEARTBEAT_SECONDS = 1.0  # an idle link still notices an outage (and its state metric says so) this soon
CLOSE_CHECK_SECONDS = 1.0  # at most this long to learn, on close, whether the master takes connections
IDLE_STOP_SECONDS = 0.1  # what close() gives a worker that is in no store call to stop

Region = tuple[int, int]  # (address, size) of a mapped extent


class RemoteState(enum.Enum):
    OFF = "off"  # no [remote] configured
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"


class RemoteLink:
    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (function, args); None: the worker stops
        self._stop = threading.Event()
        self._store: MooncakeStore | None = None
        # Worker only: what the store has registered, and each owner's regions as last synced.
        self._registered: dict[int, int] = {}  # address -> size
        self._owned: dict[str, frozenset[Region]] = {}
        self.state = RemoteState.CONNECTING  # written by the worker, read by the loop
        self.outages = 0  # times the link went DOWN
        self.resets = 0  # of those, times the store was found to have lost this host's objects
        self.on_up: list[Callable[[], None]] = []  # called on the loop each time the link turns UP
        self._post: Callable[..., Any] | None = None  # the loop's call_soon_threadsafe, from start()
        # Daemon threads: one that close() abandons in a call to a dead master must not hold the process.
        self._worker = threading.Thread(target=self._work, name="kvd-remote", daemon=True)
        self._heart = threading.Thread(target=self._heartbeat, name="kvd-remote-heartbeat", daemon=True)

    def start(self, post: Callable[..., Any]) -> None:
        """Starts connecting, once every tier has attached; ``post`` is the loop's
        ``call_soon_threadsafe``: job outcomes and ``on_up`` run through it."""
        self._post = post
        self._submit(self._recover, 0.0)
        self._worker.start()
        self._heart.start()

    @property
    def up(self) -> bool:
        return self.state is RemoteState.UP and not self._stop.is_set()

    def run(self, owner: str, regions: frozenset[Region], job: Callable, done: Callable) -> None:
        """Runs ``job(store)`` on the worker after registering ``owner``'s ``regions``; then
        ``done(result, error)`` on the loop, error a ``StoreUnavailable`` or None."""
        if not self._stop.is_set():  # a job posted before close() may run after it: dropped
            self._submit(self._job, owner, regions, job, done)

    def close(self, timeout: float) -> bool:
        """Stops the worker (queued jobs are dropped, nothing more reaches the loop) and closes
        the store's client, within ``timeout`` seconds: True when it did. False when it
        abandoned the client instead (the master takes no connection, or the job in flight
        outlived ``timeout``): the process must then leave without Mooncake's teardown,
        which would wait on the same timeouts (kvd/server/daemon.py)."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._jobs.put(None)
        problem = master_unreachable(self.settings.master, min(CLOSE_CHECK_SECONDS, timeout))
        # A dead master answers a job in flight only after Mooncake's timeouts: not worth waiting
        # for; an idle worker (or one waiting to retry) stops at once.
        left = max(0.0, deadline - time.monotonic())
        self._worker.join(left if problem is None else min(IDLE_STOP_SECONDS, left))
        if self._worker.is_alive():
            why = problem or f"a store call outlived the {timeout:.1f} s shutdown grace"
        elif self._store is not None and problem is not None:
            why = problem
        else:
            if self._store is not None:
                self._store.close()
                self._store = None
            return True
        log.warning("remote store client left unclosed: %s", why)
        return False

    def _submit(self, fn: Callable, *args) -> None:
        self._jobs.put((fn, args))

    def _to_loop(self, fn: Callable, *args) -> None:
        """Runs ``fn(*args)`` on the loop, unless the link is closed by then (the managers may
        have unmapped their memory since)."""
        if not self._stop.is_set():
            self._post(self._on_loop, fn, *args)

    def _on_loop(self, fn: Callable, *args) -> None:
        if not self._stop.is_set():
            fn(*args)

    # ---- on the worker ----------------------------------------------------------------

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the worker serves every later job too
                log.exception("remote store worker: %s failed", getattr(fn, "__name__", fn))

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
        self._to_loop(done, result, error)

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
                self._submit(self._beat)

    def _beat(self) -> None:
        if self._stop.is_set() or self.state is not RemoteState.UP:
            return
        try:
            if not self._store.probe():
                self._went_down(None)
        except StoreUnavailable as e:
            self._went_down(e)

    def _went_down(self, error: StoreUnavailable | None) -> None:
        """The store is unreachable (``error``), or it answers without this host's canary (None)."""
        if self.state is RemoteState.DOWN:
            return
        self.state = RemoteState.DOWN
        self.outages += 1
        if error is None:
            log.warning("remote store lost this host's objects (its master restarted); offering its pages again")
        else:
            log.warning("remote store unreachable (%s); serving from host memory and retrying", error)
        self._submit(self._recover, FIRST_RETRY_SECONDS)

    def _recover(self, delay: float) -> None:
        """Probes the master after ``delay``; UP when it answers, else again later."""
        if self._stop.wait(delay):
            return
        try:
            if self._store is None:
                self._store = MooncakeStore(self.settings)
            kept = self._store.probe()
            self._store.store_canary()
        except StoreUnavailable as e:
            if self.state is RemoteState.CONNECTING and delay == 0.0:
                log.warning("remote store at %s not reachable yet (%s); retrying", self.settings.master, e)
            self._submit(self._recover, min(MAX_RETRY_SECONDS, max(FIRST_RETRY_SECONDS, 2 * delay)))
            return
        was = self.state
        self.state = RemoteState.UP
        self.resets += was is RemoteState.DOWN and not kept
        if was is RemoteState.DOWN:
            log.warning("remote store at %s is back; storing and fetching pages again", self.settings.master)
        else:
            log.info("remote store at %s connected", self.settings.master)
        for callback in self.on_up:
            self._to_loop(callback)
