"""A session's token buffer: shared memory through which its large calls pass token ids.

A 50K-token prompt is 200 KB of token ids; through gRPC they are packed, copied into the
message, framed, copied out of it and parsed, which costs more than the daemon's whole
work on a hit. So a client may ask for a segment of its own (``OpenTokenBuffer``), write
the ids there and name only where they lie (a ``TokenSpan``: byte offset and count).

Why it is safe:
- Only the session's client knows the segment's random name; the first call that names a
  span of it unlinks the name (``seal``), and from then on no other process can open it.
  Mode 0660 and the tenant's group, as the page extents (kvd/core/arena.py).
- ``read`` checks the span against the buffer, then copies the ids out; every check of
  the ids (vocabulary, hits against stored ids) runs on that copy, so a client that
  rewrites its buffer meanwhile changes only what it asked for, never what was checked.
- The daemon never maps the segment: it reads it with ``os.pread``. A client may shrink
  its segment (``ftruncate``); a mapped read past the new end would kill the daemon with
  SIGBUS, a read gets fewer bytes and the call is refused. The kernel's copy also runs
  without the GIL, so a large call's read on the offload thread (kvd/server/offload.py) leaves
  the event loop free; ``close`` (the session ended, or opened another buffer) may come
  from the loop meanwhile and waits for no one: the last read in flight closes the
  descriptor, and a read that starts after ``close`` is refused.
- The segment is reserved in /dev/shm when created (kvd/core/shm.py), so a full /dev/shm
  refuses the buffer and never raises SIGBUS on a write; it is not part of the host
  budget, but one buffer per session is at most ``Limits.max_call_tokens`` ids.
"""

from __future__ import annotations

import os
import secrets
import threading

import posix_ipc

from kvd.core.errors import FailedPrecondition, InvalidArgument
from kvd.core.shm import SHM_DIR, create_segment
from kvd.wire.codec import TOKEN_BYTES

NAME_INFIX = "tok-"  # "{arena prefix}-tok-{random}": never a page extent's name (digits)
READ_BACK_TOKENS = 1024  # the most ids ReadTokenBuffer returns: a check, not a transfer


def leftovers(name_prefix: str) -> list[str]:
    """Token buffers of this prefix that still have a name: a killed daemon's, opened and
    never used. No process needs them; ``kvd serve`` and ``kvd clean`` unlink them."""
    base = f"{name_prefix.lstrip('/')}-{NAME_INFIX}"
    try:
        return ["/" + n for n in os.listdir(SHM_DIR) if n.startswith(base)]
    except FileNotFoundError:
        return []


def read_back(buffer: TokenBuffer | None, offset: int, num_tokens: int) -> bytes:
    """The ids a span of a session's buffer holds, as the daemon reads them (``ReadTokenBuffer``):
    ``kvd doctor``'s proof that its process and the daemon map the same memory, since the
    daemon created the segment in its /dev/shm and the client wrote the ids through its own
    map. Reads like any call (and so seals the name)."""
    what = "ReadTokenBuffer"
    if buffer is None:
        raise FailedPrecondition(f"{what}: the session has no token buffer (OpenTokenBuffer first)")
    if num_tokens > READ_BACK_TOKENS:
        raise InvalidArgument(f"{what}: {num_tokens} token ids asked for, at most {READ_BACK_TOKENS} are read back")
    return buffer.read(offset, num_tokens, what)


class TokenBuffer:
    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name = name
        self.size = size
        self._fd = fd
        self._linked = True
        self._lock = threading.Lock()  # reads may run on the offload thread, close on the loop
        self._reads = 0  # reads in flight
        self._closed = False

    @classmethod
    def create(cls, name_prefix: str, size: int, group: int | None) -> TokenBuffer:
        """A new segment of ``size`` bytes, reserved in /dev/shm (mode 0660: the client maps it
        read-write); raises ``ShmFull`` when /dev/shm cannot hold it."""
        name = f"/{name_prefix.lstrip('/')}-{NAME_INFIX}{secrets.token_hex(16)}"
        shm = create_segment(name, size, "a token buffer", 0o660, group)
        try:
            fd = os.dup(shm.fd)
        except BaseException:
            posix_ipc.unlink_shared_memory(name)
            raise
        finally:
            shm.close_fd()
        return cls(name, fd, size)

    def read(self, offset: int, num_tokens: int, what: str) -> bytes:
        """A copy of ``num_tokens`` packed ids from byte ``offset``; InvalidArgument when the
        span does not lie inside the buffer (or the client shrank it), FailedPrecondition
        when the buffer was closed before the read began. Safe on any thread."""
        end = offset + num_tokens * TOKEN_BYTES
        if offset % TOKEN_BYTES or end > self.size:
            raise InvalidArgument(
                f"{what}: {num_tokens} token ids at byte offset {offset} do not lie in the session's token "
                f"buffer of {self.size} bytes (offsets are multiples of {TOKEN_BYTES})"
            )
        with self._lock:
            if self._closed:
                raise FailedPrecondition(
                    f"{what}: the session's token buffer was closed during the call (the session ended "
                    "or opened another buffer)"
                )
            self._seal()
            self._reads += 1
        try:
            data = os.pread(self._fd, end - offset, offset)
        finally:
            with self._lock:
                self._reads -= 1
                if self._closed and not self._reads:
                    os.close(self._fd)
        if len(data) != end - offset:
            raise InvalidArgument(
                f"{what}: {num_tokens} token ids at byte offset {offset} lie past the end of the session's "
                f"token buffer, which its client shrank to {offset + len(data)} bytes or less"
            )
        return data

    def _seal(self) -> None:
        """Unlinks the name: the client mapped the segment (it names a span of it), and
        nobody else may open it from now on. Called holding the lock."""
        if self._linked:
            self._linked = False
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass  # `kvd clean` or the client took it already: our descriptor stays valid

    def close(self) -> None:
        """Unlinks the segment and closes it once no read is in flight."""
        with self._lock:
            if self._closed:
                return
            self._seal()
            self._closed = True
            if not self._reads:
                os.close(self._fd)
