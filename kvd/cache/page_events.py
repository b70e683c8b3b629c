"""What follows a page entering or leaving the published states and the index: one owner.

The pool (kvd/core/pool.py) reports each such moment once, whoever caused it (a publish, a
page fetched from a tier, a warm restart, an eviction, a reset, a reclaimed extent, a failed
checksum), to the cache's ``PageEvents`` (a ``PageListener``, kvd/core/listener.py), which
tells the others in this order:

- **published** (indexed or not): 1. the sealer writes the page's record
  (``Integrity.describe``, kvd/durability/integrity.py: metadata before anyone hears of the
  page); then, when indexed, 2. the event log announces it (``BlockStored``,
  kvd/cache/events.py) and 3. the tiers hear of it (``Tiers``, kvd/tiers/tier.py, nearest
  host memory first). A publishing call ends with ``submit``: 1. the sealer takes the pages
  described, 2. the tiers send what they queued.
- **restored** (a warm restart's page, verified and indexed, kvd/durability/reindexing.py):
  the event log announces it, then the tiers hear of it. Its record and seal were there before.
- **unindexed**: the event log (``BlockRemoved``).
- **unpublished** (a published page about to be freed): 1. the tiers (the remote tier, with
  policy "evict", copies the page while its bytes and seal are there), 2. the sealer forgets
  its record and checksum (a freed page must not be recovered).

A new tier plugs in at ``Tiers.attach`` and hears all of it from there.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.cache.events import EventLog
from kvd.core.index import PageContent
from kvd.core.listener import ChainPlace
from kvd.core.types import NamespaceId, PageId, PageKey
from kvd.durability.integrity import Integrity
from kvd.tiers.tier import Tiers


class PageEvents:
    """The fan-out of one cache's page reports: sealer, event log, tiers."""

    def __init__(self, integrity: Integrity, log: EventLog, tiers: Tiers) -> None:
        self.integrity = integrity
        self.log = log
        self.tiers = tiers

    def published(self, contents: Sequence[PageContent], places: Sequence[ChainPlace], indexed: bool) -> None:
        self.integrity.describe(contents, places)
        if indexed:
            for content, place in zip(contents, places):
                self._announce(content, place)
                self.tiers.published(content, place)

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        self._announce(content, place)
        self.tiers.restored(content, place)

    def unindexed(self, page: PageId, key: PageKey, namespace: NamespaceId) -> None:
        self.log.removed(namespace, key)

    def unpublished(self, page: PageId) -> None:
        self.tiers.unpublished(page)  # first: with policy "evict" the remote tier reads the page's seal
        self.integrity.forget(page)

    def submit(self) -> None:
        """A call's pages are all published (a publish's last step, a fetch's arrival)."""
        self.integrity.submit()  # once, with every page: the sealer thread stays off the GIL meanwhile
        self.tiers.submit()

    def _announce(self, content: PageContent, place: ChainPlace) -> None:
        ns = place.ns
        parent = place.parent_key if place.page_index else None
        self.log.stored(ns.id, ns.page_size, place.page_index, content.key, parent, content.tokens, place.extra_keys)
