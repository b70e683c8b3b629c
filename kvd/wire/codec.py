"""Token ids and page ids on the wire: packed little-endian int32 and uint32.

The one place both sides encode and decode them: the client packs token ids and unpacks
page ids (engine_client/), the daemon checks and stores packed token ids and packs page
ids (kvd/). Short lists (a decode step) go through ``struct``, which is cheaper than numpy
for a few values; long ones through numpy.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

TOKEN_BYTES = 4  # a token id: little-endian int32
PAGE_ID_BYTES = 4  # a page id: little-endian uint32
TOKEN_DTYPE = "<i4"
_SMALL = 256  # up to this many values, struct beats numpy


def pack_tokens(token_ids) -> bytes:
    """Token ids (a list, a tuple, a numpy array or already packed bytes) as packed int32."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return bytes(token_ids)
    if isinstance(token_ids, (list, tuple)) and len(token_ids) <= _SMALL:  # a decode step: skip numpy
        try:
            return struct.pack(f"<{len(token_ids)}i", *token_ids)
        except struct.error:
            pass  # not all int32: numpy below says which way
    return token_ids_array(token_ids).tobytes()


def token_ids_array(token_ids) -> np.ndarray:
    """Token ids (a sequence of ints or an integer array) as an int32 array, without a copy
    when they are one; TypeError or ValueError for ids that are not int32."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return np.frombuffer(token_ids, dtype=TOKEN_DTYPE)
    arr = np.asarray(token_ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    fits = np.can_cast(arr.dtype, TOKEN_DTYPE)  # int32 or narrower: no need to look at the values
    if arr.size and not fits and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31):
        raise ValueError("token ids must fit in int32")
    return arr.astype(TOKEN_DTYPE, copy=False).reshape(-1)


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    """Packed token ids as ints (for short lists; ``token_array`` for long ones)."""
    return struct.unpack(f"<{len(data) // TOKEN_BYTES}i", data)


def token_array(data: bytes) -> np.ndarray:
    """Packed token ids as a read-only int32 array over ``data`` (no copy)."""
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def pack_pages(pages: Sequence[int]) -> bytes:
    """Page ids as packed uint32."""
    return struct.pack(f"<{len(pages)}I", *pages)


def unpack_pages(data: bytes) -> list[int]:
    """Packed page ids as ints."""
    return list(struct.unpack(f"<{len(data) // PAGE_ID_BYTES}I", data))
