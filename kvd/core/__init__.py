"""The page core: host pages in shared-memory extents, their states and refcounts, the
prefix index that finds published ones, and the room a namespace gets within the budget.

``PagePool`` (pool.py) owns every page's state, refcount and index entry (index.py);
``Arena`` (arena.py) the extents, built ahead by ``ExtentSupply`` (supply.py); ``Room``
(room.py) decides what to give up when a namespace needs pages, in the order eviction.py
sets. A tier beside the core (the remote store's) hears of it through tier.py only.
"""
