"""What the disk tier's storage engine answers (kvd/diskstore/store.py): the outcome of opening
it (``Opened`` is the store's own, beside it), of each page written or read, and the
counters the tier exposes.

Expected faults are results here, never exceptions: a store that cannot open is
``OpenRefused``, a page not written is ``NotWritten`` with its reason, a page not read back
is ``ReadMiss`` (and, when its bytes or its read failed, dropped from the disk).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from kvd.diskstore.layout import DiskPage, PageIdentity, SlotClass, SlotId


class OpenRefusal(enum.Enum):
    MISSING = "missing"  # the directory does not exist (vanished, not mounted)
    READ_ONLY = "read-only"  # the directory or its file system is not writable
    NO_SPACE = "no-space"  # the file system cannot hold the budget
    IO_ERROR = "io-error"  # the file cannot be read or written


@dataclass(frozen=True)
class RecoveryReport:
    pages: int  # valid pages found on disk
    torn: int  # headers found torn or invalid (their slots are free)
    formatted: bool  # the file was formatted now: nothing before survives
    header_bytes_read: int
    seconds: float


@dataclass(frozen=True)
class OpenRefused:
    reason: OpenRefusal
    detail: str


@dataclass(frozen=True, slots=True)
class Seal:
    """A page's seal in host memory (kvd/core/records.py): checked before the page is written."""

    covered: bytes
    checksum: int


@dataclass(frozen=True, slots=True)
class PageWrite:
    identity: PageIdentity
    view: np.ndarray  # uint8 [page_bytes], kept unchanged until the write's future is done
    seal: Seal | None = None  # when given, a page whose bytes no longer match it is not written

    @property
    def page_class(self) -> SlotClass:
        """The slots the page fits."""
        return SlotClass(self.view.nbytes, len(self.identity.tokens) // 4)


class WriteRefusal(enum.Enum):
    FULL = "full"  # no free slot of the page's size: the tier frees some (its eviction policy)
    TOO_LARGE = "too-large"  # the page does not fit in a chunk
    NO_SPACE = "no-space"  # the file system answered ENOSPC (one that does not honour fallocate)
    IO_ERROR = "io-error"  # the write or its sync failed
    CHANGED = "changed"  # the page's bytes no longer match its seal
    VANISHED = "vanished"  # the file was removed under the store (its directory deleted)
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Written:
    page: DiskPage


@dataclass(frozen=True, slots=True)
class NotWritten:
    reason: WriteRefusal


WriteResult = Written | NotWritten


@dataclass(frozen=True, slots=True)
class PageRead:
    slot: SlotId
    view: np.ndarray  # uint8 [page_bytes]: where the page lands


class ReadFailure(enum.Enum):
    NOT_STORED = "not-stored"  # the slot holds no page (freed or dropped meanwhile)
    CORRUPT = "corrupt"  # the bytes read fail the header's checksum: dropped
    IO_ERROR = "io-error"  # the read failed: dropped
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class ReadOk:
    page: DiskPage


@dataclass(frozen=True, slots=True)
class ReadMiss:
    slot: SlotId
    reason: ReadFailure

    @property
    def dropped(self) -> bool:
        """Whether the store dropped the page (the tier forgets it)."""
        return self.reason in (ReadFailure.CORRUPT, ReadFailure.IO_ERROR)


ReadResult = ReadOk | ReadMiss


@dataclass
class StoreCounters:
    """What the store counts (the tier reports some of it in its ``DiskStats``, kvd/disk/ledger.py):
    gauges (pages, bytes) and counts that only grow."""

    direct_io: bool = False
    capacity_bytes: int = 0  # the file's size
    pages: int = 0  # pages on disk now
    bytes: int = 0  # their page bytes
    writes: int = 0  # pages written
    write_bytes: int = 0
    reads: int = 0  # pages read back and verified
    read_bytes: int = 0
    write_errors: int = 0  # pages whose write (or sync) failed
    read_errors: int = 0  # pages whose read failed (dropped)
    refused_full: int = 0  # pages refused: no free slot of their size, or too large
    refused_no_space: int = 0  # pages refused: ENOSPC at the write
    refused_vanished: int = 0  # pages refused: the file was removed
    changed_pages: int = 0  # pages not written: their bytes no longer matched their seal
    dropped_pages: int = 0  # pages read back that failed their checksum (torn, corrupted): dropped
    torn_headers: int = 0  # invalid headers found when the file was opened
    lost_slots: int = 0  # slots whose header could not be zeroed: unused until the next open
    backlog_pages: int = 0  # writes submitted and not finished
    backlog_bytes: int = 0
    bounced_pages: int = 0  # pages moved through an aligned bounce buffer (unaligned views)
    recovered_pages: int = 0
    recovery_seconds: float = 0.0
