"""Where a published page sits in its chain, and the seal its bytes must match: what a tier
needs to copy a page out of host memory (the remote tier's write-behind, the disk tier's
write-back).

Each tier keeps the ``ChainPlace`` of every published page it heard of (``Tier.published``);
a warm restart's pages, restored before any tier attaches, are placed by ``recovered_places``.
"""

from __future__ import annotations

from kvd.core.arena import Arena
from kvd.core.index import PrefixIndex, chain_spec
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import NamespaceRegistry
from kvd.core.pool import PagePool
from kvd.core.types import PageId
from kvd.durability.integrity import Integrity


def page_seal(integrity: Integrity, arena: Arena, page: PageId) -> tuple[bytes, int] | None:
    """The page's record fields and checksum, which its bytes must match; None before it is
    sealed, or once its seal is gone."""
    checksum = integrity.checksum(page)
    if checksum is None:
        return None
    extent = arena.extent_of(page)
    return extent.meta.covered(page - extent.first_page), checksum


def recovered_places(pool: PagePool, index: PrefixIndex, namespaces: NamespaceRegistry) -> dict[PageId, ChainPlace]:
    """Where each page a warm restart recovered sits in its chain: how many parents it has
    (each page is walked once) and its parent's key. Page 0's parent key is its chain root,
    which records do not keep: it is known only for a chain without request-wide extra keys
    (LoRA, cache salt) nor a multimodal item on page 0, whose local digest is then that of
    the namespace's plain root."""
    places: dict[PageId, ChainPlace] = {}
    depth: dict[PageId, int] = {}
    plain = {ns.id: chain_spec(ns.root, ns.page_size, ()) for ns in namespaces.all()}
    for _, at in index.items():
        walk = []  # the page and its ancestors not walked yet, deepest first
        while at is not None and at not in depth:
            walk.append(at)
            at = pool.content(at).parent
        page_index = -1 if at is None else depth[at]
        for page in reversed(walk):
            page_index += 1
            depth[page] = page_index
            content, ns = pool.content(page), namespaces.get(pool.namespace_of(page))
            if content.parent is not None:
                places[page] = ChainPlace(ns, page_index, pool.content(content.parent).key)
            elif content.local == plain[ns.id].local_digest(0):
                places[page] = ChainPlace(ns, page_index, plain[ns.id].root)
    return places
