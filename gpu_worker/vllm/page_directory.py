"""`PageDirectory`: where kvd pages lie in this process's maps, read without a kvd call.

The worker half loads pages that the scheduler half's sequences hold, on vLLM's forward
thread, and that thread makes no kvd call: the worker's kvd calls are its `Saver`'s
(gpu_worker/vllm/saver.py). The saver's thread maps the namespace's extents (when its
session opens, every `refresh_seconds`, 0.5 s: one `DescribeExtents` call, and when a
load named a page it had not mapped) and hands the forward thread a snapshot: a directory of one
daemon instance, never changed once made. A load of a page the directory does not hold
fails (vLLM recomputes its blocks) and asks the saver to map the extents again, so a page
in an extent another engine created since the last refresh costs one recompute at most.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine_client import PageLayout
from engine_client.pages import MappedExtent, extent_tensor


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
