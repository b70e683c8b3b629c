"""Warm restart: re-attach the extents a killed daemon left, verify and re-index its pages.

``kvd serve`` on the same socket (hence the same shared-memory prefix) calls ``recover``
before it accepts calls. It keeps everything it can verify and drops only what it cannot:

- When the manifest is missing, torn or of another version, when the host budget shrank
  or the extent size changed, or when an extent belongs to a namespace the manifest lacks
  or has another layout, the segments were left by another configuration: every segment
  is deleted (reason ``mismatch``) and the daemon starts empty.
- An extent whose metadata or data segment is missing, torn or short was being created
  or deleted when the daemon died (kvd/core/arena.py creates the metadata first and unlinks it
  last): that extent alone is deleted (``incomplete_extent``). Its pages were never handed
  out, so no published page is lost with it.

Otherwise namespaces come back with their old ids, every extent counts against the
budget again, and each page record (kvd/core/records.py) is read. A SEALED page is checked
against its checksum (``corrupted`` when it fails). A PUBLISHED page was published (its
bytes written before the call, its record before the reply) but the daemon died before
the sealer recorded its checksum: recovery seals it now, so a publish that returned
survives a ``kill -9``. Pages are re-indexed as CACHED with refcount 0, parents first; a
page whose parent did not come back is dropped too (``orphaned``): a lookup walks chains
from page 0 and could never reach it. Private pages of dead sessions are simply free.
The ``RecoveryReport`` is kept for ``kvd stats``, metrics and ``kvd verify``.

This module only reads and checks segments; what it verified reaches the manager through
one call, ``Catalog.restore`` (kvd/cache/catalog.py), which owns the pool, index, checksums and counters.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from kvd.core.arena import Extent, ExtentPlan, daemon_segments, leftover_segments, unlink_segments
from kvd.core.errors import KVDError
from kvd.core.index import PageContent
from kvd.core.namespaces import NamespaceIdentity, NamespaceRegistry, identity_from_doc
from kvd.core.records import (
    META_SUFFIX,
    PUBLISHED,
    ExtentMeta,
    MetaError,
    manifest_name,
    page_checksum,
    read_manifest,
)
from kvd.core.shm import SHM_DIR, ShmFull, unlink_quietly
from kvd.core.types import NamespaceId, PageId, PageKey

log = logging.getLogger(__name__)


class Mismatch(Exception):
    """The segments left behind cannot be used by this daemon; the message says why."""


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
    seconds: float = 0.0
    discarded: str | None = None  # why the previous daemon's segments were deleted

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
        }

    def as_dict(self) -> dict:
        return {**asdict(self), "discarded": self.discarded or "", "dropped_pages": self.dropped_pages}

    @classmethod
    def combined(cls, reports: list[RecoveryReport]) -> RecoveryReport:
        """Several tenants' reports as one daemon's: counts summed, reasons for discarding joined."""
        counts = {f.name: sum(getattr(r, f.name) for r in reports) for f in fields(cls) if f.name != "discarded"}
        return cls(**counts, discarded="; ".join(r.discarded for r in reports if r.discarded) or None)


@dataclass
class _Found:
    """What ``_check`` found usable, and what it dropped on the way."""

    registry: NamespaceRegistry
    metas: list[ExtentMeta] = field(default_factory=list)
    incomplete_extents: int = 0
    incomplete_pages: int = 0


@dataclass
class Recovered:
    """What a warm restart verified, for ``Catalog.restore``."""

    namespaces: list[tuple[NamespaceIdentity, NamespaceId]]  # with the ids they had
    extents: list[Extent] = field(default_factory=list)  # attached, not yet adopted
    pages: list[tuple[int, PageContent]] = field(default_factory=list)  # (chain page index, content), parents first
    checksums: dict[PageId, int] = field(default_factory=dict)
    corrupted: dict[NamespaceId, int] = field(default_factory=dict)  # failed their checksum, per namespace


def recover(manager) -> RecoveryReport:
    """Re-attaches what a previous daemon on this prefix left; see the module docstring."""
    report, found = _recover(manager.arena)
    manager.catalog.restore(report, found)
    return report


def _recover(arena) -> tuple[RecoveryReport, Recovered | None]:
    prefix = arena.name_prefix
    segments = daemon_segments(prefix)
    if not segments:
        return RecoveryReport(), None
    start = time.perf_counter()
    opened: list[ExtentMeta] = []
    try:
        found = _check(arena, prefix, segments, opened)
    except (Mismatch, MetaError) as e:
        for meta in opened:
            meta.close(unlink=False)
        lost = _published_left(prefix)
        unlink_segments(daemon_segments(prefix))
        log.warning(
            "warm restart: discarding the %d shared-memory segments a previous daemon left (%d published pages): %s",
            len(segments),
            lost,
            e,
        )
        return RecoveryReport(mismatch_pages=lost, discarded=str(e), seconds=time.perf_counter() - start), None
    report, recovered = _adopt(arena, found, start)
    rate = f", {report.ms_per_gib:.0f} ms per GiB" if report.ms_per_gib is not None else ""
    log.info(
        "warm restart: recovered %d published pages from %d extents in %.1f ms (%d bytes verified%s, "
        "%d sealed now); %d failed their checksum, %d dropped with a missing parent, "
        "%d incomplete extents dropped",
        report.recovered_pages,
        report.extents,
        report.seconds * 1e3,
        report.verified_bytes,
        rate,
        report.resealed_pages,
        report.corrupted_pages,
        report.orphaned_pages,
        report.incomplete_extents,
    )
    return report, recovered


def _published(meta: ExtentMeta) -> int:
    return int(np.count_nonzero(meta.states() >= PUBLISHED))


def _published_left(prefix: str) -> int:
    """Published pages recorded in every readable metadata segment of the prefix."""
    total = 0
    for name in leftover_segments(prefix):
        try:
            meta = ExtentMeta.open(name)
        except MetaError:
            continue
        total += _published(meta)
        meta.close(unlink=False)
    return total


def _check(arena, prefix: str, segments: list[str], opened: list[ExtentMeta]) -> _Found:
    """Reads and checks everything; deletes only incomplete extents. Metas opened so far are
    left in ``opened`` (the caller closes them when this raises)."""
    if manifest_name(prefix) not in segments:
        raise Mismatch("there is no manifest")
    doc = read_manifest(prefix)
    try:
        old_budget, old_extent = int(doc["host_bytes"]), int(doc["extent_bytes"])
        registry = NamespaceRegistry()
        for entry in doc["namespaces"]:
            registry.register(identity_from_doc(entry))
    except (KeyError, TypeError, ValueError, KVDError) as e:
        raise Mismatch(f"the manifest does not describe namespaces this daemon reads ({e!r})") from None
    if arena.budget_bytes < old_budget:
        raise Mismatch(f"the host budget shrank from {old_budget} to {arena.budget_bytes} bytes")
    if arena.extent_bytes != old_extent:
        raise Mismatch(f"the extent size changed from {old_extent} to {arena.extent_bytes} bytes")
    found = _Found(registry)
    data = set(leftover_segments(prefix))
    names = sorted(
        data | {s[: -len(META_SUFFIX)] for s in segments if s.endswith(META_SUFFIX)},
        key=lambda n: int(n.rsplit("-", 1)[1]),
    )
    for name in names:
        try:
            meta = ExtentMeta.open(name)
        except MetaError as e:
            _drop_incomplete(found, name, None, str(e))
            continue
        opened.append(meta)
        h = meta.header
        try:
            ns = registry.get(h.namespace)
        except KVDError:
            raise Mismatch(f"extent {name} belongs to namespace {h.namespace}, which the manifest lacks") from None
        if h.root != ns.root or h.page_size != ns.page_size or h.page_bytes != ns.page_bytes:
            raise Mismatch(f"extent {name}'s layout does not match namespace {ns.id} ({ns.identity.model})")
        if name not in data:
            _drop_incomplete(found, name, opened.pop(), "its data segment is missing")
        elif os.stat(SHM_DIR + name).st_size < h.num_pages * h.page_bytes:
            _drop_incomplete(found, name, opened.pop(), f"its data segment is shorter than its {h.num_pages} pages")
        else:
            found.metas.append(meta)
    spans = sorted((m.header.first_page, m.header.first_page + m.header.num_pages) for m in found.metas)
    if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
        raise Mismatch("two extents claim the same page ids")
    total = sum(m.header.num_pages * m.header.page_bytes + m.header.segment_bytes for m in found.metas)
    if total > arena.budget_bytes:  # data and metadata, as the budget counts them (kvd/core/arena.py)
        raise Mismatch(f"the extents hold {total} bytes, over the host budget of {arena.budget_bytes}")
    return found


def _drop_incomplete(found: _Found, name: str, meta: ExtentMeta | None, why: str) -> None:
    """Deletes an extent a crash left half created or half deleted."""
    lost = 0
    if meta is not None:
        lost = _published(meta)
        meta.close(unlink=True)
    unlink_quietly(name + META_SUFFIX)
    unlink_quietly(name)
    found.incomplete_extents += 1
    found.incomplete_pages += lost
    log.warning("warm restart: dropping incomplete extent %s (%s; %d published pages)", name, why, lost)


def _adopt(arena, found: _Found, start: float) -> tuple[RecoveryReport, Recovered]:
    """Attaches the usable extents and verifies their published pages."""
    recovered = Recovered([(ns.identity, ns.id) for ns in found.registry.all()])
    candidates = []
    verified = 0
    resealed: set[PageId] = set()
    for meta in sorted(found.metas, key=lambda m: m.header.first_page):
        h = meta.header
        plan = ExtentPlan(
            meta.name[: -len(META_SUFFIX)],
            NamespaceId(h.namespace),
            PageId(h.first_page),
            h.num_pages,
            h.page_bytes,
            h.page_size,
            h.root,
        )
        try:
            extent = arena.attach(plan, meta)
        except ShmFull as e:  # never map memory the tmpfs cannot back
            _drop_incomplete(found, plan.name, meta, str(e))
            continue
        recovered.extents.append(extent)
        states = meta.states()
        for slot in map(int, np.flatnonzero(states >= PUBLISHED)):
            record = meta.record(slot)
            page = PageId(h.first_page + slot)
            verified += h.page_bytes
            checksum = page_checksum(record.covered, extent.page_bytes_view(page))
            if states[slot] == PUBLISHED:  # its publish returned; the seal had not followed yet
                meta.seal(slot, checksum)
                resealed.add(page)
            elif checksum != record.checksum:
                meta.clear(slot)
                recovered.corrupted[plan.namespace] = recovered.corrupted.get(plan.namespace, 0) + 1
                log.warning("warm restart: page %d of extent %s failed its checksum; not recovered", page, plan.name)
                continue
            candidates.append((record.page_index, page, record, plan.namespace, meta, slot, checksum))
    orphaned = _chain(candidates, recovered)
    return RecoveryReport(
        extents=len(recovered.extents),
        recovered_pages=len(recovered.pages),
        resealed_pages=len(resealed & recovered.checksums.keys()),
        corrupted_pages=sum(recovered.corrupted.values()),
        orphaned_pages=orphaned,
        incomplete_pages=found.incomplete_pages,
        incomplete_extents=found.incomplete_extents,
        verified_bytes=verified,
        seconds=time.perf_counter() - start,
    ), recovered


def _chain(candidates: list, recovered: Recovered) -> int:
    """Accepts, parents first, the verified pages whose parent came back; clears the records of
    the others (orphans, and a second page under a key already taken). Returns how many it dropped."""
    accepted: dict[PageId, tuple[int, NamespaceId]] = {}
    keys: set[PageKey] = set()
    orphaned = 0
    for page_index, page, record, ns_id, meta, slot, checksum in sorted(candidates, key=lambda c: c[0]):
        content = PageContent(page, PageKey(record.key), record.tokens, record.parent, record.local)
        chained = (record.parent is None and page_index == 0) or (
            record.parent is not None and accepted.get(PageId(record.parent)) == (page_index - 1, ns_id)
        )
        if not chained or content.key in keys:
            meta.clear(slot)
            orphaned += 1
            continue
        keys.add(content.key)
        accepted[page] = (page_index, ns_id)
        recovered.pages.append((page_index, content))
        recovered.checksums[page] = checksum
    return orphaned
