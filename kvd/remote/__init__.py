"""The remote tier below the cache (optional, with ``[remote]``): published pages shared
with other hosts through a Mooncake Store.

``RemoteTier`` (tier.py, one per tenant) is what the cache calls through kvd/tiers/tier.py:
storing pages and offering them again (storing.py), fetching them (kvd/tiers/fetches.py,
the store its source through fetching.py), with the counters both share (ledger.py; the
holds are kvd/tiers/holds.py) and the jobs both run on the link's thread
(jobs.py); ``RemoteLink`` (link.py, one per daemon) that thread and the link's state;
format.py a page's key and value in the store; mooncake_store.py the only module that
imports the store's client. Only the launcher (kvd/server/daemon.py) builds it.
"""
