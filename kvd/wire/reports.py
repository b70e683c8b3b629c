"""What the stats, verify and reset calls report, as typed dicts (kvd/wire/admin.py builds
them; ``KVDClient.stats()`` / ``verify_pages()`` / ``reset_prefix_cache()`` and ``kvd stats``
/ ``verify`` / ``reset`` return or print them).

Typed dicts, not classes: each is the plain dict that ``kvd stats --json`` prints, so it
compares, serialises and reads (``stats["physical_pages"]``) as a dict, while a type
checker knows every key and its type. README's "Stats" table says what each field means;
tests/test_service.py checks a real daemon's answers against these declarations.
"""

from __future__ import annotations

from typing import TypedDict


class PageStats(TypedDict):
    """Page counts, of the whole daemon (or a tenant's part) or of one namespace."""

    logical_pages: int
    physical_pages: int
    shared_pages: int
    private_pages: int
    cached_pages: int
    pinned_pages: int
    free_pages: int
    host_pages_saved: int
    host_bytes_saved: int
    refcount_increments: int
    refcount_decrements: int
    lookup_tokens: int
    hit_tokens: int
    evicted_pages: int
    sequences: int
    sessions: int
    corrupted_pages: int


class _TenantOfNamespace(TypedDict, total=False):
    tenant: str  # only in a daemon-wide answer of a daemon with tenants


class NamespaceStats(PageStats, _TenantOfNamespace):
    namespace_id: int
    model: str
    page_bytes: int


class RecoveryStats(TypedDict):
    """What the daemon's last start found in shared memory."""

    recovered_pages: int
    resealed_pages: int
    corrupted_pages: int
    orphaned_pages: int
    mismatch_pages: int
    incomplete_pages: int
    incomplete_extents: int
    discarded: str  # why every segment was discarded; "" when none was
    seconds: float  # until every page found was verified (so far, while pages are pending)
    pending_pages: int  # found, not verified and indexed yet: the recovery runs while the daemon serves
    evicted_pages: int  # found, then freed unverified for an allocation short of room
    dropped_pages: dict[str, int]  # by reason: corrupted, orphaned, mismatch, incomplete_extent, evicted


class RemoteStats(TypedDict):
    """The remote tier's work; ``state`` is "off" without one."""

    state: str  # off, connecting, up, down
    stored_pages: int
    fetched_pages: int
    hit_tokens: int
    refused_pages: int
    skipped_pages: int
    rejected_pages: int
    errors: int
    outages: int
    resets: int  # of the outages, times the store had lost this host's objects (its master restarted)
    reoffered_pages: int  # pages offered to the store again after it came back


class DiskStats(TypedDict):
    """The disk tier's work; ``state`` is "off" without one."""

    state: str  # off, opening (pages on disk still being indexed), on
    pages: int  # on disk now
    bytes: int
    capacity_bytes: int
    written_pages: int
    fetched_pages: int  # read back, verified and published (promoted)
    hit_tokens: int
    skipped_pages: int  # evicted while the write backlog was full: not written
    refused_pages: int  # disk full after evicting, out of space, vanished
    evicted_pages: int
    rejected_pages: int  # read back and failed a check: dropped
    errors: int
    backlog_bytes: int
    recovered_pages: int
    pending_pages: int  # found at start, not indexed yet (not hittable yet)
    direct_io: bool
    written_bytes: int
    read_bytes: int  # promotions' reads
    promotion_buckets: list[int]  # batches of promotion reads per bound of kvd/tiers/stats.py's PROMOTION_BUCKETS
    promotion_seconds: float  # their seconds, summed


class PrewarmStats(TypedDict):
    """The prewarms of the cache (pins' included), in tokens (kvd/cache/prewarm.py)."""

    prompts: int
    requested_tokens: int
    resident_tokens: int  # already in host memory when asked
    promoted_tokens: int  # brought from a tier below, once a prompt's fetches ended
    not_found_tokens: int  # on no tier, or failed their checks
    over_budget_tokens: int  # beyond what the tenant's budget spared: not promoted
    pending_tokens: int  # queued or in flight now


class PrewarmPrompt(TypedDict):
    """One prompt of a prewarm, in tokens of its full pages."""

    seq_id: str  # its label: its place in the call
    requested_tokens: int
    resident_tokens: int
    pending_tokens: int  # queued for a promotion, or being promoted
    over_budget_tokens: int  # beyond the tenant's budget: not promoted
    not_found_tokens: int  # on no tier, known at once (the disk answers from its index)


class PrewarmReport(TypedDict):
    partial: bool  # some prompt went beyond the budget
    prompts: list[PrewarmPrompt]


class Stats(PageStats):
    """The daemon's totals at top level, then its budgets, its start and each namespace."""

    host_bytes: int
    host_bytes_used: int
    host_bytes_free: int
    aux_bytes: int
    aux_bytes_used: int
    aux_bytes_per_sequence: int
    arena_bytes: int
    prefix_reuse: bool
    shm_refusals: int
    recovery: RecoveryStats
    remote: RemoteStats
    disk: DiskStats
    prewarm: PrewarmStats
    namespaces: list[NamespaceStats]


class VerifyReport(TypedDict):
    """One audit of every published page against its checksum."""

    checked_pages: int
    checked_bytes: int
    corrupted_pages: int  # found by this audit (and dropped)
    seconds: float
    recovery: RecoveryStats


class ResetReport(TypedDict):
    dropped_pages: int  # cached pages dropped from the index and freed
    kept_pages: int  # published pages still referenced by a sequence or pin, untouched
