"""Typed identities shared by the daemon's modules."""

from __future__ import annotations

import enum
from typing import NewType

from kvd.wire.enums import SequenceState  # noqa: F401 - re-exported beside the other core types

PageId = NewType("PageId", int)
PageKey = NewType("PageKey", bytes)
NamespaceId = NewType("NamespaceId", int)
SeqId = NewType("SeqId", str)
SessionId = NewType("SessionId", str)
PinId = NewType("PinId", int)


class PageState(enum.Enum):
    """Life cycle of a host page: FREE → PRIVATE → PUBLISHED → CACHED → FREE."""

    FREE = "free"
    PRIVATE = "private"  # one owner, writable
    PUBLISHED = "published"  # immutable, indexed, refcount ≥ 1
    CACHED = "cached"  # published, refcount 0, evictable in LRU order
