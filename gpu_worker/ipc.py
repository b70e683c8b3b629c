"""Pool sharing: one process owns a GPU page pool, others on the same device open it.

The owner creates a `PoolExport`; its `handle` (a small picklable `PoolHandle`) goes to
other processes by any channel, and each opens a `PoolImport` that sees the same pool
memory, with no copy:

- CUDA: the pool tensor is shared by CUDA IPC (torch's `reduce_tensor`, which wraps
  `cudaIpcGetMemHandle`). The owner must stay alive while importers use it.
- CPU: the pool tensor is allocated inside a POSIX shared-memory segment (`posix_ipc`),
  so the same API and tests run without a GPU.

The host page → GPU page map lives in a second small shared-memory segment in both cases:
`[generation: u64, num_pages: u64 | host_page: i64[num_pages] | present: u8[num_pages]]`,
GPU page g holding host page `host_page[g]` when `present[g]`. The owner is its only
writer: `publish()` rewrites it from the pool (call it after the loads it reflects have
finished, `CopyBatch.synchronize()`), and `PoolImport.lookup()` reads a consistent
snapshot (a seqlock: the generation is odd while a write is in progress). Refcounts and
eviction stay with the owner; an importer reads pages only between publishes it knows the
owner will not evict under it (coordinating that is the caller's protocol).
"""
from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import posix_ipc
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from engine_client import PageLayout
from gpu_worker.pool import GpuPageId, GpuPagePool, HostPageId, torch_dtype


class SharedSegment:
    """A POSIX shared-memory segment mapped into this process.

    There is no close: the mapping goes away when this object and every tensor or array
    viewing it are gone (they keep the mmap alive), so no view can outlive its memory.
    """

    def __init__(self, shm: posix_ipc.SharedMemory) -> None:
        self.name: str = shm.name
        self.size: int = shm.size
        self.buffer = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()

    @classmethod
    def create(cls, name: str, size: int) -> SharedSegment:
        """A new segment of `size` bytes (zero-filled); fails if `name` exists."""
        if size <= 0:
            raise ValueError(f"shared segment {name} needs a positive size, got {size}")
        return cls(posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size))

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        return cls(posix_ipc.SharedMemory(name))

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A writable tensor view of `shape` at byte `offset`."""
        count = dtype.itemsize * int(np.prod(shape))
        if offset + count > self.size:
            raise ValueError(f"{shape} {dtype} at {offset} overruns segment {self.name} ({self.size} bytes)")
        raw = torch.frombuffer(self.buffer, dtype=torch.uint8, count=count, offset=offset)
        return raw.view(dtype).reshape(shape)

    def unlink(self) -> None:
        """Remove the name; processes that mapped the segment keep their mappings."""
        posix_ipc.unlink_shared_memory(self.name)


class _PageMap:
    """The published host page → GPU page map in shared memory; see the module docstring."""

    _HEADER = 16

    def __init__(self, segment: SharedSegment, num_pages: int) -> None:
        if segment.size < self.nbytes(num_pages):
            raise ValueError(f"page map segment {segment.name} is too small for {num_pages} pages")
        self.segment = segment
        buf = segment.buffer
        self._header = np.ndarray((2,), np.uint64, buf, 0)  # [generation, num_pages]
        self._host = np.ndarray((num_pages,), np.int64, buf, self._HEADER)
        self._present = np.ndarray((num_pages,), np.uint8, buf, self._HEADER + 8 * num_pages)
        if int(self._header[1]) not in (0, num_pages):
            raise ValueError(f"page map {segment.name} is for {int(self._header[1])} pages, not {num_pages}")
        self._header[1] = num_pages

    @classmethod
    def nbytes(cls, num_pages: int) -> int:
        return cls._HEADER + 9 * num_pages

    def write(self, resident: Mapping[HostPageId, GpuPageId]) -> None:
        """Replace the map (single writer)."""
        gpu = np.fromiter(resident.values(), np.int64, len(resident))
        host = np.fromiter(resident.keys(), np.int64, len(resident))
        self._header[0] += 1  # odd: write in progress
        self._present[:] = 0
        self._host[gpu] = host
        self._present[gpu] = 1
        self._header[0] += 1

    def read(self) -> dict[HostPageId, GpuPageId]:
        """A consistent snapshot: retried while a write is in progress or happened meanwhile."""
        while True:
            generation = int(self._header[0])
            if generation % 2 == 0:
                host, present = self._host.copy(), self._present.copy()
                if int(self._header[0]) == generation:
                    break
            os.sched_yield()
        gpu = np.flatnonzero(present)
        return {HostPageId(int(h)): GpuPageId(int(g)) for g, h in zip(gpu, host[gpu])}


@dataclass(frozen=True)
class PoolHandle:
    """Everything another process needs to open an exported pool; picklable."""

    layout: PageLayout
    num_pages: int
    device: str  # "cpu" or "cuda:N" as the owner numbers devices
    map_segment: str  # posix_ipc name of the published host→GPU map
    pool_segment: str | None  # CPU pools: posix_ipc name of the segment holding the pool tensor
    cuda_ipc: tuple | None  # CUDA pools: torch's rebuild_cuda_tensor arguments (CUDA IPC handle)


class PoolExport:
    """Owner side: a `GpuPagePool` whose memory and map other processes can open."""

    def __init__(self, layout: PageLayout, num_pages: int,
                 device: torch.device | str = "cpu", name: str | None = None) -> None:
        """`name` prefixes the posix_ipc segment names (default: unique per process)."""
        device = torch.device(device)
        name = name or f"/kvd-gpu-pool-{os.getpid()}-{secrets.token_hex(4)}"
        shape = (num_pages, *layout.page_shape)
        self._segments = [SharedSegment.create(name + ".map", _PageMap.nbytes(num_pages))]
        try:
            self._map = _PageMap(self._segments[0], num_pages)
            if device.type == "cpu":
                self._segments.append(SharedSegment.create(name + ".pool", num_pages * layout.page_bytes))
                kv = self._segments[1].tensor(torch_dtype(layout), shape)
                pool_segment, cuda_ipc = self._segments[1].name, None
            else:
                kv = torch.empty(shape, dtype=torch_dtype(layout), device=device)
                pool_segment, cuda_ipc = None, reduce_tensor(kv)[1]
        except BaseException:
            self.close()
            raise
        self.pool = GpuPagePool(layout, kv)
        self.handle = PoolHandle(layout, num_pages, str(device), self._segments[0].name,
                                 pool_segment, cuda_ipc)

    def publish(self) -> None:
        """Make the pool's current host→GPU map visible to importers."""
        self._map.write(self.pool.resident())

    def close(self) -> None:
        """Unlink the segment names; open importers keep working, new ones cannot open."""
        for segment in self._segments:
            segment.unlink()
        self._segments = []


class PoolImport:
    """Importer side: the exported pool's tensor and its published map."""

    def __init__(self, handle: PoolHandle) -> None:
        self.handle = handle
        self._map = _PageMap(SharedSegment.attach(handle.map_segment), handle.num_pages)
        shape = (handle.num_pages, *handle.layout.page_shape)
        if handle.pool_segment is not None:
            kv = SharedSegment.attach(handle.pool_segment).tensor(torch_dtype(handle.layout), shape)
        elif handle.cuda_ipc is not None:
            kv = rebuild_cuda_tensor(*handle.cuda_ipc)
        else:
            raise ValueError("pool handle names neither a shared segment nor a CUDA IPC handle")
        if tuple(kv.shape) != shape:
            raise ValueError(f"imported pool tensor is {tuple(kv.shape)}, handle says {shape}")
        self.kv = kv  # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], shared

    def lookup(self) -> dict[HostPageId, GpuPageId]:
        """The owner's last published host page → GPU page map."""
        return self._map.read()
