"""Enumerations of the wire contract, with the values protos/kvd.proto gives them.

The daemon and the client library both use these, so the two sides cannot drift apart.
"""

from __future__ import annotations

import enum


class SequenceState(enum.Enum):
    """A sequence's life-cycle state; which moves a client may make is kvd/cache/sequences.py's
    ``TRANSITIONS`` (the README's table). EVICTED: memory pressure dropped an ON_HOLD one's pages."""

    PREFILLED = 1
    IN_DECODE = 2
    ON_HOLD = 3
    EVICTED = 4
    COMPLETED = 5


class ExtraKind(enum.IntEnum):
    """Kinds of extra page-key material (ExtraKey.Kind in the proto)."""

    MULTIMODAL = 1
    LORA = 2
    CACHE_SALT = 3
