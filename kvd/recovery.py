"""Warm restart: re-attach the extents a killed daemon left, verify and re-index its pages.

``kvd serve`` on the same socket (hence the same shared-memory prefix) calls ``recover``
before it accepts calls. It is all or nothing at the level of the arena: when the
manifest is missing, torn or of another version, when the host budget shrank or the
extent size changed, or when an extent's metadata does not match its namespace, every
segment is deleted, the reason logged, and the daemon starts empty. It never crashes on
what it finds in /dev/shm.

Otherwise namespaces come back with their old ids, every extent counts against the
budget again, and each SEALED page record (kvd/meta.py) is checked against its checksum.
Pages that verify are re-indexed as CACHED with refcount 0, parents first; a page whose
parent did not come back (it failed its checksum, was never sealed, or was freed) is
dropped too: it can never be reached by a lookup, which walks chains from page 0.
Failed checksums count in ``corrupted_pages``; everything else — private pages of dead
sessions, unsealed pages — is simply free.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from kvd.arena import SHM_DIR, ExtentPlan, daemon_segments, leftover_segments, unlink_segments
from kvd.errors import KvdError
from kvd.index import PageContent
from kvd.manager import NamespaceCounters
from kvd.meta import META_SUFFIX, PUBLISHED, SEALED, ExtentMeta, MetaError, manifest_name, page_checksum, read_manifest
from kvd.namespaces import NamespaceRegistry, identity_from_doc
from kvd.types import NamespaceId, PageId, PageKey

log = logging.getLogger(__name__)


class Mismatch(Exception):
    """The segments left behind cannot be used by this daemon; the message says why."""


# Below this many verified bytes a warm restart's time is mostly fixed costs (opening
# segments, the manifest), so a per-GiB rate extrapolated from it would mislead.
RATE_MIN_BYTES = 64 << 20


@dataclass(frozen=True)
class RecoveryReport:
    extents: int = 0
    recovered_pages: int = 0
    corrupted_pages: int = 0
    orphaned_pages: int = 0       # verified, but their parent did not come back
    verified_bytes: int = 0
    seconds: float = 0.0
    discarded: str | None = None  # why the previous daemon's segments were deleted

    @property
    def ms_per_gib(self) -> float | None:
        """The verification rate; None below RATE_MIN_BYTES, where fixed costs would dominate it."""
        if self.verified_bytes < RATE_MIN_BYTES:
            return None
        return self.seconds * 1e3 / (self.verified_bytes / (1 << 30))


def recover(manager) -> RecoveryReport:
    """Re-attaches what a previous daemon on this prefix left; see the module docstring."""
    prefix = manager.arena.name_prefix
    segments = daemon_segments(prefix)
    if not segments:
        return RecoveryReport()
    start = time.perf_counter()
    metas: list[ExtentMeta] = []
    try:
        registry, metas = _check(manager, prefix, segments)
    except (Mismatch, MetaError) as e:
        for meta in metas:
            meta.close(unlink=False)
        unlink_segments(daemon_segments(prefix))
        log.warning("warm restart: discarding the %d shared-memory segments a previous daemon left: %s",
                    len(segments), e)
        return RecoveryReport(discarded=str(e))
    report = _adopt(manager, registry, metas, start)
    rate = f", {report.ms_per_gib:.0f} ms per GiB" if report.ms_per_gib is not None else ""
    log.info(
        "warm restart: recovered %d published pages from %d extents in %.1f ms (%d bytes verified%s); "
        "%d failed their checksum, %d dropped with a missing parent",
        report.recovered_pages, report.extents, report.seconds * 1e3, report.verified_bytes, rate,
        report.corrupted_pages, report.orphaned_pages,
    )
    return report


def _check(manager, prefix: str, segments: list[str]) -> tuple[NamespaceRegistry, list[ExtentMeta]]:
    """Reads and checks everything; changes nothing. Metas opened so far are returned through the list."""
    arena = manager.arena
    if manifest_name(prefix) not in segments:
        raise Mismatch("there is no manifest")
    doc = read_manifest(prefix)
    try:
        old_budget, old_extent = int(doc["host_bytes"]), int(doc["extent_bytes"])
        registry = NamespaceRegistry()
        for entry in doc["namespaces"]:
            registry.register(identity_from_doc(entry))
    except (KeyError, TypeError, ValueError, KvdError) as e:
        raise Mismatch(f"the manifest does not describe namespaces this daemon reads ({e!r})") from None
    if arena.budget_bytes < old_budget:
        raise Mismatch(f"the host budget shrank from {old_budget} to {arena.budget_bytes} bytes")
    if arena.extent_bytes != old_extent:
        raise Mismatch(f"the extent size changed from {old_extent} to {arena.extent_bytes} bytes")
    extents = leftover_segments(prefix)
    metas = []
    try:
        for name in extents:
            meta = ExtentMeta.open(name)
            metas.append(meta)
            h = meta.header
            try:
                ns = registry.get(h.namespace)
            except KvdError:
                raise Mismatch(f"extent {name} belongs to namespace {h.namespace}, which the manifest lacks") from None
            if h.root != ns.root or h.page_size != ns.page_size or h.page_bytes != ns.page_bytes:
                raise Mismatch(f"extent {name}'s layout does not match namespace {ns.id} ({ns.identity.model})")
            if os.stat(SHM_DIR + name).st_size < h.num_pages * h.page_bytes:
                raise Mismatch(f"extent {name} is shorter than its {h.num_pages} pages")
        spans = sorted((m.header.first_page, m.header.first_page + m.header.num_pages) for m in metas)
        if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
            raise Mismatch("two extents claim the same page ids")
        total = sum(m.header.num_pages * m.header.page_bytes for m in metas)
        if total > arena.budget_bytes:
            raise Mismatch(f"the extents hold {total} bytes, over the host budget of {arena.budget_bytes}")
    except BaseException:
        for meta in metas:
            meta.close(unlink=False)
        metas.clear()
        raise
    stray = set(segments) - set(extents) - {e + META_SUFFIX for e in extents} - {manifest_name(prefix)}
    unlink_segments(sorted(stray))  # metadata of an extent that is gone
    return registry, metas


def _adopt(manager, registry: NamespaceRegistry, metas: list[ExtentMeta], start: float) -> RecoveryReport:
    arena, pool, index = manager.arena, manager.pool, manager.index
    for ns in registry.all():
        got = manager.namespaces.register(ns.identity)
        assert got.id == ns.id, f"recovered namespace {ns.identity.model} got id {got.id}, not {ns.id}"
        manager.counters.setdefault(ns.id, NamespaceCounters())
    candidates = []
    verified = corrupted = 0
    for meta in sorted(metas, key=lambda m: m.header.first_page):
        h = meta.header
        plan = ExtentPlan(meta.name[:-len(META_SUFFIX)], NamespaceId(h.namespace), PageId(h.first_page),
                          h.num_pages, h.page_bytes, h.page_size, h.root)
        extent = arena.attach(plan, meta)
        arena.adopt_recovered(extent)
        pool.add_pages(plan.namespace, plan.name, plan.first_page, plan.num_pages)
        states = meta.states()
        for slot in np.flatnonzero(states == PUBLISHED):
            meta.clear(int(slot))  # published but never sealed: not recovered
        for slot in map(int, np.flatnonzero(states == SEALED)):
            record = meta.record(slot)
            page = PageId(h.first_page + slot)
            verified += h.page_bytes
            if page_checksum(record.covered, extent.page_bytes_view(page)) != record.checksum:
                meta.clear(slot)
                pool.counters(plan.namespace).corrupted_pages += 1
                corrupted += 1
                log.warning("warm restart: page %d of extent %s failed its checksum; not recovered", page, plan.name)
                continue
            candidates.append((record.page_index, page, record, plan.namespace, meta, slot))
    accepted: dict[PageId, tuple[int, NamespaceId]] = {}
    by_ns: dict[NamespaceId, list[tuple[int, PageContent]]] = {}
    orphaned = 0
    for page_index, page, record, ns_id, meta, slot in sorted(candidates, key=lambda c: c[0]):
        content = PageContent(page, PageKey(record.key), record.tokens, record.parent, record.local)
        chained = (record.parent is None and page_index == 0) or (
            record.parent is not None and accepted.get(PageId(record.parent)) == (page_index - 1, ns_id)
        )
        if not chained or index.lookup(content.key) is not None:
            meta.clear(slot)
            orphaned += 1
            continue
        index.insert(content, page_index)
        accepted[page] = (page_index, ns_id)
        by_ns.setdefault(ns_id, []).append((page_index, content))
        manager.checksums[page] = record.checksum
    for ns_id, contents in by_ns.items():
        contents.sort(key=lambda c: -c[0])  # chain tails are evicted first
        pool.restore(ns_id, [c for _, c in contents])
    manager.write_manifest()
    return RecoveryReport(
        extents=len(metas), recovered_pages=len(accepted), corrupted_pages=corrupted, orphaned_pages=orphaned,
        verified_bytes=verified, seconds=time.perf_counter() - start,
    )

