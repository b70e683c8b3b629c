"""Where a published page sits in its chain, and the seal its bytes must match: what a tier
needs to copy a page out of host memory (the remote tier's write-behind, the disk tier's
write-back).

Each tier keeps the ``ChainPlace`` of every published page it heard of (``Tier.published``,
``Tier.restored`` for a warm restart's pages).
"""

from __future__ import annotations

from kvd.core.arena import Arena
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
