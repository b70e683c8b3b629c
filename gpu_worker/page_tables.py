"""GPU page tables: host rows in, the page tables the runner reads and the loads to fill them out.

Each sequence of a batch (a prefill or a decode step alike) brings its host row,
`[shared prefix pages | private pages]` in token order. `GpuPageTables.map` asks the pool,
in one all-or-nothing `acquire`, for every host page the batch's sequences do not already
hold plus the missing runway (fresh private GPU pages after each row for the tokens the
batch will write: a prefill's suffix pages, a decode step's new page). The pool dedups host
pages across the batch, so a prefix shared by N sequences is loaded once and the N rows
point at the same physical pages.

A sequence keeps its GPU references between batches, and its row's device tensor is built
once and reused until the row changes: a steady decode step costs O(batch), not
O(context), and loads nothing. Life cycle, as the daemon's sequence states map onto it:

- IN_DECODE: `map` (each batch; only what changed is acquired);
- IN_DECODE → ON_HOLD and COMPLETED: `suspend` drops the GPU references; the copies stay
  cached until the pool evicts them or the caller forgets them (`GpuPagePool.forget`);
- ON_HOLD → IN_DECODE: `map` again; only pages evicted meanwhile are reloaded.

Writes land in the sequence's private GPU pages (the copy of its private host tail and the
runway). Offload them (`PageLoader.store`) and call `adopt_runway` for the runway pages that
got host pages, so cached copies and host pages agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import chain
from typing import NewType

import torch

from gpu_worker.pool import (
    Acquired,
    GpuPageId,
    GpuPagePool,
    HostPageId,
    PageLoad,
    PoolExhausted,
)

SeqId = NewType("SeqId", str)


@dataclass(frozen=True)
class HostRow:
    """A sequence's host page table: `[shared prefix pages | private pages]`, token order."""

    shared: tuple[HostPageId, ...]
    private: tuple[HostPageId, ...] = ()

    @property
    def pages(self) -> tuple[HostPageId, ...]:
        return self.shared + self.private


@dataclass(frozen=True, eq=False)  # eq would compare tensors elementwise
class BatchTables:
    """The GPU page tables of one batch and the host→device copies they wait on."""

    seq_ids: tuple[SeqId, ...]  # row order of the tables below
    rows: tuple[tuple[GpuPageId, ...], ...]  # each sequence's page table: copies of its host row, then its runway
    tables: tuple[torch.Tensor, ...]  # rows[i] as [pages_i] int64 on the pool's device (the runner's input)
    loads: tuple[PageLoad, ...]  # unique missing host pages, one copy each; do them before use
    evicted: tuple[HostPageId, ...]  # cached copies dropped to make room

    @property
    def logical_pages(self) -> int:
        return sum(len(r) for r in self.rows)

    @cached_property
    def physical_pages(self) -> int:
        """Distinct GPU pages in the rows (counted on first use: it walks every row)."""
        return len(set(chain.from_iterable(self.rows)))


@dataclass(frozen=True, eq=False)
class _HeldPages:
    """The GPU references one sequence holds; replaced, never changed, so its page-table
    row is built once and reused by every decode step that does not change it."""

    row: HostRow
    gpu: tuple[GpuPageId, ...]  # copy of row.pages[i] is gpu[i]
    runway: tuple[GpuPageId, ...]  # private pages after the row
    device: torch.device

    @cached_property
    def entries(self) -> tuple[GpuPageId, ...]:
        """The page-table row: copies of the host row, then the runway."""
        return self.gpu + self.runway

    @cached_property
    def table(self) -> torch.Tensor:
        """``entries`` as [pages] int64 on the device, built on first use."""
        return torch.tensor(self.entries, dtype=torch.int64, device=self.device)


class GpuPageTables:
    """The GPU page references of a set of sequences over one `GpuPagePool`: maps the host
    rows of each batch (prefill or decode) to page tables."""

    def __init__(self, pool: GpuPagePool) -> None:
        self.pool = pool
        self._held: dict[SeqId, _HeldPages] = {}

    def map(
        self, rows: Mapping[SeqId, HostRow], runway_pages: int | Mapping[SeqId, int] = 1
    ) -> BatchTables | PoolExhausted:
        """Page tables for `rows` (in its iteration order), each with at least
        `runway_pages` private pages after its host pages (one count for every row, or one
        per sequence: a suffix-only prefill needs as many as its suffix pages); all or nothing.

        A sequence already holding pages acquires only the host pages new to its row and
        releases those no longer in it (after the acquire, so a tight pool may refuse a
        change it could have made by releasing first). Held sequences absent from `rows`
        keep their pages."""
        wanted = runway_pages if isinstance(runway_pages, Mapping) else dict.fromkeys(rows, runway_pages)
        if any(n < 0 for n in wanted.values()):
            raise ValueError(f"runway_pages must be ≥ 0, got {runway_pages}")
        request: list[HostPageId] = []
        runway_needed: dict[SeqId, int] = {}
        same_row: set[SeqId] = set()  # the steady state of decode: nothing to acquire or release
        for seq, row in rows.items():
            held = self._held.get(seq)
            runway_needed[seq] = max(0, wanted.get(seq, 0) - (len(held.runway) if held else 0))
            if held is not None and held.row == row:
                same_row.add(seq)
                continue
            if len(set(row.pages)) != len(row.pages):
                raise ValueError(f"sequence {seq!r}: host row lists a page twice: {row.pages}")
            held_pages = set(held.row.pages) if held else set()
            request.extend(h for h in row.pages if h not in held_pages)

        got = self.pool.acquire(request, private=sum(runway_needed.values()))
        if isinstance(got, PoolExhausted):
            return got

        acquired = dict(zip(request, got.gpu_pages))
        fresh_runway = iter(got.private_pages)
        for seq, row in rows.items():
            held = self._held.get(seq) or _HeldPages(HostRow(()), (), (), self.pool.device)
            runway = held.runway + tuple(next(fresh_runway) for _ in range(runway_needed[seq]))
            if seq in same_row:
                if runway_needed[seq]:
                    self._held[seq] = replace(held, runway=runway)
                continue
            old = dict(zip(held.row.pages, held.gpu))
            keep = set(row.pages)
            self.pool.release((g for h, g in old.items() if h not in keep), owner=f"sequence {seq!r}")
            gpu = tuple(old[h] if h in old else acquired[h] for h in row.pages)
            self._held[seq] = _HeldPages(row, gpu, runway, self.pool.device)
        held_rows = [self._held[s] for s in rows]
        return BatchTables(
            tuple(rows), tuple(h.entries for h in held_rows), tuple(h.table for h in held_rows), got.loads, got.evicted
        )

    def suspend(self, seq: SeqId) -> None:
        """IN_DECODE → ON_HOLD: drop the sequence's GPU references; its copies stay cached."""
        held = self._pop(seq)
        self.pool.release(chain(held.gpu, held.runway), owner=f"sequence {seq!r}")

    def adopt_runway(self, seq: SeqId, host_pages: Sequence[HostPageId]) -> None:
        """The first len(host_pages) runway pages were offloaded into these new private host
        pages: they join the sequence's host row, and their GPU pages become the copies."""
        held = self._held.get(seq)
        if held is None:
            raise KeyError(f"sequence {seq!r} holds no GPU pages")
        n = len(host_pages)
        if n > len(held.runway):
            raise ValueError(f"sequence {seq!r}: {n} host pages adopted but only {len(held.runway)} runway pages")
        for g, h in zip(held.runway, host_pages):
            self.pool.bind(g, h)
        row = HostRow(held.row.shared, held.row.private + tuple(host_pages))
        self._held[seq] = _HeldPages(row, held.gpu + held.runway[:n], held.runway[n:], held.device)

    def trim_runway(self, seq: SeqId, keep: int) -> None:
        """Release the sequence's runway pages after the first `keep` (undoes the runway a
        `map` added when the batch it was for cannot run)."""
        held = self._held.get(seq)
        if held is None:
            raise KeyError(f"sequence {seq!r} holds no GPU pages")
        self._held[seq] = replace(held, runway=held.runway[:keep])
        self.pool.release(held.runway[keep:], owner=f"sequence {seq!r}")

    def rebind(self, seq: SeqId, position: int, host_page: HostPageId) -> PageLoad | None:
        """The daemon replaced the sequence's host page at `position` of its row by the
        identical published page `host_page` and freed the old one (publish dedup).

        If `host_page` is resident, the row now points at that copy and its own copy is
        released and forgotten. Otherwise its own copy is renamed to `host_page` and the
        returned load refreshes it from the host, so the copy equals the host page byte
        for byte (two computations of the same KV may differ in rounding)."""
        held = self._held.get(seq)
        if held is None:
            raise KeyError(f"sequence {seq!r} holds no GPU pages")
        pages = list(held.row.pages)
        old = pages[position]
        if old == host_page:
            return None
        if host_page in pages:
            raise ValueError(f"sequence {seq!r}: host page {host_page} would appear twice in its row")
        pages[position] = host_page
        n_shared = len(held.row.shared)
        row = HostRow(tuple(pages[:n_shared]), tuple(pages[n_shared:]))
        resident = self.pool.copy_of(host_page)
        if resident is None:
            self.pool.rename(old, host_page)
            self._held[seq] = replace(held, row=row)
            return PageLoad(host_page, held.gpu[position])
        got = self.pool.acquire([host_page])
        assert isinstance(got, Acquired) and not got.loads, f"resident host page {host_page} needed a load"
        self.pool.release([held.gpu[position]], owner=f"sequence {seq!r}")
        self.pool.forget([old])
        gpu = list(held.gpu)
        gpu[position] = got.gpu_pages[0]
        self._held[seq] = replace(held, row=row, gpu=tuple(gpu))
        return None

    def table(self, seq: SeqId) -> tuple[GpuPageId, ...]:
        """The sequence's current page table: copies of its host row, then its runway."""
        held = self._held.get(seq)
        if held is None:
            raise KeyError(f"sequence {seq!r} holds no GPU pages")
        return held.entries

    def holding(self) -> tuple[SeqId, ...]:
        """Sequences that hold GPU references."""
        return tuple(self._held)

    def _pop(self, seq: SeqId) -> _HeldPages:
        held = self._held.pop(seq, None)
        if held is None:
            raise KeyError(f"sequence {seq!r} holds no GPU pages")
        return held
