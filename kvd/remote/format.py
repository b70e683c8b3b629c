"""A page in the remote store: its key and the value a hit must check (version 1).

The remote tier (kvd/remote/tier.py) shares published pages between hosts through a
distributed store. A value is one header followed by the page's bytes, so a fetching
host checks everything its own index would before it serves the page::

    magic       8s   b"KVDRPAG1"
    page_index  u32  the page's index in its chain
    pad         u32
    checksum    u64  xxh3_64 of header[24:] followed by the page bytes
    page_bytes  u64
    key         16s  the page's chain key (kvd/core/index.py)
    parent_key  16s  its parent's chain key; the chain root for page 0
    local       16s  digest of the page's local extra bytes (PageContent.local), or zeros
    tokens           page_size little-endian int32 token ids

The store key names the scope (the tenant, so tenants never share through the store),
the namespace root (the identity: model, layout, TP rank, ...) and the chain key, so two
hosts with the same identity and prompt compute the same key. The key is only the way
in: a fetched page is served only when its header carries the request's token ids,
parent key, local digest and page index and its checksum covers the bytes that arrived;
anything else is a miss, never wrong KV.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from kvd.core.types import PageKey
from kvd.tiers.fetches import PageHeader

MAGIC = b"KVDRPAG1"
_HEAD = struct.Struct("<8sIIQQ16s16s16s")
HEAD_BYTES = _HEAD.size  # 80
_COVERED_FROM = 24  # the checksum covers the header from page_bytes on


def header_bytes(page_size: int) -> int:
    """Size of the header of a page of ``page_size`` tokens."""
    return HEAD_BYTES + 4 * page_size


def store_key(scope: str, namespace_root: bytes, key: PageKey) -> str:
    """The store's name for a page: the same on every host for the same identity and chain."""
    return f"kvd1/{scope or '-'}/{namespace_root.hex()}/{key.hex()}"


def write_header(out: np.ndarray, header: PageHeader, page: np.ndarray) -> None:
    """Fills ``out`` (uint8 [header_bytes]) with the header and the checksum over it and ``page``."""
    covered = (
        struct.pack("<Q", page.nbytes) + header.key + header.parent_key + header.local.ljust(16, b"\0") + header.tokens
    )
    out[_COVERED_FROM:] = np.frombuffer(covered, dtype=np.uint8)
    h = xxhash.xxh3_64(covered)
    h.update(page)
    out[:_COVERED_FROM] = np.frombuffer(
        struct.pack("<8sIIQ", MAGIC, header.page_index, 0, h.intdigest()), dtype=np.uint8
    )


def read_header(raw: np.ndarray, page: np.ndarray) -> PageHeader | None:
    """The header in ``raw`` when its magic, size and checksum hold for ``page``; None otherwise."""
    magic, page_index, _, checksum, page_bytes, key, parent_key, local = _HEAD.unpack_from(raw)
    if magic != MAGIC or page_bytes != page.nbytes:
        return None
    h = xxhash.xxh3_64(raw[_COVERED_FROM:])
    h.update(page)
    if h.intdigest() != checksum:
        return None
    local = b"" if local == bytes(16) else local
    return PageHeader(page_index, PageKey(key), parent_key, local, raw[HEAD_BYTES:].tobytes())
