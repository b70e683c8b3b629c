"""A disk tier opened in the background: the daemon answers at once, and the pages on disk
become hittable as the index learns them.

``DiskStore.opening`` (kvd/diskstore/store.py) opens the file before the daemon answers
(a directory that cannot hold it is still a start-up error) and reads every chunk's header,
then every slot's, on the store's threads. Meanwhile the tier (kvd/disk/tier.py) serves:

- a lookup misses what the index has not learnt yet (no worse than without a disk tier);
- the write-back queues the pages host memory evicts (within its backlog, beyond it they
  are skipped) and writes none until the store knows its slots: no write lands in a slot
  whose header has not been read (kvd/disk/write_back.py); a graceful stop waits for the
  open, within its time (kvd/disk/stop_writes.py).

Before the daemon answers, ``run_for`` waits for the headers and learns pages for up to the
warm restart's ``FOREGROUND_SECONDS`` (a small disk is whole before the first call). Once
the store's answer is back on the loop, ``DiskOpening`` hands its pages (in the order
they were written) to ``DiskIndex.learn`` in steps of ``STEP_PAGES``, one a loop turn, so
calls are answered between steps; each page learnt is announced (``BlockStored``, medium
``STORAGE``) and findable from then on, and still read back against its header's checksum
before it is served (kvd/disk/source.py). Then the tier's ``then`` runs (the write-back
writes what it queued). A store whose recovery could not read the file is closed: the tier
stays empty and refuses its writes (logged).

Nothing here writes to the file but the frees of pages the policy gives up (as at any
time): a ``kill -9`` during the open leaves the file as it found it, and the next start
finds every page a completed write stored.

``KVD_HOLD_AT=disk-opened`` (kvd/crashpoints.py) holds the steps once the headers are read,
so a test can call a daemon whose disk index is not complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvd import collector, crashpoints
from kvd.disk.answers import StoreAnswers
from kvd.disk.index import DiskIndex
from kvd.diskstore.layout import DiskPage
from kvd.diskstore.results import OpenRefused
from kvd.diskstore.store import Opened, Opening

log = logging.getLogger(__name__)

STEP_PAGES = 1024  # pages learnt in one loop turn: a few ms
FREEZE_STEPS = 16  # the pages' objects frozen every so many steps (kvd/collector.py)
HOLD_POLL_SECONDS = 0.005


class DiskOpening:
    """One tenant's disk store being opened: its recovery's pages, learnt step by step."""

    def __init__(
        self,
        opening: Opening,
        index: DiskIndex,
        answers: StoreAnswers,
        loop: asyncio.AbstractEventLoop,
        then: Callable[[], None],
    ) -> None:
        """``then`` runs on the loop once every page found is learnt (or the open failed)."""
        self.store = opening.store
        self._opened = opening.opened
        self.index = index
        self.loop = loop
        self._then = then
        self._started = time.perf_counter()
        self._pages: list[DiskPage] = []
        self._at = 0  # pages before it are learnt
        self._steps = 0
        self.headers_read = False  # the store's recovery is back
        self.done = False
        answers.when_done(opening.opened, self._found, self._failed)

    @property
    def pending_pages(self) -> int:
        """Pages found on disk and not learnt yet (0 until the headers are read)."""
        return len(self._pages) - self._at

    def run_for(self, seconds: float) -> None:
        """Before the daemon answers: waits for the headers and learns pages for up to
        ``seconds`` (a small disk is whole before the first call); the rest in the background."""
        deadline = time.perf_counter() + seconds
        try:
            result = self._opened.result(timeout=seconds)
        except Exception:  # noqa: BLE001 - not read yet (or a bug, which the loop's answer reports)
            return
        self._found(result)
        while not self.done and time.perf_counter() < deadline and not crashpoints.holding("disk-opened"):
            self._learn()

    def close(self) -> None:
        """The tier closes: no more page is learnt (the store closes after)."""
        self._pages, self._at = [], 0
        self.done = True

    def _found(self, result: Opened | OpenRefused) -> None:
        if self.headers_read or self.done:  # taken before the daemon answered (``run_for``)
            return
        if isinstance(result, OpenRefused):
            log.error("disk tier%s not opened (%s): no page on disk is served", self.index.of_tenant, result.detail)
            self._failed(None)
            return
        self.headers_read = True
        self._pages = result.pages
        crashpoints.reached("disk-opened")
        self.loop.call_soon(self._step)

    def _failed(self, _: BaseException | None) -> None:
        self.store.close()  # writes are refused from now on
        self._finish()

    def _step(self) -> None:
        """One step on the loop, then the next one a loop turn later."""
        if self.done:
            return
        if crashpoints.holding("disk-opened"):
            self.loop.call_later(HOLD_POLL_SECONDS, self._step)
            return
        self._learn()
        if not self.done:
            self.loop.call_soon(self._step)

    def _learn(self) -> None:
        """The index learns the next ``STEP_PAGES`` pages."""
        end = min(self._at + STEP_PAGES, len(self._pages))
        self.index.learn(self._pages[self._at : end])
        self._at = end
        self._steps += 1
        if self._at < len(self._pages):
            if self._steps % FREEZE_STEPS == 0:
                collector.freeze_grown()
            return
        collector.freeze_grown()
        log.info(
            "disk tier%s: %d pages on disk indexed %.2f s after the store opened",
            self.index.of_tenant, len(self.index), time.perf_counter() - self._started,
        )  # fmt: skip
        self._pages = []
        self._at = 0
        self._finish()

    def _finish(self) -> None:
        self.done = True
        self._then()
