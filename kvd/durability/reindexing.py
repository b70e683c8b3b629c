"""A warm restart's pages verified and indexed step by step, while the daemon serves.

``kvd/durability/recovery.py`` attaches the extents a killed daemon left and lists their
published pages (``Pending``) before the daemon answers; that takes a few array operations
per extent. Each of those pages stays PRIVATE, held by the recovery with one reference
(``PagePool.add_pages``): no allocation hands it out, no eviction takes it, no extent
holding it is reclaimed, and no lookup finds it. ``Reindexing.step`` then takes the next
``STEP_PAGES`` of them, parents first (chain page index order), and for each one:

- checks it against its checksum (a SEALED record) or seals it (a PUBLISHED one: its publish
  returned, the seal had not followed); a page that fails is dropped (``corrupted``);
- accepts it when its parent is a page this recovery accepted, at the previous chain
  index, of the same namespace, and still the one indexed there (it may have been evicted
  meanwhile, and its page reused), and when no page holds its key yet (a client may have
  published the same prompt meanwhile); else it is dropped (``orphaned``): a lookup walks
  chains from page 0 and could never reach it;
- an accepted page is indexed as CACHED with refcount 0 (``PagePool.restore``), with its
  checksum; a dropped one's record is cleared and its page released (FREE).

So nothing is served before it is verified, and a lookup meanwhile misses what is not
indexed yet (the prefix up to it still hits). The launcher runs steps before the daemon
answers for up to ``FOREGROUND_SECONDS`` (a small cache is whole before the first call),
then between calls on the event loop (kvd/server/daemon.py). ``finish`` runs what is left
at once: before an integrity audit (its report counts every page) and a prefix-cache reset.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, fields, replace

import numpy as np

from kvd import collector, crashpoints
from kvd.core.arena import Arena, Extent
from kvd.core.counters import Counters
from kvd.core.index import PageContent, chain_spec
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import NamespaceRegistry
from kvd.core.pool import PagePool
from kvd.core.records import PUBLISHED, page_checksum
from kvd.core.types import NamespaceId, PageId, PageKey
from kvd.durability.integrity import Integrity
from kvd.durability.report import RecoveryReport

log = logging.getLogger(__name__)

STEP_PAGES = 256  # pages verified and indexed by one step: a few ms of the event loop
FOREGROUND_SECONDS = 0.1  # steps run before the daemon answers, at most
HOLD_POLL_SECONDS = 0.005
FREEZE_STEPS = 16


@dataclass(frozen=True)
class Pending:
    """The published pages a warm restart found, one row each, parents first (by chain page
    index, then page id); ``extent`` indexes the attached extents."""

    page: np.ndarray  # int64 page ids
    extent: np.ndarray  # int64
    slot: np.ndarray  # int64 position in the extent
    page_index: np.ndarray  # int64 chain page index
    parent: np.ndarray  # int64 parent page id, -1 for none
    sealed_checksum: np.ndarray  # uint64; meaningful for SEALED rows
    state: np.ndarray  # uint8 PUBLISHED | SEALED
    namespace: np.ndarray  # int64

    @classmethod
    def of(cls, columns: list[dict[str, np.ndarray]]) -> Pending:
        """Rows gathered extent by extent, put parents first."""
        if not columns:
            return cls(*(np.zeros(0, np.int64) for _ in fields(cls)))
        joined = {name: np.concatenate([c[name] for c in columns]) for name in columns[0]}
        order = np.lexsort((joined["page"], joined["page_index"]))
        return cls(**{name: values[order] for name, values in joined.items()})

    def __len__(self) -> int:
        return len(self.page)


class Reindexing:
    """Verifies and indexes a warm restart's pages in steps; see the module docstring."""

    def __init__(
        self,
        pending: Pending,
        arena: Arena,
        extents: list[Extent],
        pool: PagePool,
        integrity: Integrity,
        counters: Counters,
        namespaces: NamespaceRegistry,
        found: RecoveryReport,
    ) -> None:
        """``found``: what the check before it counted (extents, incomplete ones), and when it began."""
        self.pending = pending
        self.arena = arena
        self.extents = extents
        self._unlocked = list(extents)  # locked in memory one a step (Arena.lock)
        self.pool = pool
        self.integrity = integrity
        self.counters = counters
        self._found = found
        self._started = time.perf_counter() - found.seconds
        self._at = 0  # rows before it are done
        self._row_of = np.full(int(pending.page.max()) + 1 if len(pending) else 0, -1, np.int64)
        self._row_of[pending.page] = np.arange(len(pending))
        self._accepted = np.full(len(pending), None, dtype=object)  # row -> its restored PageContent
        self._publication = np.zeros(len(pending), np.int64)  # row -> its page's, once restored (PagePool.publication)
        self._given_up = np.zeros(len(pending), bool)  # rows freed unverified for room (``give_up``)
        self._namespaces = {ns.id: ns for ns in namespaces.all()}
        self._plain = {ns.id: chain_spec(ns.root, ns.page_size, ()) for ns in namespaces.all()}
        self._counts = Counter()  # recovered, resealed, corrupted, orphaned, evicted, verified_bytes
        self._seconds: float | None = None  # once done

    @property
    def done(self) -> bool:
        """Every page verified (and indexed or dropped), every extent locked in memory."""
        return self._seconds is not None

    def report(self) -> RecoveryReport:
        """What the recovery found so far; ``pending_pages`` is what it has not verified yet."""
        c = self._counts
        seconds = self._seconds if self._seconds is not None else time.perf_counter() - self._started
        return replace(
            self._found,
            recovered_pages=c["recovered"],
            resealed_pages=c["resealed"],
            corrupted_pages=c["corrupted"],
            orphaned_pages=c["orphaned"],
            verified_bytes=c["verified_bytes"],
            pending_pages=len(self.pending) - self._at - int(np.count_nonzero(self._given_up[self._at :])),
            evicted_pages=c["evicted"],
            seconds=seconds,
        )

    def held(self) -> Counter[PageId]:
        """The pages it holds (not verified yet), one reference each (kvd/cache/invariants.py)."""
        left = self._at + np.flatnonzero(~self._given_up[self._at :])
        return Counter(map(PageId, self.pending.page[left].tolist()))

    def give_up(self, namespace: NamespaceId, count: int) -> int:
        """Frees ``count`` of the namespace's pages not verified yet, for an allocation
        short of room (kvd/cache/room.py): the last ones in the order, the deepest in their
        chains, so none leaves a page after it to recover (each such page is later still,
        and given up with it). All or nothing: a refused allocation changes nothing. Counted
        ``evicted``; returns how many."""
        p = self.pending
        left = self._at + np.flatnonzero((p.namespace[self._at :] == namespace) & ~self._given_up[self._at :])
        if len(left) < count:
            return 0
        rows = left[len(left) - count :]
        self._given_up[rows] = True
        for ext, slot in zip(p.extent[rows].tolist(), p.slot[rows].tolist()):
            self.extents[ext].meta.clear(slot)
        self.pool.release_all(p.page[rows].tolist())
        self._counts["evicted"] += len(rows)
        return len(rows)

    def run_for(self, seconds: float) -> None:
        """Steps until done or ``seconds`` have passed (or a test holds it, kvd/crashpoints.py)."""
        deadline = time.perf_counter() + seconds
        while not self.done and time.perf_counter() < deadline and not crashpoints.holding("recovery-step"):
            self.step()

    async def run(self) -> None:
        """Steps until done, letting the event loop answer calls between steps. The pages'
        contents live as long as they stay cached: every ``FREEZE_STEPS`` they are frozen
        (kvd/collector.py), else each full collection would walk all restored so far."""
        steps = 0
        while not self.done:
            if crashpoints.holding("recovery-step"):
                await asyncio.sleep(HOLD_POLL_SECONDS)
                continue
            self.step()
            steps += 1
            if steps % FREEZE_STEPS == 0 or self.done:
                collector.freeze_grown()
            await asyncio.sleep(0)

    def finish(self) -> None:
        """Steps until done, at once (a prefix-cache reset)."""
        while not self.done:
            self.step()

    def step(self) -> None:
        """Verifies and indexes the next ``STEP_PAGES`` pages (module docstring)."""
        if self._unlocked:
            self.arena.lock(self._unlocked.pop())
        p, start = self.pending, self._at
        end = min(start + STEP_PAGES, len(p))
        restored: list[tuple[ChainPlace, PageContent]] = []
        checksums: dict[PageId, int] = {}
        dropped: dict[NamespaceId, list[PageId]] = {}
        keys: set[PageKey] = set()  # of this step's pages, not in the index yet
        accepted: list[int] = []  # the rows of ``restored``
        indexed = self.pool.index.get
        corrupted = orphaned = resealed = verified = 0
        at = slice(start, end)
        rows = zip(
            self._given_up[at].tolist(),
            range(start, end),
            p.page[at].tolist(),
            p.extent[at].tolist(),
            p.slot[at].tolist(),
            p.page_index[at].tolist(),
            p.parent[at].tolist(),
            p.state[at].tolist(),
            p.sealed_checksum[at].tolist(),
            p.namespace[at].tolist(),
        )
        for given_up, row, page, ext, slot, page_index, parent, state, sealed, ns_id in rows:
            if given_up:
                continue
            extent = self.extents[ext]
            covered = extent.meta.covered(slot)
            checksum = page_checksum(covered, extent.pages[slot])
            verified += extent.plan.page_bytes
            if state == PUBLISHED:  # its publish returned; the seal had not followed yet
                extent.meta.seal(slot, checksum)
            elif checksum != sealed:
                extent.meta.clear(slot)
                corrupted += 1
                self.counters.of(ns_id).corrupted_pages += 1
                dropped.setdefault(ns_id, []).append(page)
                log.warning("warm restart: page %d of extent %s failed its checksum; not recovered", page, extent.name)
                continue
            key = PageKey(covered[16:32])
            local = covered[32:48]
            content = PageContent(page, key, covered[48:], None if parent < 0 else parent, local if any(local) else b"")
            parent_key = self._parent_key(content, parent, page_index, ns_id, start)
            if parent_key is None or key in keys or indexed(key) is not None:
                extent.meta.clear(slot)
                orphaned += 1
                dropped.setdefault(ns_id, []).append(page)
                continue
            keys.add(key)
            self._accepted[row] = content
            accepted.append(row)
            resealed += state == PUBLISHED
            restored.append((ChainPlace(self._namespaces[ns_id], page_index, parent_key or None), content))
            checksums[page] = checksum
        self._at = end
        self.pool.restore(restored)
        self._publication[accepted] = self.pool.publications([content.page for _, content in restored])
        self.integrity.restore(checksums)
        for pages in dropped.values():  # one namespace a call
            self.pool.release_all(pages)
        self._counts.update(
            recovered=len(restored), resealed=resealed, corrupted=corrupted, orphaned=orphaned, verified_bytes=verified
        )
        crashpoints.reached("recovery-step")
        if self._at == len(p):
            while self._unlocked:
                self.arena.lock(self._unlocked.pop())
            self._accepted[:] = None  # the index holds what they hold (no PageContent kept a page)
            self._seconds = time.perf_counter() - self._started
            self._log()

    def _parent_key(
        self, content: PageContent, parent: int, page_index: int, ns_id: int, step_start: int
    ) -> bytes | None:
        """The key of the page's accepted parent; for page 0 its chain root where it is the
        namespace's plain one, else b"" (unknown, but nothing to follow); None when the page
        cannot be reached (module docstring)."""
        if parent < 0:
            if page_index:
                return None
            plain = self._plain[ns_id]
            return plain.root if content.local == plain.local_digest(0) else b""
        row = self._row_of[parent] if parent < len(self._row_of) else -1
        accepted = self._accepted[row] if row >= 0 else None
        if accepted is None or self.pending.page_index[row] != page_index - 1 or self.pending.namespace[row] != ns_id:
            return None
        if row < step_start and (
            self.pool.publication(accepted.page) != self._publication[row] or not self.pool.is_indexed(parent)
        ):
            return None  # evicted, dropped or reused since
        return accepted.key

    def _log(self) -> None:
        r = self.report()
        rate = f", {r.ms_per_gib:.0f} ms per GiB" if r.ms_per_gib is not None else ""
        log.info(
            "warm restart: recovered %d published pages from %d extents in %.1f ms (%d bytes verified%s, "
            "%d sealed now); %d failed their checksum, %d dropped with a missing parent, "
            "%d incomplete extents dropped",
            r.recovered_pages,
            r.extents,
            r.seconds * 1e3,
            r.verified_bytes,
            rate,
            r.resealed_pages,
            r.corrupted_pages,
            r.orphaned_pages,
            r.incomplete_extents,
        )
