"""The loop's side of prewarms: runs each cache's ``Prewarms.step`` (kvd/cache/prewarm.py)
every ``STEP_SECONDS`` while any cache has prewarms queued or in flight, and not at all
otherwise. The servicer (kvd/server/service.py) kicks it after a Prewarm or a Pin call.
"""

from __future__ import annotations

import asyncio

from kvd.cache.tenants import Tenants

# How often a busy pump looks at fetches and the queue: a prompt's pages wait at most this
# long after landing to be settled (and a pin to extend to them), and a step is bounded
# (``PROMPTS_PER_STEP``), so engines' calls between two steps see the loop free.
STEP_SECONDS = 0.002


class PrewarmPump:
    """One per daemon: steps every tenant's prewarms while any has work."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants
        self._next: asyncio.Handle | None = None

    def kick(self) -> None:
        """Some cache may have prewarms queued: step soon (on the running loop)."""
        if self._next is None:
            self._next = asyncio.get_running_loop().call_soon(self._step)

    def _step(self) -> None:
        self._next = None
        busy = False
        for manager in self.tenants.managers():
            if manager.prewarms.busy:
                manager.prewarms.step()
                busy = busy or manager.prewarms.busy
        if busy:
            self._next = asyncio.get_running_loop().call_later(STEP_SECONDS, self._step)
