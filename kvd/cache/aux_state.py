"""The non-KV state budget: bytes of ``Sequence.aux`` one sequence and all together may hold.

Non-KV state (recurrent or indexer state, checkpoints) lives on the daemon's heap, beside
the arena's host budget (`aux_bytes`, `aux_bytes_per_sequence` in kvd/config.py). A blob
over the per-sequence limit is INVALID_ARGUMENT, since it never fits whatever else is
held; one over what the shared budget has left is RESOURCE_EXHAUSTED, since it fits once
other sequences free some. What the sequences hold is counted by their table
(``SequenceTable.aux_bytes``); kvd/cache/invariants.py checks that count against them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.cache.sequences import Sequence, SequenceTable
from kvd.core.errors import InvalidArgument, ResourceExhausted


@dataclass
class AuxBudget:
    budget: int  # bytes all sequences may hold together
    per_sequence: int  # bytes one sequence may hold
    sequences: SequenceTable  # what they hold

    @property
    def used(self) -> int:
        """Bytes all live sequences hold."""
        return self.sequences.aux_bytes

    def set(self, seq: Sequence, data: bytes) -> None:
        """Replaces the sequence's aux state, or raises before changing anything."""
        if len(data) > self.per_sequence:
            raise InvalidArgument(
                f"aux state of {len(data)} bytes is over the limit of {self.per_sequence} bytes per "
                "sequence (the daemon's aux_bytes_per_sequence)"
            )
        self.check_room(len(data) - len(seq.aux))
        self.sequences.set_aux(seq, data)

    def check_room(self, more: int) -> None:
        """Raises unless ``more`` bytes fit beside what all sequences hold."""
        if self.used + more > self.budget:
            raise ResourceExhausted(
                f"aux state of all sequences would take {self.used + more} bytes, over its budget of "
                f"{self.budget} bytes (the daemon's aux_bytes; {self.used} held now)"
            )
