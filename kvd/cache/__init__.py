"""The cache's policy: what each client call does to sequences, pins and sessions on top
of the page core.

``KVCacheManager`` (manager.py) checks every request whole, then acts; an allocation and a
publish run as jobs in steps (allocation.py, publishing.py); ``Catalog`` (catalog.py) acts
on a namespace's published pages apart from any session (registration, warm restart,
reset); ``Room`` (room.py) gives a namespace new pages and decides what to give up for
them. What follows a page's changes in the pool (its record, its KV event, the tiers) is
``PageEvents``'s (page_events.py); the KV events routers hear are events.py's; the tiers
below the cache hear of it through ``Tiers`` only (kvd/tiers/tier.py), and use only what
ports.py lends them; nothing here names a tier; invariants.py audits it all.
"""
