"""Requests and results of the client API, and the one error type it raises with its codes;
the stats, verify and reset answers (typed dicts) come from kvd/wire/reports.py, KV events
from engine_client/events.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.wire.codec import pack_tokens, unpack_pages  # noqa: F401 - part of the client API
from kvd.wire.enums import ExtraKind, SequenceState  # noqa: F401 - part of the client API
from kvd.wire.errors import ErrorCode, KVDError  # noqa: F401 - part of the client API
from kvd.wire.layout import PageLayout
from kvd.wire.reports import (  # noqa: F401 - part of the client API
    NamespaceStats,
    PageStats,
    RecoveryStats,
    RemoteStats,
    ResetReport,
    Stats,
    VerifyReport,
)


@dataclass(frozen=True)
class ExtraKey:
    """Something besides token ids that changes KV; see the constructors."""

    kind: ExtraKind
    value: bytes
    offset: int = 0
    length: int = 1

    @classmethod
    def multimodal(cls, content_hash: bytes, offset: int, length: int) -> ExtraKey:
        """An image/audio item whose placeholder tokens are [offset, offset + length)."""
        return cls(ExtraKind.MULTIMODAL, content_hash, offset, length)

    @classmethod
    def lora(cls, adapter: str | bytes) -> ExtraKey:
        return cls(ExtraKind.LORA, adapter.encode() if isinstance(adapter, str) else adapter)

    @classmethod
    def cache_salt(cls, salt: str | bytes) -> ExtraKey:
        return cls(ExtraKind.CACHE_SALT, salt.encode() if isinstance(salt, str) else salt)


@dataclass(frozen=True)
class SequenceRequest:
    seq_id: str
    token_ids: object  # a sequence of ints or an integer numpy array
    extra_keys: tuple[ExtraKey, ...] = ()


@dataclass(frozen=True)
class SequenceAllocation:
    """Where a sequence's KV lives. Prefill computes tokens [suffix_start, num_tokens)."""

    seq_id: str
    shared_pages: list[int]
    private_pages: list[int]
    shared_prefix_tokens: int
    suffix_start: int
    num_tokens: int

    @property
    def pages(self) -> list[int]:
        """The combined page table: shared prefix pages, then private pages."""
        return self.shared_pages + self.private_pages


@dataclass(frozen=True)
class SequenceStatus:
    """One sequence as the daemon holds it now (``KVDClient.describe_sequences``)."""

    seq_id: str
    state: SequenceState
    num_tokens: int  # tokens it has room for (0 once EVICTED)
    known_tokens: int  # of those, tokens whose ids the daemon knows (their pages can be published)
    shared_pages: int  # published pages at the head of its page table
    private_pages: int  # its own writable pages after them
    shared_prefix_tokens: int  # tokens its allocation found cached
    aux_bytes: int  # size of its non-KV state


@dataclass(frozen=True)
class LookupResult:
    seq_id: str
    hit_pages: list[int]
    hit_tokens: int
    remote_pending_tokens: int = 0  # more tokens a fetch from the daemon's remote store may bring: ask again


@dataclass(frozen=True)
class Rebind:
    """The sequence's page at ``position`` is now ``new_page``; ``old_page`` was freed."""

    position: int
    old_page: int
    new_page: int


@dataclass(frozen=True)
class PublishResult:
    seq_id: str
    published_pages: int
    rebinds: list[Rebind] = field(default_factory=list)


@dataclass(frozen=True)
class ExtendItem:
    seq_id: str
    num_tokens: int
    token_ids: object = None


@dataclass(frozen=True)
class ExtendResult:
    seq_id: str
    new_pages: list[int]
    num_tokens: int


@dataclass(frozen=True)
class PinResult:
    pin_id: int
    pinned_pages: int
    pinned_tokens: int
    pending_tokens: int = 0  # being promoted from a tier below: the pin extends to them once they land


@dataclass(frozen=True)
class PrewarmResult:
    """A prewarm of one prompt, in tokens of its full pages (kvd/cache/prewarm.py)."""

    seq_id: str
    requested_tokens: int
    resident_tokens: int  # already in host memory
    pending_tokens: int  # queued for a promotion, or being promoted
    over_budget_tokens: int  # beyond the tenant's budget: not promoted
    not_found_tokens: int  # on no tier, known at once (the disk answers from its index)


@dataclass(frozen=True)
class Namespace:
    id: int
    layout: PageLayout
    page_bytes: int
    root: bytes  # where its page key chains start (kvd/wire/keys.py)
