"""What the pool tells about a page entering or leaving the published states and the index.

The pool (kvd/core/pool.py) is the one class that publishes, indexes, unindexes and frees a
page, so it is the one that reports each of those moments, once, to its ``PageListener``;
it knows nothing of who listens. The cache's listener (``PageEvents``,
kvd/cache/page_events.py) hands each report on to the sealer, the KV event log and the
tiers, in the order it documents.

A page's place in its chain (``ChainPlace``) is known to whoever publishes or restores it,
not to the pool: the caller hands it in, and the pool passes it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvd.core.index import ExtraKey, PageContent
from kvd.core.namespaces import Namespace
from kvd.core.types import NamespaceId, PageId, PageKey


class ChainPlace(NamedTuple):
    """Where a published page sits in its chain: what its record, its KV event and a tier's
    copy of it name beside its content. (A named tuple: one is made per page published, and
    it costs half a frozen dataclass.)"""

    ns: Namespace
    page_index: int  # pages before it in its chain
    # The parent's page key; for page 0 the chain root, None where it is not known (a page 0
    # recovered by a warm restart: records keep no chain root).
    parent_key: bytes | None
    extra_keys: tuple[ExtraKey, ...] = ()  # the publishing request's; none for recovered pages


class PageListener(Protocol):
    """Hears every page that enters or leaves the published states or the index, from the
    pool, in the call that changes it, once the page is in its new state (``unpublished``:
    just before, while its content is still the pool's)."""

    def published(self, contents: Sequence[PageContent], places: Sequence[ChainPlace], indexed: bool) -> None:
        """Private pages became published (a publish, pages fetched from a tier), each at its
        place, in chain order: immutable from now on; in the index unless ``indexed`` is
        False (a verified hash collision). A batch of a chain is told at once (a 50K-token
        publish is 3,125 pages)."""

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        """A page a warm restart recovered is indexed (CACHED); its record and checksum were
        there before."""

    def unindexed(self, page: PageId, key: PageKey, namespace: NamespaceId) -> None:
        """The page (under ``key``) left the index, whatever the reason (evicted, freed, reclaimed, reset, a
        failed checksum, or behind a page that left): no lookup finds it any more."""

    def unpublished(self, page: PageId) -> None:
        """A published page is about to be freed: its bytes and its record are still there,
        and it is reused next."""


class _Silent:
    """A listener that hears nothing: a pool on its own (tests)."""

    def published(self, contents: Sequence[PageContent], places: Sequence[ChainPlace], indexed: bool) -> None:
        pass

    def restored(self, content: PageContent, place: ChainPlace) -> None:
        pass

    def unindexed(self, page: PageId, key: PageKey, namespace: NamespaceId) -> None:
        pass

    def unpublished(self, page: PageId) -> None:
        pass


SILENT: PageListener = _Silent()
