"""Sequences: host page tables, known token ids and the life cycle.

A sequence's page table is ``[published prefix pages | private pages]``: the first
``num_published`` pages are immutable and may be shared, the rest belong to this
sequence alone. ``pages`` is the combined view. Non-KV state (``aux``: recurrent or
indexer state, checkpoints) is per sequence; a fork copies it, and it lives as long as
the sequence id does: through eviction and re-entry, until release or COMPLETED.

The life cycle. ``allocate`` creates a sequence PREFILLED (or re-enters an EVICTED one,
aux kept). A client moves it with ``set_state`` along ``TRANSITIONS``, this table (the
README shows the same one and tests/test_readme.py holds the two together):

| from | a client may set |
|---|---|
| PREFILLED | IN_DECODE, ON_HOLD, COMPLETED |
| IN_DECODE | ON_HOLD, COMPLETED |
| ON_HOLD | IN_DECODE, COMPLETED |
| EVICTED | COMPLETED |
| COMPLETED | — |

Only the daemon moves a sequence ON_HOLD → EVICTED (``SequenceTable.evict``), when room
is made for another call: all its pages are released (private ones freed, published ones
cached unless shared), its ids and aux stay. A client that wants the pages gone releases
the sequence or sets COMPLETED, which drops it, so COMPLETED has no way out (the id is
then unknown). PREFILLED → ON_HOLD parks a prefilled sequence before its first decode
step (a preempted or disaggregated prefill), evictable like any held one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvd.core.errors import FailedPrecondition, NotFound, PermissionDenied
from kvd.core.index import ChainSpec, ExtraKey
from kvd.core.types import NamespaceId, PageId, PageKey, SeqId, SequenceState, SessionId
from kvd.wire.codec import TOKEN_BYTES

# What set_state accepts, from each state; the module docstring draws it.
TRANSITIONS: dict[SequenceState, frozenset[SequenceState]] = {
    SequenceState.PREFILLED: frozenset({SequenceState.IN_DECODE, SequenceState.ON_HOLD, SequenceState.COMPLETED}),
    SequenceState.IN_DECODE: frozenset({SequenceState.ON_HOLD, SequenceState.COMPLETED}),
    SequenceState.ON_HOLD: frozenset({SequenceState.IN_DECODE, SequenceState.COMPLETED}),
    SequenceState.EVICTED: frozenset({SequenceState.COMPLETED}),
    SequenceState.COMPLETED: frozenset(),
}


@dataclass
class Sequence:
    seq_id: SeqId
    namespace: NamespaceId
    session: SessionId
    chain: ChainSpec
    pages: list[PageId]
    num_tokens: int
    tokens: bytearray  # known token ids, little-endian int32, a prefix of the sequence
    keys: list[PageKey]  # keys of the published pages, in order
    shared_prefix_tokens: int  # tokens covered by prefix hits when it was allocated
    state: SequenceState = SequenceState.PREFILLED
    aux: bytes = b""
    extra_keys: tuple[ExtraKey, ...] = ()  # as requested; only KV events read them (kvd/cache/events.py)

    @property
    def num_published(self) -> int:
        return len(self.keys)

    @property
    def shared_pages(self) -> list[PageId]:
        return self.pages[: self.num_published]

    @property
    def private_pages(self) -> list[PageId]:
        return self.pages[self.num_published :]

    def take_pages(self) -> list[PageId]:
        """Its page table, emptied (with its keys and tokens): the pages to release."""
        pages = self.pages
        self.pages, self.keys, self.num_tokens, self.tokens = [], [], 0, bytearray()
        return pages

    @property
    def known_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES


@dataclass
class SequenceTable:
    """Every live sequence, by namespace and id and by the session that owns it, the ON_HOLD
    queue for eviction, and the aux bytes they hold together: the one record of them all,
    changed only by ``add``, ``remove`` and the transitions."""

    _seqs: dict[tuple[NamespaceId, SeqId], Sequence] = field(default_factory=dict)
    _on_hold: dict[NamespaceId, OrderedDict[SeqId, None]] = field(default_factory=dict)
    _by_session: dict[SessionId, dict[tuple[NamespaceId, SeqId], Sequence]] = field(default_factory=dict)
    aux_bytes: int = 0  # of every live sequence's aux state (kvd/cache/aux_state.py bounds it)

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self):
        return iter(self._seqs.values())

    def find(self, namespace: NamespaceId, seq_id: str) -> Sequence | None:
        return self._seqs.get((namespace, SeqId(seq_id)))

    def owned(self, namespace: NamespaceId, seq_id: str, session: SessionId) -> Sequence:
        """The session's sequence, or the error that says why not."""
        seq = self._seqs.get((namespace, SeqId(seq_id)))
        if seq is None:
            raise NotFound(
                f"sequence {seq_id!r} does not exist in namespace {namespace} "
                "(never allocated, already released or completed)"
            )
        if seq.session != session:
            raise PermissionDenied(f"sequence {seq_id!r} belongs to another session")
        return seq

    def of_session(self, session: SessionId) -> list[Sequence]:
        """The session's sequences, in the order they were added."""
        return list(self._by_session.get(session, {}).values())

    def add(self, seq: Sequence) -> None:
        key = (seq.namespace, seq.seq_id)
        assert key not in self._seqs, f"sequence {seq.seq_id!r} added twice"
        self._seqs[key] = seq
        self._by_session.setdefault(seq.session, {})[key] = seq
        self.aux_bytes += len(seq.aux)

    def remove(self, seq: Sequence) -> None:
        key = (seq.namespace, seq.seq_id)
        del self._seqs[key]
        owned = self._by_session[seq.session]
        del owned[key]
        if not owned:
            del self._by_session[seq.session]
        self._on_hold.get(seq.namespace, {}).pop(seq.seq_id, None)
        self.aux_bytes -= len(seq.aux)

    def set_aux(self, seq: Sequence, data: bytes) -> None:
        """Replaces a live sequence's aux state (``AuxBudget.set`` checks it first)."""
        self.aux_bytes += len(data) - len(seq.aux)
        seq.aux = bytes(data)

    @staticmethod
    def check_transition(seq: Sequence, state: SequenceState) -> None:
        """Raises unless a client may move `seq` to `state` (``TRANSITIONS``)."""
        if state not in TRANSITIONS[seq.state]:
            allowed = ", ".join(s.name for s in sorted(TRANSITIONS[seq.state], key=lambda s: s.value)) or "nothing"
            why = " (only the daemon evicts, under memory pressure)" if state is SequenceState.EVICTED else ""
            raise FailedPrecondition(
                f"sequence {seq.seq_id!r} cannot go from {seq.state.name} to {state.name}{why}; "
                f"from {seq.state.name} a client may set {allowed}"
            )

    def set_state(self, seq: Sequence, state: SequenceState) -> None:
        """A client's transition; raises unless ``TRANSITIONS`` allows it."""
        self.check_transition(seq, state)
        self._move(seq, state)

    def evict(self, seq: Sequence) -> None:
        """The daemon's own transition, ON_HOLD → EVICTED (the caller releases the pages)."""
        assert seq.state is SequenceState.ON_HOLD, f"sequence {seq.seq_id!r} evicted while {seq.state.name}"
        self._move(seq, SequenceState.EVICTED)

    def _move(self, seq: Sequence, state: SequenceState) -> None:
        held = self._on_hold.setdefault(seq.namespace, OrderedDict())
        if state is SequenceState.ON_HOLD:
            held[seq.seq_id] = None
        else:
            held.pop(seq.seq_id, None)
        seq.state = state

    def on_hold(self, namespace: NamespaceId) -> list[Sequence]:
        return [self._seqs[(namespace, s)] for s in self._on_hold.get(namespace, ())]
