"""Host pages over one real posix_ipc segment, for GPU-side tests that need no daemon."""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np
import posix_ipc
import torch

from engine_client import PageLayout
from gpu_worker.pool import HostPageId, torch_dtype


class SharedSegment:
    """A new POSIX shared-memory segment mapped into this process. There is no close: the
    mapping goes away when this object and every view of it are gone."""

    def __init__(self, name: str, size: int) -> None:
        if size <= 0:
            raise ValueError(f"shared segment {name} needs a positive size, got {size}")
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)  # zero-filled; fails if it exists
        self.name, self.size = name, size
        self.buffer = mmap.mmap(shm.fd, size)
        shm.close_fd()

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A writable tensor view of `shape` at the start of the segment."""
        count = dtype.itemsize * int(np.prod(shape))
        assert count <= self.size, f"{shape} {dtype} overruns segment {self.name} ({self.size} bytes)"
        return torch.frombuffer(self.buffer, dtype=torch.uint8, count=count).view(dtype).reshape(shape)

    def unlink(self) -> None:
        posix_ipc.unlink_shared_memory(self.name)


class ShmHostPages:
    """The ``HostPages`` protocol of gpu_worker.loader over a shared-memory segment."""

    def __init__(self, segment: SharedSegment, layout: PageLayout, num_pages: int) -> None:
        self.segment = segment
        # pages: [num_pages, L, 2, P, H, D]
        self.pages = segment.tensor(torch_dtype(layout), (num_pages, *layout.page_shape))

    @classmethod
    def create(cls, layout: PageLayout, num_pages: int, seed: int) -> ShmHostPages:
        """A new segment of random page bytes; the caller unlinks ``segment`` when done."""
        name = f"/kvd-test-host-{os.getpid()}-{secrets.token_hex(4)}"
        segment = SharedSegment(name, num_pages * layout.page_bytes)
        raw = segment.tensor(torch.uint8, (num_pages * layout.page_bytes,))
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
        return cls(segment, layout, num_pages)

    def page(self, page_id: HostPageId) -> torch.Tensor:
        return self.pages[page_id]

    def extents(self) -> list[memoryview]:
        return [memoryview(self.segment.buffer)]
