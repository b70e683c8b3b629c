"""Page checksums: sealing published pages off the event loop, and auditing them.

Hashing costs ~35 ms per GiB (xxh3_64, measured on this host), so publishing a
50K-token prefix of 2 MiB pages (~6 GB) would hold the event loop for ~0.2 s if it
hashed synchronously. Instead ``publish`` writes each page's record (state PUBLISHED,
kvd/meta.py) and hands the page to one background sealer thread; the checksum is
recorded (state SEALED) on the event loop a moment later, and only if the page still
holds the same content. A page whose daemon died before its seal is sealed by recovery
(kvd/recovery.py): its bytes and record were complete before ``publish`` replied. Published pages are immutable, so hashing them beside the event loop is safe;
the manager waits for the sealer before it unmaps an extent.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvd.index import PageContent
from kvd.meta import ExtentMeta, page_checksum
from kvd.types import PageId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SealJob:
    page: PageId
    content: PageContent     # identity-checked when the checksum comes back
    meta: ExtentMeta
    slot: int                # the page's record in meta
    covered: bytes           # the record fields the checksum covers
    view: np.ndarray         # the page's bytes in shared memory


@dataclass(frozen=True)
class VerifyResult:
    checked_pages: int
    checked_bytes: int
    corrupted_pages: int
    seconds: float


def _hash_all(jobs: list[SealJob]) -> list[int]:
    return [page_checksum(job.covered, job.view) for job in jobs]


class Sealer:
    """One background thread that computes checksums of freshly published pages."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-sealer")
        self._pending: list[tuple[list[SealJob], Future]] = []
        # Set by the server: schedules apply on the event loop when a batch is done.
        self.notify: Callable[[], None] | None = None

    def submit(self, jobs: list[SealJob]) -> None:
        if not jobs:
            return
        future = self._executor.submit(_hash_all, jobs)
        self._pending.append((jobs, future))
        if self.notify is not None:
            future.add_done_callback(lambda _: self.notify())

    def finished(self, wait: bool = False):
        """(job, checksum) of every finished batch; with ``wait``, of every batch."""
        still = []
        for jobs, future in self._pending:
            if not wait and not future.done():
                still.append((jobs, future))
                continue
            try:
                checksums = future.result()
            except Exception:  # noqa: BLE001 - logged; the pages stay unsealed, never wrong
                log.exception("sealing %d published pages failed; they will not survive a restart", len(jobs))
                continue
            yield from zip(jobs, checksums)
        self._pending = still

    def close(self) -> None:
        self._executor.shutdown(wait=True)
