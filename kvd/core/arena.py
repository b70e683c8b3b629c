"""The page arena: POSIX shared-memory extents under one host byte budget.

The daemon alone creates, resizes and unlinks extents; clients only attach to them by
name. Each extent belongs to one namespace and holds whole pages of that namespace's
``page_bytes``; global page ids ``[first_page, first_page + num_pages)`` map to offsets
``(page - first_page) * page_bytes``. Page ids are never reused across extents, so a
stale id from a client can never alias another extent's page.

Extents are created as the budget fills, not at start-up. Creating one is split into a
pure ``build`` (create, map, pre-fault, mlock: slow, thread-safe) and an ``adopt`` on
the event loop, so the daemon can build the next extent off the request path.

Each extent has a companion metadata segment ``{name}.meta`` (kvd/core/records.py) with one
record per page, and the arena keeps a manifest segment ``{prefix}-manifest``; with
them a restarted daemon re-attaches the extents (``attach``) instead of deleting them.

Every segment is reserved in /dev/shm when it is created (kvd/core/shm.py), so a full
/dev/shm refuses a new extent (``ShmFull``, ``shm_refused``) and never raises SIGBUS
later. The host budget counts each extent's data and metadata segments together
(``ExtentPlan.footprint``): a budget that /dev/shm holds is never refused by it.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
import mmap
import operator
import os
import resource
import threading
import time
from dataclasses import dataclass

import numpy as np
import posix_ipc

from kvd import crashpoints
from kvd.core.records import (
    HEADER_BYTES,
    MANIFEST_BYTES,
    META_SUFFIX,
    ExtentHeader,
    ExtentMeta,
    manifest_name,
    record_size,
    write_manifest,
)
from kvd.core.shm import SHM_DIR, ShmFull, create_segment, reserve, unlink_quietly
from kvd.core.types import NamespaceId, PageId

log = logging.getLogger(__name__)

# Touching one byte per OS page faults the whole extent in; first touch of shared
# memory runs ~25x slower than resident memory, so it must not happen on a request.
_OS_PAGE = mmap.PAGESIZE
_first_page = operator.attrgetter("first_page")
# Each page has a record on the daemon's heap: bound how many one extent adds at once.
MAX_EXTENT_PAGES = 1 << 16
# After /dev/shm refused an extent, the next one is tried this much later (or once an extent is freed).
SHM_RETRY_SECONDS = 5.0


@dataclass(frozen=True)
class ExtentPlan:
    """A budget reservation for an extent that has not been built yet."""

    name: str
    namespace: NamespaceId
    first_page: PageId
    num_pages: int
    page_bytes: int
    page_size: int = 1  # tokens per page, for the metadata records
    root: bytes = b""  # the namespace root, checked at recovery

    @property
    def size(self) -> int:
        """Bytes of the data segment."""
        return self.num_pages * self.page_bytes

    @property
    def header(self) -> ExtentHeader:
        """What the metadata segment's header records."""
        return ExtentHeader(self.namespace, self.root, self.first_page, self.num_pages, self.page_size, self.page_bytes)

    @property
    def footprint(self) -> int:
        """Bytes the extent takes of /dev/shm and of the host budget: data and metadata."""
        return self.size + self.header.segment_bytes


class Extent:
    """One mapped shared-memory segment holding whole pages of one namespace."""

    def __init__(self, plan: ExtentPlan, memory: mmap.mmap, locked: bool, meta: ExtentMeta) -> None:
        self.plan = plan
        self.memory = memory
        self.locked = locked
        self.meta = meta
        # bytes: [num_pages, page_bytes]
        self.pages = np.frombuffer(memory, dtype=np.uint8).reshape(plan.num_pages, plan.page_bytes)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def first_page(self) -> PageId:
        return self.plan.first_page

    @property
    def num_pages(self) -> int:
        return self.plan.num_pages

    def page_bytes_view(self, page: PageId) -> np.ndarray:
        """The bytes of one page: uint8 [page_bytes], a view into shared memory."""
        return self.pages[page - self.plan.first_page]

    def close(self, unlink: bool = False) -> None:
        self.pages = None  # drop the numpy export before closing the map
        self.memory.close()
        if unlink:  # the data first: the reverse of Arena.build
            posix_ipc.unlink_shared_memory(self.name)
        self.meta.close(unlink)


CAP_IPC_LOCK = 14  # capability(7): mlock beyond RLIMIT_MEMLOCK


def memlock_limit() -> int | None:
    """The bytes this process may mlock: None when nothing limits it (an unlimited
    RLIMIT_MEMLOCK, or CAP_IPC_LOCK in its effective capabilities, which mlock honours first)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    with open("/proc/self/status") as f:
        effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return None if effective >> CAP_IPC_LOCK & 1 else soft


class _MemoryLocker:
    """mlock through libc where RLIMIT_MEMLOCK allows it, warning once otherwise."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._warned = False
        self._lock = threading.Lock()

    def lock(self, address: int, size: int) -> bool:
        if self._libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) == 0:
            return True
        err = ctypes.get_errno()
        with self._lock:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot mlock host pages (%s); they may be swapped out. Raise "
                    "RLIMIT_MEMLOCK (systemd: LimitMEMLOCK=infinity) to keep them resident",
                    os.strerror(err),
                )
        return False


class Arena:
    """All extents of one daemon, their names and the host byte budget they share."""

    def __init__(
        self,
        budget_bytes: int,
        extent_bytes: int,
        name_prefix: str,
        lock_memory: bool = True,
        group: int | None = None,
        meta_mode: int = 0o660,
    ) -> None:
        """``group``: gid owning the extents (a tenant's group; None: the daemon's); ``meta_mode``:
        permissions of the metadata and manifest segments, which only the daemon reads."""
        if budget_bytes <= 0:
            raise ValueError(f"host budget must be positive, got {budget_bytes}")
        if extent_bytes <= 0:
            raise ValueError(f"extent size must be positive, got {extent_bytes}")
        self.budget_bytes = budget_bytes
        self.extent_bytes = extent_bytes
        self.name_prefix = name_prefix
        self.group = group
        self.meta_mode = meta_mode
        self._locker = _MemoryLocker() if lock_memory else None
        self._reserved_bytes = 0  # footprints of the planned and adopted extents
        self._next_page = 0
        self._next_extent = 0
        self._extents: dict[str, Extent] = {}
        self._by_first_page: list[Extent] = []  # sorted by first_page
        self._manifest: mmap.mmap | None = None
        self.shm_refusals = 0  # extents /dev/shm could not hold
        self.shm_note = ""  # why the last one was refused, until one fits again
        self._shm_retry_at = 0.0
        self._shm_warned = False

    # ---- budget -------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

    @property
    def shm_bytes_to_come(self) -> int:
        """Bytes this arena may still take of /dev/shm: the budget not reserved yet, and the
        manifest's segment until it exists."""
        return self.budget_bytes - self._reserved_bytes + (MANIFEST_BYTES if self._manifest is None else 0)

    def creatable_pages(self, page_bytes: int, page_size: int) -> int:
        """Pages of this size (``page_size`` tokens each, for their metadata records) that new
        extents could still hold within the budget."""
        if time.monotonic() < self._shm_retry_at:
            return 0  # /dev/shm refused the last extent (shm_refused)
        return self.pages_within(self.budget_bytes - self._reserved_bytes, page_bytes, page_size)

    def pages_within(self, budget: int, page_bytes: int, page_size: int) -> int:
        """Pages of this size that new extents taking at most ``budget`` bytes would hold, as
        ``plan`` cuts them: whole extents, then one smaller one, each with its metadata segment."""
        per_page = page_bytes + record_size(page_size)
        whole = self._extent_pages(page_bytes)
        extents, rest = divmod(budget, HEADER_BYTES + whole * per_page)
        return extents * whole + max(0, (rest - HEADER_BYTES) // per_page)

    def _extent_pages(self, page_bytes: int) -> int:
        """Pages of a whole extent of this page size."""
        return min(max(1, self.extent_bytes // page_bytes), MAX_EXTENT_PAGES)

    def plan(self, namespace: NamespaceId, page_bytes: int, page_size: int = 1, root: bytes = b"") -> ExtentPlan | None:
        """Reserves budget for the next extent of a namespace (its footprint); None when none fits."""
        num_pages = min(self._extent_pages(page_bytes), self.creatable_pages(page_bytes, page_size))
        if num_pages == 0:
            return None
        plan = ExtentPlan(
            name=f"{self.name_prefix}-{self._next_extent}",
            namespace=namespace,
            first_page=PageId(self._next_page),
            num_pages=num_pages,
            page_bytes=page_bytes,
            page_size=page_size,
            root=root,
        )
        self._next_extent += 1
        self._next_page += num_pages
        self._reserved_bytes += plan.footprint
        return plan

    def build(self, plan: ExtentPlan) -> Extent:
        """Creates the extent's metadata, then its data segment, each reserved in /dev/shm;
        maps, pre-faults and locks the data. Touches no arena state; raises ``ShmFull``,
        leaving neither segment behind, when /dev/shm cannot hold them.

        Metadata comes first, so a crash at any instant leaves either a complete extent or
        one whose data segment is missing or short, which recovery drops on its own
        (kvd/durability/recovery.py) without mistaking it for another configuration."""
        meta = ExtentMeta.create(plan.name, plan.header, self.meta_mode)
        crashpoints.reached("extent-meta")
        try:
            # 0660 whatever the umask: engines in the group (the tenant's, or the daemon's) map it read-write.
            shm = create_segment(plan.name, plan.size, f"extent {plan.name}", 0o660, self.group)
        except BaseException:
            meta.close(unlink=True)
            raise
        crashpoints.reached("extent-reserved")
        try:
            memory = mmap.mmap(shm.fd, plan.size)
        except BaseException:
            meta.close(unlink=True)
            posix_ipc.unlink_shared_memory(plan.name)
            raise
        finally:
            shm.close_fd()
        view = np.frombuffer(memory, dtype=np.uint8)
        view[::_OS_PAGE] = 0  # pre-fault every OS page
        locked = False
        if self._locker is not None:
            locked = self._locker.lock(view.ctypes.data, plan.size)
        del view
        crashpoints.reached("extent-data")
        return Extent(plan, memory, locked, meta)

    def attach(self, plan: ExtentPlan, meta: ExtentMeta) -> Extent:
        """Maps an extent a previous daemon left (warm restart), not locked yet (``lock``);
        ``adopt_recovered`` it next."""
        shm = posix_ipc.SharedMemory(plan.name)
        try:
            if shm.size < plan.size:
                raise ValueError(f"extent {plan.name} holds {shm.size} bytes, its metadata says {plan.size}")
            if self.group is not None:  # the tenant's group may have changed since
                os.fchown(shm.fd, -1, self.group)
            # A killed daemon may have died before it reserved them.
            meta.reserve()
            reserve(shm.fd, plan.size, f"extent {plan.name}")
            memory = mmap.mmap(shm.fd, plan.size)
        finally:
            shm.close_fd()
        return Extent(plan, memory, False, meta)

    def lock(self, extent: Extent) -> None:
        """Locks an attached extent's pages in memory (``attach`` does not: ~1 s per 4 GiB
        before a warm restart's first answer); the recovery does, one extent a step."""
        if self._locker is not None and not extent.locked:
            extent.locked = self._locker.lock(extent.pages.ctypes.data, extent.plan.size)

    def adopt_recovered(self, extent: Extent) -> None:
        """Adopts an attached extent: it takes its budget, and new ids and names follow it."""
        self._reserved_bytes += extent.plan.footprint
        self._next_page = max(self._next_page, extent.first_page + extent.num_pages)
        self._next_extent = max(self._next_extent, int(extent.name.rsplit("-", 1)[1]) + 1)
        self.adopt(extent)

    def write_manifest(self, doc: dict) -> None:
        """Rewrites the manifest segment (kvd/core/records.py) with the namespaces and settings."""
        self._manifest = write_manifest(self.name_prefix, doc, self._manifest, self.meta_mode)

    def adopt(self, extent: Extent) -> None:
        """Makes a built extent's pages addressable."""
        self._extents[extent.name] = extent
        bisect.insort(self._by_first_page, extent, key=_first_page)

    def release(self, extent: Extent) -> None:
        """Unmaps and unlinks an extent whose pages are all free; returns its budget."""
        del self._extents[extent.name]
        self._by_first_page.remove(extent)
        self._reserved_bytes -= extent.plan.footprint
        extent.close(unlink=True)
        self._shm_retry_at = 0.0  # its memory is back in /dev/shm

    def cancel(self, plan: ExtentPlan) -> None:
        """Returns the budget of a plan whose build failed."""
        self._reserved_bytes -= plan.footprint

    def shm_refused(self, error: ShmFull) -> None:
        """/dev/shm could not hold a new extent: no further one is planned for a while, so
        requests are served from the extents there are (and refused beyond them)."""
        self.shm_refusals += 1
        self.shm_note = str(error)
        self._shm_retry_at = time.monotonic() + SHM_RETRY_SECONDS
        if not self._shm_warned:
            self._shm_warned = True
            log.warning("%s; serving from the extents there are until space frees up", error)

    def shm_accepted(self) -> None:
        """A new extent fit in /dev/shm: the next refusal is logged again."""
        self._shm_warned = False
        self.shm_note = ""

    # ---- lookup -------------------------------------------------------------------

    def extents(self) -> list[Extent]:
        return list(self._by_first_page)

    def extent_of(self, page: PageId) -> Extent:
        at = bisect.bisect_right(self._by_first_page, page, key=_first_page)
        if at:
            extent = self._by_first_page[at - 1]
            if page < extent.first_page + extent.num_pages:
                return extent
        raise KeyError(page)

    def page_bytes_view(self, page: PageId) -> np.ndarray:
        return self.extent_of(page).page_bytes_view(page)

    def copy_page(self, src: PageId, dst: PageId) -> None:
        np.copyto(self.page_bytes_view(dst), self.page_bytes_view(src))

    def close(self, unlink: bool = True) -> None:
        """Unmaps every extent; unlinks them unless a warm restart should find them."""
        for extent in list(self._by_first_page):
            extent.close(unlink)
        self._extents.clear()
        self._by_first_page.clear()
        if self._manifest is not None:
            self._manifest.close()
            self._manifest = None
        if unlink:
            unlink_quietly(manifest_name(self.name_prefix))


def _suffixes(name_prefix: str) -> list[str]:
    """What follows ``{name_prefix}-`` in the names of the segments that exist."""
    base = name_prefix.lstrip("/") + "-"
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return [n[len(base) :] for n in names if n.startswith(base)]


def leftover_segments(name_prefix: str) -> list[str]:
    """Names of the page extents with this daemon's prefix that still exist."""
    root = "/" + name_prefix.lstrip("/")
    numbers = sorted(int(rest) for rest in _suffixes(name_prefix) if rest.isdigit())
    return [f"{root}-{n}" for n in numbers]


def daemon_segments(name_prefix: str) -> list[str]:
    """Every segment of this daemon's prefix: extents, their metadata and the manifest."""
    root = "/" + name_prefix.lstrip("/")
    ours = [
        f"{root}-{rest}"
        for rest in _suffixes(name_prefix)
        if rest.isdigit()
        or (rest.endswith(META_SUFFIX) and rest[: -len(META_SUFFIX)].isdigit())
        or f"{root}-{rest}" == manifest_name(root)
    ]
    return sorted(ours)


def unlink_segments(names: list[str]) -> None:
    for name in names:
        unlink_quietly(name)
