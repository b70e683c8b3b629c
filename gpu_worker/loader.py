"""Page loader: host↔device copies between host pages and a `GpuPagePool`.

Loads fill the GPU pages a plan allocated from their host pages; stores offload newly
written KV (a whole page or a layer slice) from a GPU page into a host private page.
On CUDA both run on a side stream, ordered after the work already queued on the compute
stream (a load may overwrite an evicted copy that queued kernels still read; a store reads
KV that queued kernels write), and the compute stream waits on an event recorded after
the copies. Each host extent is registered with `cudaHostRegister` once per process (at
the first copy batch after it appears), so the copies are DMA straight from shared
memory. On CPU the same code runs as plain, synchronous tensor copies.

The pool tensor must outlive the loader: it is used on the side stream without
`record_stream`, which is safe only because it is never freed while copies are queued.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from gpu_worker.host_registration import register_host_extents
from gpu_worker.pool import GpuPageId, GpuPagePool, HostPageId, PageLoad, torch_dtype


class HostPages(Protocol):
    """Where host pages live: the client's zero-copy views of the daemon's shared memory."""

    def page(self, page_id: HostPageId) -> torch.Tensor:
        """[num_layers, 2, page_size, num_kv_heads, head_dim] CPU view of one host page."""
        ...

    def extents(self) -> Iterable[memoryview]:
        """The writable mapped shared-memory extents that hold every page (registered on CUDA)."""
        ...


class PageStore(NamedTuple):
    """One planned device→host copy: layers `layers` of `gpu_page` into `host_page`."""

    gpu_page: GpuPageId
    host_page: HostPageId
    layers: slice = slice(None)


@dataclass(frozen=True)
class CopyBatch:
    """What one `load` or `store` call queued."""

    pages: int
    nbytes: int
    done: torch.cuda.Event | None  # recorded after the last copy; None on CPU (copies finished)

    def synchronize(self) -> None:
        """Block the host until the copies are done (before the daemon publishes a stored page)."""
        if self.done is not None:
            self.done.synchronize()


class PageLoader:
    """Copies pages between one pool and one host page source."""

    def __init__(self, pool: GpuPagePool, host: HostPages) -> None:
        self.pool = pool
        self.host = host
        self._cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=pool.device) if self._cuda else None

    def load(self, loads: Sequence[PageLoad]) -> CopyBatch:
        """Fill each load's GPU page with its host page. Kernels queued on the current
        stream after this call see the pages; the host need not wait."""
        with self._side_stream():
            for host_page, gpu_page in loads:
                src = self._host_page(host_page)  # [L, 2, P, H, D] on host
                self.pool.kv[gpu_page].copy_(src, non_blocking=self._cuda)
        return self._finish(len(loads), len(loads) * self.pool.layout.page_bytes)

    def store(self, stores: Sequence[PageStore], *, compute_waits: bool = True) -> CopyBatch:
        """Offload each store's layers of its GPU page into its host private page, after
        the KV queued to be written is written. Call `synchronize()` on the result before
        the host pages are read or published.

        With `compute_waits=False` the compute stream does not wait for the copies, so an
        offload issued after layer i overlaps layers i+1...; the caller must then
        `synchronize()` before anything overwrites the stored GPU pages."""
        nbytes = 0
        with self._side_stream():
            for gpu_page, host_page, layers in stores:
                dst = self._host_page(host_page)[layers]  # [layers, 2, P, H, D] on host
                dst.copy_(self.pool.kv[gpu_page, layers], non_blocking=self._cuda)
                nbytes += dst.numel() * dst.element_size()
        return self._finish(len(stores), nbytes, compute_waits)

    def _host_page(self, host_page: HostPageId) -> torch.Tensor:
        page = self.host.page(host_page)
        layout = self.pool.layout
        if tuple(page.shape) != layout.page_shape or page.dtype != torch_dtype(layout):
            raise ValueError(
                f"host page {host_page} is {page.dtype}{tuple(page.shape)}, "
                f"not the pool's {layout.dtype}{layout.page_shape}"
            )
        return page

    @contextmanager
    def _side_stream(self) -> Iterator[None]:
        """CUDA: register extents mapped since the last call, then run the body on the side
        stream after the compute stream's queued work."""
        if self._stream is None:
            yield
            return
        register_host_extents(self.host.extents(), self.pool.layout.page_bytes)
        self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self._stream):
            yield

    def _finish(self, pages: int, nbytes: int, compute_waits: bool = True) -> CopyBatch:
        """CUDA: record the copies' event and (unless told not to) make the compute stream wait on it."""
        if self._stream is None:
            return CopyBatch(pages, nbytes, None)
        done = torch.cuda.Event()
        done.record(self._stream)
        if compute_waits:
            torch.cuda.current_stream(self.pool.device).wait_event(done)
        return CopyBatch(pages, nbytes, done)
