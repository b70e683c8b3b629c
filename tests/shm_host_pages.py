"""Host pages over one real posix_ipc segment, for GPU-side tests that need no daemon."""
from __future__ import annotations

import os
import secrets

import torch

from engine_client import PageLayout
from gpu_worker.ipc import SharedSegment
from gpu_worker.pool import HostPageId, torch_dtype


class ShmHostPages:
    """The ``HostPages`` protocol of gpu_worker.loader over a shared-memory segment."""

    def __init__(self, segment: SharedSegment, layout: PageLayout, num_pages: int) -> None:
        self.segment = segment
        # pages: [num_pages, L, 2, P, H, D]
        self.pages = segment.tensor(torch_dtype(layout), (num_pages, *layout.page_shape))

    @classmethod
    def create(cls, layout: PageLayout, num_pages: int, seed: int) -> "ShmHostPages":
        """A new segment of random page bytes; the caller unlinks ``segment`` when done."""
        name = f"/kvd-test-host-{os.getpid()}-{secrets.token_hex(4)}"
        segment = SharedSegment.create(name, num_pages * layout.page_bytes)
        raw = segment.tensor(torch.uint8, (num_pages * layout.page_bytes,))
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
        return cls(segment, layout, num_pages)

    def page(self, page_id: HostPageId) -> torch.Tensor:
        return self.pages[page_id]

    def extents(self) -> list[memoryview]:
        return [memoryview(self.segment.buffer)]
