"""Client library for engine processes: sessions, batched page calls, zero-copy page views.

Imports only the wire contract (``kvd.wire``), never the daemon's internals.
"""

from engine_client.client import KVDClient
from engine_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from engine_client.types import (
    ErrorCode,
    ExtendItem,
    ExtendResult,
    ExtraKey,
    ExtraKind,
    KVDError,
    LookupResult,
    PinResult,
    PublishResult,
    Rebind,
    ResetReport,
    SequenceAllocation,
    SequenceRequest,
    SequenceState,
    SequenceStatus,
    Stats,
    VerifyReport,
)
from kvd.wire.layout import PageLayout

__all__ = [
    "KVDClient",
    "PageLayout",
    "SequenceRequest",
    "SequenceAllocation",
    "LookupResult",
    "PublishResult",
    "Rebind",
    "ExtendItem",
    "ExtendResult",
    "PinResult",
    "ExtraKey",
    "ExtraKind",
    "KVDError",
    "ErrorCode",
    "SequenceState",
    "SequenceStatus",
    "Stats",
    "VerifyReport",
    "ResetReport",
    "KVEventBatch",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
]
