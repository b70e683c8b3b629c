"""Crash points: debug hooks that act right after a named step of the daemon.

Crash consistency and a full /dev/shm are about instants that chance rarely hits, so the
tests aim at them with a variable in the daemon's environment, read once at import:

- ``KVD_CRASH_AT=STEP[:N]`` kills the daemon (SIGKILL, as ``kill -9`` would) the N-th time
  (default 1) it completes STEP;
- ``KVD_FILL_SHM_AT=STEP[:N]`` takes every byte /dev/shm has left, as another process could
  at that instant, with a segment named ``FILLER`` that stays until someone unlinks it.
  Only in a private mount namespace with a small tmpfs on /dev/shm (tests/small_shm.py):
  on a host's /dev/shm it starves every other user.
- ``KVD_HOLD_AT=STEP[:N]`` with ``KVD_HOLD_FILE=PATH`` holds what runs in steps (``holding``)
  from the N-th time it completes STEP on, for as long as the file PATH exists: a test
  makes its calls while a background job stands still at a known point, then removes the
  file.

Steps:

- ``extent-meta``: an extent's metadata segment exists, its data segment does not yet;
- ``extent-reserved``: the data segment is created and reserved in /dev/shm, not yet
  mapped (on the thread that builds it: a worker's, ahead of need, or the event loop);
- ``extent-data``: the data segment is created, reserved and pre-faulted, and the extent
  is not yet adopted (its pages were never handed out);
- ``publish-recorded``: a publish wrote its pages' records (state PUBLISHED) and has not
  handed them to the sealer, so none has a checksum yet;
- ``recovery-step``: a warm restart verified and indexed one more step of pages
  (kvd/durability/reindexing.py; ``STEP_PAGES`` each, parents first);
- ``disk-opened``: the disk tier's store read every header on disk, back on the event
  loop, and its index has learnt none of the pages yet (kvd/disk/opening.py).

Unset (always, in production) a step costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import mmap
import os
import signal
import threading
from collections.abc import Callable

import posix_ipc

STEPS = ("extent-meta", "extent-reserved", "extent-data", "publish-recorded", "recovery-step", "disk-opened")
FILLER = "/kvd-test-shm-filler"  # the segment KVD_FILL_SHM_AT fills /dev/shm with


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fill_shm() -> None:
    """Grows ``FILLER`` by reserved chunks, smaller and smaller, until /dev/shm has no page left."""
    shm = posix_ipc.SharedMemory(FILLER, flags=posix_ipc.O_CREAT, mode=0o600)
    try:
        size = os.fstat(shm.fd).st_size
        for chunk in (1 << 20, mmap.PAGESIZE):
            while True:
                try:
                    os.posix_fallocate(shm.fd, size, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
                size += chunk
    finally:
        shm.close_fd()


def _parse(variable: str, value: str) -> tuple[str, int] | None:
    if not value:
        return None
    step, _, nth = value.partition(":")
    if step not in STEPS or (nth and not nth.isdigit()):
        raise ValueError(f"{variable}={value!r}: expected one of {', '.join(STEPS)}, optionally ':N'")
    return step, int(nth or 1)


def _armed() -> dict[str, list[tuple[int, Callable[[], None]]]]:
    """Step → (N, action) of every hook the environment sets."""
    armed: dict[str, list[tuple[int, Callable[[], None]]]] = {}
    for variable, action in (("KVD_CRASH_AT", _kill), ("KVD_FILL_SHM_AT", _fill_shm)):
        target = _parse(variable, os.environ.get(variable, ""))
        if target is not None:
            armed.setdefault(target[0], []).append((target[1], action))
    return armed


_ARMED = _armed()
_HOLD = _parse("KVD_HOLD_AT", os.environ.get("KVD_HOLD_AT", ""))
_HOLD_FILE = os.environ.get("KVD_HOLD_FILE", "")
_seen: dict[str, int] = {}
_lock = threading.Lock()  # extents are built on a worker thread as well as the event loop


def reached(step: str) -> None:
    """Marks ``step`` as done; runs the hook set for this occurrence of it, if any."""
    hooks = _ARMED.get(step)
    if hooks is None and (_HOLD is None or _HOLD[0] != step):
        return
    with _lock:
        _seen[step] = seen = _seen.get(step, 0) + 1
        for nth, action in hooks or ():
            if nth == seen:
                action()


def holding(step: str) -> bool:
    """True while ``KVD_HOLD_AT`` holds ``step``: it was completed N times or more, and the
    file ``KVD_HOLD_FILE`` exists."""
    if _HOLD is None or _HOLD[0] != step:
        return False
    return _seen.get(step, 0) >= _HOLD[1] and os.path.exists(_HOLD_FILE)
