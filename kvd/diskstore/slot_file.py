"""The disk tier's one file: created and reserved whole, then read and written between its
byte ranges and callers' buffers, with direct I/O where the file system allows it.

``SlotFile.open`` creates ``kvd-disk.slots`` (kvd/diskstore/layout.py) in an existing directory
and reserves all of it with ``posix_fallocate``, so a full file system refuses the tier when
it opens (``OSError`` ENOSPC, which the store turns into a refusal), never at a write. Then
it asks the file system whether direct I/O works (``statx``'s STATX_DIOALIGN, Linux 6.1 and
later, then an aligned read through an O_DIRECT descriptor); with it every transfer bypasses
the page cache. Without it (tmpfs, whose file is memory anyway; older kernels; alignment
above 4 KiB) transfers are buffered and ``forget`` drops the range from the page cache once
it is clean, so the cache does not hold the tier's bytes a second time in RAM.

Page bytes move with ``os.preadv``/``os.pwritev`` straight between the file and the
caller's buffers (numpy views of shared-memory pages): no copy through Python objects.
Direct I/O needs every buffer's address and length aligned: a page view that starts on a
4 KiB boundary is transferred in place, its last partial block through a 4 KiB staging block;
a view that does not (a page size not a multiple of 4 KiB) goes whole through an aligned
bounce buffer, and is counted (``bounced`` in the results). Staging and bounce buffers are
anonymous maps (page-aligned), one per thread, grown as needed.

Every method blocks: the store (kvd/diskstore/store.py) calls them on its worker threads only.
Errors are ``OSError`` as the kernel gives them; ``inject`` makes the next calls of one kind
fail with a given errno (a test hook at the syscall boundary: EIO, ENOSPC).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

from kvd.diskstore import crashpoints
from kvd.diskstore.layout import BLOCK, FILE_NAME

log = logging.getLogger(__name__)

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
OPS = crashpoints.FAULT_OPS  # the file calls a test may make fail
_ZEROS = bytes(BLOCK)


class Staging(threading.local):
    """An aligned scratch area per thread: anonymous memory, grown to the largest request."""

    def __init__(self) -> None:
        self._memory: mmap.mmap | None = None

    def take(self, nbytes: int) -> np.ndarray:
        """uint8 [nbytes] at a page-aligned address; valid until this thread's next ``take``."""
        if self._memory is None or len(self._memory) < nbytes:
            self._memory = mmap.mmap(-1, max(-(-nbytes // BLOCK) * BLOCK, BLOCK))
        return np.frombuffer(self._memory, np.uint8, nbytes)


def _address(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


class _Statx(ctypes.Structure):
    _fields_ = [
        ("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32), ("attributes", ctypes.c_uint64),
        ("nlink", ctypes.c_uint32), ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
        ("mode", ctypes.c_uint16), ("spare0", ctypes.c_uint16), ("ino", ctypes.c_uint64),
        ("size", ctypes.c_uint64), ("blocks", ctypes.c_uint64), ("attributes_mask", ctypes.c_uint64),
        ("times", ctypes.c_uint64 * 8), ("devices", ctypes.c_uint32 * 4), ("mnt_id", ctypes.c_uint64),
        ("dio_mem_align", ctypes.c_uint32), ("dio_offset_align", ctypes.c_uint32), ("spare", ctypes.c_uint64 * 12),
    ]  # fmt: skip


_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100


def direct_io_alignment(path: str) -> int | None:
    """The alignment direct I/O on ``path`` needs, when the kernel says it supports it there."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    statx = getattr(libc, "statx", None)
    if statx is None:  # glibc older than 2.28
        return None
    out = _Statx()
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, ctypes.byref(out)) != 0:
        return None
    if not out.mask & _STATX_DIOALIGN or out.dio_offset_align == 0:
        return None  # no direct I/O here (tmpfs), or a kernel that does not tell
    return max(out.dio_offset_align, out.dio_mem_align)


class SlotFile:
    """The open, reserved slot file; ``direct`` says whether its transfers bypass the page cache."""

    def __init__(self, path: str, fd: int, size: int, alignment: int | None) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.direct = alignment is not None
        self.alignment = alignment or 1  # of a torn write's length (crash tests)
        self._staging = Staging()
        self._injected: dict[str, collections.deque[int | None]] = {op: collections.deque() for op in OPS}
        self._inject_lock = threading.Lock()

    @classmethod
    def open(cls, directory: str, size: int, *, direct: bool = True, mode: int = 0o600) -> SlotFile:
        """Opens (or creates) the file in ``directory``, reserved at ``size`` bytes. ``OSError``:
        ENOENT (no such directory), EROFS / EACCES (not writable), ENOSPC (does not fit)."""
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, "no such directory", directory)
        path = os.path.join(directory, FILE_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        try:
            created = os.fstat(fd).st_size == 0
            try:
                if os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError:
                if created:
                    os.unlink(path)
                raise
            opened = open_direct(path) if direct else None
            if opened is not None:
                os.close(fd)
                fd, alignment = opened
                return cls(path, fd, size, alignment)
            return cls(path, fd, size, None)
        except BaseException:
            os.close(fd)
            raise

    # ---- transfers ------------------------------------------------------------------------

    def read_pages(self, offset: int, views: Sequence[np.ndarray], stride: int) -> int:
        """Reads the data of consecutive slots (``stride`` bytes apart, from ``offset``) into
        ``views`` (uint8 [page_bytes] each); returns how many went through a bounce buffer."""
        iov, copies, bounced = self._page_iovecs(views, stride, reading=True)
        self._transfer("read", iov, offset)
        for staged, view in copies:
            np.copyto(view, staged)
        return bounced

    def write_pages(self, offset: int, views: Sequence[np.ndarray], stride: int) -> int:
        """Writes ``views`` into consecutive slots' data; returns how many were bounced."""
        iov, _, bounced = self._page_iovecs(views, stride, reading=False)
        if crashpoints.tears("disk-data-torn"):
            self._torn(iov, offset, sum(len(b) for b in iov) // 2)
        self._transfer("write", iov, offset)
        return bounced

    def read_blocks(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` (whole blocks) from ``offset``, in this thread's staging area."""
        out = self._staging.take(nbytes)
        self._transfer("read", [memoryview(out)], offset)
        return out

    def write_blocks(self, offset: int, data: np.ndarray, meaningful: int | None = None) -> None:
        """Writes ``data`` (whole blocks, page-aligned memory) at ``offset``. A torn header write
        (crash test) writes half of its first ``meaningful`` bytes."""
        if meaningful is not None and crashpoints.tears("disk-header-torn"):
            self._torn([memoryview(data)], offset, meaningful // 2)
        self._transfer("write", [memoryview(data)], offset)

    def write_zeros(self, offset: int, nbytes: int) -> None:
        """Zeroes ``nbytes`` (whole blocks) from ``offset``."""
        zeros = self._staging.take(nbytes)
        zeros[:] = 0
        self._transfer("write", [memoryview(zeros)], offset)

    def sync(self) -> None:
        """Makes what was written durable (fdatasync): the barrier between a page's bytes and its header."""
        self._raise_injected("sync")
        os.fdatasync(self.fd)

    def forget(self, offset: int, nbytes: int) -> None:
        """Drops the range from the page cache (buffered I/O only; its writes must be synced first)."""
        if not self.direct:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def vanished(self) -> bool:
        """Whether the file was unlinked under the tier (its directory removed): writes would be lost."""
        return os.fstat(self.fd).st_nlink == 0

    def inject(self, op: str, error: int, count: int = 1, skip: int = 0) -> None:
        """Test hook: after ``skip`` calls of ``op`` ("read", "write", "sync") that succeed, the
        next ``count`` fail with ``error``."""
        assert op in OPS, f"unknown operation {op!r}"
        with self._inject_lock:
            self._injected[op].extend([None] * skip + [error] * count)

    def close(self) -> None:
        os.close(self.fd)

    # ---- helpers --------------------------------------------------------------------------

    def _page_iovecs(
        self, views: Sequence[np.ndarray], stride: int, reading: bool
    ) -> tuple[list[memoryview], list[tuple[np.ndarray, np.ndarray]], int]:
        """The buffers one preadv/pwritev of consecutive slots uses, the (staged, view) pairs a
        read copies out afterwards (a write copies in here), and how many views go whole
        through a bounce buffer."""
        plan = []  # per view: bytes moved in place, bytes staged
        for view in views:
            n = view.nbytes
            assert n <= stride, f"a page of {n} bytes in a slot of {stride}"
            if not self.direct:
                plan.append((n, 0))
            elif _address(view) % BLOCK == 0:
                plan.append((n // BLOCK * BLOCK, BLOCK if n % BLOCK else 0))
            else:
                plan.append((0, -(-n // BLOCK) * BLOCK))
        pad = BLOCK if any(stride > inplace + staged for (inplace, staged) in plan) else 0
        staging = self._staging.take(sum(staged for _, staged in plan) + pad)
        if pad:
            staging[-pad:] = 0
        iov: list[memoryview] = []
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        at = 0
        for view, (inplace, staged) in zip(views, plan):
            if inplace:
                iov.append(memoryview(view[:inplace]))
            if staged:
                block = staging[at : at + staged]
                at += staged
                rest = view[inplace:]
                if reading:
                    copies.append((block[: rest.nbytes], rest))
                else:
                    block[: rest.nbytes] = rest
                    block[rest.nbytes :] = 0
                iov.append(memoryview(block))
            gap = stride - inplace - staged
            while gap:  # buffered: the slot's padding, read into or written from zeros
                iov.append(memoryview(staging[-pad:])[: min(gap, pad)])
                gap -= min(gap, pad)
        return iov, copies, sum(inplace == 0 and staged > 0 for inplace, staged in plan)

    def _raise_injected(self, op: str) -> None:
        if self._injected[op]:
            with self._inject_lock:
                error = self._injected[op].popleft() if self._injected[op] else None
            if error is not None:
                raise OSError(error, f"{os.strerror(error)} (injected)")

    def _transfer(self, op: str, iov: list[memoryview], offset: int) -> None:
        """Moves every byte of ``iov`` (at most IOV_MAX buffers a call), resuming short transfers."""
        self._raise_injected(op)
        call = os.preadv if op == "read" else os.pwritev
        pending = collections.deque(iov)
        while pending:
            batch = [pending[i] for i in range(min(len(pending), IOV_MAX))]
            done = call(self.fd, batch, offset)
            if done == 0:
                raise OSError(errno.EIO, f"{op} of {self.path} at {offset} returned nothing")
            offset += done
            while done:
                head = pending[0]
                if done >= len(head):
                    done -= len(head)
                    pending.popleft()
                else:
                    pending[0] = head[done:]
                    done = 0

    def _torn(self, iov: list[memoryview], offset: int, nbytes: int) -> None:
        """Crash test: writes the first ``nbytes`` of ``iov`` (rounded down to the alignment), then dies."""
        nbytes -= nbytes % self.alignment
        part = []
        for b in iov:
            if nbytes <= 0:
                break
            part.append(b[:nbytes])
            nbytes -= len(part[-1])
        if part:
            os.pwritev(self.fd, part, offset)
        crashpoints.die()


def open_direct(path: str) -> tuple[int, int] | None:
    """An O_DIRECT descriptor of the file ``path`` (read and write) and the alignment it
    needs, when the file system supports direct I/O there at an alignment of at most
    ``BLOCK`` and an aligned read through it works; None: transfers must be buffered."""
    alignment = direct_io_alignment(path)
    if alignment is None or alignment > BLOCK:
        return None
    fd = _open_direct(path)
    return None if fd is None else (fd, alignment)


def _open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor of ``path`` when an aligned read through it works; None otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        log.info("no direct I/O on %s (%s): buffered I/O", path, e.strerror)
        return None
    probe = mmap.mmap(-1, BLOCK)
    try:
        os.preadv(fd, [probe], 0)
    except OSError as e:
        os.close(fd)
        log.info("no direct I/O on %s (%s): buffered I/O", path, e.strerror)
        return None
    finally:
        probe.close()
    return fd
