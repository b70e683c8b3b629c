"""The engine's sequences and the host pages each holds a daemon reference to.

A GPU copy of a host page is trusted only while one of the engine's sequences holds a
daemon reference to that page: when the last one goes (completion, eviction, rebind) the
copy is forgotten, because the daemon may then free the page id and reuse it for other KV.
A sequence the daemon evicted while on hold is noticed through the session's eviction
events (`evicted`), or at the latest when the daemon hands out one of its pages again
(`check_fresh`, `check_hits`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine_client import SequenceState
from gpu_worker.page_tables import HostRow
from gpu_worker.pool import GpuPagePool, HostPageId


@dataclass
class EngineSequence:
    """One sequence as the engine sees it."""

    tokens: list[int]  # tokens whose K/V is cached: the prompt, then every token fed
    next_token: int  # chosen but not yet fed (-1 until the prefill chose it)
    host: list[HostPageId]  # the daemon's page table, token order
    published: int  # leading host pages that are published
    state: SequenceState = SequenceState.IN_DECODE

    @property
    def row(self) -> HostRow:
        return HostRow(tuple(self.host[: self.published]), tuple(self.host[self.published :]))


class HeldSequences:
    """Sequences by id, and for each host page the sequences (with the position) that hold it."""

    def __init__(self, pool: GpuPagePool, page_size: int) -> None:
        self.pool = pool  # whose copies of pages nobody holds any more are forgotten
        self.page_size = page_size
        self._seqs: dict[str, EngineSequence] = {}
        self._holders: dict[HostPageId, dict[str, int]] = {}  # host page -> {sequence: position}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __getitem__(self, seq_id: str) -> EngineSequence:
        return self._seqs[seq_id]

    def add(self, seq_id: str, tokens: list[int], host: Sequence[HostPageId], published: int) -> EngineSequence:
        seq = EngineSequence(tokens, -1, list(host), published)
        self._seqs[seq_id] = seq
        for position, page in enumerate(seq.host):
            self._hold(page, seq_id, position)
        return seq

    def live(self, seq_ids: Sequence[str], state: SequenceState) -> list[EngineSequence]:
        """The sequences, each of which must exist here in `state`; no id twice."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in {list(seq_ids)}")
        seqs = []
        for s in seq_ids:
            seq = self._seqs.get(s)
            if seq is None:
                raise KeyError(f"sequence {s!r} is not in this engine")
            if seq.state is not state:
                raise ValueError(f"sequence {s!r} is {seq.state.name}, not {state.name}")
            seqs.append(seq)
        return seqs

    def append_page(self, seq_id: str, page: HostPageId) -> None:
        seq = self._seqs[seq_id]
        self._hold(page, seq_id, len(seq.host))
        seq.host.append(page)

    def rebind(self, seq_id: str, position: int, old: HostPageId, new: HostPageId) -> None:
        """The daemon replaced the sequence's page at `position` by an identical published one."""
        seq = self._seqs[seq_id]
        assert seq.host[position] == old, (
            f"{seq_id}: rebind of page {old} at {position}, engine has {seq.host[position]}"
        )
        self.check_hit(position, new, seq.host[position - 1] if position else None, seq.tokens)
        self._release(old, seq_id)
        seq.host[position] = new
        self._hold(new, seq_id, position)

    def remove(self, seq_id: str) -> EngineSequence:
        """Forget the sequence (its daemon references are gone) and the copies nobody holds now."""
        seq = self._seqs.pop(seq_id)
        self._drop_host_pages(seq_id, seq)
        return seq

    def evicted(self, seq_id: str) -> None:
        """The daemon evicted the on-hold sequence: its pages are no longer held."""
        seq = self._seqs[seq_id]
        assert seq.state is SequenceState.ON_HOLD, f"sequence {seq_id!r} evicted while {seq.state.name}"
        self._drop_host_pages(seq_id, seq)
        seq.state = SequenceState.EVICTED

    def check_fresh(self, pages: Iterable[HostPageId]) -> None:
        """Pages the daemon just allocated were free: any sequence here that still holds one
        was evicted (its notice is still on the way), and no copy of one may be used."""
        for page in pages:
            for seq_id in list(self._holders.get(page, {})):
                self.evicted(seq_id)
            if self.pool.copy_of(page) is not None:
                self.pool.forget([page])

    def check_hits(self, hits: Sequence[HostPageId], tokens: Sequence[int]) -> None:
        for position, page in enumerate(hits):
            self.check_hit(position, page, hits[position - 1] if position else None, tokens)

    def check_hit(self, position: int, page: HostPageId, parent: HostPageId | None, tokens: Sequence[int]) -> None:
        """A published page the daemon hands out at `position` (after `parent`, holding
        these tokens) is what the sequences here that hold it think it is, unless they were
        evicted and the page id reused; then they are evicted here too and its copy dropped."""
        holders = self._holders.get(page)
        if not holders or any(self._seqs[s].state is SequenceState.IN_DECODE for s in holders):
            return  # an IN_DECODE holder keeps the page alive in the daemon: it is what it was
        size = self.page_size
        seq_id, pos = next(iter(holders.items()))
        seq = self._seqs[seq_id]
        same = (
            pos == position
            and pos < seq.published
            and (seq.host[pos - 1] if pos else None) == parent
            and seq.tokens[pos * size : (pos + 1) * size] == list(tokens[position * size : (position + 1) * size])
        )
        if not same:
            for s in list(holders):
                self.evicted(s)

    def _hold(self, page: HostPageId, seq_id: str, position: int) -> None:
        self._holders.setdefault(page, {})[seq_id] = position

    def _release(self, page: HostPageId, seq_id: str) -> bool:
        """Drop the sequence's hold; True when no sequence here holds the page now."""
        holders = self._holders[page]
        del holders[seq_id]
        if holders:
            return False
        del self._holders[page]
        return True

    def _drop_host_pages(self, seq_id: str, seq: EngineSequence) -> None:
        orphans = [page for page in seq.host if self._release(page, seq_id)]
        self.pool.forget(orphans)
        seq.host = []
