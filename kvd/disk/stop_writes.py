"""The last writes of a graceful stop: the pages host memory still holds go to the disk, so
that a host reboot (a fresh /dev/shm) after a clean stop finds the whole cache warm.

Write-back (kvd/disk/write_back.py) writes a page only when host memory evicts it; at a
stop the cache's most recently used pages are the ones still in host memory, and a warm
restart on the same /dev/shm finds them there, but a reboot would lose them. ``write_host_pages`` runs
when ``kvd stop`` (SIGTERM) has stopped the servers, so no call changes a page meanwhile: it
writes each tenant's sealed published pages (cached or still referenced) that the disk does
not hold, straight from host memory (no copy), through the tier's own write path (a full
disk frees its policy's victims). Bounded twice:

- by the budget: at most as many pages as the disk tier's file holds, the pages host
  memory would evict last first (more would only evict them again);
- by time: batches of ``backlog_bytes`` are written one after the other, most valuable
  first, until ``[disk] stop_write_seconds`` have passed; the batch in flight then is
  finished by the tier's close, the rest is not written (logged).

Most valuable first means the disk's recency (its write order, which the next start reads
back) has these pages in reverse among themselves: a hit makes a page the most recent again.
A tier still opening (kvd/disk/opening.py) is waited for, within the same time: until its
index has learnt the pages on disk it cannot tell which host pages the disk holds already.
The launcher (kvd/server/daemon.py) calls it for every tenant at once, before the tiers close.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd.disk.tier import DiskTier
from kvd.diskstore.results import PageWrite
from kvd.diskstore.store import DiskStore

log = logging.getLogger(__name__)

POLL_SECONDS = 0.005  # how often a batch in flight is looked at


async def write_host_pages(tiers: list[DiskTier], seconds: float) -> None:
    """Writes what host memory holds to each tier's disk, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(_write_tier(tier, deadline) for tier in tiers))


async def _write_tier(tier: DiskTier, deadline: float) -> None:
    started = time.monotonic()
    while not tier.opening.done and time.monotonic() < deadline:  # what the disk holds is not known yet
        await asyncio.sleep(POLL_SECONDS)
    tier.integrity.apply(wait=True)  # the seals of the last pages published (the sealer's last batch)
    writes = _within(tier.unwritten()[::-1], tier.store)
    written = 0
    for batch in _batches(writes, tier.write_back.backlog_limit):
        if time.monotonic() >= deadline:
            break
        tier.write_back.write(batch)
        while tier.write_back.backlog_bytes and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        written += len(batch)
    left = len(writes) - written
    log.info(
        "disk tier %s: wrote %d pages host memory held in %.2f s%s",
        tier.scope,
        written,
        time.monotonic() - started,
        f"; {left} not written (disk.stop_write_seconds ran out)" if left else "",
    )


def _within(writes: list[PageWrite], store: DiskStore) -> list[PageWrite]:
    """The first of ``writes`` the disk's file holds (pages of several sizes share its chunks:
    counted as though each size had them all)."""
    room = {page_class: store.holds_at_most(page_class) for page_class in {w.page_class for w in writes}}
    for n, w in enumerate(writes):
        room[w.page_class] -= 1
        if room[w.page_class] < 0:
            return writes[:n]
    return writes


def _batches(writes: list[PageWrite], batch_bytes: int) -> list[list[PageWrite]]:
    """``writes`` in order, cut into batches of at most ``batch_bytes`` (one page at least)."""
    batches: list[list[PageWrite]] = []
    size = 0
    for w in writes:
        if not batches or size + w.view.nbytes > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(w)
        size += w.view.nbytes
    return batches
