"""`PageDirectory`: where kvd pages lie in this process's maps, read without a kvd call.

The worker half loads pages that the scheduler half's sequences hold, on vLLM's forward
thread, and that thread makes no kvd call: the worker's kvd calls are its `Saver`'s
(gpu_worker/vllm/saver.py). The saver's thread maps the namespace's extents (one
`DescribeExtents` call: when its session opens, when a load named an extent it had not
mapped, and when the daemon released one it maps, which it sees in /dev/shm every
`refresh_seconds`, 0.5 s, without a call) and hands the forward thread a snapshot: a
directory of one daemon instance, never changed once made. A page in an extent created
since (by another engine's saves) is found through the extents its load plan names
(`ExtentRef`, asked by the scheduler half with its holds): `extended` maps them without a
kvd call (the shared-memory object is opened by name), on the forward thread, into a
directory of that thread's own, and the saver is asked to map them too. A page neither
holds fails its load (vLLM recomputes its blocks) and asks the saver to map the extents
again.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from engine_client import PageLayout
from engine_client.pages import MappedExtent, attach, extent_tensor
from gpu_worker.vllm.plans import ExtentRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageDirectory:
    """The extents of the link's namespace mapped in this process, of daemon `instance`
    ("" and none while kvd cannot serve), sorted by first page."""

    instance: str = ""
    layout: PageLayout | None = None
    extents: tuple[MappedExtent, ...] = ()
    _firsts: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, instance: str, layout: PageLayout, extents: list[MappedExtent]) -> PageDirectory:
        ordered = tuple(sorted(extents, key=lambda e: e.first_page))
        for extent in ordered:  # made here, on the saver's thread: the forward thread only reads them
            extent_tensor(extent, layout, writable=False)
        return cls(instance, layout, ordered, [e.first_page for e in ordered])

    def names(self) -> set[str]:
        return {e.name for e in self.extents}

    def released(self) -> bool:
        """Whether the daemon released an extent of the directory (its memory stays allocated
        while mapped: the saver maps the extents again)."""
        return any(e.unlinked() for e in self.extents)

    def pages_by_extent(self, page_ids: list[int]) -> list[tuple[object, list[int], list[int]]] | None:
        """As `KVDClient.pages_by_extent` (read-only views), or None when a page lies in no
        extent of the directory."""
        groups: dict[str, tuple[object, list[int], list[int]]] = {}
        for position, page_id in enumerate(page_ids):
            i = bisect.bisect_right(self._firsts, page_id) - 1
            if i < 0 or page_id >= self.extents[i].first_page + self.extents[i].num_pages:
                return None
            extent = self.extents[i]
            _, indices, positions = groups.setdefault(
                extent.name, (extent_tensor(extent, self.layout, writable=False), [], [])
            )
            indices.append(page_id - extent.first_page)
            positions.append(position)
        return list(groups.values())

    def extended(self, refs: list[ExtentRef]) -> PageDirectory:
        """This directory with the named extents it does not hold, mapped here (no kvd call);
        an extent that cannot be mapped (gone since) is left out."""
        names = self.names()
        added = []
        for ref in refs:
            if ref.name in names:
                continue
            try:
                added.append(attach(ref.name, ref.first_page, ref.num_pages, self.layout))
            except Exception as e:  # noqa: BLE001 - an extent that cannot be mapped: its pages fail to load
                log.warning("kvd extent %s cannot be mapped: %s", ref.name, e)
        return self if not added else PageDirectory.of(self.instance, self.layout, [*self.extents, *added])
