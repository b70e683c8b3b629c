"""The disk tier (issue 30): pages kept in one preallocated file below host RAM.

``DiskTier`` (tier.py, one per tenant, with ``[disk]``) is what the cache calls through
kvd/cache/tier.py: write-back of evicted pages, its index of pages on disk, promotions
through the shared fetch machinery (kvd/cache/fetches.py), ``ArcPolicy`` or ``LruPolicy``
(eviction.py) when the disk is full, and ``UseCounts`` (admission.py) with ``min_uses``.
``DiskStore`` (store.py) is the storage engine the tier calls: open (recovering every valid
page), write pages from shared-memory views, read them back into host pages with their
checksums checked, free slots; all transfers on its own worker threads, results as futures.
layout.py fixes the file's format (superblock, chunks of slots of one size, slot headers),
slot_file.py moves bytes between the file and buffers (direct I/O where the file system
allows it), recovery.py reads the headers back when the file is opened, crashpoints.py the
debug hooks crash tests kill the process at. Which pages go to disk and which are evicted
from it is the tier's policy (tier.py, eviction.py): nothing in the engine decides it.
"""
