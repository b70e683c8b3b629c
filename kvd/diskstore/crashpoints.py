"""Crash points of the disk tier's storage engine: debug hooks at its dangerous instants.

As kvd/crashpoints.py does for shared memory, a variable in the environment,
read once at import, aims at instants that chance rarely hits (its own variable: that
module refuses steps it does not know):

- ``KVD_DISK_CRASH_AT=STEP[:N]`` kills the process (SIGKILL, as ``kill -9`` would) the
  N-th time (default 1) it reaches STEP.

Steps after which the process dies (kvd/diskstore/store.py):

- ``disk-chunk-formatted``: a chunk's new header is written, no slot of it yet;
- ``disk-data-written``: a write's page bytes are in the file, their headers are not;
- ``disk-header-written``: the headers are written too, not yet synced or reported;
- ``disk-slot-invalidated``: a free's zeroed headers are written, not yet synced or reported.

Steps that tear a write (kvd/diskstore/slot_file.py): the first half of the bytes is written,
then the process dies:

- ``disk-data-torn``: a run of page bytes;
- ``disk-header-torn``: a run of slot headers (half of what the headers hold, rounded down
  to the file's direct-I/O alignment).

And one that makes a file call fail, as a failing disk would (the hook ``DiskStore.inject``
sets from a test in the same process, for a daemon in its own):

- ``KVD_DISK_FAULT=OP:ERRNO[:SKIP]``: once a store is open (its recovery's reads done), the
  call of OP (``read``, ``write``, ``sync``: kvd/diskstore/slot_file.py) after SKIP (default 0)
  that succeed fails with ERRNO (a name: ``EIO``, ``ENOSPC``).

Unset (always, in production) a step costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from typing import NamedTuple

STEPS = ("disk-chunk-formatted", "disk-data-written", "disk-header-written", "disk-slot-invalidated")
TEARS = ("disk-data-torn", "disk-header-torn")
VARIABLE = "KVD_DISK_CRASH_AT"
FAULT_VARIABLE = "KVD_DISK_FAULT"
FAULT_OPS = ("read", "write", "sync")  # the file calls kvd/diskstore/slot_file.py makes


class Fault(NamedTuple):
    """A file call to fail: ``DiskStore.inject``'s arguments."""

    op: str
    error: int
    count: int
    skip: int


def _target() -> tuple[str, int] | None:
    value = os.environ.get(VARIABLE, "")
    if not value:
        return None
    step, _, nth = value.partition(":")
    if step not in STEPS + TEARS or (nth and not nth.isdigit()):
        raise ValueError(f"{VARIABLE}={value!r}: expected one of {', '.join(STEPS + TEARS)}, optionally ':N'")
    return step, int(nth or 1)


def _fault() -> Fault | None:
    value = os.environ.get(FAULT_VARIABLE, "")
    if not value:
        return None
    op, _, rest = value.partition(":")
    name, _, skip = rest.partition(":")
    error = getattr(errno, name, None) if name.startswith("E") else None
    if op not in FAULT_OPS or not isinstance(error, int) or (skip and not skip.isdigit()):
        raise ValueError(f"{FAULT_VARIABLE}={value!r}: expected OP:ERRNO[:SKIP], OP one of {', '.join(FAULT_OPS)}")
    return Fault(op, error, 1, int(skip or 0))


_TARGET = _target()
FAULT = _fault()  # injected into each store this process opens
_seen = 0
_lock = threading.Lock()  # the engine's worker threads reach steps concurrently


def _hit(step: str) -> bool:
    """Whether this occurrence of ``step`` is the armed one."""
    global _seen
    if _TARGET is None or _TARGET[0] != step:
        return False
    with _lock:
        _seen += 1
        return _seen == _TARGET[1]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def reached(step: str) -> None:
    """Marks ``step`` as done; dies here when it is the armed occurrence."""
    if _hit(step):
        die()


def tears(step: str) -> bool:
    """Whether the write about to happen at ``step`` is to be torn: the caller writes part of it, then calls ``die``."""
    return _hit(step)
