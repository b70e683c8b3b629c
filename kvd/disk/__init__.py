"""The disk tier (issue 30): pages kept in one preallocated file below host RAM.

``DiskTier`` (tier.py, one per tenant, with ``[disk]``) is what the cache calls through
kvd/cache/tier.py; it composes ``DiskIndex`` (index.py: its pages on disk, the eviction
policy, ``ArcPolicy`` or ``LruPolicy`` from eviction.py, and their KV events),
``WriteBack`` (write_back.py: write-back of evicted pages, its queue, copies and backlog)
and promotions through the shared fetch machinery (kvd/cache/fetches.py), and consults
``UseCounts`` (admission.py) with ``min_uses``; answers.py brings the store's answers back
to the event loop, ledger.py holds the counters they share.
``DiskStore`` (store.py) is the storage engine the tier calls: open (recovering every valid
page), write pages from shared-memory views, read them back into host pages with their
checksums checked, free slots; all transfers on its own worker threads, results as futures.
layout.py fixes the file's format (superblock, chunks of slots of one size, slot headers),
slot_file.py moves bytes between the file and buffers (direct I/O where the file system
allows it), recovery.py reads the headers back when the file is opened, crashpoints.py the
debug hooks crash tests kill the process at. Which pages go to disk and which are evicted
from it is the tier's policy (tier.py, index.py, eviction.py): nothing in the engine decides it.
"""
