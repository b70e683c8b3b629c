"""The remote tier beside the page core (optional, with ``[remote]``): published pages
shared with other hosts through a Mooncake Store.

``RemoteTier`` (tier.py, one per tenant) is what the cache calls through kvd/cache/tier.py;
``RemoteLink`` (link.py, one per daemon) the thread every store call runs on and the
link's state; format.py a page's key and value in the store; mooncake_store.py the only
module that imports the store's client. Only the launcher (kvd/server/daemon.py) builds it.
"""
