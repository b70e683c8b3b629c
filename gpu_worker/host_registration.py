"""Registering the daemon's shared-memory extents with CUDA (``cudaHostRegister``), once per
process, so host↔device copies are DMA straight from shared memory.

Both GPU sides use it: the reference engine's loader (gpu_worker/loader.py) and the vLLM
connector's saver (gpu_worker/vllm/saver.py). It imports torch only, none of the reference
engine's pool or model.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import warnings
from collections.abc import Iterable

import torch

# cudaHostRegister of very large ranges fails or stalls; register at most this much at once.
CUDA_REGISTER_CHUNK_BYTES = 64 << 30

log = logging.getLogger(__name__)
_registered: set[tuple[int, int]] = set()
_registered_lock = threading.Lock()


def register_chunks(
    address: int, nbytes: int, align: int, max_chunk: int = CUDA_REGISTER_CHUNK_BYTES
) -> list[tuple[int, int]]:
    """Split `[address, address + nbytes)` into `(address, size)` ranges of at most
    `max_chunk` bytes whose inner boundaries lie at multiples of `align` from the start,
    so that no KV page straddles two registrations."""
    step = max_chunk - max_chunk % align
    if step <= 0:
        raise ValueError(f"alignment {align} exceeds the largest chunk {max_chunk}")
    return [(address + off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


# Process-wide, because cudaHostRegister is per process: (address, nbytes) of every extent
# this module registered, so each is registered once however many loaders use it.
# cudaHostRegisterReadOnly: published pages are mapped PROT_READ (engine_client/pages.py).
_HOST_REGISTER_READ_ONLY = 0x08


def register_host_extents(extents: Iterable[memoryview], page_bytes: int) -> int:
    """CUDA only: cudaHostRegister each extent once per process, in chunks aligned to both
    KV pages and OS pages; extents already pinned (by the engine client, or allocated
    pinned) are left alone, since a second registration fails. Returns the bytes newly
    registered. A failed extent is rolled back (its chunks unregistered) before raising;
    a read-only map the device cannot register stays pageable (its copies are slower, not wrong)."""
    cudart = torch.cuda.cudart()
    align = math.lcm(page_bytes, mmap.PAGESIZE)
    added = 0
    with _registered_lock:
        for extent in extents:
            view = memoryview(extent)
            if view.nbytes == 0:
                continue
            with warnings.catch_warnings():  # a read-only map: torch only reads its address here
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                head = torch.frombuffer(view, dtype=torch.uint8, count=1)  # the extent's first byte
            key = (head.data_ptr(), view.nbytes)
            if key in _registered:
                continue
            if not head.is_pinned():  # torch's probe clears the CUDA error it may cause
                flags = _HOST_REGISTER_READ_ONLY if view.readonly else 0
                done: list[int] = []
                for ptr, size in register_chunks(*key, align=align):
                    err = int(cudart.cudaHostRegister(ptr, size, flags))
                    if err != 0:
                        for p in done:
                            cudart.cudaHostUnregister(p)
                        if view.readonly:
                            log.warning(
                                "cannot register a read-only host extent (CUDA error %d); copies of "
                                "published pages from it go through pageable memory",
                                err,
                            )
                            break
                        raise RuntimeError(f"cudaHostRegister({ptr:#x}, {size}) failed with CUDA error {err}")
                    done.append(ptr)
                else:
                    added += view.nbytes
            _registered.add(key)
    return added
