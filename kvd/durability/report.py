"""What a daemon's start found in shared memory (kvd/durability/recovery.py) and verified
(kvd/durability/reindexing.py): kept for ``kvd stats``, metrics and ``kvd verify``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# Below this many verified bytes a warm restart's time is mostly fixed costs (opening
# segments, the manifest), so a per-GiB rate extrapolated from it would mislead.
RATE_MIN_BYTES = 64 << 20


@dataclass(frozen=True)
class RecoveryReport:
    """What the last start found in shared memory; every dropped page is counted by reason."""

    extents: int = 0
    recovered_pages: int = 0
    resealed_pages: int = 0  # of recovered_pages: published but not sealed when the daemon died
    corrupted_pages: int = 0  # failed their checksum
    orphaned_pages: int = 0  # verified, but their parent did not come back
    mismatch_pages: int = 0  # published pages of segments another configuration left
    incomplete_pages: int = 0  # published pages of incomplete extents
    incomplete_extents: int = 0  # extents a crash left half created or half deleted
    verified_bytes: int = 0
    seconds: float = 0.0  # from the start until every page found was verified (so far, while pending)
    discarded: str | None = None  # why the previous daemon's segments were deleted
    pending_pages: int = 0  # found, not verified and indexed yet (the recovery runs while the daemon serves)
    evicted_pages: int = 0  # found, then freed unverified for an allocation short of room

    @property
    def ms_per_gib(self) -> float | None:
        """The verification rate; None below RATE_MIN_BYTES, where fixed costs would dominate it."""
        if self.verified_bytes < RATE_MIN_BYTES:
            return None
        return self.seconds * 1e3 / (self.verified_bytes / (1 << 30))

    @property
    def dropped_pages(self) -> dict[str, int]:
        return {
            "corrupted": self.corrupted_pages,
            "orphaned": self.orphaned_pages,
            "mismatch": self.mismatch_pages,
            "incomplete_extent": self.incomplete_pages,
            "evicted": self.evicted_pages,
        }

    def as_dict(self) -> dict:
        return {**asdict(self), "discarded": self.discarded or "", "dropped_pages": self.dropped_pages}

    @classmethod
    def combined(cls, reports: list[RecoveryReport]) -> RecoveryReport:
        """Several tenants' reports as one daemon's: counts summed, reasons for discarding joined."""
        counts = {f.name: sum(getattr(r, f.name) for r in reports) for f in fields(cls) if f.name != "discarded"}
        return cls(**counts, discarded="; ".join(r.discarded for r in reports if r.discarded) or None)
