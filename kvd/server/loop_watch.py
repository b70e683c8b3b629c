"""The event loop's watchdog: says when the loop was held so long that calls waited, and
what held it.

Every call runs on one event loop (kvd/server/daemon.py). A call is timed from its
handler's start (kvd/server/service.py logs one over a second), so a loop held by
something else (a long step, a garbage collection, a thread keeping the GIL) makes calls
wait unseen before their handlers start; an engine gives up on a call after 5 s. A timer
on the loop marks every ``TICK_SECONDS`` (a callback: no task step, no future, as the
daemon's idle CPU is mostly these ticks); a thread of the watchdog's own looks every
``TICK_SECONDS`` and, once the mark is ``STALL_SECONDS`` old, logs a WARNING with the stack
the loop's thread is in at that instant (once a stall) and calls ``on_stall`` (the metric
``kvd_event_loop_stalls_total``), then logs the stall's length when the loop marks again.

The thread needs the GIL to look: a stall in code that never releases it is seen (and its
stack taken) when that code lets go, still inside it in practice.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
STALL_SECONDS = 1.0


class LoopWatch:
    """Marks from the loop, looks from a thread; ``start`` on the loop, ``stop`` there too."""

    def __init__(self, on_stall: Callable[[], None] | None = None, stall_seconds: float = STALL_SECONDS) -> None:
        self.on_stall = on_stall
        self.stall_seconds = stall_seconds
        self._mark = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._marker: asyncio.TimerHandle | None = None
        self._looker = threading.Thread(target=self._look, name="kvd-loop-watch", daemon=True)

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._mark = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._marker = self._loop.call_later(TICK_SECONDS, self._marks)
        self._looker.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._marker is not None:
            self._marker.cancel()
        self._looker.join()

    def _marks(self) -> None:
        """A timer's callback, not a task: a tick costs the loop no task step or future."""
        self._mark = time.monotonic()
        self._marker = self._loop.call_later(TICK_SECONDS, self._marks)

    def _look(self) -> None:
        reported: float | None = None  # the mark of the stall already reported
        while not self._stopped.wait(TICK_SECONDS):
            mark = self._mark
            held = time.monotonic() - mark - TICK_SECONDS
            if held >= self.stall_seconds and reported != mark:
                reported = mark
                if self.on_stall is not None:
                    self.on_stall()
                log.warning(
                    "the event loop has been held for %.2f s (calls wait meanwhile); it is in:\n%s",
                    held,
                    self._loop_stack(),
                )
            elif reported is not None and reported != mark:
                log.warning("the event loop was held for %.2f s", mark - reported - TICK_SECONDS)
                reported = None

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
