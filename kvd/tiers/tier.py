"""Tiers below the cache: everything the cache tells one, in one narrow interface, and the
one place a tier plugs in.

A ``Tier`` hears the moments a tier cares about and knows nothing else of the cache: a
page published and indexed, a publish done, a published page about to be freed (through
``PageEvents``, kvd/cache/page_events.py, in the order it documents), a request matched
and an allocation's hits (from the manager and kvd/cache/allocation.py), a request's
``Miss``. The disk tier (kvd/disk/tier.py) and the remote store's tier (kvd/remote/tier.py),
each imported only when configured, implement it; the cache names neither.

``Tiers`` holds a cache's tiers, nearest host memory first, and is what the cache calls:
each call goes to every tier in that order. A tier plugs in with ``Tiers.attach``, once,
before the daemon takes calls (kvd/server/daemon.py attaches the disk tier, then the remote
tier); without any,
every call does nothing, so the cache and the page core under it read, run and test
without a tier and its store client.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from kvd.core.index import ChainSpec, ExtraKey, PageContent
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import Namespace
from kvd.core.types import PageId, PageKey
from kvd.tiers.stats import TierStats
from kvd.wire.codec import TOKEN_BYTES


@dataclass(frozen=True)
class Miss:
    """A request matched ``hits`` locally (``hit_keys`` their keys) and its prompt may have
    full pages past them: what a tier hears of it, in one value."""

    ns: Namespace
    chain: ChainSpec
    extra_keys: tuple[ExtraKey, ...]  # as requested, for the KV events of pages a tier brings
    tokens: bytes  # the prompt's token ids, packed
    hits: list[PageId]
    hit_keys: list[PageKey]

    @property
    def full_pages(self) -> int:
        """The prompt's full pages, the hit's included."""
        return len(self.tokens) // (self.ns.page_size * TOKEN_BYTES)

    @property
    def full_page_tokens(self) -> bytes:
        """The token ids of the prompt's full pages, packed."""
        return self.tokens[: self.full_pages * self.ns.page_size * TOKEN_BYTES]

    @property
    def missing(self) -> range:
        """The chain indexes of the full pages past the hit."""
        return range(len(self.hits), self.full_pages)

    @property
    def parent_key(self) -> bytes:
        """The key of the first missing page's parent: the last hit page's, or the chain root."""
        return self.hit_keys[-1] if self.hit_keys else self.chain.root


class Tier(Protocol):
    def published(self, content: PageContent, place: ChainPlace) -> None:
        """A page was just published and indexed (one the tier fetched itself too)."""

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        """A warm restart's page was verified and indexed (CACHED); ``place.parent_key`` is
        None for a page 0 whose chain root is not known."""

    def submit(self) -> None:
        """A call's pages are all published: what it indexed may go now."""

    def unpublished(self, page: PageId) -> None:
        """A published page stops being published (freed); its bytes and seal are still there."""

    def served(self, hits: list[PageId], page_size: int) -> None:
        """An allocation took these prefix hits."""

    def missed(self, miss: Miss) -> int:
        """A request matched ``miss.hits`` locally; returns the tokens past them the tier may
        still bring (ask again), 0 for none."""

    def holds(self) -> Counter[PageId]:
        """The pool references the tier holds right now, by page (kvd/cache/invariants.py)."""

    def stats(self) -> TierStats:
        """Its state and counters, under its ``kind`` in the cache's stats (kvd/cache/stats.py)."""


class Tiers:
    """The tiers beside one cache, nearest host memory first; each call goes to all of them."""

    def __init__(self) -> None:
        self._tiers: list[Tier] = []

    def attach(self, tier: Tier) -> None:
        """Plugs a tier in below the ones attached before: the one place a tier joins the
        cache. Before the daemon takes calls, after a warm restart's pages are restored (the
        tier finds them in the index)."""
        self._tiers.append(tier)

    def published(self, content: PageContent, place: ChainPlace) -> None:
        for tier in self._tiers:
            tier.published(content, place)

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        for tier in self._tiers:
            tier.restored(content, place)

    def submit(self) -> None:
        for tier in self._tiers:
            tier.submit()

    def unpublished(self, page: PageId) -> None:
        for tier in self._tiers:
            tier.unpublished(page)

    def served(self, hits: list[PageId], page_size: int) -> None:
        for tier in self._tiers:
            tier.served(hits, page_size)

    def missed(self, miss: Miss) -> int:
        """The tiers hear of the miss nearest first, until one may still bring tokens: a page
        the disk is bringing is not fetched from the remote store too. The client asks again
        once that fetch ends, and the next tier hears of what it did not bring."""
        for tier in self._tiers:
            pending = tier.missed(miss)
            if pending:
                return pending
        return 0

    def holds(self) -> Counter[PageId]:
        """The pool references all tiers hold, by page."""
        held: Counter[PageId] = Counter()
        for tier in self._tiers:
            held.update(tier.holds())
        return held

    def stats(self) -> dict[str, TierStats]:
        """Each tier's stats, by its kind."""
        return {stats.kind: stats for stats in (tier.stats() for tier in self._tiers)}


class _NoTiers(Tiers):
    """No tier, ever: what hears a cache's calls that no tier may hear of (matching, with
    prefix reuse off, finds nothing a tier could bring)."""

    def attach(self, tier: Tier) -> None:
        raise AssertionError("NO_TIERS takes no tier; attach to a cache's own Tiers")


NO_TIERS: Tiers = _NoTiers()
