"""Crash points: a debug hook that makes the daemon SIGKILL itself right after a named step.

Crash consistency is about instants a ``kill -9`` rarely hits by chance, so the tests aim
at them: ``KVD_CRASH_AT=STEP[:N]`` in the daemon's environment kills it (SIGKILL, as
``kill -9`` would) the N-th time (default 1) it completes STEP. Steps:

- ``extent-meta``: an extent's metadata segment exists, its data segment does not yet;
- ``extent-data``: the data segment is created, reserved and pre-faulted, and the extent
  is not yet adopted (its pages were never handed out);
- ``publish-recorded``: a publish wrote its pages' records (state PUBLISHED) and has not
  handed them to the sealer, so none has a checksum yet.

The variable is read once, at import; unset (always, in production) a crash point costs
one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

STEPS = ("extent-meta", "extent-data", "publish-recorded")


def _parse(value: str) -> tuple[str, int] | None:
    if not value:
        return None
    step, _, nth = value.partition(":")
    if step not in STEPS or (nth and not nth.isdigit()):
        raise ValueError(f"KVD_CRASH_AT={value!r}: expected one of {', '.join(STEPS)}, optionally ':N'")
    return step, int(nth or 1)


_TARGET = _parse(os.environ.get("KVD_CRASH_AT", ""))
_seen: dict[str, int] = {}
_lock = threading.Lock()  # extents are built on a worker thread as well as the event loop


def reached(step: str) -> None:
    """Marks ``step`` as done; SIGKILLs this process if it is the targeted crash point."""
    if _TARGET is None or _TARGET[0] != step:
        return
    with _lock:
        _seen[step] = _seen.get(step, 0) + 1
        if _seen[step] == _TARGET[1]:
            os.kill(os.getpid(), signal.SIGKILL)
