"""Zero-copy views of the daemon's shared-memory pages inside an engine process.

The client attaches to extents by name and never creates, resizes or unlinks one: only
the daemon owns the arena. A page is a view, not a copy: writes through it land in the
daemon's shared memory, where every other process sees them. Each extent is mapped twice,
read-write and read-only (``PROT_READ``): published pages are handed out from the
read-only map, so a stray write to one fails in the process that made it (numpy raises,
a torch write faults) instead of corrupting every engine's KV.

Page layout (kvd/wire/layout.py): ``[num_layers, 2, page_size, num_kv_heads, head_dim]``,
axis 1 holding K (0) and V (1).
"""

from __future__ import annotations

import bisect
import mmap
import os
import warnings
from dataclasses import dataclass

import numpy as np
import posix_ipc

from kvd.wire.layout import PageLayout

SHM_DIR = "/dev/shm"  # where a shared-memory object's name lies (glibc's shm_open)

# numpy cannot hold bfloat16 or float8; those pages are viewed as same-width integers and
# reinterpreted by torch.
_NUMPY_STORAGE = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "uint8": np.uint8,
}


@dataclass
class MappedExtent:
    name: str
    first_page: int
    num_pages: int
    memory: mmap.mmap
    array: np.ndarray  # [num_pages, *page_shape] in the storage dtype, writable
    readonly_memory: mmap.mmap
    readonly: np.ndarray  # the same pages through the read-only map
    tensor: object = None  # the writable array as a torch tensor, made on first use
    readonly_tensor: object = None

    def unlinked(self) -> bool:
        """Whether the daemon released the extent (unlinked its name): its memory stays
        allocated in /dev/shm as long as this process maps it. A look at /dev/shm, no kvd call."""
        return not os.path.exists(SHM_DIR + self.name)


def attach(name: str, first_page: int, num_pages: int, layout: PageLayout) -> MappedExtent:
    """Maps an existing extent read-write and read-only. Raises posix_ipc.ExistentialError if it is gone."""
    shm = posix_ipc.SharedMemory(name)  # no O_CREAT: attach only
    try:
        size = num_pages * layout.page_bytes
        if shm.size < size:
            raise ValueError(f"extent {name} holds {shm.size} bytes, expected at least {size}")
        memory = mmap.mmap(shm.fd, size)
        readonly_memory = mmap.mmap(shm.fd, size, prot=mmap.PROT_READ)
    finally:
        shm.close_fd()
    shape = (num_pages, *layout.page_shape)
    array = np.frombuffer(memory, dtype=_NUMPY_STORAGE[layout.dtype]).reshape(shape)
    readonly = np.frombuffer(readonly_memory, dtype=_NUMPY_STORAGE[layout.dtype]).reshape(shape)
    return MappedExtent(name, first_page, num_pages, memory, array, readonly_memory, readonly)


class PageMap:
    """The extents of one namespace that this process has mapped, by page id."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._extents: list[MappedExtent] = []  # sorted by first_page
        self._firsts: list[int] = []

    def find(self, page: int) -> tuple[MappedExtent, int] | None:
        i = bisect.bisect_right(self._firsts, page) - 1
        if i >= 0:
            extent = self._extents[i]
            if page < extent.first_page + extent.num_pages:
                return extent, page - extent.first_page
        return None

    def refresh(self, extents: list[tuple[str, int, int]]) -> None:
        """Maps new extents and forgets released ones, given (name, first_page, num_pages)."""
        known = {e.name: e for e in self._extents}
        fresh = []
        for name, first, count in extents:
            fresh.append(known.get(name) or attach(name, first, count, self.layout))
        fresh.sort(key=lambda e: e.first_page)
        self._extents = fresh
        self._firsts = [e.first_page for e in fresh]

    def extents(self) -> list[MappedExtent]:
        return list(self._extents)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _as_tensor(array: np.ndarray, layout: PageLayout):
    import torch

    with warnings.catch_warnings():  # torch has no read-only tensors; the map itself refuses writes
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(array)
    if layout.dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        t = t.view(torch_dtype(layout.dtype))
    return t


def extent_tensor(extent: MappedExtent, layout: PageLayout, writable: bool = True):
    """The whole extent as a torch tensor [num_pages, *page_shape], sharing memory; through
    the read-only map unless ``writable``."""
    if writable:
        if extent.tensor is None:
            extent.tensor = _as_tensor(extent.array, layout)
        return extent.tensor
    if extent.readonly_tensor is None:
        extent.readonly_tensor = _as_tensor(extent.readonly, layout)
    return extent.readonly_tensor
