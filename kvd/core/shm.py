"""/dev/shm itself: creating a segment with its memory reserved, so a full tmpfs is a refusal.

A segment of a tmpfs is only sized by ``ftruncate``; its memory is taken page by page on
first touch, and a touch the tmpfs cannot back kills the process with SIGBUS. So every
segment the daemon creates and writes (extent data and metadata, the manifest, token
buffers) is reserved whole when it is created (``posix_fallocate``): a /dev/shm that
cannot hold it is ``ShmFull`` then, and never a signal later, in the daemon or in a
client. kvd/core/arena.py, kvd/core/records.py and kvd/cache/token_buffers.py create their segments here.
"""

from __future__ import annotations

import errno
import os

import posix_ipc

from kvd.core.errors import ResourceExhausted

SHM_DIR = "/dev/shm"


class ShmFull(ResourceExhausted):
    """/dev/shm cannot hold a new segment (a container's default is 64 MiB)."""


def shm_free_bytes() -> int:
    """Bytes /dev/shm can still allocate."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def reserve(fd: int, size: int, what: str) -> None:
    """Allocates ``size`` bytes of the segment open on ``fd`` in the tmpfs now; ``what``
    names the segment in the ``ShmFull`` raised when /dev/shm cannot hold them. A segment
    whose blocks are all allocated (one a previous daemon reserved) is left as it is: the
    tmpfs would walk each of its pages (~1 s per 4 GiB on a loaded box)."""
    if os.fstat(fd).st_blocks * 512 >= size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise ShmFull(
            f"{SHM_DIR} has {shm_free_bytes()} bytes free, too few for {what} of {size} bytes; "
            f"give {SHM_DIR} more room (docker run --shm-size) or lower --host-bytes"
        ) from None


def create_segment(
    name: str, size: int, what: str, mode: int = 0o660, group: int | None = None, exclusive: bool = True
) -> posix_ipc.SharedMemory:
    """A segment of ``size`` bytes, reserved (``reserve``), with ``mode`` whatever the umask
    and owned by ``group`` (None: the daemon's). ``exclusive``: fail if the name exists; else
    an existing segment is taken over. The caller maps it and closes the descriptor
    (``close_fd``). Raises ``ShmFull`` when /dev/shm cannot hold it; on any error the name
    is unlinked, so nothing half created is left."""
    flags = posix_ipc.O_CREX if exclusive else posix_ipc.O_CREAT
    shm = posix_ipc.SharedMemory(name, flags=flags, mode=mode, size=size)
    try:
        os.fchmod(shm.fd, mode)
        if group is not None:
            os.fchown(shm.fd, -1, group)
        reserve(shm.fd, size, what)
    except BaseException:
        shm.close_fd()
        unlink_quietly(name)
        raise
    return shm


def unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass  # gone already
