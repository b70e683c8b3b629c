"""What the remote tier counts, and what it reports. Storing (kvd/remote/storing.py) and
fetching (kvd/tiers/fetches.py) share one ``RemoteCounters``, and one ``Holds``
(kvd/tiers/holds.py): every page a store call reads or writes is held with a pool reference,
and the bytes pages being stored (and copies of evicted pages) take of the tier's backlog.
The tier reports them with its link's state as its ``RemoteStats`` (a ``TierStats``,
kvd/tiers/stats.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar


@dataclass
class RemoteCounters:
    stored_pages: int = 0  # pages the store accepted
    fetched_pages: int = 0  # pages fetched, verified and published locally
    hit_tokens: int = 0  # allocated prefix tokens served by fetched pages
    refused_pages: int = 0  # puts the store refused (full or otherwise): the page stays local only
    skipped_pages: int = 0  # published while the link was down or the backlog full: not stored
    rejected_pages: int = 0  # fetched pages whose header or checksum did not match: a miss
    errors: int = 0  # store calls that failed (the master unreachable, a page that did not arrive)
    reoffered_pages: int = 0  # offered again after the store came back, and accepted (in stored_pages too)


_LINK = ("state", "outages", "resets")  # the link's, which every tenant's tier shares


@dataclass
class RemoteStats(RemoteCounters):
    """The remote tier (kvd/remote/tier.py): the link's state and the tier's counters."""

    kind: ClassVar[str] = "remote"
    state: str = "off"
    outages: int = 0
    resets: int = 0

    def combined(self, other: RemoteStats) -> RemoteStats:
        """Tenants share one link: its state, outages and resets once, the tiers' counters summed."""
        total = RemoteStats(**{name: getattr(self, name) for name in _LINK})
        for f in fields(self):
            if f.name not in _LINK:
                setattr(total, f.name, getattr(self, f.name) + getattr(other, f.name))
        return total

    def as_dict(self) -> dict:
        return asdict(self)
