"""What the remote tier counts. Storing (kvd/remote/storing.py) and fetching
(kvd/cache/fetches.py) share one ``RemoteCounters``, and one ``Holds`` (kvd/cache/holds.py):
every page a store call reads or writes is held with a pool reference, and the bytes pages
being stored (and copies of evicted pages) take of the tier's backlog.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RemoteCounters:
    stored_pages: int = 0  # pages the store accepted
    fetched_pages: int = 0  # pages fetched, verified and published locally
    hit_tokens: int = 0  # allocated prefix tokens served by fetched pages
    refused_pages: int = 0  # puts the store refused (full or otherwise): the page stays local only
    skipped_pages: int = 0  # published while the link was down or the backlog full: not stored
    rejected_pages: int = 0  # fetched pages whose header or checksum did not match: a miss
    errors: int = 0  # store calls that failed (the master unreachable, a page that did not arrive)
    reoffered_pages: int = 0  # offered again after the store came back, and accepted (in stored_pages too)
