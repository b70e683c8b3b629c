"""The client's half of its session's token buffer (kvd/cache/token_buffers.py is the daemon's).

A large Allocate or Lookup writes its token ids into a shared-memory segment of the
session's own and sends only where they lie (``TokenSpan``), so 200 KB of a 50K-token
prompt skip packing into the message, gRPC's framing and parsing. ``KVDClient`` chooses
this path on its own for calls of ``MIN_TOKENS`` ids or more; the API does not change.
"""

from __future__ import annotations

import mmap

import numpy as np
import posix_ipc

from kvd.wire.codec import TOKEN_BYTES, TOKEN_DTYPE, token_ids_array

MIN_TOKENS = 4096  # below this, packing ids into the message costs less than the span's bookkeeping
MIN_BYTES = 1 << 20  # a new buffer's size at least; it doubles as calls grow


class ClientTokenBuffer:
    """The mapped segment; ``spans`` writes a call's token ids into it."""

    def __init__(self, shm_name: str, size: int) -> None:
        shm = posix_ipc.SharedMemory(shm_name)
        try:
            self._memory = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.size = size
        self._ids = np.frombuffer(self._memory, dtype=TOKEN_DTYPE)

    @staticmethod
    def size_for(num_tokens: int) -> int:
        """The buffer to ask for when a call of ``num_tokens`` ids does not fit: a power of two."""
        return max(MIN_BYTES, 1 << (num_tokens * TOKEN_BYTES - 1).bit_length())

    def spans(self, arrays: list[np.ndarray]) -> list[tuple[int, int]]:
        """Writes the int32 arrays one after another from the start; where each lies, in
        order: (byte offset, number of ids). The caller holds the buffer for the whole call
        (the daemon reads it during the call)."""
        spans, start = [], 0
        for ids in arrays:
            end = start + len(ids)
            self._ids[start:end] = ids
            spans.append((start * TOKEN_BYTES, len(ids)))
            start = end
        return spans

    @staticmethod
    def arrays(token_lists) -> list[np.ndarray]:
        """Each request's token ids as an int32 array (checked as ``pack_tokens`` checks them)."""
        return [token_ids_array(t) for t in token_lists]
