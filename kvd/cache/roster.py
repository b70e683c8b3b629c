"""The roster: which session holds which sequence, and who hears when a sequence is evicted.

A sequence is filed in three places that must agree: the page tables (``SequenceTable``,
kvd/cache/sequences.py), its session's set (``Session.sequences``, kvd/cache/sessions.py) and
the budget of non-KV state (``AuxBudget``, kvd/cache/aux_state.py). The manager
(kvd/cache/manager.py) and an allocation (kvd/cache/allocation.py) add and forget sequences
here, never in one of the three alone.

Making room for a call (``Room``, kvd/cache/room.py) may evict ON_HOLD sequences of any
session; the roster hands out what it evicted once the call is done: the caller's own ids
for its reply, every other owner's on its session stream (its ``listener``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.cache.aux_state import AuxBudget
from kvd.cache.room import Room
from kvd.cache.sequences import Sequence, SequenceTable
from kvd.cache.sessions import Session, SessionRegistry
from kvd.core.errors import ResourceExhausted
from kvd.core.namespaces import Namespace
from kvd.core.types import NamespaceId, SeqId, SessionId


@dataclass
class Roster:
    sequences: SequenceTable
    sessions: SessionRegistry
    aux: AuxBudget
    room: Room

    def add(self, session: Session, seq: Sequence) -> None:
        self.sequences.add(seq)
        session.sequences.add((seq.namespace, seq.seq_id))
        self.aux.added(seq)

    def forget(self, seq: Sequence) -> None:
        self.aux.removed(seq)
        self.sequences.remove(seq)
        self.sessions.get(seq.session).sequences.discard((seq.namespace, seq.seq_id))

    def make_room(self, ns: Namespace, need: int, protect: Sequence | None = None) -> None:
        """``Room.ensure_free``; when it fails after evicting (``/dev/shm`` refused an extent it
        counted on), every owner of what it evicted, the caller too, hears of it on its stream."""
        try:
            self.room.ensure_free(ns, need, protect)
        except ResourceExhausted:
            self.report_evictions(None)
            raise

    def report_evictions(self, caller: Session | None) -> list[SeqId]:
        """Hands out what the current call evicted: the ids of the caller's own sequences are
        returned for its reply; every other owner hears of its own on its session stream."""
        evicted = self.room.take_evicted()
        own: list[SeqId] = []
        others: dict[tuple[SessionId, NamespaceId], list[SeqId]] = {}
        for seq in evicted:
            if caller is not None and seq.session == caller.id:
                own.append(seq.seq_id)
            else:
                others.setdefault((seq.session, seq.namespace), []).append(seq.seq_id)
        for (session_id, ns_id), seq_ids in others.items():
            listener = self.sessions.get(session_id).listener
            if listener is not None:
                listener(ns_id, seq_ids)
        return own
