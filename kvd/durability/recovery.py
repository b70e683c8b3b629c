"""Warm restart: re-attach the extents a killed daemon left and list its pages to verify.

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
budget again, and the state, chain place and checksum of every page record
(kvd/core/records.py) are read as arrays, a few operations per extent: the published pages
(``Pending``) are held, unverified, until ``Reindexing`` (kvd/durability/reindexing.py)
verifies and indexes them, parents first, while the daemon serves. A SEALED page is checked
against its checksum (``corrupted`` when it fails). A PUBLISHED page was published (its
bytes written before the call, its record before the reply) but the daemon died before
the sealer recorded its checksum: it is sealed then, so a publish that returned survives
a ``kill -9``. A page whose parent did not come back is dropped too (``orphaned``).
Private pages of dead sessions are simply free. The ``RecoveryReport``
(kvd/durability/report.py) is kept for ``kvd stats``, metrics and ``kvd verify``.

This module only reads and checks segments; what it attached reaches the manager through
one call, ``Catalog.restore`` (kvd/cache/catalog.py), which owns the pool, index, checksums and counters.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from kvd.core.arena import Extent, ExtentPlan, daemon_segments, leftover_segments, unlink_segments
from kvd.core.errors import KVDError
from kvd.core.namespaces import NamespaceIdentity, NamespaceRegistry, identity_from_doc
from kvd.core.records import (
    META_SUFFIX,
    PUBLISHED,
    ExtentMeta,
    MetaError,
    manifest_name,
    read_manifest,
)
from kvd.core.shm import SHM_DIR, ShmFull, unlink_quietly
from kvd.core.types import NamespaceId, PageId
from kvd.durability.reindexing import Pending
from kvd.durability.report import RecoveryReport

log = logging.getLogger(__name__)


class Mismatch(Exception):
    """The segments left behind cannot be used by this daemon; the message says why."""


@dataclass
class _Found:
    """What ``_check`` found usable, and what it dropped on the way."""

    registry: NamespaceRegistry
    metas: list[ExtentMeta] = field(default_factory=list)
    incomplete_extents: int = 0
    incomplete_pages: int = 0


@dataclass
class Recovered:
    """What a warm restart attached, for ``Catalog.restore``; its pages are verified later (``Reindexing``)."""

    namespaces: list[tuple[NamespaceIdentity, NamespaceId]]  # with the ids they had
    extents: list[Extent] = field(default_factory=list)  # attached, not yet adopted
    held: list[np.ndarray] = field(default_factory=list)  # per extent: offsets of its published pages
    pending: Pending | None = None


def recover(manager) -> RecoveryReport:
    """Re-attaches what a previous daemon on this prefix left; see the module docstring. Its
    pages are verified and indexed next, in steps (``manager.catalog.reindexing``)."""
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
    recovered = _attach(arena, found)
    report = RecoveryReport(
        extents=len(recovered.extents),
        incomplete_pages=found.incomplete_pages,
        incomplete_extents=found.incomplete_extents,
        pending_pages=len(recovered.pending),
        seconds=time.perf_counter() - start,
    )
    log.info(
        "warm restart: %d extents attached in %.1f ms, %d published pages to verify and index while serving",
        report.extents,
        report.seconds * 1e3,
        report.pending_pages,
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


def _attach(arena, found: _Found) -> Recovered:
    """Attaches the usable extents and lists their published pages (``Pending``)."""
    recovered = Recovered([(ns.identity, ns.id) for ns in found.registry.all()])
    rows = []
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
        columns = meta.columns()
        states = columns["state"]
        held = np.flatnonzero(states >= PUBLISHED)
        rows.append(
            {
                "page": held + h.first_page,
                "extent": np.full(len(held), len(recovered.extents), np.int64),
                "slot": held,
                "page_index": columns["page_index"][held].astype(np.int64),
                "parent": np.where(columns["has_parent"][held] != 0, columns["parent"][held].astype(np.int64), -1),
                "sealed_checksum": columns["checksum"][held],
                "state": states[held],
                "namespace": np.full(len(held), h.namespace, np.int64),
            }
        )
        recovered.extents.append(extent)
        recovered.held.append(held)
    recovered.pending = Pending.of(rows)
    return recovered
