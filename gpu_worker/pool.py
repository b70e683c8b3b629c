"""GPU page pool of one (device, namespace): residency of host pages and GPU refcounts.

The pool is one preallocated tensor

    kv: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]    # axis 2: 0 = K, 1 = V

whose pages have the host page layout (kvd/wire/layout.py), so a load is one contiguous
copy per page. Every GPU page is in exactly one state:

- free: holds nothing of value;
- in use: refcount ≥ 1, the number of page-table rows that point at it. It is either the
  resident copy of one host page (shared by every row whose host row contains that page)
  or a private page of one sequence (decode runway) that no host page backs;
- cached: the resident copy of a host page with refcount 0, kept in LRU order so that a
  shared prefix loaded for one batch is not loaded again for the next. Cached pages are
  evicted (oldest first) only when no free page is left.

Every refcount change happens here, in `acquire` / `release`, which are symmetric. An
acquire is all or nothing: when the pool cannot hold the request even after evicting
every evictable page, it returns `PoolExhausted` and nothing changed. A broken rule (a page
released twice, a host page bound twice) raises `PoolInvariantError` naming the page.

The pool does no copying: `acquire` says which loads are needed and the loader does them.
A resident copy is trusted to equal its host page; whoever writes a host-backed GPU page
(decode appending to a sequence's private tail) writes the host page too before the last
reference goes, and host page ids whose contents will change are `forget`-ed first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, NewType

import torch

from engine_client import PageLayout
from gpu_worker.gpu_stats import GpuPoolStats

GpuPageId = NewType("GpuPageId", int)
HostPageId = NewType("HostPageId", int)


class PoolInvariantError(AssertionError):
    """A refcount or residency rule of the pool was broken; the message names the page."""


class PageLoad(NamedTuple):
    """One planned host→device copy of a whole page."""

    host_page: HostPageId
    gpu_page: GpuPageId


@dataclass(frozen=True)
class Acquired:
    """What one successful `acquire` did."""

    gpu_pages: tuple[GpuPageId, ...]  # one per requested host page reference, in request order
    private_pages: tuple[GpuPageId, ...]  # fresh pages, refcount 1, no host page behind them
    loads: tuple[PageLoad, ...]  # each host page that was not resident, once
    evicted: tuple[HostPageId, ...]  # cached host pages whose GPU copy was dropped for room


@dataclass(frozen=True)
class PoolExhausted:
    """The pool cannot hold the request even after evicting every cached page; nothing changed."""

    needed: int  # pages the request needs that are not resident
    available: int  # free pages plus cached pages the request does not itself use


@dataclass(frozen=True)
class PoolState:
    """The pool's whole bookkeeping, for before/after comparisons and invariant checks."""

    refcounts: dict[GpuPageId, int]
    host_of_gpu: dict[GpuPageId, HostPageId]
    cached: tuple[GpuPageId, ...]  # LRU order, oldest first
    free: tuple[GpuPageId, ...]  # allocation order


def torch_dtype(layout: PageLayout) -> torch.dtype:
    """The torch dtype a layout's dtype name spells (names follow torch's spelling)."""
    return getattr(torch, layout.dtype)


class GpuPagePool:
    """Pages of one pool tensor: host page → GPU page map, refcounts, LRU cache of idle copies."""

    def __init__(self, layout: PageLayout, kv: torch.Tensor) -> None:
        """Manage `kv` (already allocated) as a pool."""
        if kv.dim() != 6 or tuple(kv.shape[1:]) != layout.page_shape:
            raise ValueError(f"pool tensor shape {tuple(kv.shape)} is not [num_pages, *{layout.page_shape}]")
        if kv.dtype != torch_dtype(layout):
            raise ValueError(f"pool tensor dtype {kv.dtype} is not the layout's {layout.dtype}")
        if not kv.is_contiguous():
            raise ValueError("pool tensor must be C-contiguous: pages are copied whole")
        self.layout = layout
        self.kv = kv  # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
        self.num_pages: int = kv.shape[0]
        self._free: deque[GpuPageId] = deque(GpuPageId(g) for g in range(self.num_pages))
        self._refs: dict[GpuPageId, int] = {}  # in-use pages only; every count ≥ 1
        self._cached: OrderedDict[GpuPageId, None] = OrderedDict()  # oldest first
        self._host_of_gpu: dict[GpuPageId, HostPageId] = {}
        self._gpu_of_host: dict[HostPageId, GpuPageId] = {}
        self._loaded = 0
        self._skipped = 0

    @classmethod
    def allocate(cls, layout: PageLayout, num_pages: int, device: torch.device | str = "cpu") -> GpuPagePool:
        """A pool over a fresh (uninitialised) tensor of `num_pages` pages on `device`."""
        if num_pages <= 0:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        kv = torch.empty((num_pages, *layout.page_shape), dtype=torch_dtype(layout), device=device)
        return cls(layout, kv)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    # ---- queries -------------------------------------------------------------------------

    def resident(self) -> dict[HostPageId, GpuPageId]:
        """Every host page that has a GPU copy (in use or cached), and where."""
        return dict(self._gpu_of_host)

    def refcount(self, gpu_page: GpuPageId) -> int:
        return self._refs.get(gpu_page, 0)

    def host_page(self, gpu_page: GpuPageId) -> HostPageId | None:
        """The host page `gpu_page` is a copy of; None for free and private pages."""
        return self._host_of_gpu.get(gpu_page)

    def copy_of(self, host_page: HostPageId) -> GpuPageId | None:
        """The GPU page holding a copy of `host_page` (in use or cached); None if not resident."""
        return self._gpu_of_host.get(host_page)

    # ---- refcount changes ----------------------------------------------------------------

    def acquire(self, host_pages: Sequence[HostPageId], private: int = 0) -> Acquired | PoolExhausted:
        """Take one reference per entry of `host_pages` (duplicates = several rows) and
        `private` fresh private pages; all or nothing.

        Host pages already resident are reused (a cached one leaves the LRU); each missing
        one gets a GPU page once, listed in `loads` for the loader to fill before use.
        """
        if private < 0:
            raise ValueError(f"private page count must be ≥ 0, got {private}")
        wanted = dict.fromkeys(host_pages)  # unique host pages, first-seen order
        missing = [h for h in wanted if h not in self._gpu_of_host]
        reused_cached = [
            self._gpu_of_host[h] for h in wanted if h in self._gpu_of_host and self._gpu_of_host[h] in self._cached
        ]
        needed = len(missing) + private
        available = len(self._free) + len(self._cached) - len(reused_cached)
        if needed > available:
            return PoolExhausted(needed=needed, available=available)

        # From here on nothing can fail: take the reused copies out of the LRU first so that
        # eviction below cannot pick a page this request needs.
        for g in reused_cached:
            del self._cached[g]
        loads: list[PageLoad] = []
        evicted: list[HostPageId] = []
        for h in missing:
            g = self._take_page(evicted)
            self._host_of_gpu[g] = h
            self._gpu_of_host[h] = g
            loads.append(PageLoad(h, g))
        private_pages = tuple(self._take_page(evicted) for _ in range(private))
        gpu_pages = tuple(self._gpu_of_host[h] for h in host_pages)
        for g in (*gpu_pages, *private_pages):
            self._refs[g] = self._refs.get(g, 0) + 1
        self._loaded += len(loads)
        self._skipped += len(host_pages) - len(loads)
        return Acquired(gpu_pages, private_pages, tuple(loads), tuple(evicted))

    def release(self, gpu_pages: Iterable[GpuPageId], owner: str = "") -> None:
        """Drop one reference per entry. A host-backed page left with none becomes cached
        (most recently used end); a private one becomes free."""
        by = f" by {owner}" if owner else ""
        for g in gpu_pages:
            count = self._refs.get(g)
            if count is None:
                raise PoolInvariantError(f"gpu page {g} released{by} but holds no reference (released twice?)")
            if count > 1:
                self._refs[g] = count - 1
                continue
            del self._refs[g]
            if g in self._host_of_gpu:
                self._cached[g] = None
            else:
                self._free.append(g)

    # ---- residency changes without refcount changes --------------------------------------

    def bind(self, gpu_page: GpuPageId, host_page: HostPageId) -> None:
        """Record that private page `gpu_page` now equals host page `host_page` (its KV was
        offloaded there), so later rows with that host page reuse it instead of loading."""
        if gpu_page not in self._refs:
            raise PoolInvariantError(f"gpu page {gpu_page} bound to host page {host_page} while unreferenced")
        if gpu_page in self._host_of_gpu:
            raise PoolInvariantError(
                f"gpu page {gpu_page} bound to host page {host_page} but already holds "
                f"host page {self._host_of_gpu[gpu_page]}"
            )
        if host_page in self._gpu_of_host:
            raise PoolInvariantError(
                f"host page {host_page} bound to gpu page {gpu_page} but already resident "
                f"in gpu page {self._gpu_of_host[host_page]}"
            )
        self._host_of_gpu[gpu_page] = host_page
        self._gpu_of_host[host_page] = gpu_page

    def rename(self, old: HostPageId, new: HostPageId) -> None:
        """Host page `old` was replaced by host page `new` (the daemon found an identical page
        on publish and freed `old`): the copy of `old` now stands for `new`, with its
        references. The caller reloads it from `new` if the bytes may differ."""
        g = self._gpu_of_host.get(old)
        if g is None:
            raise PoolInvariantError(f"host page {old} renamed to {new} but it is not resident")
        if new in self._gpu_of_host:
            raise PoolInvariantError(
                f"host page {old} renamed to {new}, which is already resident in gpu page {self._gpu_of_host[new]}"
            )
        del self._gpu_of_host[old]
        self._gpu_of_host[new] = g
        self._host_of_gpu[g] = new

    def forget(self, host_pages: Iterable[HostPageId]) -> None:
        """Drop the cached copies of host pages whose ids the daemon will reuse (freed
        private pages), so a recycled id never hits a stale copy. Pages not resident are
        ignored; a page still referenced is a bug."""
        for h in host_pages:
            g = self._gpu_of_host.get(h)
            if g is None:
                continue
            if g in self._refs:
                raise PoolInvariantError(f"host page {h} forgotten while gpu page {g} holds {self._refs[g]} references")
            del self._cached[g]
            del self._host_of_gpu[g]
            del self._gpu_of_host[h]
            self._free.append(g)

    def _take_page(self, evicted: list[HostPageId]) -> GpuPageId:
        """A page with no reference and no host page: a free one, else the LRU cached one."""
        if self._free:
            return self._free.popleft()
        g, _ = self._cached.popitem(last=False)
        h = self._host_of_gpu.pop(g)
        del self._gpu_of_host[h]
        evicted.append(h)
        return g

    # ---- inspection ----------------------------------------------------------------------

    def snapshot(self) -> PoolState:
        return PoolState(
            refcounts=dict(self._refs),
            host_of_gpu=dict(self._host_of_gpu),
            cached=tuple(self._cached),
            free=tuple(self._free),
        )

    def check(self) -> None:
        """Raise PoolInvariantError unless every page is in exactly one state and the
        host↔GPU maps are consistent."""
        free, cached, used = set(self._free), set(self._cached), set(self._refs)
        if len(free) != len(self._free):
            raise PoolInvariantError("a gpu page is on the free list twice")
        for name_a, a, name_b, b in (
            ("free", free, "cached", cached),
            ("free", free, "in use", used),
            ("cached", cached, "in use", used),
        ):
            if a & b:
                raise PoolInvariantError(f"gpu page {min(a & b)} is both {name_a} and {name_b}")
        lost = set(range(self.num_pages)) - free - cached - used
        if lost:
            raise PoolInvariantError(f"gpu page {min(lost)} is in no state")
        for g, n in self._refs.items():
            if n < 1:
                raise PoolInvariantError(f"gpu page {g} is in use with refcount {n}")
        for g in free:
            if g in self._host_of_gpu:
                raise PoolInvariantError(f"free gpu page {g} still holds host page {self._host_of_gpu[g]}")
        for g in cached:
            if g not in self._host_of_gpu:
                raise PoolInvariantError(f"cached gpu page {g} holds no host page")
        for g, h in self._host_of_gpu.items():
            if self._gpu_of_host.get(h) != g:
                raise PoolInvariantError(
                    f"gpu page {g} holds host page {h}, which maps to gpu page {self._gpu_of_host.get(h)}"
                )
        if len(self._gpu_of_host) != len(self._host_of_gpu):
            raise PoolInvariantError("host→gpu and gpu→host maps differ in size")

    def stats(self) -> GpuPoolStats:
        shared = [n for n in self._refs.values() if n > 1]
        return GpuPoolStats(
            capacity=self.num_pages,
            unique_host_pages_loaded=self._loaded,
            duplicate_loads_skipped=self._skipped,
            logical_pages=sum(self._refs.values()),
            physical_pages=len(self._refs),
            shared_pages=len(shared),
            shared_refs=sum(shared),
            cached_pages=len(self._cached),
            free_pages=len(self._free),
        )
