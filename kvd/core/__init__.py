"""The page core: host pages in shared-memory extents, their states and refcounts, and the
prefix index that finds published ones.

``PagePool`` (pool.py) owns every page's state, refcount and index entry (index.py), in
the eviction order eviction.py sets, and reports each page entering or leaving the
published states or the index to its listener (listener.py); ``Arena`` (arena.py) the extents and their
metadata records (records.py), built ahead by ``ExtentSupply`` (supply.py). The core
imports nothing of the daemon above it (tests/test_codegen.py): what to give up for room
is the cache's (kvd/cache/room.py), and settings reach it as arguments.
"""
