"""The garbage collector's policy in the daemon: what a full collection has kept is frozen.

A daemon holding 512K published pages tracks over a million objects (a ``PageContent``
per published page, index runs and entries; a page's state and counts are array columns,
kvd/core/page_columns.py, not objects); a full collection walks all of them on
the event loop, inside whichever call allocated when it came due: 0.5–0.9 s measured at
1 GiB of 2 KiB pages (bench/bench_gc.py). Like other long-lived Python servers, the
daemon moves objects it keeps into the permanent generation (``gc.freeze()``, O(1)), which
no collection walks:

- once started (recovery done, servers built), after one full collection;
- after each extent is adopted (kvd/core/supply.py): it lives as long as the daemon;
- right after every full collection: what survived it is frozen, so the next one walks
  only what survived since (a cache that turns over replaces its ``PageContent`` objects,
  and freezing at the first two points alone let full collections grow back to ~0.5 s).

Why memory stays bounded:

- Frozen objects are still freed by reference counting the moment their last reference
  goes (an evicted page's content, a released sequence's table). kvd's page objects hold
  no reference cycles, so they all go that way (bench_gc.py counts what freezing kept).
- What freezing can keep is reference cycles that become garbage after they were frozen
  (say a call's objects, alive at a freeze). So at most once every ``complete_seconds``
  (an hour) the permanent generation is handed back (``gc.unfreeze()``): the next full
  collection walks every object once, returns those cycles, and freezes again. The
  garbage held is at most what an hour of calls leaves in cycles; that one collection is
  the hourly cost (0.5–0.9 s at 512K pages: the pause a full collection had every few
  seconds under churn before).
- Young collections are as frequent as ever (CPython's thresholds for them); a full
  collection comes due after every collection of the middle generation, not every tenth
  (``OLDEST_THRESHOLD``), so each walks little. Garbage cycles are found as promptly as
  before, or sooner, unless frozen while alive.

A manager in a process without an installed ``Collector`` (tests, benches) leaves the
collector alone.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

COMPLETE_SECONDS = 3600.0
# A full collection comes due after this many collections of the middle generation
# (CPython's default 10), once the objects promoted since the last one reach a quarter
# of those it kept. As each walks only what was promoted since the last, more frequent
# means shorter: at 512K pages under churn, 3.7–6.1 ms at 1, 6.2 ms at 2, 18–23 ms at 10.
OLDEST_THRESHOLD = 1

_installed: Collector | None = None


class Collector:
    """Freezes what each full collection kept; hands it all back once every ``complete_seconds``."""

    def __init__(self, complete_seconds: float = COMPLETE_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.complete_seconds = complete_seconds
        self._clock = clock
        self._last_complete = clock()
        self.full_collections = 0
        self.complete_collections = 0

    def install(self) -> Collector:
        """Collects everything once (before serving: no call waits for it), freezes what is
        left and from now on follows every full collection. Returns self."""
        global _installed
        assert _installed is None, "a Collector is installed already"
        _installed = self
        gc.callbacks.append(self._after_collection)
        self._thresholds = gc.get_threshold()
        gc.set_threshold(self._thresholds[0], self._thresholds[1], OLDEST_THRESHOLD)
        gc.collect()  # what is left is frozen by _after_collection
        # CPython runs the next full collection once the objects promoted since the last one
        # reach a quarter of what that one kept: a second, empty collection sets that count
        # from the objects left outside the frozen ones, not from the whole heap.
        gc.collect()
        log.info("collector: %d long-lived objects frozen at start-up", gc.get_freeze_count())
        return self

    def uninstall(self) -> None:
        global _installed
        gc.callbacks.remove(self._after_collection)
        gc.set_threshold(*self._thresholds)
        _installed = None
        gc.unfreeze()

    def _after_collection(self, phase: str, info: dict) -> None:
        if phase != "stop" or info["generation"] != 2:
            return
        self.full_collections += 1
        now = self._clock()
        if now - self._last_complete >= self.complete_seconds:
            # The next full collection walks the frozen objects too, and freezes them again.
            self._last_complete = now
            self.complete_collections += 1
            gc.unfreeze()
        else:
            gc.freeze()


def freeze_grown() -> None:
    """After the long-lived heap grew (a new extent's pages), with a ``Collector`` installed:
    the young generations are collected (cheap: only what was made since their last
    collection), then every object is frozen."""
    if _installed is None:
        return
    gc.collect(1)
    gc.freeze()
    if log.isEnabledFor(logging.DEBUG):  # counting walks the frozen objects: ~1 ms per million
        log.debug("collector: %d long-lived objects frozen after adopting an extent", gc.get_freeze_count())
