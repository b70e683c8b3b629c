"""KV events as ``KVDClient.subscribe_events`` hands them out: which pages of the client's
tenant became findable (``BlockStored``) or stopped being findable (``BlockRemoved``,
``AllBlocksCleared``), in numbered batches.

They are vLLM's KV events (kvd's ZMQ stream sends the same, kvd/server/event_publisher.py) with
kvd's page keys as block hashes (``KVDClient.page_keys`` computes them locally).
engine_client/messages.py reads them off the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Pages that follow one another in one chain became findable."""

    namespace_id: int
    block_hashes: list[bytes]  # the pages' kvd keys, parents first
    parent_block_hash: bytes | None  # the key of block_hashes[0]'s parent; None for a chain's first page
    token_ids: list[int]  # block_size per page
    block_size: int
    lora_name: str | None
    medium: str  # "CPU": kvd's host pages; "STORAGE": the disk tier's; "REMOTE": the remote tier's store


@dataclass(frozen=True)
class BlockRemoved:
    """Pages that are no longer findable (evicted, reset, dropped)."""

    namespace_id: int
    block_hashes: list[bytes]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Everything announced before is gone (a daemon's first batch says so)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """What one call changed, in order."""

    seq: int  # numbered without gaps: a first seq above a resume's from_seq means some were missed
    ts: float  # seconds since the epoch when the batch closed
    events: list[KVEvent]
