"""A tier beside the cache: everything the cache tells it, in one narrow interface.

The cache (kvd/cache/manager.py, kvd/cache/allocation.py, kvd/cache/publishing.py) calls a
``Tier`` at the moments a tier cares about (a page indexed, a publish done, a page about to
be freed, a request matched, an allocation's hits) and knows nothing else of it. The remote
store's tier (kvd/remote/tier.py, imported only with a remote tier configured) implements
it; without one the manager holds ``NO_TIER``, which does nothing, so the cache and the
page core under it read, run and test without the remote tier and its store client.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from kvd.cache.stats import RemoteStats
from kvd.core.index import ChainSpec, ExtraKey, PageContent
from kvd.core.namespaces import Namespace
from kvd.core.types import PageId, PageKey


class Tier(Protocol):
    def published(
        self, ns: Namespace, content: PageContent, page_index: int, parent_key: bytes, extra_keys: tuple[ExtraKey, ...]
    ) -> None:
        """A page was just published and indexed."""

    def submit(self) -> None:
        """A publish ended: what it indexed may go now."""

    def unpublished(self, page: PageId) -> None:
        """A published page stops being published (freed); its bytes and seal are still there."""

    def served(self, hits: list[PageId], page_size: int) -> None:
        """An allocation took these prefix hits."""

    def missed(
        self,
        ns: Namespace,
        chain: ChainSpec,
        extra_keys: tuple[ExtraKey, ...],
        tokens: bytes,
        hits: list[PageId],
        hit_keys: list[PageKey],
    ) -> int:
        """A request matched ``hits`` locally; returns the tokens past them the tier may still
        bring (ask again), 0 for none."""

    def holds(self) -> Counter[PageId]:
        """The pool references the tier holds right now, by page (kvd/cache/invariants.py)."""

    def stats(self) -> RemoteStats:
        """Its state and counters (kvd/cache/stats.py)."""


class _NoTier:
    """No tier: every call does nothing."""

    def published(self, ns, content, page_index, parent_key, extra_keys) -> None:
        pass

    def submit(self) -> None:
        pass

    def unpublished(self, page: PageId) -> None:
        pass

    def served(self, hits: list[PageId], page_size: int) -> None:
        pass

    def missed(self, ns, chain, extra_keys, tokens, hits, hit_keys) -> int:
        return 0

    def holds(self) -> Counter[PageId]:
        return Counter()

    def stats(self) -> RemoteStats:
        return RemoteStats()


NO_TIER: Tier = _NoTier()
