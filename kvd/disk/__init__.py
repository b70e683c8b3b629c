"""The disk tier (issue 30): the policy of pages kept in one preallocated file below host RAM.

``DiskTier`` (tier.py, one per tenant, with ``[disk]``) is what the cache calls through
kvd/tiers/tier.py, built from what the cache lends it (kvd/cache/ports.py); it composes
``DiskIndex`` (index.py: its pages on disk, the eviction policy, ``ArcPolicy`` or
``LruPolicy`` from kvd/tiers/eviction.py, and their KV events), ``WriteBack``
(write_back.py: write-back of evicted pages, its queue, copies and backlog) and promotions
through the shared fetch machinery (kvd/tiers/fetches.py) with the disk as its source
(source.py), and consults ``UseCounts`` (admission.py) with ``min_uses``; answers.py brings
the store's answers back to the event loop, opening.py the pages found on disk at start
learnt in the background, ledger.py holds the counters they share and the
stats the tier reports, reclaim.py what a full disk frees, stop_writes.py the writes of a
graceful stop, doctor.py ``kvd doctor --disk``. The storage engine they call is
kvd/diskstore/.
"""
