"""``kvd doctor --disk``: the disk tier's checks, run where the daemon runs (as its user), on
the ``[disk]`` table ``kvd serve`` would read (kvd/config.py: the config file, ``KVD_DISK_*``,
``--disk-*``). One line each, as the engine's doctor prints (kvd/wire/checks.py):

1. disk path: the directory exists and this process may create, write, sync and remove a
   file in it (a read-only mount or a directory of another user fails here, as the daemon's
   start would).
2. disk space: the file system can hold what the budget reserves. The daemon reserves its
   whole file at start (``posix_fallocate``, kvd/diskstore/slot_file.py), one per tenant with
   tenants, so a budget above the free space (plus what kvd's files hold already) stops
   its start.
3. direct I/O: whether transfers bypass the page cache there (as the store decides:
   ``statx``'s alignment, then an aligned read through O_DIRECT). Without it the tier works,
   buffered; on tmpfs (memory) it holds pages in RAM a second time and loses them at a
   reboot, so both are a WARN.
4. read bandwidth: a probe file of ``probe_bytes`` written, synced and read back in
   ``PROBE_READ_BYTES`` reads with the store's kind of I/O (direct, or buffered after
   dropping the file from the page cache), timed. Promotions read at about this speed
   (bench/RESULTS.md: the store's batched reads at 0.96-0.98x the disk's own); below
   ``SLOW_READ_BYTES_PER_S`` a promotion may take longer than recomputing the prompt.

Every probe file (``.kvd-doctor-<pid>``) is removed before the check returns; the tier's
own file is never opened.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from collections.abc import Callable, Iterator

from kvd.config import ServeConfig
from kvd.diskstore.layout import BLOCK, FILE_NAME, file_bytes
from kvd.diskstore.slot_file import open_direct
from kvd.wire.checks import Check, Status

PROBE_BYTES = 64 << 20  # the read probe's default size: a tenth of a second on a SATA SSD
PROBE_READ_BYTES = 2 << 20  # one read: a 2 MiB page (the store reads a page per request)
SLOW_READ_BYTES_PER_S = 200e6  # below a SATA SSD's ~500 MB/s: a spinning disk or a network file system
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def _size(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def file_system(path: str) -> str:
    """The type of the file system ``path`` is on (``/proc/self/mounts``, the deepest mount
    point above it)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fs_type = line.split()[:3]
            point = point.replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fs_type
    return kind


@contextlib.contextmanager
def probe_file(directory: str, nbytes: int) -> Iterator[tuple[str, int]]:
    """A new file of ``nbytes`` reserved in ``directory`` (path, descriptor), removed after."""
    path = os.path.join(directory, f".kvd-doctor-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        yield path, fd
    finally:
        os.close(fd)
        os.unlink(path)


def _shares(cfg: ServeConfig) -> list[tuple[str, int]]:
    """(directory, budget) of each tenant's disk tier, as the daemon divides the table."""
    disk = cfg.disk
    if not cfg.tenants:
        return [disk.share(None, 0, 0)]
    return [disk.share(t.name, t.host_bytes, cfg.host_bytes) for t in cfg.tenants]


def _held(directory: str) -> int:
    """Bytes kvd's file in ``directory`` holds on disk already (it keeps them at the next start)."""
    try:
        return os.stat(os.path.join(directory, FILE_NAME)).st_blocks * 512
    except FileNotFoundError:
        return 0


class DiskExamination:
    """The checks in order, on one configuration."""

    def __init__(self, cfg: ServeConfig, probe_bytes: int = PROBE_BYTES) -> None:
        self.cfg = cfg
        self.path = cfg.disk.path
        self.probe_bytes = probe_bytes

    def path_check(self) -> Check:
        path = self.path
        if not os.path.isdir(path):
            found = "is not a directory" if os.path.exists(path) else "does not exist"
            return Check(
                "disk path",
                Status.FAIL,
                f"{path} {found}",
                "create it on a local SSD's file system, owned by the daemon's user (mkdir -p; the daemon creates "
                "its file there, never the directory)",
            )
        try:
            with probe_file(path, BLOCK) as (_, fd):
                os.pwrite(fd, bytes(BLOCK), 0)
                os.fsync(fd)
        except OSError as e:
            why = {errno.EROFS: "its file system is mounted read-only", errno.EACCES: "permission denied"}
            return Check(
                "disk path",
                Status.FAIL,
                f"uid {os.getuid()} cannot write a file in {path}: {why.get(e.errno, e.strerror)}",
                "give the daemon's user a writable directory (chown it; mount the file system read-write)",
            )
        return Check("disk path", Status.OK, f"uid {os.getuid()} can write in {path} ({file_system(path)})")

    def space(self) -> Check:
        chunk = self.cfg.disk.chunk_bytes
        shares = _shares(self.cfg)
        needed = sum(file_bytes((budget - BLOCK) // chunk, chunk) for _, budget in shares)
        held = sum(_held(directory) for directory, _ in shares)
        fs = os.statvfs(self.path)
        free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
        files = "its file" if len(shares) == 1 else f"{len(shares)} files, one per tenant"
        found = (
            f"disk.bytes {_size(self.cfg.disk.bytes)} reserves {_size(needed)} ({files}); {self.path} has "
            f"{_size(free)} free of {_size(total)}" + (f", and kvd's files hold {_size(held)} already" if held else "")
        )
        if needed - held > free:
            return Check(
                "disk space",
                Status.FAIL,
                f"{found}: the daemon's start would be refused (no space)",
                f"lower disk.bytes to at most {_size(free + held)}, or free space on this file system",
            )
        return Check("disk space", Status.OK, found)

    def direct_io(self) -> Check:
        kind = file_system(self.path)
        with probe_file(self.path, BLOCK) as (probe, _):
            opened = open_direct(probe)
        if opened is not None:
            fd, alignment = opened
            os.close(fd)
            return Check(
                "direct I/O", Status.OK, f"{kind}: direct I/O at {alignment}-byte alignment, the page cache bypassed"
            )
        if kind in MEMORY_FILE_SYSTEMS:
            return Check(
                "direct I/O",
                Status.WARN,
                f"{self.path} is on {kind}, which is memory: the disk tier there holds pages in RAM besides host "
                "memory, and loses them at a reboot",
                "put disk.path on a local SSD's file system (ext4, xfs)",
            )
        return Check(
            "direct I/O",
            Status.WARN,
            f"{kind} offers no direct I/O here: transfers go through the page cache and are dropped from it after",
            "ext4 or xfs on a local SSD support direct I/O (Linux 6.1 or later says so through statx)",
        )

    def read_bandwidth(self) -> Check:
        fs = os.statvfs(self.path)
        room = fs.f_bavail * fs.f_frsize // 2 // PROBE_READ_BYTES * PROBE_READ_BYTES
        nbytes = min(-(-self.probe_bytes // PROBE_READ_BYTES) * PROBE_READ_BYTES, room)
        if nbytes == 0:
            return Check("read bandwidth", Status.SKIP, f"not checked: {self.path} has no room for a probe file")
        seconds, direct = _timed_read(self.path, nbytes)
        rate = nbytes / seconds
        found = (
            f"read {_size(nbytes)} in {PROBE_READ_BYTES >> 20} MiB {'direct' if direct else 'buffered'} reads at "
            f"{rate / 1e6:,.0f} MB/s: a 1 GiB promotion takes about {(1 << 30) / rate:.2f} s"
        )
        if rate < SLOW_READ_BYTES_PER_S:
            return Check(
                "read bandwidth",
                Status.WARN,
                f"{found}, slower than a SATA SSD: promotions may take longer than recomputing",
                "put disk.path on a local SSD (NVMe reads at 2-7 GB/s)",
            )
        return Check("read bandwidth", Status.OK, found)


def _timed_read(directory: str, nbytes: int) -> tuple[float, bool]:
    """Seconds to read a probe file of ``nbytes`` written and synced just before, with direct
    I/O where there is some (else after dropping it from the page cache); and whether direct."""
    buffer = mmap.mmap(-1, PROBE_READ_BYTES)  # page-aligned, as direct I/O needs
    buffer.write(os.urandom(PROBE_READ_BYTES))
    try:
        with probe_file(directory, nbytes) as (probe, fd):
            opened = open_direct(probe)
            io_fd = fd if opened is None else opened[0]
            try:
                for offset in range(0, nbytes, PROBE_READ_BYTES):
                    os.pwritev(io_fd, [buffer], offset)
                os.fsync(io_fd)
                if opened is None:
                    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
                start = time.perf_counter()
                for offset in range(0, nbytes, PROBE_READ_BYTES):
                    os.preadv(io_fd, [buffer], offset)
                return time.perf_counter() - start, opened is not None
            finally:
                if opened is not None:
                    os.close(opened[0])
    finally:
        buffer.close()


# Each check and the checks it needs, in the order they run and print.
STEPS: list[tuple[str, tuple[str, ...], Callable[[DiskExamination], Check]]] = [
    ("disk path", (), DiskExamination.path_check),
    ("disk space", ("disk path",), DiskExamination.space),
    ("direct I/O", ("disk path",), DiskExamination.direct_io),
    ("read bandwidth", ("disk path",), DiskExamination.read_bandwidth),
]


def examine(cfg: ServeConfig, probe_bytes: int = PROBE_BYTES) -> list[Check]:
    """Every check of the disk tier ``cfg`` configures, in order (skipped where a check it
    needs did not pass); one FAIL when it configures none."""
    if cfg.disk is None:
        return [
            Check(
                "disk tier",
                Status.FAIL,
                "not configured: no [disk] table, KVD_DISK_PATH or --disk-path",
                "set disk.path and disk.bytes in the daemon's config (or pass --disk-path and --disk-bytes here)",
            )
        ]
    exam = DiskExamination(cfg, probe_bytes)
    checks: dict[str, Check] = {}
    for name, needs, run in STEPS:
        unmet = [n for n in needs if checks[n].status in (Status.FAIL, Status.SKIP)]
        checks[name] = Check(name, Status.SKIP, f"not checked: needs {unmet[0]}") if unmet else run(exam)
    return list(checks.values())
