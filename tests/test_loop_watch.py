"""The event loop's watchdog (kvd/server/loop_watch.py) names what held the loop."""

from __future__ import annotations

import asyncio
import logging
import time

import uvloop

from kvd.server.loop_watch import LoopWatch


def _hold_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)


def test_a_held_loop_is_counted_and_logged_with_the_stack_that_held_it(caplog):
    stalls = []

    async def main():
        watch = LoopWatch(on_stall=lambda: stalls.append(time.monotonic()), stall_seconds=0.5)
        watch.start()
        await asyncio.sleep(0.3)  # a loop that runs freely is no stall
        assert stalls == []
        _hold_the_loop_for(1.2)
        await asyncio.sleep(0.3)  # the loop marks again: the stall's length is logged
        watch.stop()

    with caplog.at_level(logging.WARNING, logger="kvd.server.loop_watch"):
        uvloop.run(main())
    assert len(stalls) == 1
    held, ended = (r.getMessage() for r in caplog.records)
    assert "the event loop has been held for" in held and "_hold_the_loop_for" in held
    seconds = float(ended.removeprefix("the event loop was held for ").removesuffix(" s"))
    assert 1.0 <= seconds <= 1.6
