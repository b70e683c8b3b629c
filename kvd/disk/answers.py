"""The disk store's answers brought back to the event loop, for one tenant's disk tier.

``DiskStore`` (kvd/diskstore/store.py) answers every call with a ``concurrent.futures.Future``
completed on its worker threads. ``StoreAnswers.when_done`` runs the caller's ``then`` on
the loop with the results, or its ``failed`` when the call raised (a bug, not a disk fault:
those are results), logged with its traceback. The tier's reads (kvd/disk/tier.py) and its
write-back (kvd/disk/write_back.py) share one; once the tier closes (host memory is being
unmapped) the answers that come later are dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)


class StoreAnswers:
    """One tenant's store calls answered on the loop, until ``close``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, of_tenant: str) -> None:
        self.loop = loop
        self.of_tenant = of_tenant  # for log lines: " of tenant NAME", or nothing for the implicit tenant
        self._closed = False  # host memory is being unmapped: answers that come later are dropped

    def when_done(self, future: Future, then: Callable[[Any], None], failed: Callable[[BaseException], None]) -> None:
        """``then(results)`` on the event loop once the store's call is done; ``failed(error)``
        when it raised instead, logged with its traceback."""

        def back(done: Future) -> None:
            if not self._closed:
                self.loop.call_soon_threadsafe(self._answered, done, then, failed)

        future.add_done_callback(back)

    def close(self) -> None:
        """Answers that come from now on are dropped."""
        self._closed = True

    def _answered(self, done: Future, then, failed) -> None:
        if self._closed:
            return
        error = done.exception()
        if error is None:
            then(done.result())
            return
        log.error("disk tier%s: a call to the store raised (a bug)", self.of_tenant, exc_info=error)
        failed(error)
